"""Markdown tables and the chart generated from benchmarks/index.json, and the marked regions they replace.

A generated region in a markdown file:

    <!-- bench:table workload=llama-1b -->   one workload's current run: stock anchors, hf_accel defaults, best
    <!-- bench:summary -->                   README's table: one line per workload
    <!-- bench:runs -->                      every indexed run, newest first (the dated log)
    <!-- bench:multi workload=llama-1b -->   the newest multi-GPU run (bench.py --nproc): per-GPU-count rows, scaling
    ...generated text...
    <!-- /bench:table -->                    (closing tag names the same kind)
"""
from __future__ import annotations

import re
from pathlib import Path
from typing import Any, Callable

from .index import current_runs, rows_by_role

WORKLOAD_TITLES = {
    "llama-1b": "Llama-3.2-1B shapes, full FT",
    "neox-1.4b": "GPT-NeoX 1.4B shapes, full FT",
    "llama-8b-lora": "Llama-3-8B shapes, LoRA r=16 + checkpointing",
    "llama-8b-qlora": "Llama-3-8B shapes, QLoRA (NF4 base) r=16 + checkpointing",
    "llama-70b-qlora": "Llama-3-70B shapes, QLoRA (NF4 base built on the GPU) r=16 + checkpointing",
    "falcon-1b": "Falcon ~1B, full FT",
    "falcon-rw-1b": "Falcon-RW-1B shapes (ALiBi), full FT",
    "qwen3-8b-lora": "Qwen3-8B shapes, LoRA r=16 + checkpointing",
    "mistral-7b-lora": "Mistral-7B shapes, LoRA r=16 + checkpointing",
    "gemma2-9b-lora": "Gemma-2-9B shapes, LoRA r=16 + checkpointing",
    "llama-1b-completion": "Llama-3.2-1B shapes, full FT, prompt-masked SFT data",
    "llama-8b-lora-completion": "Llama-3-8B shapes, LoRA r=16 + checkpointing, prompt-masked SFT data",
    "llama-8b-full": "Llama-3-8B shapes, full FT + checkpointing",
    "qwen3-30b-a3b-lora": "Qwen3-30B-A3B shapes (128 experts top-8), LoRA r=16 on attention + experts + checkpointing",
    "gpt-oss-20b-lora": "gpt-oss-20b shapes (bf16, 32 experts top-4), LoRA r=16 on attention + experts + checkpointing",
    "gemma4-12b-lora": "Gemma 4 12B text shapes, LoRA r=16 + checkpointing",
    "qwen3.5-9b-lora": "Qwen3.5-9B text shapes (Gated DeltaNet + attention), LoRA r=16 + checkpointing",
}
CONFIG_LABELS = {
    "hf-sdpa-padded": "HF, SDPA, padded batches of 8",
    "hf-fa4-padded": "HF, flash-attn-4, padded batches of 8",
    "hf-sdpa-packed": "HF, SDPA, DataCollatorWithFlattening",
    "liger-sdpa-padded": "Liger on HF SDPA, padded",
    "trl-fa4-packed": "TRL SFTTrainer packing + flash-attn-4",
    "trl-fa4-packed-liger": "TRL SFTTrainer packing + flash-attn-4 + Liger",
    "hf_accel": "`patch(model)` with every fast path off (attention + packing)",
    "hf_accel-defaults": "`hf_accel.patch(model)`, no arguments",
    "hf_accel-best": "`patch(model, fused_ce=True, fused_ops=True, compile=True)`",
    "unsloth": "Unsloth FastLanguageModel + TRL padding-free",
    "unsloth-eager": "Unsloth FastLanguageModel + TRL padding-free, UNSLOTH_COMPILE_DISABLE=1",
    "unsloth-qlora": "Unsloth FastLanguageModel 4-bit + TRL padding-free",
    "trl-qlora": "QLoRA, TRL SFTTrainer packing + flash-attn-4 + Liger",
    "trl-qlora-noliger": "QLoRA, TRL SFTTrainer packing + flash-attn-4",
    "trl-qlora-kbit": "QLoRA on PEFT's prepare_model_for_kbit_training, TRL SFTTrainer packing + flash-attn-4 + Liger",
    "hf_accel-qlora": "QLoRA, `hf_accel.patch(model)`, no arguments",
    "hf_accel-qlora-kbit": "QLoRA on PEFT's prepare_model_for_kbit_training, `hf_accel.patch(model)`",
    "hf_accel-qlora-sft": "QLoRA, `hf_accel.SFTTrainer(peft_config=...)`, TRL's packing",
    "hf_accel-sdpa": "`hf_accel.patch(model, backend=\"sdpa\")`",
    "hf_accel-offload": "`hf_accel.patch(model, checkpointing=\"offload\")`",
    "hf_accel-offload-mlp4k": "`hf_accel.patch(model, checkpointing=\"offload\", mlp_chunks=4096)`",
    "hf_accel-qlora-offload": "QLoRA, `hf_accel.patch(model, checkpointing=\"offload\")`",
    "hf_accel-qlora-budget": "QLoRA, a budget plan: `hf_accel.patch(model, checkpointing=\"budget:14.5GiB\")` or the "
                             "run's `--best-checkpointing`",
}
ROLE_LABELS = {"stock": "stock anchor", "defaults": "hf_accel defaults", "best": "hf_accel best",
               "plain": "hf_accel, fast paths off", "hf_accel": "hf_accel"}
ROLE_ORDER = ("stock", "defaults", "best", "plain", "hf_accel")
NOT_MEASURED = "not measured yet"

_REGION = re.compile(r"(<!-- bench:(?P<kind>[a-z]+)(?P<attrs>(?: [a-z_]+=[^ >]+)*) -->\n)(?P<body>.*?)"
                     r"(<!-- /bench:(?P=kind) -->)", re.DOTALL)
_OPENING = re.compile(r"<!-- bench:[a-z]+")


class StaleOrBroken(ValueError):
    """A generated region that cannot be rendered (unknown kind, unclosed marker)."""


def _date(run: dict[str, Any]) -> str:
    date = str(run.get("date") or "?")
    return f"{date[:10]} {date[11:16]} UTC" if len(date) >= 16 else date  # the benchmark machine's clock is UTC


def _k(value: float | None) -> str:
    return "-" if value is None else f"{value / 1000:.1f}k"


def _int(value: float | None) -> str:
    return "-" if value is None else f"{value:,.0f}"


def _gib(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f}"


def _ratio(row: dict[str, Any]) -> str:
    run, steady = row.get("ratio_to_best_stock"), row.get("steady_ratio_to_best_stock")
    if run is None:
        return "-"
    return f"{run:.2f}x" + (f" / {steady:.2f}x" if steady is not None else "")


def _label(row: dict[str, Any]) -> str:
    text = CONFIG_LABELS.get(row["config"], row.get("description", row["config"]))
    if row.get("versions"):  # packages its child ran apart from the run's own (Unsloth's pins, bitsandbytes)
        text += " (" + ", ".join(f"{k} {v}" for k, v in row["versions"].items()) + ")"
    if row.get("checkpointing") and row["role"] != "stock":
        text += f", checkpointing {row['checkpointing']}"
    return text


def _ok(row: dict[str, Any]) -> bool:
    return row["status"].startswith("ok") and "tokens_per_s" in row


def _provenance(run: dict[str, Any]) -> str:
    versions = run.get("versions", {})
    stack = ", ".join(f"{k} {v}" for k, v in versions.items() if k != "hf_accel_commit")
    commit = f", hf_accel commit {versions['hf_accel_commit']}" if versions.get("hf_accel_commit") else ""
    note = "" if run.get("command_source") == "recorded" else f" ({run.get('command_source')})"
    return (f"{_date(run)}, {run.get('gpu')}, {stack}{commit}; "
            f"[`{run['file']}`](benchmarks/results/{run['file']})\n\n`{run['command']}`{note}")


def _has_best(workload: str) -> bool:
    """Whether the workload's preset runs an `hf_accel-best` row (the QLoRA preset has none: no flags to add)."""
    from .presets import PRESETS

    preset = PRESETS.get(workload)
    return preset is None or "hf_accel-best" in preset.configs


def workload_table(index: dict[str, Any], workload: str) -> str:
    run = current_runs(index).get(workload)
    if run is None:
        return f"No run of `{workload}` indexed yet: `python scripts/bench.py --preset {workload}`."
    lines = [_provenance(run), "",
             "| row | configuration | tokens/s | steady tokens/s | vs best stock (run / steady) | peak GiB | MFU "
             "| status |", "|---|---|---:|---:|---:|---:|---:|---|"]
    rows = rows_by_role(run, ROLE_ORDER)
    for role in ("defaults", "best") if _has_best(workload) else ("defaults",):
        if not any(r["role"] == role for r in rows):
            rows.append({"config": f"hf_accel-{role}", "role": role, "status": "", "missing": True})
    for row in sorted(rows, key=lambda r: ROLE_ORDER.index(r["role"])):
        what = f"{_label(row)} (`{row['config']}`)"
        if row.get("missing"):
            lines.append(f"| {ROLE_LABELS[row['role']]} | {what} | {NOT_MEASURED} | | | | | |")
            continue
        mfu = row.get("mfu")
        lines.append(f"| {ROLE_LABELS[row['role']]} | {what} | {_int(row.get('tokens_per_s'))} "
                     f"| {_int(row.get('steady_tokens_per_s'))} | {_ratio(row)} | {_gib(row.get('peak_gib'))} "
                     f"| {'-' if mfu is None else f'{100 * mfu:.1f}%'} | {row['status']} |")
    return "\n".join(lines)


def _cell(row: dict[str, Any] | None, with_ratio: bool) -> str:
    if row is None:
        return NOT_MEASURED
    if not _ok(row):
        return row["status"]
    text = f"{_k(row['tokens_per_s'])}, {_gib(row.get('peak_gib'))} GiB"
    if row.get("checkpointing"):
        text += f" (checkpointing {row['checkpointing']})"
    return text + (f", {_ratio(row)}" if with_ratio and row.get("ratio_to_best_stock") else "")


def summary_table(index: dict[str, Any]) -> str:
    """README: per workload the strongest stock anchor of the current run, hf_accel defaults and best."""
    current = current_runs(index)
    lines = ["| workload | strongest stock, same run | hf_accel defaults (`patch(model)`) | hf_accel best "
             "| best vs stock (run / steady) | measured |", "|---|---|---|---|---:|---|"]
    order = [w for w in WORKLOAD_TITLES if w in current] + sorted(set(current) - set(WORKLOAD_TITLES))
    for workload in order:
        run = current[workload]
        stock = [r for r in run["configs"] if r["role"] == "stock" and _ok(r) and r.get("same_computation", True)]
        anchor = max(stock, key=lambda r: r["tokens_per_s"])
        found = {r["role"]: r for r in run["configs"] if r["role"] in ("defaults", "best")}
        best = found.get("best")
        best_cell = _cell(best, False) if _has_best(workload) else "- (no extra flags in this preset)"
        lines.append(f"| {WORKLOAD_TITLES.get(workload, workload)} | {_label(anchor)}: {_cell(anchor, False)} "
                     f"| {_cell(found.get('defaults'), True)} | {best_cell} "
                     f"| {_ratio(best) if best and _ok(best) else '-'} | {run['date'][:10]}, {run.get('gpu')} |")
    return "\n".join(lines)


def _on_gpus(row: dict[str, Any]) -> str:
    """The config's name, with " xN" for a multi-GPU (bench.py --nproc) row and " @ N tokens" for a long-context
    (bench.py --doc-lengths) row."""
    name = f"{row['config']} x{row['nproc']}" if row.get("nproc") else row["config"]
    return f"{name} @ {row['doc_length']:,} tokens" if row.get("doc_length") else name


def _older(run: dict[str, Any], row: dict[str, Any]):
    """The redefinition (benchlib.anchors.REDEFINED) this row's measurement predates, or None."""
    from .anchors import older_definition

    return older_definition(row["config"], run["workload"], run.get("anchor_revision"))


def redefinitions_legend(index: dict[str, Any]) -> str:
    """What each mark of the runs log means: per configuration whose definition changed, what rows of earlier
    records measured and what it measures now (only those the log has marked rows of)."""
    from .anchors import REDEFINED

    marked = {r["config"] for run in index["runs"] for r in run["configs"] if _older(run, r) is not None}
    lines = [f"- `{name}` *[{change.tag}]* (before anchor revision {change.revision}): {change.before}"
             + (f"; now {change.after}" if change.after else "")
             for name, change in REDEFINED.items() if name in marked]
    if not lines:
        return ""
    return ("Rows marked *[older anchor]* or *[PEFT-prepared base]* were measured with an earlier definition of "
            "their configuration (benchlib.anchors.REDEFINED); their ratios are against that run's anchors:\n\n"
            + "\n".join(lines) + "\n\n")


def runs_log(index: dict[str, Any]) -> str:
    """Every indexed run, newest first: date, workload, GPU, results, file and command; a row measured with an
    earlier definition of its configuration is marked (redefinitions_legend says what it measured)."""
    header = "| date | workload | GPU | configuration: tokens/s (peak GiB) | run | command |"
    lines = [redefinitions_legend(index) + header, "|---|---|---|---|---|---|"]
    for run in reversed(index["runs"]):
        def name(r: dict[str, Any]) -> str:
            older = _older(run, r)
            return _on_gpus(r) + ("" if older is None else f" *[{older.tag}]*")

        results = "; ".join(
            f"{name(r)} {_int(r['tokens_per_s'])} ({_gib(r.get('peak_gib'))})" if _ok(r)
            else f"{name(r)}: {r['status'][:60]}" for r in run["configs"])
        current = " **current**" if run.get("current") else ""
        lines.append(f"| {_date(run)}{current} | {run['workload']} | {run.get('gpu')} | {results} "
                     f"| [`{run['file']}`](benchmarks/results/{run['file']}) | `{run['command']}` |")
    return "\n".join(lines)


def multi_gpu_table(index: dict[str, Any], workload: str) -> str:
    """The newest multi-GPU run of `workload`: each configuration at each GPU count, then the scaling table."""
    from .report import scaling_table

    runs = [r for r in index["runs"] if r["workload"] == workload and r.get("nproc")]
    if not runs:
        return f"No multi-GPU run of `{workload}` indexed yet: `python scripts/bench.py --preset multi-gpu`."
    run = max(runs, key=lambda r: r["date"])
    lines = [_provenance(run), "", "| configuration | GPUs | tokens/s | steady tokens/s | peak GiB per GPU | status |",
             "|---|---:|---:|---:|---:|---|"]
    for row in run["configs"]:
        lines.append(f"| `{row['config']}` | {row.get('nproc', '-')} | {_int(row.get('tokens_per_s'))} "
                     f"| {_int(row.get('steady_tokens_per_s'))} | {_gib(row.get('peak_gib'))} | {row['status']} |")
    stock = [row["config"] for row in run["configs"] if row["role"] == "stock"]
    return "\n".join(lines) + "\n\n" + scaling_table(run["configs"], stock)


def _attempted(row: dict[str, Any]) -> bool:
    """A long-context cell that says something about the length: measured, OOM, an error, or skipped because a shorter
    length ran out of memory; not a length a run had no time left for."""
    status = row["status"]
    return not status.startswith("skipped") or "OOM" in status


def _short_status(row: dict[str, Any]) -> str:
    """A failed cell's status in a table cell's room: a process the kernel killed with the host's memory gone says
    so with its resident peak (the record keeps the whole message)."""
    status = row["status"]
    if "killed (SIGKILL" in status and row.get("host_available_min_gib", 99) < 2:
        return f"host out of memory (killed at {_gib(row.get('host_rss_peak_gib'))} GiB resident)"
    return status[:60]


def long_context_region(index: dict[str, Any], workload: str) -> str:
    """A long-context workload (bench.py --doc-lengths): per configuration and document length, the newest run that
    attempted it (a length a later run had no time for keeps its earlier result): tokens/s, MFU, peak memory (and the
    host's peak where saved tensors went to host memory), and the longest length that trained. The runs used are listed
    first; a cell from an older run than its configuration's newest says which."""
    runs = [r for r in index["runs"] if r["workload"] == workload]
    if not runs:
        return f"No run of `{workload}` indexed yet: `python scripts/bench.py --preset long-context`."
    cells: dict[str, dict[int, tuple[dict[str, Any], dict[str, Any]]]] = {}
    newest: dict[str, dict[str, Any]] = {}
    for run in runs:  # the index's order: oldest first
        for row in run["configs"]:
            newest[row["config"]] = run
            n = row.get("doc_length")
            earlier = cells.get(row["config"], {}).get(n)
            if n and (earlier is None or _attempted(row) or not _attempted(earlier[0])):
                cells.setdefault(row["config"], {})[n] = (row, run)
    used = [run for run in runs if any(r is run for c in cells.values() for _, r in c.values())]
    lengths = sorted({n for c in cells.values() for n in c})
    lines = [f"From {'one run' if len(used) == 1 else f'{len(used)} runs'}:", ""]
    lines += [f"- {_provenance(run)}".replace("\n\n", " ") for run in used]
    lines += ["", "| configuration | " + " | ".join(f"{n:,} tokens" for n in lengths) + " | longest that trained |",
              "|---|" + "---|" * len(lengths) + "---:|"]
    for config, by_length in cells.items():
        texts = []
        for n in lengths:
            row, run = by_length.get(n, (None, None))
            if row is None:
                texts.append("not run")
                continue
            if _ok(row):
                mfu = row.get("mfu")
                host = row.get("host_peak_gib") if row.get("offloaded_host_peak_gib") else None
                text = (f"{_int(row['tokens_per_s'])} tokens/s, {'-' if mfu is None else f'{100 * mfu:.1f}%'}"
                        f" MFU, {_gib(row.get('peak_gib'))} GiB{'' if host is None else f' (host {_gib(host)})'}")
            else:
                text = _short_status(row)
            texts.append(text if run is newest[config] else f"{text} ({_date(run)} run)")
        longest = max((n for n, (row, _) in by_length.items() if _ok(row)), default=None)
        lines.append(f"| `{config}` | " + " | ".join(texts) + f" | {'none' if longest is None else f'{longest:,}'} |")
    return "\n".join(lines)


RENDERERS: dict[str, Callable[[dict[str, Any], dict[str, str]], str]] = {
    "long": lambda index, attrs: long_context_region(index, attrs["workload"]),
    "multi": lambda index, attrs: multi_gpu_table(index, attrs.get("workload", "llama-1b")),
    "table": lambda index, attrs: workload_table(index, attrs["workload"]),
    "summary": lambda index, attrs: summary_table(index),
    "runs": lambda index, attrs: runs_log(index),
}


def regenerate(text: str, index: dict[str, Any], name: str = "text") -> str:
    """`text` with every generated region re-rendered from `index`."""
    matches = list(_REGION.finditer(text))
    if len(_OPENING.findall(text)) != len(matches):
        raise StaleOrBroken(f"{name}: {len(_OPENING.findall(text))} '<!-- bench:KIND ... -->' markers but "
                            f"{len(matches)} closed regions; each needs its '<!-- /bench:KIND -->'")

    def render(match: re.Match) -> str:
        kind = match["kind"]
        if kind not in RENDERERS:
            raise StaleOrBroken(f"{name}: unknown region kind {kind!r}; known: {', '.join(RENDERERS)}")
        attrs = dict(a.split("=", 1) for a in match["attrs"].split())
        if kind == "table" and "workload" not in attrs:
            raise StaleOrBroken(f"{name}: '<!-- bench:table -->' needs workload=NAME")
        return f"{match.group(1)}{RENDERERS[kind](index, attrs)}\n{match.group(5)}"

    return _REGION.sub(render, text)


COLORS = {"stock": "#9a9a9a", "defaults": "#8fb8de", "best": "#1f5fa8", "plain": "#c9d9ea", "hf_accel": "#c9d9ea"}


def write_chart(index: dict[str, Any], path: Path) -> None:
    """tokens/s (top) and peak GiB (bottom) of every configuration of each workload's current run, as a PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    current = current_runs(index)
    workloads = [w for w in WORKLOAD_TITLES if w in current] + sorted(set(current) - set(WORKLOAD_TITLES))
    fig, axes = plt.subplots(2, len(workloads), figsize=(3.4 * len(workloads), 6.2), squeeze=False)
    for col, workload in enumerate(workloads):
        rows = [r for r in rows_by_role(current[workload], ROLE_ORDER) if _ok(r)]
        names = [r["config"] for r in rows]
        colors = [COLORS[r["role"]] for r in rows]
        for ax, key, unit in ((axes[0][col], "tokens_per_s", "tokens/s"), (axes[1][col], "peak_gib", "peak GiB")):
            values = [r.get(key) or 0 for r in rows]
            bars = ax.bar(range(len(rows)), values, color=colors)
            ax.bar_label(bars, labels=[_k(v) if key == "tokens_per_s" else f"{v:.1f}" for v in values], fontsize=7)
            ax.set_xticks(range(len(rows)), names, rotation=30, ha="right", fontsize=7)
            ax.set_ylabel(unit, fontsize=8)
            ax.tick_params(axis="y", labelsize=7)
            ax.margins(y=0.15)
        axes[0][col].set_title(f"{WORKLOAD_TITLES.get(workload, workload)}\n{_date(current[workload])}", fontsize=8)
    gpus = sorted({str(current[w].get("gpu")) for w in workloads})
    fig.suptitle(f"scripts/bench.py, current run per workload ({', '.join(gpus)}; benchmarks/index.json)",
                 fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
