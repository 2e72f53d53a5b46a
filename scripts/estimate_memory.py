#!/usr/bin/env python
"""Offline training-memory estimate: `python scripts/estimate_memory.py llama-3-8b --lora-rank 16 --checkpointing op`,
or a budget plan split between device and host: `... --batch-tokens 524288 --checkpointing budget:120GiB --host-gib 96`.

MODEL is a known shape (llama-3.2-1b, llama-3-8b, pythia-1.4b, falcon-1b) or a local directory with config.json.
"""
import argparse
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from hf_accel.memory.estimate import KNOWN_SHAPES, estimate_training_memory  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model", help=f"one of {', '.join(KNOWN_SHAPES)} or a local config directory")
    parser.add_argument("--dtype", default="bf16", choices=["bf16", "fp16", "fp32"])
    parser.add_argument("--optimizer", default="adamw", choices=["adamw", "adam", "adamw_8bit", "sgd"])
    parser.add_argument("--lora-rank", type=int, default=None)
    parser.add_argument("--lora-targets", default=None, help="comma-separated module names (default: all linear)")
    parser.add_argument("--batch-tokens", type=int, default=4096, help="tokens per micro-batch")
    parser.add_argument("--checkpointing", default="none",
                        help="none | full | every_N | op | budget:20GiB | budget:0.6 (with --device-gib)")
    parser.add_argument("--device-gib", type=float, default=None, help="device memory for fractional budgets")
    parser.add_argument("--host-gib", type=float, default=None,
                        help="host memory budget plans may offload layer inputs to (default: none)")
    args = parser.parse_args()
    estimate = estimate_training_memory(
        args.model, dtype=args.dtype, optimizer=args.optimizer, lora_rank=args.lora_rank,
        lora_targets=args.lora_targets.split(",") if args.lora_targets else None, batch_tokens=args.batch_tokens,
        checkpointing=args.checkpointing,
        device_bytes=int(args.device_gib * 1024**3) if args.device_gib else None,
        host_bytes=int(args.host_gib * 1024**3) if args.host_gib is not None else None,
    )
    print(estimate.table())


if __name__ == "__main__":
    main()
