#!/usr/bin/env python
"""``hf-accel estimate-memory`` from a checkout: `python scripts/estimate_memory.py llama-3-8b --lora-rank 16
--checkpointing op`, or a budget plan split between device and host: `... --batch-tokens 524288 --checkpointing
budget:120GiB --host-gib 96` (hf_accel/cli/estimate.py)."""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from a checkout without installing

from hf_accel.cli import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main(["estimate-memory", *sys.argv[1:]]))
