"""Checkpointing specs and byte sizes as the user writes them ("every_2", "budget:20GiB", "512MiB"), parsed without
torch, so the ``hf-accel`` command refuses a wrong one before it loads anything. ``policy_from_spec`` builds the
policy from what ``parse_checkpointing`` returns."""
from __future__ import annotations

import math
from dataclasses import dataclass

from ..errors import ConfigurationError

ALLOWED = ("'none', 'full', 'offload', 'every_N' (e.g. 'every_2'), 'op', 'budget:20GiB', 'budget:0.6' (fraction of "
           "device memory), 'budget:20GiB+offload', 'budget:20GiB+no-offload'")
_GIB = 1024**3
_UNITS = {"kib": 1024, "mib": 1024**2, "gib": _GIB, "tib": 1024**4, "kb": 1e3, "mb": 1e6, "gb": 1e9, "tb": 1e12, "b": 1}


def parse_bytes(text: str) -> int:
    """'20GiB', '512MiB', '1.5GB', '1000000' -> bytes (ValueError otherwise)."""
    lowered = text.strip().lower()
    for unit, scale in sorted(_UNITS.items(), key=lambda kv: -len(kv[0])):
        if lowered.endswith(unit):
            return _whole(float(lowered[: -len(unit)]) * scale)
    return _whole(float(lowered))


def _whole(n: float) -> int:
    if not math.isfinite(n):
        raise ValueError(f"not a finite size: {n}")
    return int(n)


@dataclass(frozen=True)
class CheckpointSpec:
    """A parsed checkpointing spec: ``kind`` is none | full | offload | op | every | budget."""

    kind: str
    every: int | None = None  # kind "every": checkpoint every N-th decoder layer
    budget: float | str | None = None  # kind "budget": a fraction of device memory (float) or a size ("20GiB")
    offload: bool | None = None  # kind "budget": "+offload" / "+no-offload"; None: where the model is on CUDA


def parse_checkpointing(spec: str) -> CheckpointSpec:
    """The spec string's meaning; ``ConfigurationError`` naming the allowed forms for anything else."""
    text = spec.strip().lower()
    if text in ("none", "full", "op", "offload"):
        return CheckpointSpec(text)
    if text.startswith("every_") and text[6:].isdigit() and int(text[6:]) >= 1:
        return CheckpointSpec("every", every=int(text[6:]))
    if text.startswith("budget:"):
        value, offload = text[7:], None
        for suffix, flag in (("+no-offload", False), ("+offload", True)):
            if value.endswith(suffix):
                value, offload = value[: -len(suffix)], flag
                break
        bare = value.replace(".", "", 1).isdigit()  # a number without a unit
        if bare and float(value) == 0:
            raise ConfigurationError(f"checkpointing spec {spec!r}: a memory budget must be positive, "
                                     "e.g. 'budget:20GiB' or 'budget:0.8'.")
        if bare and "." in value:
            if not float(value) <= 1:
                raise ConfigurationError(
                    f"checkpointing spec {spec!r}: a budget without a unit is a fraction of the device's memory, "
                    f"between 0 and 1 (e.g. 'budget:0.8'); for a size write its unit (e.g. 'budget:{value}GiB')."
                )
            return CheckpointSpec("budget", budget=float(value), offload=offload)
        try:
            size = parse_bytes(value)
        except (ValueError, OverflowError):
            pass
        else:
            if bare:
                raise ConfigurationError(
                    f"checkpointing spec {spec!r}: a budget needs a unit or a decimal point: 'budget:{value}GiB' (a "
                    f"size) or 'budget:0.8' (a fraction of the device's memory). Allowed: {ALLOWED}."
                )
            if size <= 0:
                raise ConfigurationError(f"checkpointing spec {spec!r}: a memory budget must be positive, "
                                         "e.g. 'budget:20GiB'.")
            return CheckpointSpec("budget", budget=value, offload=offload)
    raise ConfigurationError(f"unknown checkpointing spec {spec!r}. Allowed: {ALLOWED}.")
