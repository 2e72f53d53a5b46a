"""``hf-accel estimate-memory MODEL``: training memory predicted offline from a config (no weights, no hub).

    hf-accel estimate-memory llama-3-8b --lora-rank 16 --checkpointing op --batch-tokens 16384
    hf-accel estimate-memory llama-3-8b --lora-rank 16 --batch-tokens 524288 --checkpointing budget:120GiB --host-gib 96
    hf-accel estimate-memory llama-3-8b --lora-rank 16 --load-in-4bit --checkpointing full --batch-tokens 16384

MODEL is a known shape (llama-3.2-1b, llama-3-8b, pythia-1.4b, falcon-1b) or a local folder with config.json.
"""
from __future__ import annotations

import argparse
import os

from ..errors import ConfigurationError, UsageError
from ..memory.spec import parse_checkpointing
from .checks import mlp_chunks_value

DTYPES = ("bf16", "fp16", "fp32")
OPTIMIZERS = ("adamw", "adam", "adamw_8bit", "sgd")


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # one line, no usage dump
        raise UsageError(message.removeprefix("argument "))


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = _Parser(prog="hf-accel estimate-memory", description=__doc__,
                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model", help="a known shape (llama-3.2-1b, llama-3-8b, pythia-1.4b, falcon-1b) or a local "
                        "config folder")
    parser.add_argument("--dtype", default="bf16", choices=DTYPES)
    parser.add_argument("--optimizer", default="adamw", choices=OPTIMIZERS)
    parser.add_argument("--lora-rank", type=int, default=None)
    parser.add_argument("--lora-targets", default=None, help="comma-separated module names (default: the family's)")
    parser.add_argument("--batch-tokens", type=int, default=4096, help="tokens per micro-batch")
    parser.add_argument("--checkpointing", default="none",
                        help="none | full | every_N | op | budget:20GiB | budget:0.6 (with --device-gib)")
    parser.add_argument("--device-gib", type=float, default=None, help="device memory for fractional budgets")
    parser.add_argument("--host-gib", type=float, default=None,
                        help="host memory budget plans may offload layer inputs to (default: none)")
    parser.add_argument("--load-in-4bit", action="store_true",
                        help="QLoRA: the linear weights in bitsandbytes 4-bit (needs --lora-rank), the rest in fp32 as "
                        "PEFT's kbit preparation leaves them")
    parser.add_argument("--use-bnb-nested-quant", action="store_true",
                        help="with --load-in-4bit: the 4-bit blocks' scales quantized too")
    parser.add_argument("--keep-base-dtype", action="store_true",
                        help="with --load-in-4bit: the other weights back in --dtype after PEFT's preparation, as "
                        "hf-accel sft --keep-base-dtype, TRL's SFTTrainer and Unsloth keep them (a --dtype residual "
                        "stream)")
    parser.add_argument("--loss", default="fused", choices=("fused", "full"),
                        help="fused: patch()'s chunked loss, its CUDA default (one ~512 MiB chunk of logits at a "
                        "time); full: the stock loss over the whole (tokens, vocab) logits")
    parser.add_argument("--mlp-chunks", default="auto",
                        help="patch()'s mlp_chunks: auto (chunk the MLPs of long calls), a chunk size in tokens, or "
                        "0 / off")
    args = parser.parse_args(argv)
    args.mlp_chunks = mlp_chunks_value(args.mlp_chunks)
    if args.lora_rank is not None and args.lora_rank < 1:
        raise UsageError(f"--lora-rank {args.lora_rank}: a LoRA rank is at least 1 (leave it out for full "
                         "fine-tuning)")
    if args.load_in_4bit and args.lora_rank is None:
        raise UsageError("--load-in-4bit: a 4-bit base is frozen and trains LoRA adapters (QLoRA): add --lora-rank R "
                         "(e.g. 16)")
    for name in ("use_bnb_nested_quant", "keep_base_dtype"):
        if getattr(args, name) and not args.load_in_4bit:
            raise UsageError(f"--{name.replace('_', '-')} applies to a 4-bit base: add --load-in-4bit")
    if args.batch_tokens < 1:
        raise UsageError(f"--batch-tokens {args.batch_tokens}: must be at least 1")
    for name in ("device_gib", "host_gib"):
        value = getattr(args, name)
        if value is not None and not (value > 0 or (name == "host_gib" and value == 0)) or value == float("inf"):
            raise UsageError(f"--{name.replace('_', '-')} {value}: must be a positive number of GiB")
    try:
        spec = parse_checkpointing(args.checkpointing)
    except ConfigurationError as e:  # the allowed forms
        raise UsageError(f"--checkpointing {args.checkpointing}: {e}") from None
    if spec.kind == "budget" and isinstance(spec.budget, float) and args.device_gib is None:
        raise UsageError(f"--checkpointing {args.checkpointing} is a fraction of device memory: add --device-gib "
                         "(e.g. 80), or give the budget in bytes (budget:20GiB)")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from .quiet import quiet_libraries

    quiet_libraries()  # the libraries' import-time messages a user cannot act on (torchao's, without CUDA)
    from ..memory.estimate import estimate_training_memory

    estimate = estimate_training_memory(
        args.model, dtype=args.dtype, optimizer=args.optimizer, lora_rank=args.lora_rank,
        lora_targets=args.lora_targets.split(",") if args.lora_targets else None, batch_tokens=args.batch_tokens,
        checkpointing=args.checkpointing,
        device_bytes=int(args.device_gib * 1024**3) if args.device_gib else None,
        host_bytes=int(args.host_gib * 1024**3) if args.host_gib is not None else None,
        base_4bit=args.load_in_4bit, nested_quant=args.use_bnb_nested_quant, keep_base_dtype=args.keep_base_dtype,
        loss=args.loss,
        mlp_chunks=args.mlp_chunks,
    )
    print(estimate.table())
