"""benchmarks/index.json: one entry per scripts/bench.py run in benchmarks/results/, derived from the run's JSON.

The index holds nothing a result file does not: it is rebuilt from the files (so a result cannot be edited in one place
only), and `scripts/bench_tables.py --check` fails when it is stale. Per workload, the newest run that has a stock
anchor and an hf_accel configuration measured in it (a same-run comparison) is marked `current`, preferring runs that
measured hf_accel's defaults and best settings, then either; BENCHMARKS.md's and README's tables show those runs.

Older records lack some fields (no `command`, `steady_tokens_per_s`, time zone): an entry keeps what its file has,
reconstructs the command from the recorded arguments (saying so) and leaves the rest out.

Multi-GPU runs (bench.py --nproc: the record and each row carry `nproc`) and long-context runs (bench.py --doc-lengths:
each row carries `doc_length`) are indexed but never `current`: the per-workload tables compare single-GPU runs of one
batch shape; those runs have tables of their own.
"""
from __future__ import annotations

import ast
import json
import re
import shlex
from pathlib import Path
from typing import Any, Iterable

INDEX_VERSION = 1

# bench.py arguments that change what a run measures, as (argparse dest, flag, the default that the flag may omit)
_ARGS = (("steps", "--steps", None), ("warmup", "--warmup", None), ("tokens_per_step", "--tokens-per-step", "None"),
         ("seed", "--seed", "0"), ("fused_ce", "--fused-ce", "auto"), ("ce_chunk_size", "--ce-chunk-size", "None"),
         ("best_backend", "--best-backend", "auto"), ("best_checkpointing", "--best-checkpointing", "None"),
         ("best_fused_ops", "--best-fused-ops", "auto"), ("best_compile", "--best-compile", "auto"),
         ("time_budget", "--time-budget", None), ("config_timeout", "--config-timeout", None),
         ("nproc", "--nproc", "None"))

APART_VERSIONS = ("unsloth", "unsloth_zoo", "bitsandbytes", "trl", "datasets", "transformers")  # per-row versions
ROW_FIELDS = ("tokens_per_s", "steady_tokens_per_s", "ratio_to_best_stock", "steady_ratio_to_best_stock", "peak_gib",
              "mfu", "timed_steps", "same_computation", "nproc", "doc_length", "host_peak_gib",
              "offloaded_host_peak_gib", "host_rss_peak_gib", "host_available_min_gib")
_DIGITS = {"tokens_per_s": 1, "steady_tokens_per_s": 1, "ratio_to_best_stock": 4, "steady_ratio_to_best_stock": 4,
           "peak_gib": 3, "mfu": 4, "host_peak_gib": 3, "offloaded_host_peak_gib": 3, "host_rss_peak_gib": 3,
           "host_available_min_gib": 3}  # one more digit than the tables show: no double rounding


def role(config: str) -> str:
    """stock | defaults | best | plain (hf_accel with every fast path off) | other hf_accel configurations."""
    if not config.startswith("hf_accel"):
        return "stock"
    return {"hf_accel-defaults": "defaults", "hf_accel-qlora": "defaults", "hf_accel-best": "best",
            "hf_accel": "plain"}.get(config, "hf_accel")


def is_bench_record(record: Any) -> bool:
    """A scripts/bench.py record (not a profile, micro-benchmark or sft.py metrics file)."""
    return isinstance(record, dict) and isinstance(record.get("results"), list) and "workload" in record \
        and "args" in record


def reconstructed_command(args: dict[str, str]) -> str:
    """The bench.py command line that a record's stored arguments stand for (machine paths left out)."""
    configs = args.get("configs", "")
    try:
        configs = ",".join(ast.literal_eval(configs))
    except (ValueError, SyntaxError):
        pass
    argv = ["python", "scripts/bench.py", "--workload", args.get("workload", "?"), "--configs", configs]
    for dest, flag, default in _ARGS:
        value = args.get(dest)
        if value is not None and value != default:
            argv += [flag, value]
    if args.get("tiny") == "True":
        argv.append("--tiny")
    return shlex.join(argv)


_TIMEOUT = re.compile(r"error: timeout after (\d+)s$")


def _status(status: str, config_timeout: float | None) -> str:
    """A result's status; a timeout shorter than the run's --config-timeout reads as the time budget's cut.

    bench.py gives a configuration the smaller of --config-timeout and what is left of --time-budget; its first
    versions recorded a cut by the budget as "error: timeout after Ns", as if that length had failed
    (bench.py now records it as skipped). Records keep what was written; the index reads such a status for what it
    was."""
    cut = _TIMEOUT.match(status)
    if cut and config_timeout is not None and float(cut[1]) < config_timeout:
        return f"skipped: time budget exhausted after {cut[1]}s"
    return status


def _row(result: dict[str, Any], config_timeout: float | None = None) -> dict[str, Any]:
    recorded = str(result.get("status", "?")).splitlines()[0][:200]
    row: dict[str, Any] = {"config": result.get("config", "?"), "role": role(result.get("config", "?")),
                           "status": _status(recorded, config_timeout)}
    if row["status"] != recorded:
        row["recorded_status"] = recorded
    for key in ROW_FIELDS:
        value = result.get(key)
        if value is not None:
            row[key] = round(value, _DIGITS[key]) if key in _DIGITS else value
    plan = next((n for n in result.get("notes") or [] if isinstance(n, str) and n.startswith("checkpointing: ")), None)
    if plan:
        row["checkpointing"] = plan.removeprefix("checkpointing: ")
    if result.get("description"):
        row["description"] = result["description"]
    apart = {k: v for k, v in (result.get("versions") or {}).items() if k in APART_VERSIONS and v}
    if apart:  # a child that ran with packages packed apart (Unsloth, bitsandbytes): their versions
        row["versions"] = apart
    return row


def _rows(record: dict[str, Any]) -> list[dict[str, Any]]:
    """The record's rows; in a long-context sweep, a length the old bench.py skipped as "failed at a shorter length"
    after a cut by the time budget reads as skipped for time, as the cut itself does (see `_status`)."""
    rows, cut_configs = [], set()
    for result in record["results"]:
        row = _row(result, _float(record["args"].get("config_timeout")))
        if row["status"] == "skipped: failed at a shorter length" and row["config"] in cut_configs:
            row.update(status="skipped: time budget exhausted", recorded_status=result["status"])
        if row["status"].startswith("skipped: time budget exhausted after"):
            cut_configs.add(row["config"])
        rows.append(row)
    return rows


def _float(value: Any) -> float | None:
    try:
        return float(value)
    except (TypeError, ValueError):
        return None


def entry(record: dict[str, Any], file: str) -> dict[str, Any]:
    """The index entry of one bench.py record stored as `file` (a name under benchmarks/results/)."""
    versions = record.get("versions") or {}
    recorded = record.get("command")
    out = {
        "file": file, "workload": record["workload"], "date": record.get("date"),
        "gpu": versions.get("gpu") or record.get("device"),
        "command": recorded or reconstructed_command(record["args"]),
        "command_source": "recorded" if recorded else "reconstructed from the record's arguments",
        "preset": record.get("preset"), "nproc": record.get("nproc"),
        "anchor_revision": record.get("anchor_revision"),  # absent before issue 70 (benchlib.anchors)
        "versions": {k: versions[k] for k in ("torch", "transformers", "trl", "peft", "liger-kernel", "flash-attn-4",
                                              "hf_accel_commit") if versions.get(k)},
        "current": False,
        "configs": _rows(record),
    }
    return {k: v for k, v in out.items() if v is not None}


def _measured(row: dict[str, Any]) -> bool:
    return "tokens_per_s" in row and row["status"].startswith("ok")


def _is_comparison(e: dict[str, Any]) -> bool:
    """A stock anchor and an hf_accel configuration both measured in this run."""
    return any(r["role"] == "stock" and _measured(r) and r.get("same_computation", True) for r in e["configs"]) \
        and any(r["role"] != "stock" and _measured(r) for r in e["configs"])


def _sort_key(e: dict[str, Any]) -> tuple[str, str]:
    return (str(e.get("date") or "")[:19], e["file"])  # naive (older) and +00:00 dates compare by their UTC digits


def build_index(results_dir: Path) -> dict[str, Any]:
    """Index every non-tiny bench.py record in `results_dir`, oldest first, the current run per workload marked."""
    entries = []
    for path in sorted(results_dir.glob("*.json")):
        try:
            record = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError):
            continue
        if is_bench_record(record) and not record.get("tiny"):
            entries.append(entry(record, path.name))
    entries.sort(key=_sort_key)
    for workload in {e["workload"] for e in entries}:
        anchored = [e for e in entries if e["workload"] == workload and _is_comparison(e) and not e.get("nproc")
                    and not any(r.get("doc_length") for r in e["configs"])]
        # a run of side configurations only (e.g. offload rows beside Unsloth) does not displace the last run that
        # measured the defaults or the best settings: the tables' headline rows
        headline = [e for e in anchored if any(r["role"] in ("defaults", "best") and _measured(r) for r in e["configs"])]
        # and a run that measured both headline rows is preferred to a later one that measured one of them (e.g. a
        # stock anchor beside the defaults only, for a side comparison): the tables show both
        both = [e for e in headline if {"defaults", "best"} <= {r["role"] for r in e["configs"] if _measured(r)}]
        if both or headline or anchored:
            (both or headline or anchored)[-1]["current"] = True
    return {"version": INDEX_VERSION,
            "about": "generated by scripts/bench_tables.py from benchmarks/results/*.json; do not edit",
            "runs": entries}


def current_runs(index: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {e["workload"]: e for e in index["runs"] if e.get("current")}


def dumps(index: dict[str, Any]) -> str:
    return json.dumps(index, indent=1, ensure_ascii=False) + "\n"


def rows_by_role(run: dict[str, Any], roles: Iterable[str]) -> list[dict[str, Any]]:
    wanted = list(roles)
    return sorted((r for r in run["configs"] if r["role"] in wanted), key=lambda r: wanted.index(r["role"]))
