"""Offloaded checkpointing: a checkpointed layer's saved input lives in host memory between forward and backward.

Non-reentrant `torch.utils.checkpoint` keeps exactly one thing per checkpointed layer until backward: the layer's
positional inputs (in a decoder layer, `hidden_states`), saved as autograd saved tensors *before* its own
saved-tensor hooks take over the layer's insides. `offloaded_checkpoint` runs `checkpoint` under an outer
`torch.autograd.graph.saved_tensors_hooks` pair (`ActivationOffloader.pack` / `unpack`), so those inputs, and only
those, go through our hooks:

- pack (forward): on CUDA the tensor is copied device -> pinned host memory on a side stream that first waits for
  the compute stream (so the copy overlaps the next layer's compute), and `record_stream` keeps the device memory from
  being reused before the copy ends. Elsewhere (CPU) the "host" copy is a plain copy, so the same bookkeeping runs.
- unpack (backward, when the layer is about to be recomputed): the host copy comes back on the side stream (unless a
  prefetch already started it), the compute stream waits for it, and the copy of the layer recomputed *next* (the
  one packed before this one) is started, so it travels while this layer recomputes and runs backward.

Pinned host buffers come from torch's caching host allocator, which rounds every block up to a power of two (a
3 GiB layer input would take 4 GiB): each copy is therefore split into power-of-two pieces (`pinned_pieces`), so the
host memory a plan counts is the host memory it takes, to within 1 MiB per tensor; freed pieces are cached by torch
and reused by the next step's copies of the same sizes.

The design follows torchtune's `OffloadActivations` (saved-tensor hooks, a side stream, prefetch in backward),
narrowed to checkpoint inputs: everything else is recomputed, as in full checkpointing, so gradients are identical
to it (bit for bit: the same kernels see the same values).
"""
from __future__ import annotations

import logging
import os
import weakref
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
from torch.utils.checkpoint import checkpoint

logger = logging.getLogger(__name__)


class _Offloaded:
    """One saved tensor in host memory; what autograd keeps instead of the device tensor."""

    __slots__ = ("host", "device", "shape", "dtype", "copied", "fetched", "fetch_done", "previous", "__weakref__")

    def __init__(self, host: torch.Tensor | list[torch.Tensor], device: torch.device, copied, previous,
                 shape: torch.Size | None = None, dtype: torch.dtype | None = None) -> None:
        # the saved tensor's values in host memory: the tensor itself (off CUDA), or its bytes in pinned pieces
        self.host = host
        self.device = device  # where unpack must return it
        self.shape, self.dtype = shape, dtype  # of the saved tensor, when `host` holds its bytes in pieces
        self.copied = copied  # CUDA event: device -> host copy finished (None off CUDA)
        self.fetched: torch.Tensor | None = None  # device copy started by a prefetch, not yet handed out
        self.fetch_done = None  # CUDA event: host -> device copy finished
        self.previous = previous  # weakref to the entry packed before this one (recomputed after it)


@dataclass
class OffloadStats:
    """What the hooks moved (counted on every device, so CPU tests can see the policy act)."""

    packed: int = 0  # tensors copied to host memory
    packed_bytes: int = 0
    unpacked: int = 0  # tensors handed back for a recompute
    prefetched: int = 0  # of those, host -> device copies started ahead of their unpack
    kept: int = 0  # saved tensors left where they were (empty, or below min_bytes)
    over_limit: int = 0  # saved tensors left on the device because the host copies had reached host_limit
    host_bytes: int = 0  # host bytes held by copies alive now
    host_peak_bytes: int = 0  # the most they held at once

    def reset(self) -> None:
        self.packed = self.packed_bytes = self.unpacked = self.prefetched = self.kept = self.over_limit = 0
        self.host_peak_bytes = self.host_bytes

    def _hold(self, nbytes: int) -> None:
        self.host_bytes += nbytes
        self.host_peak_bytes = max(self.host_peak_bytes, self.host_bytes)


MIN_PIECE = 1 << 20  # bytes below this share one (rounded) piece


# torch's caching host allocator page-locks a new block with cudaHostAlloc by default, which holds the GPU until it
# returns; registering ordinary memory on 8 threads page-locked ~3x faster with matmuls running beside it
# (scripts/bench_pinned.py, figures in docs/long-context.md): a 344k-token step's first forward pins ~99 GiB.
PINNED_REGISTER_THREADS = 8
ALLOCATOR_ENV = ("PYTORCH_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF")
_PINNING: dict = {}  # "settings": what register_pinned_host_memory set in this process (None: left alone)


def register_pinned_host_memory() -> str | None:
    """Once per process, before the first pinned copy: torch's caching host allocator page-locks new blocks by
    registering ordinary memory on several threads (``pinned_use_cuda_host_register``) instead of ``cudaHostAlloc``,
    which holds the GPU while it runs; the same page-locked memory either way. Only where no allocator configuration
    was given (``ALLOCATOR_ENV``, or settings made in code): a user's own stays as it is (a new setting would reset the
    keys it does not name). The settings made, or None where none were."""
    if "settings" in _PINNING:
        return _PINNING["settings"]
    _PINNING["settings"] = None
    getter = getattr(torch._C, "_accelerator_getAllocatorSettings", None)  # (settings made in code, not the env)
    given = next((name for name in ALLOCATOR_ENV if os.environ.get(name)), None) or (
        "torch's allocator settings" if getter is not None and getter() else None)
    if given is not None:
        logger.info("hf_accel: %s given; the pinned host memory of offloaded checkpointing is allocated as they say",
                    given)
        return None
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    threads = min(PINNED_REGISTER_THREADS, 1 << (max(cpus, 1).bit_length() - 1))  # (a power of two, as torch asks)
    settings = f"pinned_use_cuda_host_register:True,pinned_num_register_threads:{threads}"
    setter = getattr(torch._C, "_accelerator_setAllocatorSettings", None) or torch.cuda.memory._set_allocator_settings
    try:
        setter(settings)
    except (RuntimeError, ValueError, AttributeError) as exc:  # (a speed setting: the default way still works)
        logger.info("hf_accel: pinned host memory stays with cudaHostAlloc (%s: %s)", settings, exc)
        return None
    _PINNING["settings"] = settings
    logger.info("hf_accel: pinned host memory for offloaded checkpointing: %s", settings)
    return settings


def pinned_pieces(nbytes: int) -> list[int]:
    """Piece sizes summing to `nbytes`: its power-of-two parts of at least MIN_PIECE, then one piece of the rest
    (under MIN_PIECE), so the host allocator's rounding to powers of two wastes less than MIN_PIECE."""
    pieces = [1 << bit for bit in range(nbytes.bit_length() - 1, -1, -1) if nbytes >> bit & 1 and 1 << bit >= MIN_PIECE]
    rest = nbytes - sum(pieces)
    return pieces + ([rest] if rest else [])


def copy_to_pieces(tensor: torch.Tensor, pin_memory: bool) -> tuple[list[torch.Tensor], torch.Tensor]:
    """Start copying `tensor`'s bytes into host pieces (``pinned_pieces``) on the current stream; the pieces and the
    flat byte view read (the caller keeps its memory alive until the copy ends)."""
    flat = tensor.detach().contiguous().view(-1).view(torch.uint8)
    pieces = [torch.empty(n, dtype=torch.uint8, device="cpu", pin_memory=pin_memory)
              for n in pinned_pieces(flat.numel())]
    for piece, part in zip(pieces, flat.split([p.numel() for p in pieces])):
        piece.copy_(part, non_blocking=True)
    return pieces, flat


def join_pieces(pieces: list[torch.Tensor], shape: torch.Size, dtype: torch.dtype,
                device: torch.device) -> torch.Tensor:
    """Start copying host pieces back into one new tensor of `shape` and `dtype` on `device` (current stream)."""
    flat = torch.empty(sum(p.numel() for p in pieces), dtype=torch.uint8, device=device)
    for piece, part in zip(pieces, flat.split([p.numel() for p in pieces])):
        part.copy_(piece, non_blocking=True)
    return flat.view(dtype).view(shape)


@dataclass
class ActivationOffloader:
    """The saved-tensor hooks of offloaded checkpointing, with their side streams and counters.

    min_bytes: saved tensors smaller than this stay where they are. pin_memory: page-locked host buffers for CUDA
    tensors (asynchronous copies need them). prefetch: start the next recompute's copy back when one is unpacked.
    host_limit: the most bytes of host copies alive at once (None: no limit); a tensor that would pass it stays
    where it is, counted in ``stats.over_limit``.
    """

    min_bytes: int = 0
    pin_memory: bool = True
    prefetch: bool = True
    host_limit: int | None = None
    stats: OffloadStats = field(default_factory=OffloadStats)
    _streams: dict = field(default_factory=dict, repr=False)
    _last: Any = field(default=None, repr=False)  # weakref to the newest entry

    def _side_stream(self, device: torch.device):
        key = device.index if device.index is not None else torch.cuda.current_device()
        if key not in self._streams:
            self._streams[key] = torch.cuda.Stream(device=key)
        return self._streams[key]

    def pack(self, tensor: torch.Tensor) -> Any:
        if tensor.numel() == 0 or tensor.numel() * tensor.element_size() < self.min_bytes:
            self.stats.kept += 1
            return tensor
        copied, nbytes = None, tensor.numel() * tensor.element_size()
        if self.host_limit is not None and self.stats.host_bytes + nbytes > self.host_limit:
            self.stats.over_limit += 1
            return tensor
        if tensor.device.type == "cuda":
            if self.pin_memory:
                register_pinned_host_memory()
            compute, side = torch.cuda.current_stream(tensor.device), self._side_stream(tensor.device)
            side.wait_stream(compute)  # the tensor's producer must finish before the copy reads it
            with torch.cuda.stream(side):
                host, flat = copy_to_pieces(tensor, self.pin_memory)
                copied = side.record_event()
            tensor.record_stream(side)  # its memory is not reused by compute until the copy has read it
            flat.record_stream(side)  # (a contiguous copy, when the tensor was not)
        else:
            host = tensor.detach().to("cpu", copy=True)
        entry = _Offloaded(host, tensor.device, copied, self._last, tensor.shape, tensor.dtype)
        self._last = weakref.ref(entry)
        self.stats.packed += 1
        self.stats.packed_bytes += nbytes
        self.stats._hold(nbytes)
        weakref.finalize(entry, self.stats._hold, -nbytes)
        return entry

    def peek(self, entry: Any) -> torch.Tensor:
        """The entry's tensor on its device, for a spaced span's rebuild (``memory.spacing``), leaving the entry to its
        own unpack: on CUDA the device copy stays as that unpack's prefetch."""
        if not isinstance(entry, _Offloaded):
            return entry
        if entry.device.type != "cuda":
            return entry.host.to(entry.device)
        if entry.fetched is None:
            self._fetch(entry)
        torch.cuda.current_stream(entry.device).wait_event(entry.fetch_done)
        return entry.fetched

    def unpack(self, entry: Any) -> torch.Tensor:
        if not isinstance(entry, _Offloaded):
            return entry
        self.stats.unpacked += 1
        if entry.device.type != "cuda":
            return entry.host.to(entry.device)  # same device off CUDA: the host copy itself
        if entry.fetched is None:
            self._fetch(entry)
        else:
            self.stats.prefetched += 1
        tensor, done = entry.fetched, entry.fetch_done
        entry.fetched = entry.fetch_done = None  # the host copy stays: a second backward can unpack again
        compute = torch.cuda.current_stream(entry.device)
        compute.wait_event(done)
        tensor.record_stream(compute)  # allocated on the side stream, used and freed on compute
        previous = entry.previous() if (self.prefetch and entry.previous is not None) else None
        if previous is not None and previous.fetched is None:
            self._fetch(previous)
        return tensor

    def _fetch(self, entry: _Offloaded) -> None:
        side = self._side_stream(entry.device)
        with torch.cuda.stream(side):  # after the device -> host copy: same stream, so in order
            entry.fetched = join_pieces(entry.host, entry.shape, entry.dtype, entry.device)
            entry.fetch_done = side.record_event()

    def hooks(self) -> torch.autograd.graph.saved_tensors_hooks:
        return torch.autograd.graph.saved_tensors_hooks(self.pack, self.unpack)


def offloaded_checkpoint(offloader: ActivationOffloader, function: Callable, *args, **kwargs):
    """`torch.utils.checkpoint(function, *args, use_reentrant=False)` whose saved inputs live in host memory.

    Only the checkpoint's own input saves reach the offloader: inside the region, checkpoint's inner hooks take
    precedence and save nothing but placeholders.
    """
    if not torch.is_grad_enabled():
        return function(*args, **kwargs)
    with offloader.hooks():
        return checkpoint(function, *args, use_reentrant=False, **kwargs)
