"""What a benchmarked run held besides the device peak: host memory (resident and pinned) and, where hf_accel's
checkpointing planned, offloaded or spaced layers' inputs, the plan's split."""
from __future__ import annotations

from typing import Any

import torch
from torch import nn

from .train import causal_lm


def host_peak_bytes() -> int | None:
    """This process's resident-memory high-water mark (Linux /proc/self/status VmHWM; pinned host buffers are
    resident too), or None where it cannot be read."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def memory_summary(model: nn.Module, device: str) -> dict[str, Any]:
    """Host peaks (resident high-water mark, torch's pinned host allocator) and, where a checkpointing policy planned,
    offloaded or spaced, what it did: for the long-context sweeps' device / host split."""
    from dataclasses import asdict

    from hf_accel.memory.checkpointing import applied_policy

    out: dict[str, Any] = {}
    hwm = host_peak_bytes()
    if hwm is not None:
        out["host_peak_gib"] = hwm / 2**30
    stats = getattr(torch.cuda, "host_memory_stats", None)
    if device.startswith("cuda") and stats is not None:
        pinned = stats().get("allocated_bytes.peak")
        if pinned is not None:
            out["pinned_peak_gib"] = pinned / 2**30
    policy = applied_policy(model) or applied_policy(causal_lm(model))
    plan = getattr(policy, "plan", None)
    if plan is not None:
        out["checkpointing_plan"] = {
            "split": plan.split(), "choices": list(plan.choices),
            "predicted_peak_gib": plan.predicted_peak_bytes / 2**30,
            "budget_gib": getattr(policy, "budget_bytes_resolved", 0) / 2**30, "host_gib": plan.host_bytes / 2**30,
            "host_budget_gib": None if plan.host_budget_bytes is None else plan.host_budget_bytes / 2**30,
            **_predicted_terms(policy)}
    offloader, spacer = getattr(policy, "offloader", None), getattr(policy, "spacer", None)
    if offloader is not None:
        out["offloaded_host_peak_gib"] = offloader.stats.host_peak_bytes / 2**30
    if spacer is not None:
        out["spacing"] = asdict(spacer.stats)
    return out


def _predicted_terms(policy) -> dict[str, Any]:
    """What a budget plan's predicted peak is made of (plan.peak_terms), and the probed figures of its largest layer,
    in GiB: to set beside the measured peak (run 32, under the count before 12-05 15:00: 76.0 predicted, 59.0
    measured at 344k tokens)."""
    from hf_accel.memory.plan import peak_terms

    planning, probe = getattr(policy, "planning", None), getattr(policy, "probe", None)
    if planning is None or probe is None:
        return {}
    terms = peak_terms(probe.layers, policy.plan.choices, planning["fixed_bytes"], planning["extra_bytes"],
                       planning["grads"])
    largest = max(probe.layers, key=lambda layer: layer.none_bytes)
    return {"predicted_terms_gib": {name: n / 2**30 for name, n in terms.items()},
            "largest_layer_gib": {name: getattr(largest, f"{name}_bytes") / 2**30
                                  for name in ("none", "op", "full", "backward")}}
