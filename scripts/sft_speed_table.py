#!/usr/bin/env python
"""Markdown table of `scripts/sft.py` speed runs from their metrics.json files (the GPU check of issue 5).

    python scripts/sft_speed_table.py run1/metrics.json run2/metrics.json ...

"tokens/s" is real tokens over the whole run (start-up compiles included); "after the first log" drops the first logging
interval (JIT compiles, allocator warm-up); ratios are against the last file given (the baseline).
"""
import json
import sys
from pathlib import Path


def row(path: Path) -> dict:
    metrics = json.loads(path.read_text())
    logs = [log for log in metrics.get("log_history", []) if "tokens_per_s" in log and "tokens" in log]
    later = logs[1:]
    seconds = sum(log["tokens"] / log["tokens_per_s"] for log in later)
    return {
        "run": path.parent.name if path.stem == "metrics" else path.stem, "steps": metrics["steps"], "patched": metrics["patched"], "backend": metrics["backend"],
        "tokens_per_s": metrics["throughput"]["tokens_per_s"],
        "later_tokens_per_s": sum(log["tokens"] for log in later) / seconds if seconds else None,
        "padding": metrics["throughput"].get("padding_fraction"), "peak_gib": metrics["throughput"].get("peak_mem_gib"),
        "final_loss": metrics["losses"][-1] if metrics.get("losses") else None,
    }


def table(rows: list[dict]) -> str:
    base = rows[-1]

    def ratio(key, r):
        return f"{r[key] / base[key]:.2f}x" if r[key] and base[key] else "-"

    def num(v, fmt):
        return "-" if v is None else format(v, fmt)

    lines = ["| run | backend | steps | tokens/s | vs baseline | tokens/s after the first log | vs baseline | padding "
             "| peak GiB | last logged loss |", "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        lines.append(f"| {r['run']} | {r['backend']} | {r['steps']} | {num(r['tokens_per_s'], ',.0f')} "
                     f"| {ratio('tokens_per_s', r)} | {num(r['later_tokens_per_s'], ',.0f')} "
                     f"| {ratio('later_tokens_per_s', r)} | {num(r['padding'], '.1%')} | {num(r['peak_gib'], '.1f')} "
                     f"| {num(r['final_loss'], '.4f')} |")
    return "\n".join(lines)


if __name__ == "__main__":
    files = [Path(p) for p in sys.argv[1:] if Path(p).exists()]
    if not files:
        sys.exit("usage: sft_speed_table.py metrics.json ... (the last one is the baseline)")
    print(table([row(p) for p in files]))
