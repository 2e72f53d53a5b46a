#!/usr/bin/env python
"""End-to-end training-throughput benchmark: stock HF / Liger / TRL stacks vs hf_accel on random-init models.

Every configuration runs in its own subprocess (a crash or OOM is recorded, memory starts clean), with a
per-configuration timeout inside a total time budget. Results: JSON + markdown under --out; the table is printed last.

    python scripts/bench.py --preset llama-1b                   # a named run (--list-presets), ~3 min on one H200
    python scripts/bench.py --workload llama-1b                 # all configurations, ~9 min on one H200
    python scripts/bench.py --workload neox-1.4b --configs hf-sdpa-padded,hf_accel
    python scripts/bench.py --device cpu --tiny                 # CI smoke: tiny model, CUDA-only configs skipped
    python scripts/bench.py --preset multi-gpu                  # FSDP2 on 1 and 2 GPUs: scaling, ~9 min on 2 H200
    python scripts/bench.py --preset llama-1b-completion        # prompt-masked SFT data (40-60% of tokens masked)

Multi-GPU (--nproc N, or a list such as 1,2: each config at each count, each in its own launch): the child runs under
`accelerate launch --config_file <--accelerate-config, default examples/accelerate/fsdp2.yaml> --num_processes N`,
one process per GPU, in its own process group (killed as a group on a timeout). TRL configs run SFTTrainer as they
do on one GPU (FSDP2 comes from the launcher); hf_accel configs run through hf_accel.Trainer with a token budget of
the step's tokens per rank (the plain loop cannot run under FSDP2). Each rank trains that many tokens per step
(weak scaling); tokens/s sums the ranks, step times are rank 0's, peak GiB is the largest rank's (every rank's in
peak_gib_per_rank), MFU divides by N GPUs. --nproc 1 is the same launched path on one GPU (the scaling reference);
without --nproc a config runs in a plain process, as before. Configs without a launched path are skipped.

Flags given with --preset override the preset's settings. Results are indexed and turned into BENCHMARKS.md's and
README's tables by scripts/bench_tables.py.

Precision: bf16 weights (no fp32 master copy) and torch.optim.AdamW(fused=True) for every configuration (fp32 in
--tiny CPU runs). Token budget: ~16k real tokens per optimizer step for every configuration (padded: micro-batches of
8 padded to longest with gradient accumulation; packed: one row; TRL: 4 bfd rows of 4096). MFU: see
hf_accel/training/flops.py (6*trainable + 4*frozen matmul params per token + causal attention, real tokens only; the
LM head on tokens with a target only). Prompt-masked workloads (`*-completion`): every configuration trains the same
masks (TRL through completion_mask + completion_only_loss=True, the others through labels -100 on the prompt); each
record counts the data set's targets as the config's own data path labels them, and the table says whether they agree.
"""
from __future__ import annotations

import argparse
import contextlib
import datetime as dt
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from dataclasses import asdict
from pathlib import Path

for _key, _value in (("HF_HUB_OFFLINE", "1"), ("HF_DATASETS_OFFLINE", "1"), ("HF_HUB_DISABLE_TELEMETRY", "1"),
                     ("TOKENIZERS_PARALLELISM", "false")):
    os.environ.setdefault(_key, _value)
REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # run from a checkout without installing

import torch  # noqa: E402

from hf_accel.errors import BudgetExceeded  # noqa: E402

from hf_accel.training import flops  # noqa: E402
from benchlib.anchors import ANCHOR_REVISION, anchors_text, stock_anchors  # noqa: E402
from benchlib.apart import child_env  # noqa: E402
from benchlib.configs import CONFIGS, Options, missing_requirement  # noqa: E402
from benchlib.distributed import CHILDREN, Rank, RunStopped, gather_ranks, launch_argv, run_group  # noqa: E402
from benchlib.presets import PresetUnavailable, describe, get_preset  # noqa: E402
from benchlib.report import (add_ratios, add_ratios_per_nproc, markdown_table, profile_table,  # noqa: E402
                                   repeat_command, repo_relative, scaling_table, targets_line, versions,
                                   write_outputs)
from benchlib.memory_report import memory_summary  # noqa: E402
from benchlib.train import RunSettings, Timing, summarize  # noqa: E402
from benchlib.workloads import WORKLOADS, DataSpec, build_config, make_data, with_positions  # noqa: E402

MIN_CONFIG_SECONDS = {False: 45.0, True: 5.0}  # do not start a configuration with less time left than this


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", default=None, help="a named run of benchlib.presets (see --list-presets); "
                                                   "other flags override its settings")
    p.add_argument("--list-presets", action="store_true", help="print the presets and exit")
    p.add_argument("--workload", choices=sorted(WORKLOADS), default="llama-1b")
    p.add_argument("--configs", default=",".join(n for n, c in CONFIGS.items() if not c.sites),
                   help=f"comma-separated subset of: {', '.join(CONFIGS)} (default: those that run in this "
                        "environment; the Unsloth / QLoRA ones, whose packages are packed apart, run when named)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--tiny", action="store_true", help="tiny model and data (CPU smoke test)")
    p.add_argument("--steps", type=int, default=None, help="timed steps (default 30; tiny 2)")
    p.add_argument("--warmup", type=int, default=None,
                   help="untimed warmup steps (default 3; tiny 1); 0 times the first step too, compiles and all")
    p.add_argument("--step-time-budget", type=float, default=15.0, help="stop timing a config after this many s")
    p.add_argument("--time-budget", type=float, default=540.0, help="total seconds for all configs")
    p.add_argument("--config-timeout", type=float, default=200.0, help="seconds before a config is killed")
    p.add_argument("--tokens-per-step", type=int, default=None, help="real tokens per optimizer step (16384)")
    p.add_argument("--doc-lengths", default=None,
                   help="long-context sweep: comma-separated document lengths; each step trains one document of that "
                        "length, each (config, length) in its own process, shortest first; a config stops at its "
                        "first failure (OOM, timeout)")
    p.add_argument("--sweep-gpus", type=int, default=1,
                   help="long-context sweep: run over this many GPUs of the machine, one record (each free GPU "
                        "takes the next length of the config with the fewest lengths measured, as one GPU does; a "
                        "config's lengths run in order, one at a time)")
    p.add_argument("--doc-length", type=int, default=None, help=argparse.SUPPRESS)  # one length, in a child
    p.add_argument("--device-memory-cap-gib", type=float, default=None,
                   help="cap what every configuration's process may allocate on its GPU to this many GiB "
                        "(torch.cuda.set_per_process_memory_fraction, set before the model is built; recorded with "
                        "each result), e.g. 80 to compare with results on an 80 GB GPU")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--profile-steps", type=int, default=0,
                   help="profile each configuration's first N timed steps with torch.profiler: kernel ms per step by "
                        "category in the JSON and a side-by-side table (those steps' times include the profiler's "
                        "overhead: take speed from a run without it)")
    p.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    p.add_argument("--fused-ce", choices=["auto", "inline", "recompute", "liger", "off"], default="auto",
                   help="hf_accel-best loss: patch(fused_ce=True) (auto), one fused_ce method forced from outside "
                        "the model, or the model's own")
    p.add_argument("--ce-chunk-size", type=int, default=None, help="fused CE tokens per chunk (default: automatic)")
    p.add_argument("--best-backend", default="auto", help="hf_accel-best: backend passed to hf_accel.patch")
    p.add_argument("--best-checkpointing", default=None, help="hf_accel-best: checkpointing passed to hf_accel.patch")
    p.add_argument("--best-fused-ops", choices=["auto", "on", "off"], default="auto",
                   help="hf_accel-best: liger-kernel fused norms/SwiGLU via patch(fused_ops=...) (auto: when usable)")
    p.add_argument("--best-compile", choices=["auto", "on", "off"], default="auto",
                   help="hf_accel-best: patch(compile=True), the decoder layers' training forwards through inductor "
                        "(auto: on CUDA)")
    p.add_argument("--best-mlp-chunks", default="auto", type=lambda v: v if v == "auto" else int(v),
                   help="hf_accel-best: patch(mlp_chunks=...): auto (training calls over 32768 tokens), a chunk size "
                        "in tokens, or 0 (off)")
    p.add_argument("--substitute-attn", default=None,
                   help="run flash_attention_4 configs with this attn_implementation instead (CPU smoke of TRL)")
    p.add_argument("--extra-site", action="append", default=[], metavar="NAME",
                   help="a package pack to put first on every child's PYTHONPATH: NAME -> SITE_ROOT/site-NAME (what "
                        "pack-wheels.sh NAME installs), or a folder; configs that need a pack (unsloth, bnb) name "
                        "their own (repeatable)")
    p.add_argument("--site-root", default="/tmp", help="the folder holding the packs' site-NAME folders")
    p.add_argument("--peak-tflops", type=float, default=None, help="bf16 dense peak for MFU (default: by GPU name)")
    p.add_argument("--nproc", default=None,
                   help="run each config under accelerate launch on N processes (GPUs), FSDP2 by default; a "
                        "comma-separated list runs each config at each count (e.g. 1,2: scaling). Default: one plain "
                        "process, no launcher")
    p.add_argument("--accelerate-config", default="examples/accelerate/fsdp2.yaml",
                   help="accelerate config for --nproc (relative paths: to the repository root); "
                        "examples/accelerate/ddp_cpu.yaml runs CPU processes over gloo (tests)")
    p.add_argument("--best-accelerate-config", default=None,
                   help="hf_accel-best under --nproc: its own accelerate config (default: --accelerate-config), e.g. "
                        "fsdp2.yaml with --best-checkpointing budget:... where the others run FSDP's activation "
                        "checkpointing (fsdp2_checkpointing.yaml, which refuses an hf_accel policy): the same sharding, "
                        "hf_accel's checkpointing plan instead of FSDP's every layer")
    p.add_argument("--child", type=Path, default=None, help=argparse.SUPPRESS)
    preset_name = p.parse_known_args(argv)[0].preset
    if preset_name:
        try:
            preset = get_preset(preset_name)
        except PresetUnavailable as exc:
            p.exit(2, f"{p.prog}: error: {exc}\n")
        except KeyError as exc:
            p.error(exc.args[0])
        p.set_defaults(workload=preset.workload, configs=",".join(preset.configs), **preset.settings)
    args = p.parse_args(argv)
    args.steps = args.steps if args.steps is not None else (2 if args.tiny else 30)
    args.warmup = args.warmup if args.warmup is not None else 1 if args.tiny else 3
    if args.warmup < 0 or args.steps < 1:
        p.error(f"--warmup must be >= 0 and --steps >= 1 (got {args.warmup} and {args.steps})")
    args.configs = [c.strip() for c in args.configs.split(",") if c.strip()]
    unknown = [c for c in args.configs if c not in CONFIGS]
    if unknown:
        p.error(f"unknown configs {unknown}; choose from {', '.join(CONFIGS)}")
    if args.nproc is not None:
        try:
            args.nproc = [int(n) for n in str(args.nproc).split(",") if n.strip()]
        except ValueError:
            args.nproc = []
        if not args.nproc or min(args.nproc) < 1:
            p.error(f"--nproc takes process counts >= 1, e.g. 2 or 1,2; got {parse_known(argv, '--nproc')!r}")
        if args.doc_lengths:
            p.error("--nproc and --doc-lengths cannot be combined (each long-context run is one process)")
    if args.sweep_gpus < 1 or (args.sweep_gpus > 1 and not args.doc_lengths):
        p.error(f"--sweep-gpus takes a GPU count >= 1 and only with --doc-lengths; got {args.sweep_gpus}")
    return args


def parse_known(argv: list[str] | None, flag: str) -> str | None:
    """The raw value of `flag` in argv (for error messages)."""
    argv = sys.argv[1:] if argv is None else argv
    for i, arg in enumerate(argv):
        if arg == flag and i + 1 < len(argv):
            return argv[i + 1]
        if arg.startswith(flag + "="):
            return arg.split("=", 1)[1]
    return None


def accelerate_config(args: argparse.Namespace, name: str | None = None) -> Path:
    """The accelerate config that configuration `name` launches under (--best-accelerate-config for hf_accel-best)."""
    path = Path(config_yaml(args, name))
    return path if path.is_absolute() else REPO / path


def config_yaml(args: argparse.Namespace, name: str | None = None) -> str:
    if name == "hf_accel-best" and getattr(args, "best_accelerate_config", None):
        return args.best_accelerate_config
    return args.accelerate_config


def data_spec(args: argparse.Namespace) -> DataSpec:
    if args.doc_length:
        return DataSpec.single_documents(args.doc_length, seed=args.seed)
    spec = DataSpec.tiny() if args.tiny else DataSpec()
    overrides = {"seed": args.seed, "prompt_share": WORKLOADS[args.workload].prompt_share}
    if args.tokens_per_step:
        overrides["tokens_per_step"] = args.tokens_per_step
    return DataSpec(**{**asdict(spec), **overrides})


def options(args: argparse.Namespace) -> Options:
    compiled = args.best_compile == "on" or (args.best_compile == "auto" and args.device.startswith("cuda"))
    return Options(fused_ce=args.fused_ce, backend=args.best_backend, checkpointing=args.best_checkpointing,
                   ce_chunk_size=args.ce_chunk_size, substitute_attn=args.substitute_attn,
                   fused_ops=args.best_fused_ops, mlp_chunks=args.best_mlp_chunks,
                   extra_sites=tuple(args.extra_site), site_root=args.site_root, compile=compiled)


def peak(args: argparse.Namespace) -> float | None:
    if args.peak_tflops:
        return args.peak_tflops * 1e12
    return flops.peak_flops(torch.cuda.get_device_name(0)) if args.device.startswith("cuda") else None


def child_main(args: argparse.Namespace) -> None:
    """Run one configuration and write its result JSON to args.child."""
    name = args.configs[0]
    config, workload = CONFIGS[name], WORKLOADS[args.workload]
    result = {"config": name, "description": config.description}
    launched, rank = args.nproc is not None, Rank.from_env()
    device, budget = args.device, args.step_time_budget
    timing = Timing()
    if launched:  # each rank on its own GPU; all ranks run the same number of steps (one stopping alone would hang)
        device, budget = rank.device(args.device), float("inf")
        timing.notes.append(f"{rank.world_size} processes under accelerate launch ({args.accelerate_config}); "
                            "step-time budget off")
    if args.doc_length:  # the document must fit the model's positions
        workload = with_positions(workload, args.doc_length, args.tiny)
    settings = RunSettings(workload, device, args.tiny, args.steps, args.warmup, budget, args.seed,
                           profile_steps=args.profile_steps)
    try:
        result.update(cap_device_memory(args.device_memory_cap_gib, device))
        if launched and config.launched is None:
            raise RuntimeError(f"{name} has no multi-process path (runs without --nproc only)")
        spec = data_spec(args)
        # every rank draws the same samples and takes its share: enough for all ranks' steps without reuse
        data = make_data(spec, build_config(workload, args.tiny).vocab_size,
                         (args.steps + args.warmup) * rank.world_size)
        if data.prompts is not None:  # prompt-masked: the data set's own count, to hold each config's labels to
            result.update(data_tokens=sum(data.lengths), expected_target_tokens=data.target_tokens())
        model = (config.launched if launched else config.run)(settings, data, options(args), timing)
        ranks: dict = {}
        if launched:
            timing, ranks = gather_ranks(timing, device)
        gpu_peak = peak(args)
        result.update(summarize(model, timing, gpu_peak * rank.world_size if gpu_peak else None, device))
        result.update(memory_summary(model, device))
        if timing.profile is not None:
            result["profile"] = timing.profile
        result.update(ranks)
        result["status"] = "ok"
        result["same_computation"] = workload.family not in config.wrong_for and config.changes_computation is None
        if config.sites or args.extra_site:  # packages packed apart: what this child imported, beside the parent's
            result["versions"] = versions()
        if not result["same_computation"]:
            result["status"] = (f"ok ({config.changes_computation or 'documents attend across packed boundaries'}: "
                                "not the same computation)")
        if args.substitute_attn and "fa4" in config.needs:
            result["status"] += f" [{args.substitute_attn} substituted for flash_attention_4]"
    except Exception as exc:  # noqa: BLE001 - any failure is this configuration's result, not the run's
        result["status"] = f"error: {type(exc).__name__}: {str(exc).splitlines()[0][:200] if str(exc) else ''}"
        if isinstance(exc, torch.OutOfMemoryError):
            result["status"] = "OOM"
        if isinstance(exc, BudgetExceeded):  # refused before the first step: the plan says how long a document fits
            result["status"] = (f"refused by the budget plan: at most ~{exc.longest_tokens:,} tokens fit "
                                f"(this length needs {exc.smallest_budget})")
            result["longest_feasible_tokens"] = exc.longest_tokens
        result["traceback"] = repo_relative(traceback.format_exc()[-4000:])
        result["notes"] = timing.notes
    if launched:
        result["nproc"] = rank.world_size
    if rank.rank == 0:
        args.child.write_text(json.dumps(result, default=str))


def cap_device_memory(cap_gib: float | None, device: str) -> dict:
    """Cap this process's allocations on `device` at `cap_gib` GiB (before anything is allocated); what to record."""
    if cap_gib is None:
        return {}
    if not device.startswith("cuda"):
        return {"device_memory_cap_gib": cap_gib, "device_memory_cap": "not applied: not a CUDA device"}
    index = torch.device(device).index or 0
    total = torch.cuda.get_device_properties(index).total_memory
    if cap_gib * 2**30 > total:
        raise RuntimeError(f"--device-memory-cap-gib {cap_gib} is more than the device's {total / 2**30:.1f} GiB")
    torch.cuda.set_per_process_memory_fraction(cap_gib * 2**30 / total, index)
    return {"device_memory_cap_gib": cap_gib, "device_total_gib": total / 2**30}


def command(argv: list[str]) -> str:
    """How this run was asked for, as a command line to repeat it (the machine-specific --out dropped)."""
    return repeat_command("scripts/bench.py", argv)


def child_argv(args: argparse.Namespace, name: str, out: Path, nproc: int | None = None) -> list[str]:
    """The child's command line: plain python, or (nproc) under accelerate launch with --nproc N passed on."""
    argv = [str(Path(__file__).resolve()), "--workload", args.workload, "--configs", name,
            "--device", args.device, "--steps", str(args.steps), "--warmup", str(args.warmup),
            "--step-time-budget", str(args.step_time_budget), "--seed", str(args.seed),
            "--profile-steps", str(args.profile_steps), "--fused-ce", args.fused_ce,
            "--best-backend", args.best_backend, "--best-fused-ops", args.best_fused_ops,
            "--best-compile", args.best_compile, "--best-mlp-chunks", str(args.best_mlp_chunks), "--child", str(out)]
    for flag, value in (("--tokens-per-step", args.tokens_per_step), ("--doc-length", args.doc_length),
                        ("--best-checkpointing", args.best_checkpointing),
                        ("--ce-chunk-size", args.ce_chunk_size),
                        ("--substitute-attn", args.substitute_attn), ("--peak-tflops", args.peak_tflops),
                        ("--device-memory-cap-gib", args.device_memory_cap_gib)):
        if value is not None:
            argv += [flag, str(value)]
    for site in args.extra_site:
        argv += ["--extra-site", site]
    argv += ["--tiny"] if args.tiny else []
    if nproc is None:
        return [sys.executable, *argv]
    argv += ["--nproc", str(nproc), "--accelerate-config", config_yaml(args, name)]
    return launch_argv(accelerate_config(args, name), nproc, argv)


def run_one(args: argparse.Namespace, name: str, timeout: float, nproc: int | None = None,
            gpu: int | None = None) -> dict:
    """One configuration in a fresh subprocess (its own process group, or a launcher's with `nproc` ranks, killed as
    a group on a timeout); a timeout, crash or missing result becomes an error status. `gpu`: the one GPU it sees."""
    extra = {"nproc": nproc} if nproc else {}
    env = child_env(CONFIGS[name], options(args))
    if gpu is not None:
        visible = [d for d in env.get("CUDA_VISIBLE_DEVICES", "").split(",") if d.strip()]
        env["CUDA_VISIBLE_DEVICES"] = visible[gpu] if gpu < len(visible) else str(gpu)
        extra["gpu"] = gpu
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "result.json"
        start = time.perf_counter()
        length = {"doc_length": args.doc_length} if args.doc_length else {}
        try:
            proc = run_group(child_argv(args, name, out, nproc), env, timeout)
        except RunStopped as stop:
            return {"config": name, "status": f"skipped: the run was stopped ({stop}) after "
                    f"{time.perf_counter() - start:.0f}s of this configuration", **extra, **length}
        except subprocess.TimeoutExpired as exc:
            # stdout too: a budget plan prints its split there, the child's progress lines go to stderr
            tail = "\n".join(_text(stream)[-limit:] for stream, limit in ((exc.output, 1500), (exc.stderr, 2500)))
            if timeout < args.config_timeout:  # the run's time budget had less left than a configuration may take
                status = f"skipped: time budget exhausted after {timeout:.0f}s"
            else:
                status = f"error: timeout after {timeout:.0f}s"
            host = getattr(exc, "host", None)
            return {"config": name, "status": status, "log_tail": tail, **extra, **length,
                    **(host.figures() if host is not None else {})}
        host = getattr(proc, "host", None)
        result = json.loads(out.read_text()) if out.exists() else {
            "config": name, "status": _exit_status(proc.returncode, host)}
        if host is not None:
            result.update(host.figures())
        result.update(extra)
        if args.doc_length:
            result["doc_length"] = args.doc_length
        result["wall_seconds"] = time.perf_counter() - start
        if result.get("status") != "ok":
            result["log_tail"] = repo_relative(proc.stderr[-3000:])
        return result


def _exit_status(returncode: int, host) -> str:
    """A child that ended without its record: how it ended, and for a kill (SIGKILL: the kernel's OOM killer, where no
    one else sent it) how much host memory it held and the machine had left at the last look (every 2 s)."""
    if returncode != -signal.SIGKILL or host is None:
        return f"error: process exited with code {returncode} (crash or OOM kill)"
    left = "" if host.min_available_bytes is None else f", {host.min_available_bytes / 2**30:.1f} GiB of the host left"
    return (f"error: killed (SIGKILL, no Python error: the kernel's OOM killer if the host ran out) at "
            f"{host.peak_rss_bytes / 2**30:.1f} GiB resident{left}")


def _text(stream: bytes | str | None) -> str:
    return stream.decode(errors="replace") if isinstance(stream, bytes) else stream or ""


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    if args.list_presets:
        print(describe())
        return 0
    if args.child is not None:
        child_main(args)
        return 0
    workload, opts, start = WORKLOADS[args.workload], options(args), time.perf_counter()
    with stop_on_signals():
        if args.doc_lengths:
            return long_context_main(args, argv, workload, opts, start)
        return sweep_main(args, argv, workload, opts, start)


STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)


@contextlib.contextmanager
def stop_on_signals():
    """SIGTERM / SIGINT (an outer `timeout`, Ctrl-C) stop the run instead of killing bench.py: the running children
    are killed with their process groups, what is left is recorded as skipped, the record is written and bench.py
    exits with 128 + the signal's number (see ChildGroups)."""
    def handler(signum, frame):
        CHILDREN.stop(signal.Signals(signum).name)

    CHILDREN.reset()
    main_thread = threading.current_thread() is threading.main_thread()  # only the main thread may set handlers
    previous = {sig: signal.signal(sig, handler) for sig in STOP_SIGNALS} if main_thread else {}
    try:
        yield
    finally:
        for sig, old in previous.items():
            signal.signal(sig, old)
        CHILDREN.reset()  # a stopped run's mark ends with it: a later run in this process starts its children


def run_stem(args: argparse.Namespace, suffix: str = "") -> str:
    """The record's file stem: workload and the run's start time (UTC)."""
    now = dt.datetime.now(dt.timezone.utc)
    return f"{args.workload}{'-tiny' if args.tiny else ''}{suffix}_{now:%Y-%m-%dT%H%M%S}"


def result_line(result: dict) -> str:
    """One configuration's outcome for the log: its status, and its numbers when it trained."""
    status = str(result.get("status"))
    if not status.startswith("ok"):
        return status
    peak_gib = result.get("peak_gib")
    return (f"{status}: {result.get('tokens_per_s', 0):,.0f} tokens/s, steady "
            f"{result.get('steady_tokens_per_s', 0):,.0f}, peak {'-' if peak_gib is None else f'{peak_gib:.1f}'} GiB")


def write_so_far(args: argparse.Namespace, stem: str, record: dict, table: str, total: int) -> None:
    """The record of the configurations measured so far, marked incomplete (the run's last write replaces it)."""
    write_outputs(args.out, stem, {**record, "incomplete": f"{len(record['results'])} of {total} configurations"},
                  table)


def finish(args: argparse.Namespace, stem: str, record: dict, table: str) -> int:
    """Write the run's record (with the signal that stopped it, if one did) and table, print the table last; returns
    bench.py's exit code: 0, or 128 + the number of that signal (as a shell reports a signal's end)."""
    if CHILDREN.stopped_by:
        record["stopped_by"] = CHILDREN.stopped_by
    json_path, md_path = write_outputs(args.out, stem, record, table)
    print(f"[bench] wrote {json_path} and {md_path}", flush=True)
    print(f"\n## {args.workload} ({record['versions'].get('gpu') or args.device})\n\n{table}", flush=True)
    return 0 if CHILDREN.stopped_by is None else 128 + signal.Signals[CHILDREN.stopped_by].value


def sweep_main(args: argparse.Namespace, argv: list[str], workload, opts: Options, start: float) -> int:
    """Each configuration (at each --nproc count) in its own process, one after another, then the table. The record
    is written after every configuration (marked incomplete until the last), so a run cut from outside keeps what
    it measured."""
    results = []
    nprocs = f"-nproc{'-'.join(map(str, args.nproc))}" if args.nproc else ""
    stem = run_stem(args, nprocs)
    total = len(args.nproc or [None]) * len(args.configs)
    for nproc in args.nproc or [None]:
        for name in args.configs:
            reason = missing_requirement(CONFIGS[name], args.device, workload.family, opts, workload) or \
                launch_unmet(args, name, nproc)
            remaining = args.time_budget - (time.perf_counter() - start)
            if reason is None and CHILDREN.stopped_by is not None:
                reason = f"the run was stopped ({CHILDREN.stopped_by})"
            if reason is None and remaining < MIN_CONFIG_SECONDS[args.tiny]:
                reason = f"time budget exhausted ({args.time_budget:.0f}s)"
            if reason:
                result = {"config": name, "status": f"skipped: {reason}", **({"nproc": nproc} if nproc else {})}
            else:
                result = run_one(args, name, min(args.config_timeout, remaining), nproc)
            results.append(result)
            print(f"[bench] {args.workload} {name}{f' x{nproc}' if nproc else ''}: {result_line(result)}", flush=True)
            write_so_far(args, stem, *sweep_record(args, argv, workload, results, start), total)
    return finish(args, stem, *sweep_record(args, argv, workload, results, start))


def sweep_record(args: argparse.Namespace, argv: list[str], workload, results: list[dict],
                 start: float) -> tuple[dict, str]:
    """The sweep's record and table for the results so far."""
    stock = [n for n, c in CONFIGS.items() if c.stock]
    best = add_ratios_per_nproc(results, stock) if args.nproc else add_ratios(results, stock)
    table = markdown_table(results, best)
    if targets_line(results):
        table = targets_line(results) + "\n\n" + table
    if anchors_text(args.configs):
        table = anchors_text(args.configs) + "\n\n" + table
    profiles = profile_table(results)
    if profiles:
        table += "\n\n" + profiles
    if args.nproc:
        table += "\n\n" + scaling_table(results, stock)
    spec = data_spec(args)
    now = dt.datetime.now(dt.timezone.utc)
    record = {
        "workload": args.workload, "workload_notes": workload.notes, "tiny": args.tiny, "device": args.device,
        "date": now.isoformat(timespec="seconds"), "command": command(argv), "preset": args.preset,
        "versions": versions(),
        "model_config": build_config(workload, args.tiny).to_dict(), "data": asdict(spec),
        "precision": ("bf16 weights, no fp32 master copy" + ("; fp32 LoRA adapters, forwards under bf16 autocast "
                      "(as Trainer/TRL with bf16=True)" if workload.lora else "")) if args.device.startswith("cuda")
        else "fp32",
        "optimizer": "torch.optim.AdamW(fused=True), lr 1e-5", "peak_flops": peak(args),
        "device_memory_cap_gib": args.device_memory_cap_gib,
        "mfu_formula": flops.__doc__, "args": {k: str(v) for k, v in vars(args).items()},
        "anchor_revision": ANCHOR_REVISION, "anchors": stock_anchors(args.configs),
        "total_seconds": time.perf_counter() - start, "results": results,
    }
    if args.nproc:
        record.update(nproc=args.nproc, accelerate_config=args.accelerate_config)
        if args.best_accelerate_config and "hf_accel-best" in args.configs:
            record["best_accelerate_config"] = args.best_accelerate_config
    return record, table


def launch_unmet(args: argparse.Namespace, name: str, nproc: int | None) -> str | None:
    """Why `name` cannot run on `nproc` launched processes here (None: it can, or no launcher)."""
    if nproc is None:
        return None
    if CONFIGS[name].launched is None:
        return "no multi-process path (--nproc): runs in one plain process only"
    if args.device.startswith("cuda") and torch.cuda.device_count() < nproc:
        return f"needs {nproc} GPUs, {torch.cuda.device_count()} visible"
    if not accelerate_config(args, name).exists():
        return f"accelerate config {config_yaml(args, name)} not found"
    return None


def long_context_main(args: argparse.Namespace, argv: list[str], workload, opts: Options, start: float) -> int:
    """Every (config, length) in its own process, shortest length first; a config's first failure (OOM, timeout,
    error) skips its longer lengths. Table: tokens/s and MFU per length, each config's longest length that trained."""
    lengths = sorted(int(n) for n in args.doc_lengths.split(","))
    if args.sweep_gpus > 1 and args.device.startswith("cuda") and torch.cuda.device_count() < args.sweep_gpus:
        print(f"bench.py: --sweep-gpus {args.sweep_gpus} needs {args.sweep_gpus} GPUs; "
              f"{torch.cuda.device_count()} visible", file=sys.stderr)
        return 2

    stem = run_stem(args)
    done: dict[str, list[dict]] = {name: [] for name in args.configs}  # each config's lengths so far, in order
    failed: dict[str, str | None] = dict.fromkeys(args.configs)  # "OOM" / "failed" once a length did not train

    def measure_next(name: str, gpu: int | None) -> None:
        """The config's next length (shortest first): run, or skipped with the reason."""
        length = lengths[len(done[name])]
        reason = missing_requirement(CONFIGS[name], args.device, workload.family, opts, workload)
        remaining = args.time_budget - (time.perf_counter() - start)
        if reason is None and CHILDREN.stopped_by is not None:
            reason = f"the run was stopped ({CHILDREN.stopped_by})"
        if reason is None and failed[name] is not None:
            reason = f"{failed[name]} at a shorter length"
        if reason is None and remaining < MIN_CONFIG_SECONDS[args.tiny]:
            reason = f"time budget exhausted ({args.time_budget:.0f}s)"
        if reason:
            result = {"config": name, "doc_length": length, "status": f"skipped: {reason}"}
        else:
            result = run_one(argparse.Namespace(**{**vars(args), "doc_length": length}), name,
                             min(args.config_timeout, remaining), gpu=gpu)
            status = str(result.get("status", ""))
            if not status.startswith(("ok", "skipped")):  # did not train (not: time ran out, or the run stopped)
                failed[name] = "OOM" if status == "OOM" else "failed"
        where = f" (GPU {gpu})" if gpu is not None else ""
        with lock:
            done[name].append(result)
            print(f"[bench] {args.workload} {name} @ {length}{where}: {result_line(result)}", flush=True)
            write_so_far(args, stem, *long_context_record(args, argv, workload, done, lengths, start),
                         len(args.configs) * len(lengths))

    # Each free GPU (one: the current device) takes the next length of the config that has measured the fewest
    # lengths and is not running (ties: --configs order), so all configs advance together and a time budget that runs
    # out cuts every config's longest lengths, not a whole config queued behind another (2026-11-30 14:30, one GPU:
    # TRL and HF sdpa took the whole budget and hf_accel measured nothing). --sweep-gpus N: configs side by side, one
    # record (the same run).
    lock = threading.Lock()
    running: set[str] = set()
    errors: list[BaseException] = []

    def claim() -> str | None:
        with lock:
            waiting = [n for n in args.configs if n not in running and len(done[n]) < len(lengths)]
            if not waiting:
                return None
            name = min(waiting, key=lambda n: len(done[n]))
            running.add(name)
            return name

    def gpu_worker(gpu: int | None) -> None:
        while not errors and (name := claim()) is not None:
            try:
                measure_next(name, gpu)
            except BaseException as error:  # raised in the main thread after the join, as a serial sweep would
                errors.append(error)
            finally:
                with lock:
                    running.discard(name)

    if args.sweep_gpus == 1:
        gpu_worker(None)
    else:
        workers = [threading.Thread(target=gpu_worker, args=(gpu,)) for gpu in range(args.sweep_gpus)]
        for worker in workers:
            worker.start()
        for worker in workers:
            worker.join()  # a worker stops when every config is measured or running on another GPU
    if errors:
        raise errors[0]
    return finish(args, stem, *long_context_record(args, argv, workload, done, lengths, start))


def long_context_record(args: argparse.Namespace, argv: list[str], workload, done: dict[str, list[dict]],
                        lengths: list[int], start: float) -> tuple[dict, str]:
    """The long-context sweep's record and table for the (config, length) results so far."""
    from benchlib.report import long_context_table

    results = [r for name in args.configs for r in done[name]]
    table = long_context_table(results)
    now = dt.datetime.now(dt.timezone.utc)
    record = {
        "workload": args.workload, "workload_notes": workload.notes, "tiny": args.tiny, "device": args.device,
        "date": now.isoformat(timespec="seconds"), "command": command(argv), "preset": args.preset,
        "versions": versions(), "model_config": build_config(with_positions(workload, max(lengths), args.tiny),
                                                              args.tiny).to_dict(),
        "data": {"doc_lengths": lengths, "docs_per_step": 1}, "peak_flops": peak(args),
        "device_memory_cap_gib": args.device_memory_cap_gib,
        "mfu_formula": flops.__doc__, "args": {k: str(v) for k, v in vars(args).items()},
        "anchor_revision": ANCHOR_REVISION, "anchors": stock_anchors(args.configs),
        "total_seconds": time.perf_counter() - start, "results": results,
    }
    return record, table


if __name__ == "__main__":
    sys.exit(main())
