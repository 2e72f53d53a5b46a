"""What holds the tensors a test left behind: for tests/gpu/conftest.py's retained-memory check, which names the amount
but not the owner (run 40: 0.69 GiB after a TRL + Liger full fine-tune, not reproduced on CPU).

``describe(device)`` groups the live tensors on ``device`` by shape and dtype (model weights and their Adam states come
in pairs of the same shapes) and follows the largest one's referrers up to the first objects that are neither
containers nor tensors: the module, optimizer, trainer or closure keeping it."""
from __future__ import annotations

import gc
import types
import warnings
from collections import Counter

import torch

_PLUMBING = (dict, list, tuple, set, frozenset, types.FrameType, types.CellType, torch.Tensor)


def _live_tensors(device: str) -> list[torch.Tensor]:
    """Tensors holding memory on ``device`` (fake tensors and symbolic shapes, which dynamo leaves about, hold none)."""
    from torch._subclasses.fake_tensor import FakeTensor

    found = []
    with warnings.catch_warnings():  # isinstance() touches deprecated module attributes gc hands back
        warnings.simplefilter("ignore")
        for obj in gc.get_objects():
            try:
                if (isinstance(obj, torch.Tensor) and not isinstance(obj, FakeTensor) and obj.device.type == device
                        and not obj.is_meta and all(isinstance(d, int) for d in obj.shape)):
                    found.append(obj)
            except Exception:  # noqa: BLE001 - a half-built object
                continue
    return found


def _owners(obj, depth: int = 6, limit: int = 6) -> list[str]:
    """The first non-container objects above ``obj`` in the referrer graph, by type name (breadth first)."""
    seen, frontier, owners = {id(obj)}, [obj], []
    for _ in range(depth):
        nxt = []
        for item in frontier:
            for ref in gc.get_referrers(item):
                if id(ref) in seen or ref is frontier or ref is nxt or isinstance(ref, types.FrameType):
                    continue
                seen.add(id(ref))
                if isinstance(ref, _PLUMBING):
                    nxt.append(ref)
                else:
                    owners.append(f"{type(ref).__module__}.{type(ref).__qualname__}")
        if owners:
            break
        frontier = nxt
    return list(dict.fromkeys(owners))[:limit]


def describe(device: str = "cuda", top: int = 5) -> str:
    """A few lines: the bytes of live tensors on ``device`` by (shape, dtype), and who holds the largest."""
    tensors = _live_tensors(device)
    if not tensors:
        return f"no live tensors on {device} found by gc (held outside Python objects: a library's own cache)"
    sizes = Counter()
    counts = Counter()
    for t in tensors:
        key = (tuple(t.shape), str(t.dtype).replace("torch.", ""))
        sizes[key] += t.numel() * t.element_size()
        counts[key] += 1
    lines = [f"{len(tensors)} live tensors on {device}, {sum(sizes.values()) / 2**30:.3f} GiB; largest groups:"]
    for key, nbytes in sizes.most_common(top):
        lines.append(f"  {counts[key]} x {key[0]} {key[1]}: {nbytes / 2**20:.1f} MiB")
    largest = max(tensors, key=lambda t: t.numel() * t.element_size())
    lines.append(f"  the largest, {tuple(largest.shape)}, is held by: {', '.join(_owners(largest)) or 'nothing found'}")
    return "\n".join(lines)
