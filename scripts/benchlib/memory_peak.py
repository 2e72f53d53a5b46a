"""What is alive on the GPU at a training step's memory peak, and who allocated it.

`record(step)` runs `step()` under torch's allocator history (`torch.cuda.memory._record_memory_history`, Python
stacks only) and `peak_table(snapshot, baseline)` replays the snapshot's alloc / free trace: the moment the live
bytes were highest, and the blocks alive then grouped by the innermost Python frames outside torch that allocated
them (blocks allocated in autograd's backward threads carry no Python frame: they are grouped by block size, which
names the tensor's shape class, e.g. 256 MiB = 16k tokens x 4096 x fp32). What was allocated before the step
(weights, optimizer states, the training state) is the baseline, one line. `scripts/profile_step.py --memory-peak`
writes it for a workload's step (issue 38: where hf_accel's QLoRA peak sits against TRL's, and what a memory budget's
plan misses).

Known limit: torch 2.11-2.13 fail a compiled region's autograd Function under activation checkpointing while the
allocator's history is on (`SystemError: <built-in method apply of FunctionMeta object> returned NULL`, pytorch issue
179536; seen on the H200 with hf_accel's compiled decoder layers, 2026-12-02). `record` raises a RuntimeError naming
it; profile eager layers (profile_step.py without --defaults / --compile) until torch fixes it.
"""
from __future__ import annotations

from collections import defaultdict
from typing import Any, Callable

MiB = 2**20


def record(step: Callable[[], Any], max_entries: int = 500_000) -> tuple[dict, int]:
    """Run `step()` with the allocator's history on; returns (snapshot, bytes allocated before the step)."""
    import torch

    torch.cuda.synchronize()
    baseline = torch.cuda.memory_allocated()
    torch.cuda.memory._record_memory_history(max_entries=max_entries, stacks="python")
    try:
        try:
            step()
        except SystemError as error:
            raise RuntimeError(
                "the step failed while CUDA's allocator history was on (" + str(error)[:120] + "): torch fails "
                "compiled regions under activation checkpointing while it records (pytorch issue 179536). Profile "
                "the memory of eager layers (without --defaults / --compile) until torch fixes it.") from error
        torch.cuda.synchronize()
        snapshot = torch.cuda.memory._snapshot()
    finally:
        torch.cuda.memory._record_memory_history(enabled=None)
    return snapshot, baseline


def _frame_key(frames: list[dict], size: int, depth: int = 2) -> str:
    """The innermost `depth` frames outside torch's own package, or the block size where no Python frame is known."""
    ours = [f for f in frames if "/torch/" not in f.get("filename", "") or "_inductor" in f.get("filename", "")]
    if not ours:
        return f"(no Python frame: backward) {size / MiB:,.1f} MiB blocks"
    return " < ".join(f"{f['filename'].rsplit('/', 2)[-1] if '/' in f['filename'] else f['filename']}:"
                      f"{f.get('line', '?')} {f.get('name', '?')}" for f in ours[:depth])


def peak_table(snapshot: dict, baseline: int, device: int = 0, top: int = 25) -> dict:
    """Replay the device's trace: the peak's live bytes over `baseline` and, at that moment, the live blocks grouped
    by allocating frames (bytes, count), largest first."""
    trace = snapshot["device_traces"][device]
    live: dict[int, tuple[int, str]] = {}
    total = peak = 0
    at_peak: dict[int, tuple[int, str]] = {}
    peak_index = -1
    for i, event in enumerate(trace):
        action, addr, size = event["action"], event["addr"], event["size"]
        if action == "alloc":
            live[addr] = (size, _frame_key(event.get("frames", []), size))
            total += size
            if total > peak:
                peak, at_peak, peak_index = total, dict(live), i
        elif action == "free_requested" and addr in live:
            total -= live.pop(addr)[0]
    groups: dict[str, list[int]] = defaultdict(lambda: [0, 0])
    for size, key in at_peak.values():
        groups[key][0] += size
        groups[key][1] += 1
    ranked = sorted(groups.items(), key=lambda kv: -kv[1][0])
    trigger = trace[peak_index] if peak_index >= 0 else {}
    return {"baseline_gib": baseline / 2**30, "step_peak_over_baseline_gib": peak / 2**30,
            "peak_gib": (baseline + peak) / 2**30, "events": len(trace), "peak_event": peak_index,
            "peak_allocation": _frame_key(trigger.get("frames", []), trigger.get("size", 0)) if trigger else None,
            "live_at_peak": [{"allocated_by": k, "gib": b / 2**30, "blocks": n} for k, (b, n) in ranked[:top]],
            "live_at_peak_rest_gib": sum(b for _, (b, _) in ranked[top:]) / 2**30}


def markdown(result: dict) -> str:
    lines = [f"memory at the step's peak: {result['peak_gib']:.2f} GiB = {result['baseline_gib']:.2f} GiB allocated "
             f"before the step + {result['step_peak_over_baseline_gib']:.2f} GiB during it (event "
             f"{result['peak_event']} of {result['events']}; the peak's allocation: {result['peak_allocation']})",
             "", "| allocated by | GiB live at the peak | blocks |", "|---|---:|---:|"]
    lines += [f"| {row['allocated_by'][:110]} | {row['gib']:.3f} | {row['blocks']} |" for row in result["live_at_peak"]]
    lines.append(f"| (the rest) | {result['live_at_peak_rest_gib']:.3f} | - |")
    return "\n".join(lines)
