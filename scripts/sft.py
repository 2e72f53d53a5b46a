#!/usr/bin/env python
"""``hf-accel sft`` from a checkout: the same command (hf_accel/cli/sft.py), for `python scripts/sft.py ...` and
`accelerate launch scripts/sft.py ...`. ``hf-accel sft --help`` lists the flags."""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from a checkout without installing

from hf_accel.cli.sft import cli  # noqa: E402

if __name__ == "__main__":
    sys.exit(cli())
