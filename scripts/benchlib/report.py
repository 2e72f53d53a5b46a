"""Environment record and the results table."""
from __future__ import annotations

import json
import platform
import shlex
import subprocess
from importlib import metadata
from pathlib import Path
from typing import Any, Iterable

import torch

DISTRIBUTIONS = ("torch", "transformers", "trl", "peft", "accelerate", "datasets", "liger-kernel", "flash-attn-4",
                 "triton", "hf_accel", "unsloth", "unsloth_zoo", "bitsandbytes", "cut-cross-entropy", "torchao")


def versions() -> dict[str, Any]:
    """Installed versions of everything that changes the numbers, plus the GPU and the repo commit."""
    found: dict[str, Any] = {"python": platform.python_version()}
    for name in DISTRIBUTIONS:
        try:
            found[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            found[name] = None
    found["cuda"] = torch.version.cuda
    found["gpu"] = torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
    try:
        # "-dirty" when the files differ from that commit: a GPU machine's copy of the working tree keeps the
        # session's first HEAD, so a bare hash there named code older than what ran
        commit = subprocess.run(["git", "describe", "--always", "--dirty", "--abbrev=7"], capture_output=True,
                                text=True, timeout=5, cwd=Path(__file__).resolve().parent)
        found["hf_accel_commit"] = commit.stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        found["hf_accel_commit"] = None
    return found


def repeat_command(script: str, argv: list[str]) -> str:
    """How a bench run was asked for, as a command line to repeat it (the machine-specific --out dropped)."""
    kept, skip = [], False
    for arg in argv:
        if skip:
            skip = False
        elif arg == "--out":
            skip = True
        elif not arg.startswith("--out="):
            kept.append(arg)
    return shlex.join(["python", script, *kept])


REPO = Path(__file__).resolve().parents[2]


def repo_relative(text: str) -> str:
    """`text` (a traceback, a log's tail) with the checkout's own location cut from its paths: records name files
    relative to the repository, never where the machine that ran them kept it."""
    return text.replace(f"{REPO}/", "").replace(str(REPO), ".")


def _fmt(value: Any, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def _ok(result: dict[str, Any]) -> bool:
    return str(result.get("status", "")).startswith("ok") and result.get("tokens_per_s") is not None


def add_ratios(results: list[dict[str, Any]], stock: Iterable[str]) -> str | None:
    """Set `ratio_to_best_stock` on every ok result (tokens/s over the fastest stock config's) and
    `steady_ratio_to_best_stock` (steady tokens/s over the highest steady rate of a stock config: where competing
    anchors, e.g. TRL with and without Liger, split the two measures, each ratio is against its own fastest); return
    the fastest stock config's name (None if none ran)."""
    stock = set(stock)
    # a stock run that computes something else (e.g. Falcon packed without document masking) is no baseline
    ok_stock = [r for r in results if r["config"] in stock and _ok(r) and r.get("same_computation", True)]
    if not ok_stock:
        return None
    best = max(ok_stock, key=lambda r: r["tokens_per_s"])
    steady = max((r["steady_tokens_per_s"] for r in ok_stock if r.get("steady_tokens_per_s")), default=None)
    for r in results:
        if _ok(r):
            r["ratio_to_best_stock"] = r["tokens_per_s"] / best["tokens_per_s"]
            if r.get("steady_tokens_per_s") and steady:
                r["steady_ratio_to_best_stock"] = r["steady_tokens_per_s"] / steady
    return best["config"]


def add_ratios_per_nproc(results: list[dict[str, Any]], stock: Iterable[str]) -> str | None:
    """add_ratios within each process count (bench.py --nproc): a config is compared with the best stock config
    measured on as many GPUs. Returns "NAME" (one best stock everywhere), "NAME at N, ..." or None."""
    best = {}
    for nproc in dict.fromkeys(r.get("nproc") for r in results):
        best[nproc] = add_ratios([r for r in results if r.get("nproc") == nproc], stock)
    named = {n: b for n, b in best.items() if b}
    if len(set(named.values())) <= 1:
        return next(iter(named.values()), None)
    return ", ".join(f"{b} at {n}" for n, b in named.items())


def scaling(results: list[dict[str, Any]], stock: Iterable[str]) -> dict[str, Any]:
    """The multi-GPU comparison from bench.py --nproc results (steady tokens/s, summed over ranks):
    by_config: {config: {nproc: steady tokens/s}} (ok results only);
    scaling: {config: steady at the largest nproc / steady at the smallest} (configs measured at two counts or more);
    vs_stock: {nproc: {hf_accel config: its steady tokens/s / the best stock config's at that nproc}}."""
    stock = set(stock)
    by_config: dict[str, dict[int, float]] = {}
    for r in results:
        if _ok(r) and r.get("nproc") and r.get("steady_tokens_per_s"):
            by_config.setdefault(r["config"], {})[int(r["nproc"])] = float(r["steady_tokens_per_s"])
    out: dict[str, Any] = {"by_config": by_config, "scaling": {}, "vs_stock": {}}
    for name, rates in by_config.items():
        if len(rates) >= 2:
            out["scaling"][name] = rates[max(rates)] / rates[min(rates)]
    for nproc in sorted({n for rates in by_config.values() for n in rates}):
        anchors = [rates[nproc] for name, rates in by_config.items() if name in stock and nproc in rates]
        if anchors:
            out["vs_stock"][nproc] = {name: rates[nproc] / max(anchors) for name, rates in by_config.items()
                                      if name not in stock and nproc in rates}
    return out


def scaling_table(results: list[dict[str, Any]], stock: Iterable[str]) -> str:
    """config | steady tokens/s at each nproc | scaling (largest / smallest nproc) | vs best stock at each nproc."""
    stock = list(stock)
    numbers = scaling(results, stock)
    counts = sorted({n for rates in numbers["by_config"].values() for n in rates})
    if not counts:
        return "scaling: no configuration finished under --nproc"
    lines = [
        f"scaling = steady tokens/s (summed over ranks) on {counts[-1]} GPUs / on {counts[0]}; vs best stock = steady "
        "tokens/s / the best stock config's on as many GPUs",
        "",
        "| config | " + " | ".join(f"steady tokens/s x{n}" for n in counts) + " | scaling | "
        + " | ".join(f"vs best stock x{n}" for n in counts) + " |",
        "|---|" + "---:|" * (2 * len(counts) + 1),
    ]
    for name, rates in numbers["by_config"].items():
        cells = [_fmt(rates.get(n), ",.0f") for n in counts]
        ratios = [_fmt(numbers["vs_stock"].get(n, {}).get(name), ".2f") for n in counts]
        lines.append(f"| {name} | {' | '.join(cells)} | {_fmt(numbers['scaling'].get(name), '.2f')} "
                     f"| {' | '.join(ratios)} |")
    return "\n".join(lines)


def common_loss_step(results: list[dict[str, Any]]) -> int | None:
    """The last timed step every finished config reached (configs stopped by the step-time budget run fewer)."""
    counts = [len(r["losses"]) for r in results if _ok(r) and r.get("losses")]
    return min(counts) if counts else None


def markdown_table(results: list[dict[str, Any]], best_stock: str | None) -> str:
    """config | tokens/s | x best stock | MFU | peak GiB | loss at a step every config reached | steady tokens/s |
    steady x best stock | slowest step | status."""
    step = common_loss_step(results)
    nprocs = any(r.get("nproc") for r in results)  # bench.py --nproc: a process-count column, peak per GPU
    lines = [
        f"ratio = tokens/s / tokens/s of the best stock config ({best_stock or 'none ran'}); loss at timed step "
        f"{step or '-'} (the last one every config reached; TRL packs other batches, so compare its loss loosely); "
        "steady = the median step's tokens/s (one slow step, e.g. a compile or a garbage-collector pause, moves the "
        "mean but not this), its ratio over the highest steady rate among the stock configs",
        "",
        "| config | real tokens/s | vs best stock | MFU | peak GiB | loss | steady tokens/s | steady vs best stock "
        "| slowest step | status |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    if nprocs:
        lines[0] += ("; nproc = GPUs (processes) of the run, tokens/s summed over them, MFU per GPU; peak GiB/GPU = "
                     "the largest rank's")
        lines[2] = lines[2].replace("| config |", "| config | nproc |").replace("| peak GiB |", "| peak GiB/GPU |")
        lines[3] = "|---|---:" + lines[3][4:]
    for r in results:
        mfu = r.get("mfu")
        losses = r.get("losses") or []
        loss = losses[step - 1] if step and len(losses) >= step else r.get("loss")
        nproc = f" {_fmt(r.get('nproc'), 'd')} |" if nprocs else ""
        lines.append(
            f"| {r['config']} |{nproc} {_fmt(r.get('tokens_per_s'), ',.0f')}"
            f" | {_fmt(r.get('ratio_to_best_stock'), '.2f')}"
            f" | {'-' if mfu is None else f'{100 * mfu:.1f}%'} | {_fmt(r.get('peak_gib'), '.1f')}"
            f" | {_fmt(loss, '.4f')} | {_fmt(r.get('steady_tokens_per_s'), ',.0f')}"
            f" | {_fmt(r.get('steady_ratio_to_best_stock'), '.2f')} | {_slowest(r)} | {r.get('status', '?')} |"
        )
    return "\n".join(lines)


def targets_line(results: list[dict[str, Any]]) -> str:
    """Prompt-masked workloads: whether every finished configuration's own data path labels exactly the data set's
    completion tokens as targets (its collator over its prepared data, TRL's from its completion masks), and the share
    of each one's timed tokens that were targets; "" for a workload without masks."""
    rows = [r for r in results if _ok(r) and r.get("expected_target_tokens") is not None]
    if not rows:
        return ""
    wrong = [r for r in rows if r.get("data_target_tokens") != r["expected_target_tokens"]]
    shares = ", ".join(f"{r['config']} {_fmt(r.get('target_fraction'), '.1%')}" for r in rows)
    if wrong:
        head = "targets DIFFER from the data set's completion tokens: " + ", ".join(
            f"{r['config']} {_fmt(r.get('data_target_tokens'), ',')} of {r['expected_target_tokens']:,}" for r in wrong)
    else:
        first = rows[0]
        masked = 1 - first["expected_target_tokens"] / first["data_tokens"]
        head = (f"targets: every configuration's own data path labels exactly the data set's "
                f"{first['expected_target_tokens']:,} completion tokens as targets ({masked:.1%} of its "
                f"{first['data_tokens']:,} tokens masked: prompts, each document's first token among them)")
    return f"{head}; targets per real token in the timed steps: {shares}"


def profile_table(results: list[dict[str, Any]]) -> str:
    """bench.py --profile-steps: kernel ms per step by category, one column per configuration ("" when none ran)."""
    profiled = [r for r in results if r.get("profile")]
    if not profiled:
        return ""
    cats = list(profiled[0]["profile"]["ms_per_step"])
    lines = ["Kernel time per profiled step, ms (torch.profiler over each configuration's first "
             f"{profiled[0]['profile']['steps']} timed steps):", "",
             "| category | " + " | ".join(r["config"] for r in profiled) + " |",
             "|---|" + "---:|" * len(profiled)]
    for cat in cats:
        lines.append(f"| {cat} | " + " | ".join(_fmt(r["profile"]["ms_per_step"].get(cat), ".1f") for r in profiled)
                     + " |")
    return "\n".join(lines)


def long_context_table(results: list[dict[str, Any]]) -> str:
    """The long-context sweep: per config, the longest document length that trained, then one row per (config,
    length): tokens/s, MFU (attention FLOPs counted), peak GiB, status ("OOM", a timeout, or skipped after one)."""
    longest: dict[str, int | None] = {}
    for r in results:
        longest.setdefault(r["config"], None)
        if _ok(r):
            longest[r["config"]] = max(longest[r["config"]] or 0, r["doc_length"])
    planned = {r["config"]: r["longest_feasible_tokens"] for r in results if r.get("longest_feasible_tokens")}
    lines = ["| config | longest length that trained |", "|---|---:|"]
    lines += [f"| {name} | {'none' if n is None else f'{n:,}'}"
              f"{f' (its budget plan: at most ~{planned[name]:,})' if name in planned else ''} |"
              for name, n in longest.items()]
    lines += ["", "| config | document length | real tokens/s | MFU | peak GiB | host peak GiB (pinned) | status |",
              "|---|---:|---:|---:|---:|---:|---|"]
    for r in results:
        mfu = r.get("mfu")
        pinned = "" if r.get("pinned_peak_gib") is None else f" ({r['pinned_peak_gib']:.1f})"
        lines.append(
            f"| {r['config']} | {r['doc_length']:,} | {_fmt(r.get('tokens_per_s'), ',.0f')}"
            f" | {'-' if mfu is None else f'{100 * mfu:.1f}%'} | {_fmt(r.get('peak_gib'), '.1f')}"
            f" | {_fmt(r.get('host_peak_gib'), '.1f')}{pinned} | {r.get('status', '?')} |"
        )
    plans = [r for r in results if r.get("checkpointing_plan")]
    if plans:
        lines += ["", "| config | document length | checkpointing plan (split) | host memory planned GiB |",
                  "|---|---:|---|---:|"]
        lines += [f"| {r['config']} | {r['doc_length']:,} | {r['checkpointing_plan']['split']} | "
                  f"{r['checkpointing_plan']['host_gib']:.1f} |" for r in plans]
    caps = {r.get("device_memory_cap_gib") for r in results if r.get("device_total_gib")} - {None}
    if caps:
        lines += ["", f"Every configuration's process capped at {', '.join(f'{c:g}' for c in sorted(caps))} GiB of "
                  "device memory (torch.cuda.set_per_process_memory_fraction)."]
    return "\n".join(lines)


_EVENT_WORDS = (("compiled_graphs", "compiled graphs"), ("fa4_kernels", "flash-attn-4 kernels"),
                ("gc_full", "full GCs"))


def _slowest(result: dict[str, Any]) -> str:
    """The slowest step's time, with what the host did during it (HostEvents) when anything."""
    steps = result.get("step_seconds") or []
    if not steps:
        return "-"
    index = max(range(len(steps)), key=steps.__getitem__)
    text = f"{1000 * steps[index]:,.0f} ms"
    event = next((e for e in result.get("host_events") or [] if e.get("step") == index), None)
    if event:
        parts = [f"+{event[key]} {words}" for key, words in _EVENT_WORDS if event.get(key)]
        if event.get("gc_full_ms"):
            parts.append(f"{event['gc_full_ms']:,.0f} ms in GC")
        text += f" (step {index}: {', '.join(parts)})"
    return text


def write_outputs(out_dir: Path, stem: str, record: dict[str, Any], table: str) -> tuple[Path, Path]:
    out_dir.mkdir(parents=True, exist_ok=True)
    json_path, md_path = out_dir / f"{stem}.json", out_dir / f"{stem}.md"
    json_path.write_text(json.dumps(record, indent=2, default=str) + "\n")
    md_path.write_text(f"# {stem}\n\n{table}\n")
    return json_path, md_path
