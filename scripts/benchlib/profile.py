"""Kernel time by category for a few training steps: what `scripts/profile_step.py` reports for hf_accel alone, and
what `bench.py --profile-steps N` records for every configuration of a run (TRL, Unsloth and hf_accel side by side,
issue 20c). The profiled steps are the first N timed steps, so their times include the profiler's overhead: take
speed from a run without it."""
from __future__ import annotations

from collections import defaultdict
from typing import Any

import torch

# Kernel-name fragments, checked in order: the first match decides a kernel's category.
CATEGORIES = (
    # bitsandbytes' 4-bit dequantize (kDequantizeBlockwise...): QLoRA's forward, checkpoint recompute and backward each
    # dequantize every frozen weight once; compare its calls per step with 3 x the quantized linears
    ("dequantize", ("dequant",)),
    ("attention", ("flash", "fmha", "attention", "attn", "fwd_sm90", "bwd_sm90", "cute")),
    ("loss", ("cross_entropy", "log_softmax", "nll", "liger_cross", "softmax", "_ce_grad_rows")),
    ("optimizer", ("adam", "multi_tensor", "foreach")),
    ("matmul", ("gemm", "sm90_xmma", "nvjet", "cutlass", "matmul", "cublas")),
    ("norms+elementwise", ("elementwise", "vectorized", "norm", "reduce", "silu", "gelu", "mul", "add", "copy", "rope",
                           "swiglu", "index", "cat", "fill")),
)


def category(kernel: str) -> str:
    name = kernel.lower()
    return next((cat for cat, keys in CATEGORIES if any(k in name for k in keys)), "other")


def ms_by_category(prof: Any, steps: int, cuda: bool) -> dict[str, float]:
    """Milliseconds per step by category: device time of CUDA kernels on a GPU, self CPU time of ops elsewhere."""
    totals: dict[str, float] = defaultdict(float)
    for event in prof.key_averages():
        if cuda:
            us = getattr(event, "device_time_total", None) or getattr(event, "cuda_time_total", 0)
        else:
            us = event.self_cpu_time_total
        if us and event.key:
            totals[category(event.key)] += us / 1000 / steps
    out = {cat: round(totals.get(cat, 0.0), 3) for cat, _ in CATEGORIES}
    out["other"] = round(totals.get("other", 0.0), 3)
    out["total"] = round(sum(totals.values()), 3)
    return out


def top_kernels(prof: Any, steps: int, cuda: bool, n: int = 20) -> list[dict[str, Any]]:
    """The ``n`` kernels (CPU: ops) with the most time per step: name, ms and calls per step, category."""
    rows = []
    for event in prof.key_averages():
        us = (getattr(event, "device_time_total", None) or getattr(event, "cuda_time_total", 0)) if cuda \
            else event.self_cpu_time_total
        if us and event.key:
            rows.append({"kernel": event.key[:120], "ms_per_step": round(us / 1000 / steps, 3),
                         "calls_per_step": round(event.count / steps, 1), "category": category(event.key)})
    return sorted(rows, key=lambda r: -r["ms_per_step"])[:n]


class StepProfiler:
    """torch.profiler over ``steps`` consecutive steps: ``begin()`` at the first step's start, ``end()`` after the
    last; ``result`` then holds ``{"steps": N, "ms_per_step": {category: ms}, "top_kernels": [...]}``."""

    def __init__(self, steps: int, cuda: bool) -> None:
        self.steps, self.cuda = steps, cuda
        self.result: dict[str, Any] | None = None
        self._prof = None

    def begin(self) -> None:
        from torch.profiler import ProfilerActivity, profile

        activities = [ProfilerActivity.CUDA] if self.cuda else [ProfilerActivity.CPU]
        self._prof = profile(activities=activities)
        self._prof.start()

    def end(self, steps: int | None = None) -> None:
        """Stop after ``steps`` profiled steps (default: all ``self.steps``; fewer when the run stopped early)."""
        if self._prof is None:
            return
        if self.cuda:
            torch.cuda.synchronize()
        self._prof.stop()
        steps = steps or self.steps
        self.result = {"steps": steps, "ms_per_step": ms_by_category(self._prof, steps, self.cuda),
                       "top_kernels": top_kernels(self._prof, steps, self.cuda)}
        self._prof = None
