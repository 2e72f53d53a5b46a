#!/usr/bin/env python
"""Where a training step's time goes: steady-state step time and GPU kernel time by category.

Runs the benchmark's hf_accel configuration (same model shapes, data and optimizer as scripts/bench.py), warms up,
times steps, then profiles a few with torch.profiler and groups CUDA kernel time into attention / matmul / loss /
optimizer / norms+elementwise / other. Also times batch collation on the CPU alone. Prints a markdown table last.

    python scripts/profile_step.py --workload llama-1b --out results/        # on a GPU
    python scripts/profile_step.py --workload llama-1b --device cpu --tiny   # smoke run
    python scripts/profile_step.py --workload llama-8b-qlora --defaults      # the QLoRA rows' model, patch(model)
    python scripts/profile_step.py --workload llama-8b-qlora --defaults --memory-peak   # + what its peak holds
    python scripts/profile_step.py --workload llama-8b-qlora --defaults --op-sites      # + which code launches them

QLoRA workloads (`*-qlora`) profile the hf_accel-qlora row's model: the NF4 base as scripts/bench.py builds it (no
kbit preparation since issue 70: the recommended recipe; checkpointing on), LoRA; `--defaults` patches it as
`hf_accel.patch(model)` does with no arguments (the hf_accel-qlora row) instead of the explicit --fused-ops /
--compile / --fused-ce choices.
"""
from __future__ import annotations

import argparse
import itertools
import json
import sys
import time
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

import hf_accel  # noqa: E402
from benchlib.configs import Options, _apply_checkpointing, _fused_loss, _hf_accel_steps  # noqa: E402
from benchlib.apart import qlora_base  # noqa: E402
from benchlib.profile import category  # noqa: E402
from benchlib.train import RunSettings, Timing, add_lora, build_model, hf_loss, run_loop  # noqa: E402
from benchlib.workloads import WORKLOADS, DataSpec, make_data  # noqa: E402

def kernel_gaps(events, steps: int, top: int = 12) -> dict:
    """Idle time between consecutive GPU kernels, grouped by the kernels on either side: where the GPU waits for
    the host (syncs, Python between launches, collation between steps). Gaps of 20 µs or less are launch-queue
    spacing, not a wait for the host: they are summed apart (`short_gap_ms_per_step`, over `kernels_per_step`
    kernels), so a step's time outside its kernels splits into host waits, launch spacing and the rest."""
    spans = sorted((e.time_range.start, e.time_range.end, e.key) for e in events
                   if getattr(e, "device_type", None) == torch.autograd.DeviceType.CUDA and e.time_range.end > 0)
    sites: dict[tuple[str, str], list[float]] = defaultdict(lambda: [0, 0.0])
    busy_until, prev, idle_us, short_us = None, None, 0.0, 0.0
    for start, end, key in spans:
        if busy_until is not None and start - busy_until > 20:  # µs: ignore launch-queue jitter
            site = sites[(prev[:60], key[:60])]
            site[0] += 1
            site[1] += start - busy_until
            idle_us += start - busy_until
        elif busy_until is not None and start > busy_until:
            short_us += start - busy_until
        if busy_until is None or end > busy_until:
            busy_until, prev = end, key
    ranked = sorted(sites.items(), key=lambda kv: -kv[1][1])[:top]
    return {"idle_ms_per_step": idle_us / 1000 / steps, "short_gap_ms_per_step": short_us / 1000 / steps,
            "kernels_per_step": len(spans) / steps,
            "span_ms_per_step": (busy_until - spans[0][0]) / 1000 / steps if spans else 0.0,
            "sites": [{"after": a, "before": b, "count_per_step": n / steps, "ms_per_step": us / 1000 / steps}
                      for (a, b), (n, us) in ranked]}


MATMUL_OPS = ("aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm", "aten::_scaled_mm", "aten::matmul")


def op_sites(prof, steps: int, device: bool, top: int = 40) -> list[dict]:
    """The aten ops other than matmuls (the kernel table has those) with the most time of their own (GPU time; host
    time for a CPU run), per call site: op, input shapes and the innermost Python frames outside torch (the
    profiler's Python events that enclose the op). Kernels that inductor's compiled code launches itself (its triton
    kernels) have no aten op and do not show; its extern calls (custom ops, copies) and every eager op do."""
    sites: dict[tuple, list] = defaultdict(lambda: [0, 0.0])
    for event in prof.events():
        if not event.name.startswith(("aten::", "bitsandbytes::")) or event.name in MATMUL_OPS:
            continue
        own_us = event.self_device_time_total if device else event.self_cpu_time_total
        if not own_us:
            continue
        frames, parent = [], event.cpu_parent
        while parent is not None and len(frames) < 5:
            name = parent.name.removeprefix("autograd::engine::evaluate_function: ")
            python = ".py(" in name and not name.startswith("torch/") and "/torch/" not in name
            if (python and "profile_step.py" not in name) or name != parent.name or "Compiled" in name:
                frames.append(name)  # our code's frames, the autograd node of a backward op, compiled regions
            parent = parent.cpu_parent
        site = sites[(event.name, str(event.input_shapes)[:160], tuple(frames))]
        site[0] += 1
        site[1] += own_us
    rows = [{"op": op, "shapes": shapes, "calls_per_step": n / steps, "ms_per_step": us / 1000 / steps,
             "stack": list(frames)} for (op, shapes, frames), (n, us) in sites.items()]
    return sorted(rows, key=lambda r: -r["ms_per_step"])[:top]


def profile(args) -> dict:
    workload = WORKLOADS[args.workload]
    settings = RunSettings(workload=workload, device=args.device, tiny=args.tiny, steps=args.steps,
                           warmup=args.warmup, step_time_budget=1e9)
    qlora = args.workload.endswith("-qlora")
    model = qlora_base(settings, "sdpa") if qlora else build_model(settings, "sdpa")
    if args.defaults:
        report = hf_accel.patch(model, **({"compile": {"nested_graph_breaks": False}} if args.without_nested_breaks
                                          else {}))
    else:
        report = hf_accel.patch(model, fused_ops=args.fused_ops, compile=args.compile)
    model = add_lora(model, workload)  # the workload's adapters (Llama-8B LoRA), as scripts/bench.py adds them
    spec = DataSpec.tiny() if args.tiny else DataSpec()
    if args.checkpointing:
        _apply_checkpointing(model, args.checkpointing, spec.tokens_per_step, Timing())
    data = make_data(spec, model.config.vocab_size, args.warmup + args.steps + args.profile_steps + 4)
    options = Options(fused_ce=args.fused_ce)
    # with --defaults the loss is patch()'s own (its fused_ce="auto" binds it into the forward)
    loss_fn = hf_loss if args.fused_ce == "off" or args.defaults else _fused_loss(options)

    collate_start = time.perf_counter()
    batches = list(itertools.islice(_hf_accel_steps(data, 0), args.warmup + args.steps + args.profile_steps))
    collate_s = (time.perf_counter() - collate_start) / len(batches)

    timing = Timing()
    optimizer = run_loop(model, iter(batches[: args.warmup + args.steps]), loss_fn, settings, timing)
    steady = sorted(timing.step_seconds)[len(timing.step_seconds) // 2]  # median: robust to JIT-compile steps

    kernel_us: dict[str, float] = defaultdict(float)
    sites: list[dict] = []
    top_kernels: list[tuple[str, float, float]] = []
    gaps: dict = {}
    profiled_step_s = None
    cuda = args.device.startswith("cuda")
    if (cuda or args.op_sites) and args.profile_steps:
        from torch.profiler import ProfilerActivity
        from torch.profiler import profile as torch_profile

        prof_settings = RunSettings(workload=workload, device=args.device, tiny=args.tiny, steps=args.profile_steps,
                                    warmup=0, step_time_budget=1e9)
        activities = ([ProfilerActivity.CUDA] if cuda else []) + ([ProfilerActivity.CPU] if args.op_sites else [])
        profiled_timing = Timing()
        with torch_profile(activities=activities, record_shapes=args.op_sites, with_stack=args.op_sites) as prof:
            run_loop(model, iter(batches[args.warmup + args.steps:]), loss_fn, prof_settings, profiled_timing,
                     optimizer)
        profiled_step_s = sum(profiled_timing.step_seconds) / max(len(profiled_timing.step_seconds), 1)
        gaps = kernel_gaps(prof.events(), args.profile_steps)
        sites = op_sites(prof, args.profile_steps, device=cuda) if args.op_sites else []
        for event in prof.key_averages():
            device_us = getattr(event, "device_time_total", None) or getattr(event, "cuda_time_total", 0)
            if device_us and event.key and event.device_type == torch.autograd.DeviceType.CUDA \
                    and not getattr(event, "is_user_annotation", False):  # kernels, not record_function ranges
                kernel_us[category(event.key)] += device_us / args.profile_steps
                top_kernels.append((event.key[:120], device_us / args.profile_steps / 1000,
                                    event.count / args.profile_steps))  # name, ms / step, calls / step
    memory_peak = None
    if args.memory_peak:
        from benchlib.memory_peak import peak_table, record

        one = RunSettings(workload=workload, device=args.device, tiny=args.tiny, steps=1, warmup=0,
                          step_time_budget=1e9)
        snapshot, baseline = record(lambda: run_loop(model, iter(batches[-1:]), loss_fn, one, Timing(), optimizer))
        memory_peak = peak_table(snapshot, baseline)
    profiled = batches[args.warmup + args.steps:] or batches
    tokens = sum(mb["input_ids"].numel() for step in profiled for mb in step) / len(profiled)
    return {
        "workload": args.workload, "device": args.device, "fused_ce": args.fused_ce, "fused_ops": args.fused_ops,
        "compile": args.compile, "checkpointing": args.checkpointing, "lora": workload.lora, "qlora": qlora,
        "defaults": args.defaults, "without_nested_breaks": args.without_nested_breaks, "speedups": report.speedups,
        "notes": report.notes,
        "trainable_params": sum(p.numel() for p in model.parameters() if p.requires_grad),
        "params": sum(p.numel() for p in model.parameters()),
        "param_tensors": sum(1 for _ in model.parameters()),
        "backend": report.backend, "steady_step_s": steady, "step_seconds": timing.step_seconds,
        "profiled_step_s": profiled_step_s,
        "tokens_per_step": tokens, "collate_s_per_step": collate_s,
        "kernel_ms_per_step": {k: v / 1000 for k, v in sorted(kernel_us.items(), key=lambda kv: -kv[1])},
        "top_kernels_ms_per_step": sorted(top_kernels, key=lambda kv: -kv[1])[:40],
        "kernel_gaps": gaps,
        "op_sites": sites,
        "peak_gib": torch.cuda.max_memory_allocated() / 2**30 if args.device.startswith("cuda") else None,
        "memory_peak": memory_peak,
    }


def table(result: dict) -> str:
    total = sum(result["kernel_ms_per_step"].values()) or float("nan")
    lines = [
        f"## {result['workload']} step profile ({result['device']}, backend {result['backend']}, "
        + ("patch(model) defaults: " + "; ".join(result.get("speedups", [])) if result.get("defaults") else
           f"fused_ce={result['fused_ce']}, fused_ops={result['fused_ops']}, compile={result.get('compile', False)}")
        + f"{', checkpointing=' + result['checkpointing'] if result.get('checkpointing') else ''}"
        f"{', QLoRA (NF4 base)' if result.get('qlora') else ', LoRA' if result.get('lora') else ''})",
        f"steady step {result['steady_step_s'] * 1000:.1f} ms for {result['tokens_per_step']:,.0f} tokens "
        f"({result['tokens_per_step'] / result['steady_step_s']:,.0f} tokens/s); collation on the CPU "
        f"{result['collate_s_per_step'] * 1000:.1f} ms/step",
        "", "| category | GPU ms / step | share |", "|---|---:|---:|",
    ]
    for cat, ms in result["kernel_ms_per_step"].items():
        lines.append(f"| {cat} | {ms:.1f} | {ms / total:.0%} |")
    if result["kernel_ms_per_step"]:
        idle = result["steady_step_s"] * 1000 - total
        lines.append(f"| (step time not covered by kernels: host work, launch gaps) | {idle:.1f} | - |")
    if result.get("top_kernels_ms_per_step"):
        lines += ["", "| kernel | ms / step | calls / step |", "|---|---:|---:|"]
        lines += [f"| {k[0][:70]} | {k[1]:.1f} | {k[2] if len(k) > 2 else '-'} |"
                  for k in result["top_kernels_ms_per_step"][:15]]
    if result.get("op_sites"):
        unit = "GPU" if result["device"].startswith("cuda") else "host"
        lines += ["", f"| aten op | input shapes | calls / step | {unit} ms / step | innermost frames |",
                  "|---|---|---:|---:|---|"]
        lines += [f"| {r['op']} | {r['shapes'][:60]} | {r['calls_per_step']:.1f} | {r['ms_per_step']:.2f} | "
                  f"{' < '.join(f.rsplit('/', 1)[-1] for f in r['stack'][:3])} |" for r in result["op_sites"][:20]]
    gaps = result.get("kernel_gaps") or {}
    if gaps.get("kernels_per_step"):
        lines += ["", f"Profiled steps: {result['profiled_step_s'] * 1000:.1f} ms each (the profiler's own cost "
                  f"included); kernels from first start to last end {gaps['span_ms_per_step']:.1f} ms a step, "
                  f"{gaps['kernels_per_step']:,.0f} kernels a step; between them {gaps['idle_ms_per_step']:.1f} ms "
                  f"in gaps over 20 µs (waits for the host) and {gaps['short_gap_ms_per_step']:.1f} ms in shorter "
                  "ones (launch spacing)."]
    if gaps.get("sites"):
        lines += ["", f"GPU idle between kernels: {gaps['idle_ms_per_step']:.1f} ms/step; largest sites:", "",
                  "| after kernel | before kernel | gaps/step | ms/step |", "|---|---|---:|---:|"]
        lines += [f"| {g['after'][:50]} | {g['before'][:50]} | {g['count_per_step']:.1f} | {g['ms_per_step']:.2f} |"
                  for g in gaps["sites"][:8]]
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workload", choices=sorted(WORKLOADS), default="llama-1b")
    p.add_argument("--device", default="cuda")
    p.add_argument("--tiny", action="store_true")
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--profile-steps", type=int, default=3)
    p.add_argument("--fused-ce", choices=["auto", "inline", "recompute", "liger", "off"], default="off")
    p.add_argument("--fused-ops", action="store_true")
    p.add_argument("--compile", action="store_true", help="patch(compile=True): inductor-compiled decoder layers")
    p.add_argument("--checkpointing", default=None, help="a checkpointing spec, as bench.py --best-checkpointing")
    p.add_argument("--defaults", action="store_true",
                   help="hf_accel.patch(model) with no arguments (the library's own choices), as bench's "
                        "hf_accel-defaults / hf_accel-qlora rows; --fused-ops / --compile / --fused-ce are then unused")
    p.add_argument("--without-nested-breaks", action="store_true",
                   help="with --defaults: patch(model, compile={'nested_graph_breaks': False}), as bench's "
                        "hf_accel-without-nested-breaks row")
    p.add_argument("--memory-peak", action="store_true",
                   help="CUDA: one more step under the allocator's history; what is alive at its peak, grouped by "
                        "the Python frames that allocated it (benchlib.memory_peak)")
    p.add_argument("--op-sites", action="store_true",
                   help="CUDA: also record the host side (shapes, Python stacks) and list the aten ops with the most "
                        "GPU time by call site: where eager copies and casts come from")
    p.add_argument("--out", type=Path, default=None)
    return p


def main(argv=None) -> None:
    args = build_parser().parse_args(argv)
    if args.without_nested_breaks and not args.defaults:
        raise SystemExit("profile_step.py: --without-nested-breaks changes --defaults' patch; give both")
    if args.memory_peak and not args.device.startswith("cuda"):
        raise SystemExit("profile_step.py: --memory-peak reads CUDA's allocator history; run it with --device cuda")
    result = profile(args)
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        name = (f"profile_{args.workload}_defaults{'_without-nested' if args.without_nested_breaks else ''}"
                f"{_checkpointing_tag(args)}.json" if args.defaults else
                f"profile_{args.workload}_{args.fused_ce}_{'fusedops' if args.fused_ops else 'plain'}"
                f"{'_compiled' if args.compile else ''}.json")
        (args.out / name).write_text(json.dumps(result, indent=1))
    print(table(result))
    if result.get("memory_peak"):
        from benchlib.memory_peak import markdown

        print("\n" + markdown(result["memory_peak"]))


def _checkpointing_tag(args) -> str:
    return "" if not args.checkpointing else "_" + "".join(c if c.isalnum() or c in ".-" else "-"
                                                          for c in args.checkpointing)


if __name__ == "__main__":
    main()
