"""Choosing an attention backend: the first in this device's preference order whose declared capabilities cover the
request. Rejections are kept (``Selection.rejected``) so reports and errors can say why each backend was passed over.
"""
from __future__ import annotations

import functools
import logging
from dataclasses import dataclass

from ...errors import BackendUnavailable
from .backend import Backend
from .base import AttentionRequest, DeviceInfo
from .fa4 import FA4Backend
from .flash_attn_ext import FlashAttn2Backend, FlashAttn3Backend
from .flex import FlexBackend
from .mem_efficient import MemEfficientBackend
from .reference import ReferenceBackend
from .sdpa import SDPABackend
from .torch_fa2 import TorchFA2Backend

logger = logging.getLogger("hf_accel")

BACKENDS: dict[str, Backend] = {
    b.name: b
    for b in (FA4Backend(), FlashAttn3Backend(), FlashAttn2Backend(), TorchFA2Backend(), FlexBackend(),
              MemEfficientBackend(), SDPABackend(), ReferenceBackend())
}

# Fastest first, per device type (fa4 ahead of PyTorch's FA2 forward + backward: BENCHMARKS.md, FlashMHA).
# Flex is fast only compiled on CUDA; on the CPU its eager path is a math reference, so SDPA comes first there.
# mem-efficient (varlen, any head_dim) serves what the flash-class kernels cannot: head_dim above 256 (Gemma 4's global
# layers), before the padded SDPA path.
PREFERENCE: dict[str, tuple[str, ...]] = {
    "cuda": ("fa4", "fa3", "fa2", "torch-fa2", "flex", "mem-efficient", "sdpa", "reference"),
    "default": ("sdpa", "flex", "reference"),
}


@dataclass(frozen=True)
class Selection:
    backend: Backend
    rejected: tuple[tuple[str, str], ...]  # (backend name, why not), in preference order

    def explain(self) -> str:
        why_not = "; ".join(f"{name}: {why}" for name, why in self.rejected)
        return f"{self.backend.name}" + (f" (passed over: {why_not})" if why_not else "")


@functools.lru_cache(maxsize=None)
def _unavailable_reason(name: str) -> str | None:
    return BACKENDS[name].unavailable_reason()


def _why_not(name: str, request: AttentionRequest, installed: frozenset[str] | None) -> str | None:
    if installed is not None:
        reason = None if name in installed else "not installed"
    else:
        reason = _unavailable_reason(name)
    if reason:
        return reason
    missing = BACKENDS[name].capabilities.missing(request)
    return "cannot do " + ", ".join(missing) if missing else None


def _order(device: DeviceInfo) -> tuple[str, ...]:
    return PREFERENCE.get(device.type, PREFERENCE["default"])


@functools.lru_cache(maxsize=256)
def select(request: AttentionRequest, backend: str = "auto", installed: frozenset[str] | None = None) -> Selection:
    """The backend serving ``request``. ``installed`` overrides what counts as installed (tests fake a device)."""
    if backend != "auto" and backend not in BACKENDS:
        raise BackendUnavailable(
            f"unknown attention backend {backend!r}; choose 'auto' or one of: {', '.join(BACKENDS)}."
        )
    names = _order(request.device) if backend == "auto" else (backend,)
    rejected = []
    for name in names:
        why = _why_not(name, request, installed)
        if why is None:
            return Selection(BACKENDS[name], tuple(rejected))
        rejected.append((name, why))
    could = [n for n in _order(request.device) if _why_not(n, request, installed) is None]
    tried = "; ".join(f"{n} ({why})" for n, why in rejected)
    advice = f"Pass backend='auto' or one of: {', '.join(could)}." if could else "No installed backend can serve it."
    raise BackendUnavailable(
        f"backend {backend!r} cannot serve this attention call (head_dim={request.head_dim}, dtype={request.dtype}, "
        f"device={request.device.type}); tried {tried}. {advice}"
    )


@dataclass(frozen=True)
class BackendStatus:
    name: str
    available: bool
    reason: str | None
    notes: tuple[str, ...]


def list_backends() -> list[BackendStatus]:
    """Every backend hf_accel knows, whether it can run in this process, and why not."""
    out = []
    for name, b in BACKENDS.items():
        reason = _unavailable_reason(name)
        out.append(BackendStatus(name, reason is None, reason, b.capabilities.notes))
    return out


def format_backends() -> str:
    rows = [f"{s.name:10s} {'yes' if s.available else 'no ':3s}  {s.reason or '; '.join(s.notes)}" for s in list_backends()]
    return "backend    ok   notes\n" + "\n".join(rows)
