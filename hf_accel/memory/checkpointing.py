"""Checkpointing policies: which decoder layers (or other modules) recompute their activations in backward.

Each policy is a small object with `apply(model, context=None)`, `remove(model)` and `describe()`; `context` is the
run it is applied for (`memory.context.RunContext`: what a memory budget plans with; the fixed policies ignore it).
Decoder layers are transformers' `GradientCheckpointingLayer`s: we turn on transformers' own checkpointing through
the model's enable method (`activation_checkpointing_enable` in 5.23, `gradient_checkpointing_enable` in 5.17, found by
feature detection) and then set each layer's `gradient_checkpointing` flag and `_gradient_checkpointing_func` as the
policy says. A decoder layer's `forward` is never replaced (that silently disables transformers' checkpointing); only
non-layer modules picked by a `check_fn` (e.g. MLPs) get their instance `forward` wrapped, and `remove` restores it.

`Trainer.train()` re-enables checkpointing from its arguments and overwrites the per-layer flags: call
`reapply_checkpointing(model)` after that (hf_accel's Trainer does it) to restore the policy's choice.

This module is the policies' face: the fixed policies live in `policies`, the `budget:` one in `budget` (both
re-exported here, `MemoryBudget` included), and `policy_from_spec` turns a spec into either.
"""
from __future__ import annotations

from .budget import MemoryBudget
from .policies import (CheckpointingPolicy, EveryN, FullCheckpointing, LayerChoice,  # noqa: F401 (re-exported)
                       NoCheckpointing, OffloadedCheckpointing, OpLevel, PerLayer, SelectiveModules, applied_policy,
                       default_save_ops_for, reapply_checkpointing, remove_checkpointing)
from .spec import ALLOWED, parse_checkpointing
from .targets import decoder_layers, default_save_ops  # noqa: F401 (re-exported)
from ..errors import ConfigurationError

__all__ = ["CheckpointingPolicy", "EveryN", "FullCheckpointing", "MemoryBudget", "NoCheckpointing",
           "OffloadedCheckpointing", "OpLevel", "PerLayer", "SelectiveModules", "applied_policy", "decoder_layers",
           "policy_from_spec", "reapply_checkpointing", "remove_checkpointing"]


def policy_from_spec(spec, *, use_reentrant: bool = False, explicit: bool = True) -> CheckpointingPolicy:
    """Turn a user spec into a policy.

    spec: "none" | "full" | "offload" | "every_N" (any N >= 1) | "op" | "budget:20GiB" | "budget:0.6" (fraction of
    device memory; on CUDA plans may keep layer inputs in host memory where device-only plans do not fit) |
    "budget:20GiB+offload" / "budget:20GiB+no-offload" (offload allowed / not, whatever the device) | True / False | a
    CheckpointingPolicy (returned as is) | a callable check_fn(module) -> bool.
    """
    if isinstance(spec, CheckpointingPolicy):
        return spec
    common = {"use_reentrant": use_reentrant, "explicit": explicit}
    if isinstance(spec, bool):
        return FullCheckpointing(**common) if spec else NoCheckpointing(**common)
    if callable(spec):
        return SelectiveModules(check_fn=spec, **common)
    if not isinstance(spec, str):
        raise ConfigurationError(f"unknown checkpointing spec {spec!r}. Allowed: {ALLOWED}, True/False, a "
                                 "CheckpointingPolicy, or a callable check_fn(module) -> bool.")
    parsed = parse_checkpointing(spec)
    simple = {"none": NoCheckpointing, "full": FullCheckpointing, "op": OpLevel, "offload": OffloadedCheckpointing}
    if parsed.kind in simple:
        return simple[parsed.kind](**common)
    if parsed.kind == "every":
        return EveryN(n=parsed.every, **common)
    return MemoryBudget(budget=parsed.budget, offload=parsed.offload, **common)
