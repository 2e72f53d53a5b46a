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

The design follows torchtune's `OffloadActivations` (saved-tensor hooks, a side stream, prefetch in backward),
narrowed to checkpoint inputs: everything else is recomputed, as in full checkpointing, so gradients are identical
to it (bit for bit: the same kernels see the same values).
"""
from __future__ import annotations

import weakref
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
from torch.utils.checkpoint import checkpoint


class _Offloaded:
    """One saved tensor in host memory; what autograd keeps instead of the device tensor."""

    __slots__ = ("host", "device", "copied", "fetched", "fetch_done", "previous", "__weakref__")

    def __init__(self, host: torch.Tensor, device: torch.device, copied, previous) -> None:
        self.host = host  # the saved tensor's values in host memory (pinned when it came from CUDA)
        self.device = device  # where unpack must return it
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

    def reset(self) -> None:
        self.packed = self.packed_bytes = self.unpacked = self.prefetched = self.kept = 0


@dataclass
class ActivationOffloader:
    """The saved-tensor hooks of offloaded checkpointing, with their side streams and counters.

    min_bytes: saved tensors smaller than this stay where they are. pin_memory: page-locked host buffers for CUDA
    tensors (asynchronous copies need them). prefetch: start the next recompute's copy back when one is unpacked.
    """

    min_bytes: int = 0
    pin_memory: bool = True
    prefetch: bool = True
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
        copied = None
        if tensor.device.type == "cuda":
            compute, side = torch.cuda.current_stream(tensor.device), self._side_stream(tensor.device)
            side.wait_stream(compute)  # the tensor's producer must finish before the copy reads it
            with torch.cuda.stream(side):
                host = torch.empty(tensor.shape, dtype=tensor.dtype, device="cpu", pin_memory=self.pin_memory)
                host.copy_(tensor, non_blocking=True)
                copied = side.record_event()
            tensor.record_stream(side)  # its memory is not reused by compute until the copy has read it
        else:
            host = tensor.detach().to("cpu", copy=True)
        entry = _Offloaded(host, tensor.device, copied, self._last)
        self._last = weakref.ref(entry)
        self.stats.packed += 1
        self.stats.packed_bytes += tensor.numel() * tensor.element_size()
        return entry

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
            entry.fetched = entry.host.to(entry.device, non_blocking=True)
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
