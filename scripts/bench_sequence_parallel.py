"""The longest single document that trains on one GPU and, with Ulysses sequence parallelism, over several: each
measured in the same run (issue 19f).

    python scripts/bench_sequence_parallel.py                       # Llama-3-8B LoRA, 256k and 512k, 1 and 2 GPUs
    python scripts/bench_sequence_parallel.py --lengths 524288 --gpus 1,2 --steps 1

Each (GPU count G, length L) is one `accelerate launch --config_file examples/accelerate/deepspeed_zero3.yaml
--num_processes G scripts/sft.py --doc-length L --max-tokens-per-batch L ...`: every step trains one document of L
random tokens. G > 1 adds `--sequence-parallel G` (the G processes split each document, DeepSpeed's Ulysses
all-to-alls around hf_accel's attention); G = 1 is the same ZeRO-3 config on one GPU, the baseline. Lengths run
in ascending order; a GPU count that ran out of memory skips its longer lengths. Per run: steady tokens/s (after the
first step, which holds start-up), MFU per GPU, the largest rank's peak memory, or what stopped it (OOM, timeout,
an error). Written as JSON + markdown under --out, with the command, the machine and the versions.
"""
from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchlib.distributed import launch_argv, run_group  # noqa: E402
from benchlib.report import repeat_command, repo_relative, versions, write_outputs  # noqa: E402

DEFAULT_SFT_ARGS = "--model-shape llama-8b-long --lora-r 16 --checkpointing full"


def _counts(text: str, what: str) -> list[int]:
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{what}: comma-separated integers, got {text!r}") from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"{what}: positive integers, got {text!r}")
    return sorted(set(values))


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--lengths", type=lambda t: _counts(t, "--lengths"), default=[262144, 524288],
                   help="document lengths in tokens (default 262144,524288)")
    p.add_argument("--gpus", type=lambda t: _counts(t, "--gpus"), default=[1, 2],
                   help="process counts; each above 1 runs sequence parallel over that many (default 1,2)")
    p.add_argument("--sft-args", default=DEFAULT_SFT_ARGS,
                   help=f"model and training arguments for scripts/sft.py (default: {DEFAULT_SFT_ARGS!r})")
    p.add_argument("--steps", type=int, default=2, help="optimizer steps per run; the first is not steady (default 2)")
    p.add_argument("--config", type=Path, default=ROOT / "examples" / "accelerate" / "deepspeed_zero3.yaml",
                   help="accelerate config (DeepSpeed: sequence parallelism runs on it)")
    p.add_argument("--deepspeed-config-file", type=Path, default=None,
                   help="passed to accelerate launch (the CPU config names ds_zero3_cpu.json this way)")
    p.add_argument("--config-timeout", type=float, default=1800,
                   help="seconds per run (default 1800: a 512k-token step of Llama-3-8B takes ~5 minutes on 2 H200s, "
                        "longer than one device call, so run this in the background across calls)")
    p.add_argument("--time-budget", type=float, default=0,
                   help="stop starting runs after this many seconds (0: no limit)")
    p.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results")
    args = p.parse_args(argv)
    if args.steps < 1:
        p.error(f"--steps {args.steps}: at least 1")
    for length in args.lengths:
        bad = [g for g in args.gpus if length % g]
        if bad:
            p.error(f"--lengths {length}: sequence parallelism over {bad} GPUs needs a length they divide")
    return args


def run_argv(args: argparse.Namespace, gpus: int, length: int, out: Path) -> list[str]:
    sft = [str(ROOT / "scripts" / "sft.py"), *shlex.split(args.sft_args), "--doc-length", str(length),
           "--max-tokens-per-batch", str(length), "--max-steps", str(args.steps), "--logging-steps", "1",
           "--eval-examples", "0", "--output-dir", str(out)]
    if gpus > 1:
        sft += ["--sequence-parallel", str(gpus)]
    if args.deepspeed_config_file is not None:
        sft = ["--deepspeed_config_file", str(args.deepspeed_config_file), *sft]
    return launch_argv(args.config, gpus, sft)


def stopped_by(text: str) -> str:
    """Why a launch failed, from its output: OOM, or the ranks' own last error line (hf-accel sft's "error:" line first;
    not the launcher's ChildFailedError, which only says a rank failed)."""
    if "OutOfMemoryError" in text or "CUDA out of memory" in text:
        return "OOM"
    lines = [line.strip() for line in text.splitlines() if "Error" in line and "ChildFailedError" not in line]
    own = [line.split("error: ", 1)[1] for line in lines if "hf-accel sft: error: " in line]
    errors = own or lines
    return f"error: {errors[-1][:200]}" if errors else "error (no message)"


def run_one(args: argparse.Namespace, gpus: int, length: int, work: Path) -> dict[str, Any]:
    out = work / f"gpus{gpus}_len{length}"
    argv = run_argv(args, gpus, length, out)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
           "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    row: dict[str, Any] = {"gpus": gpus, "doc_length": length, "sequence_parallel": gpus if gpus > 1 else 1}
    start = time.perf_counter()
    try:
        proc = run_group(argv, env, args.config_timeout)
    except subprocess.TimeoutExpired:
        row.update(status=f"timeout after {args.config_timeout:.0f}s", seconds=time.perf_counter() - start)
        return row
    row["seconds"] = time.perf_counter() - start
    text = (proc.stdout or "") + (proc.stderr or "")
    metrics = out / "metrics.json"
    if proc.returncode != 0 or not metrics.exists():
        row["status"] = stopped_by(text)
        row["log_tail"] = repo_relative(text[-3000:])
        return row
    record = json.loads(metrics.read_text())
    throughput = record.get("throughput") or {}
    row.update(status="ok", losses=record.get("losses"),
               **{k: throughput.get(k) for k in ("tokens", "tokens_per_s", "steady_tokens_per_s", "mfu", "steady_mfu",
                                                 "peak_mem_gib", "world_size")})
    return row


def cell(row: dict[str, Any] | None) -> str:
    if row is None:
        return "-"
    if row["status"] != "ok":
        return row["status"]
    rate = row.get("steady_tokens_per_s") or row.get("tokens_per_s")
    parts = [f"{rate:,.0f} tokens/s" + ("" if row.get("steady_tokens_per_s") else " (whole run)")]
    mfu = row.get("steady_mfu") or row.get("mfu")
    if mfu:
        parts.append(f"{mfu:.1%} MFU")
    if row.get("peak_mem_gib") is not None:
        parts.append(f"{row['peak_mem_gib']:.1f} GiB/GPU")
    return ", ".join(parts)


def table(rows: list[dict[str, Any]], gpus: list[int], lengths: list[int]) -> str:
    by = {(r["gpus"], r["doc_length"]): r for r in rows}
    head = ["document tokens"] + [f"{g} GPU" if g == 1 else f"{g} GPUs, sequence parallel" for g in gpus]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for length in lengths:
        lines.append(f"| {length:,} | " + " | ".join(cell(by.get((g, length))) for g in gpus) + " |")
    longest = []
    for g in gpus:
        ok = [n for n in lengths if by.get((g, n), {}).get("status") == "ok"]
        longest.append(f"{max(ok):,}" if ok else "none")
    lines.append("| longest that trained | " + " | ".join(longest) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    start, rows, stopped = time.perf_counter(), [], {}
    with tempfile.TemporaryDirectory(prefix="sp-bench-") as tmp:
        for length in args.lengths:
            for gpus in args.gpus:
                row: dict[str, Any] = {"gpus": gpus, "doc_length": length}
                if gpus in stopped:
                    row["status"] = f"skipped: {stopped[gpus]} at a shorter length"
                elif args.time_budget and time.perf_counter() - start > args.time_budget:
                    row["status"] = "not run: time budget spent"
                else:
                    print(f"[sp-bench] {gpus} GPU(s), {length:,} tokens ...", flush=True)
                    row = run_one(args, gpus, length, Path(tmp))
                    print(f"[sp-bench] {gpus} GPU(s), {length:,} tokens: {cell(row)}", flush=True)
                    if row["status"] == "OOM" or row["status"].startswith("timeout"):
                        stopped[gpus] = row["status"]
                rows.append(row)
    when = datetime.now(timezone.utc)
    command = repeat_command("scripts/bench_sequence_parallel.py", argv)
    found = versions()
    md = (f"{when:%Y-%m-%d %H:%M} UTC, {found.get('gpu') or 'CPU'}, hf_accel commit {found.get('hf_accel_commit')}\n\n"
          f"`{command}` (sft.py arguments: `{args.sft_args}`, {args.steps} steps per run; steady = after the first "
          "step; GiB/GPU = the largest rank's peak)\n\n" + table(rows, args.gpus, args.lengths))
    record = {"date": when.isoformat(timespec="seconds"), "command": command, "versions": found,
              "sft_args": args.sft_args, "steps": args.steps, "results": rows,
              "total_seconds": time.perf_counter() - start}
    json_path, md_path = write_outputs(args.out, f"sequence-parallel_{when:%Y-%m-%dT%H%M%S}", record, md)
    print(f"[sp-bench] wrote {json_path} and {md_path}\n\n{md}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
