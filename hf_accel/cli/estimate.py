"""``hf-accel estimate-memory MODEL``: training memory predicted offline from a config (no weights, no hub).

    hf-accel estimate-memory llama-8b --lora-r 16 --checkpointing op --max-tokens-per-batch 16384
    hf-accel estimate-memory llama-8b --lora-r 16 --max-tokens-per-batch 524288 --checkpointing budget:120GiB
    hf-accel estimate-memory llama-70b --lora-r 16 --load-in-4bit --checkpointing full --max-tokens-per-batch 16384

MODEL is a shape of ``hf-accel sft --model-shape`` and the benchmarks, a published model's name, or a local folder
with config.json (the MODEL argument's help lists the names). The flags are named as ``hf-accel sft``'s (``--lora-r``,
``--max-tokens-per-batch``); ``--lora-rank`` and ``--batch-tokens`` are their older spellings.
"""
from __future__ import annotations

import argparse
import os
import re
from pathlib import Path

from ..errors import ConfigurationError, UsageError
from ..memory.spec import parse_checkpointing
from .checks import mlp_chunks_value

DTYPES = ("bf16", "fp16", "fp32")
OPTIMIZERS = ("adamw", "adam", "adamw_8bit", "sgd")


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # one line, no usage dump
        raise UsageError(re.sub(r"^argument (--[\w-]+)(/--[\w-]+)*:", r"\1:", message.removeprefix("argument ")))


def shape_names() -> tuple[str, ...]:
    """The shapes ``hf-accel sft --model-shape`` builds and the benchmarks' bases (hf_accel.cli.shapes)."""
    from .shapes import BASES, MODEL_SHAPES

    return tuple(dict.fromkeys([*MODEL_SHAPES, *BASES]))


def model_names() -> tuple[str, ...]:
    """Every MODEL name: the shapes, then the published names the memory estimate knows (imports torch)."""
    from ..memory.estimate import KNOWN_SHAPES

    return tuple(dict.fromkeys([*shape_names(), *KNOWN_SHAPES]))


def _model_help(argv: list[str]) -> str:
    if not any(a in ("-h", "--help") for a in argv):  # the names of the memory module need torch: only for --help
        return "a --model-shape name of hf-accel sft, a published model's name, or a local folder with config.json"
    from .quiet import quiet_libraries

    quiet_libraries()  # torch's and torchao's import-time messages a user cannot act on
    return f"one of {', '.join(model_names())}, or a local folder with config.json"


def build_parser(argv: list[str]) -> argparse.ArgumentParser:
    parser = _Parser(prog="hf-accel estimate-memory", description=__doc__,
                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model", help=_model_help(argv))
    parser.add_argument("--dtype", default="bf16", choices=DTYPES)
    parser.add_argument("--optimizer", default="adamw", choices=OPTIMIZERS)
    parser.add_argument("--lora-r", "--lora-rank", dest="lora_rank", type=int, default=None, metavar="R",
                        help="LoRA rank (leave it out for full fine-tuning)")
    parser.add_argument("--lora-targets", default=None, help="comma-separated module names (default: the family's)")
    parser.add_argument("--lora-experts", action="store_true",
                        help="with --lora-r: LoRA on the MoE experts' 3-D projections too (PEFT's target_parameters)")
    parser.add_argument("--max-tokens-per-batch", "--batch-tokens", dest="batch_tokens", type=int, default=4096, metavar="N",
                        help="tokens per packed micro-batch (default 4096)")
    parser.add_argument("--checkpointing", default="none",
                        help="none | full | every_N | op | budget:20GiB | budget:0.6 (with --device-gib)")
    parser.add_argument("--device-gib", type=float, default=None, help="device memory for fractional budgets")
    parser.add_argument("--host-gib", type=float, default=None,
                        help="host memory budget plans may offload layer inputs to (default: none)")
    parser.add_argument("--load-in-4bit", action="store_true",
                        help="QLoRA: the linear weights in bitsandbytes 4-bit (needs --lora-r), the rest in fp32 as "
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
    return parser


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    import sys

    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser(argv).parse_args(argv)
    args.mlp_chunks = mlp_chunks_value(args.mlp_chunks)
    if args.lora_rank is not None and args.lora_rank < 1:
        raise UsageError(f"--lora-r {args.lora_rank}: a LoRA rank is at least 1 (leave it out for full "
                         "fine-tuning)")
    if args.load_in_4bit and args.lora_rank is None:
        raise UsageError("--load-in-4bit: a 4-bit base is frozen and trains LoRA adapters (QLoRA): add --lora-r R "
                         "(e.g. 16)")
    if args.lora_experts and args.lora_rank is None:
        raise UsageError("--lora-experts puts LoRA adapters on the experts: add --lora-r R (e.g. 16)")
    for name in ("use_bnb_nested_quant", "keep_base_dtype"):
        if getattr(args, name) and not args.load_in_4bit:
            raise UsageError(f"--{name.replace('_', '-')} applies to a 4-bit base: add --load-in-4bit")
    if args.batch_tokens < 1:
        raise UsageError(f"--max-tokens-per-batch {args.batch_tokens}: must be at least 1")
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
        resolve_model(args.model), dtype=args.dtype, optimizer=args.optimizer, lora_rank=args.lora_rank,
        lora_targets=args.lora_targets.split(",") if args.lora_targets else None, batch_tokens=args.batch_tokens,
        checkpointing=args.checkpointing,
        device_bytes=int(args.device_gib * 1024**3) if args.device_gib else None,
        host_bytes=int(args.host_gib * 1024**3) if args.host_gib is not None else None,
        base_4bit=args.load_in_4bit, nested_quant=args.use_bnb_nested_quant, keep_base_dtype=args.keep_base_dtype,
        loss=args.loss,
        mlp_chunks=args.mlp_chunks, lora_experts=args.lora_experts,
    )
    print(estimate.table())


def resolve_model(name: str):
    """MODEL as the memory estimate takes it: a local folder as it is, a shape's config (``hf-accel sft
    --model-shape``'s, so one name means one model in both commands), or a published name the estimate knows."""
    if Path(name).expanduser().is_dir():
        return name
    if name in shape_names():
        from .shapes import BASES, MODEL_SHAPES, model_shape_config, shape_config

        return model_shape_config(name) if name in MODEL_SHAPES else shape_config(BASES[name])
    if name.lower() in (n.lower() for n in model_names()):
        return name
    import difflib

    close = difflib.get_close_matches(name.lower(), model_names(), n=1)
    raise UsageError(f"MODEL {name!r}: not a local folder nor a known name" + (f"; did you mean {close[0]}?" if close
                     else "") + f" (names: {', '.join(model_names())})")
