"""Host buffers for background saves: one snapshot of the state, allocated once and reused by every save.

A background save must copy the state off the device before training mutates it; fresh copies per save (plus a
serializer's own copy) put the host at 2-3x the checkpoint's size. Here the copy goes into buffers kept between
saves (page-locked on CUDA, so the device-to-host copy runs at full bandwidth), and the files are written from them
by streaming writers, so the host holds about 1.0x the checkpoint. When the buffers are not allocated yet and the
host lacks the memory for them (plus ``HEADROOM``), ``shortfall`` says why and the caller saves synchronously.
"""
from __future__ import annotations

import logging
import threading
from typing import Any, Callable

import torch

from ..memory.machine import host_available_bytes

logger = logging.getLogger("hf_accel")

HEADROOM = 0.2  # keep this fraction of the snapshot's size free beyond it


def proc_bytes(path: str, key: str) -> int | None:
    """A ``key: N kB`` line of a /proc file (``/proc/meminfo``, ``/proc/self/status``) in bytes; None if absent."""
    try:
        with open(path, encoding="ascii") as f:
            for line in f:
                if line.startswith(key + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def _alias_key(t: torch.Tensor) -> tuple:
    """Tensors with the same key are one tensor under two names (tied weights): one buffer serves both. (The first
    element's address, layout and dtype: cheap, as a save reads it for every tensor of the state.)"""
    return (t.device, t.data_ptr(), t.shape, t.stride(), t.dtype)


def _once(tensors: list[tuple[tuple, torch.Tensor]]) -> list[tuple[tuple, torch.Tensor]]:
    """``(path, tensor)`` pairs with each aliased tensor kept under its first path (as ``copy`` maps them)."""
    seen: set[tuple] = set()
    out = []
    for path, t in tensors:
        key = _alias_key(t)
        if key not in seen:
            seen.add(key)
            out.append((path, t))
    return out


def _tensors(obj: Any, path: tuple = ()) -> list[tuple[tuple, torch.Tensor]]:
    if torch.is_tensor(obj):
        return [(path, obj)]
    if isinstance(obj, dict):
        return [x for k, v in obj.items() for x in _tensors(v, path + (k,))]
    if isinstance(obj, (list, tuple)):
        return [x for i, v in enumerate(obj) for x in _tensors(v, path + (i,))]
    return []


class SnapshotBuffers:
    """Reusable host copies of nested tensors (a state dict, an optimizer state)."""

    def __init__(self, pin: bool | None = None, available: Callable[[], int] = host_available_bytes) -> None:
        self.pin = torch.cuda.is_available() if pin is None else pin
        self._available = available
        self._buffers: dict[tuple, torch.Tensor] = {}
        self._reserving: threading.Thread | None = None
        self._reserved: dict[tuple, torch.Tensor] = {}

    @property
    def nbytes(self) -> int:
        self._join()
        return sum(b.numel() * b.element_size() for b in self._buffers.values())

    def reserve(self, state: Any, background: bool = True) -> bool:
        """Allocate now the buffers a later ``copy(state)`` needs (on a thread by default), so the first save does
        not pay for page-locking them (seconds for a 1B model's checkpoint, many times a later save's copy:
        benchmarks/other-measurements.md). False, and nothing allocated, when the host lacks the memory
        (``shortfall``)."""
        if self.shortfall(state) is not None:  # (it waited for any reservation under way)
            return False
        wanted = [(path, t.shape, t.dtype) for path, t in _once(_tensors(state)) if not self._held(path, t)]

        def allocate() -> None:
            try:
                for path, shape, dtype in wanted:
                    self._reserved[path] = torch.empty(shape, dtype=dtype, device="cpu", pin_memory=self.pin)
            except Exception as exc:  # e.g. the host ran short meanwhile: the save allocates (or falls back) itself
                logger.warning("hf_accel: reserving snapshot buffers ahead of the first save failed (%s)", exc)

        if background:
            self._reserving = threading.Thread(target=allocate, name="hf_accel-snapshot-reserve", daemon=True)
            self._reserving.start()
        else:
            allocate()
        return True

    def _join(self) -> None:
        """Wait for a reservation under way and take its buffers."""
        if self._reserving is not None:
            self._reserving.join()
            self._reserving = None
        if self._reserved:
            self._buffers.update(self._reserved)
            self._reserved = {}

    def _held(self, path: tuple, t: torch.Tensor) -> bool:
        """Whether the buffer for ``path`` exists and can take ``t``."""
        buf = self._buffers.get(path)
        return buf is not None and buf.shape == t.shape and buf.dtype == t.dtype

    def _missing_bytes(self, state: Any) -> tuple[int, int]:
        """(bytes of the state, bytes of it without a held buffer), tied tensors once. When every tensor has its
        buffer (every save after the first) this is one dictionary lookup per tensor and returns (0, 0)."""
        tensors = _tensors(state)
        if all(self._held(path, t) for path, t in tensors):
            return 0, 0
        unique = _once(tensors)
        total = sum(t.numel() * t.element_size() for _, t in unique)
        missing = sum(t.numel() * t.element_size() for path, t in unique if not self._held(path, t))
        return total, missing

    def shortfall(self, state: Any) -> str | None:
        """None when ``state`` fits (buffers already held, or the host has room for the new ones); else why not."""
        self._join()
        total, missing = self._missing_bytes(state)
        if not missing:
            return None
        free = self._available()
        if free - missing < HEADROOM * total:
            return (f"host memory is short for a background snapshot ({free / 2**30:.2f} GiB available, it needs "
                    f"{missing / 2**30:.2f} GiB more plus {HEADROOM:.0%} headroom)")
        return None

    def copy(self, state: Any) -> Any:
        """``state`` with every tensor replaced by its host buffer, filled with the tensor's current values; tensors
        that are one tensor under several names (tied weights) share one buffer, so writers see the tie (and store
        it once) and the host holds it once."""
        self._join()
        aliases: dict[tuple, torch.Tensor] = {}

        def walk(obj: Any, path: tuple) -> Any:
            if torch.is_tensor(obj):
                key = _alias_key(obj)
                if key in aliases:
                    return aliases[key]
                if not self._held(path, obj):
                    self._buffers[path] = torch.empty(obj.shape, dtype=obj.dtype, device="cpu", pin_memory=self.pin)
                buf = self._buffers[path]
                buf.copy_(obj, non_blocking=self.pin)
                aliases[key] = buf
                return buf
            if isinstance(obj, dict):
                return {k: walk(v, path + (k,)) for k, v in obj.items()}
            if isinstance(obj, (list, tuple)):
                return type(obj)(walk(v, path + (i,)) for i, v in enumerate(obj))
            return obj

        with torch.no_grad():  # copies of live parameters: no autograd record (and no detach per tensor)
            out = walk(state, ())
        if self.pin:  # the non-blocking copies must land before the writer thread reads the buffers
            torch.cuda.synchronize()
        return out

    def release(self) -> None:
        self._join()
        self._buffers.clear()
