#!/usr/bin/env python
"""Issue 38's memory question on the GPU: does the QLoRA defaults' peak (0.17 GiB over TRL's) come from the compiled
layers? One Llama-3-8B QLoRA model as scripts/bench.py builds it (NF4 from files, PEFT's kbit preparation, LoRA r=16),
patched after its LoRA in each variant in turn (compiled layers, eager layers, compiled without inductor's donated
buffers, compiled without liger-kernel): the allocator's peak over two steps after three warm-up steps, and the
memory planner's one-layer backward probe. Writes $OUT/diag_qlora_memory.json (one H200: ~4 minutes).
The record benchmarks/results/diag_qlora_memory_2026-12-03T0611.json came from an earlier draft of this script
(the same variants and measurements, with the probe wrapped in a try); this form ran on 2026-12-04
(diag_qlora_memory_2026-12-04T0255.json: defaults and two amb= variants).
Arguments name other variants: ``amb=F`` is the compiled defaults with the partitioner's
``torch._functorch.config.activation_memory_budget`` at F (1.0: save what min-cut picks; lower: recompute more of
each layer's forward inside its backward), e.g. ``defaults amb=0.9 amb=0.8``.

    PYTHONPATH=/tmp/site-bnb:$PYTHONPATH python scripts/gpu_queues/diag_qlora_memory.py [VARIANT ...]
"""
from __future__ import annotations

import itertools
import json
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT), str(ROOT / "scripts")]

import torch  # noqa: E402

import hf_accel  # noqa: E402
from benchlib.apart import qlora_base  # noqa: E402
from benchlib.configs import _hf_accel_steps  # noqa: E402
from benchlib.train import RunSettings, Timing, add_lora, hf_loss, run_loop  # noqa: E402
from benchlib.workloads import WORKLOADS, DataSpec, make_data  # noqa: E402
from hf_accel.memory import plan  # noqa: E402

GIB = 2 ** 30
WORKLOAD = WORKLOADS["llama-8b-qlora"]


def settings(steps: int) -> RunSettings:
    return RunSettings(workload=WORKLOAD, device="cuda", tiny=False, steps=steps, warmup=0, step_time_budget=1e9)


def measure(model, batches: list, **patch_kwargs) -> dict:
    """Patch with ``patch_kwargs``, warm up, then the peak over two steps and the planner's backward probe; unpatch."""
    torch._dynamo.reset()
    report = hf_accel.patch(model, **patch_kwargs)
    run_loop(model, iter(batches[:3]), hf_loss, settings(3), Timing())
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    timing = Timing()
    run_loop(model, iter(batches[3:5]), hf_loss, settings(2), timing)
    torch.cuda.synchronize()
    row = {"peak_gib": torch.cuda.max_memory_allocated() / GIB, "before_gib": before / GIB,
           "steps_s": timing.step_seconds, "speedups": report.speedups}
    batch = {k: v.cuda() if torch.is_tensor(v) else v for k, v in batches[5][0].items()}
    layer = [m for m in model.modules() if type(m).__name__ == "LlamaDecoderLayer"][1]
    with torch.autocast("cuda", dtype=torch.bfloat16):
        compiled = patch_kwargs.get("compile", "auto") is not False
        row["layer_backward_gib"] = plan.layer_backward_bytes(model, batch, layer, compiled=compiled) / GIB
    hf_accel.unpatch(model)
    torch.cuda.empty_cache()
    return row


def run_variant(name: str, model, batches: list) -> dict:
    """One named variant's row (see the module docstring)."""
    if name == "defaults":
        return measure(model, batches)
    if name == "eager":
        return measure(model, batches, compile=False)
    if name == "no-donated-buffers":
        with torch._functorch.config.patch(donated_buffer=False):
            return measure(model, batches)
    if name == "no-fused-ops":
        return measure(model, batches, fused_ops=False)
    if name.startswith("amb="):
        with torch._functorch.config.patch(activation_memory_budget=float(name[4:])):
            return measure(model, batches)
    raise SystemExit(f"unknown variant {name!r}")


def main() -> None:
    variants = sys.argv[1:] or ["defaults", "eager", "no-donated-buffers", "no-fused-ops"]
    model = add_lora(qlora_base(settings(1), "sdpa", kbit_preparation=True), WORKLOAD)  # PEFT's recipe, as measured
    batches = list(itertools.islice(_hf_accel_steps(make_data(DataSpec(), model.config.vocab_size, 12), 0), 8))
    rows = {}
    for name in variants:
        rows[name] = run_variant(name, model, batches)
        print(name, json.dumps(rows[name]), flush=True)
        Path(os.environ.get("OUT", "."), "diag_qlora_memory.json").write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
