"""Quiet by default: what a run prints is what a user can act on.

DeepSpeed, where installed, is imported by accelerate (``unwrap_model`` checks for its engine) even in runs that do
not use it, and warns on import that it "was unable to detect" a GPU on a machine that has none. Where torch sees no
CUDA device and no accelerator was named, DeepSpeed is told the CPU up front (``DS_ACCELERATOR=cpu``, what its own
detection falls back to), which it takes without a warning.

Progress bars of the libraries below us (datasets' ``map``, tokenizing) draw only on a terminal; in a log file tqdm's
carriage-return chains are noise, and hf_accel's own progress prints one line per logging interval there instead.
"""
from __future__ import annotations

import importlib.util
import os
import sys


def on_terminal() -> bool:
    return bool(getattr(sys.stderr, "isatty", lambda: False)())


def quiet_libraries() -> None:
    """DeepSpeed's accelerator named where it would fall back to the CPU anyway; datasets' and transformers'
    progress bars off unless stderr is a terminal."""
    if "DS_ACCELERATOR" not in os.environ and importlib.util.find_spec("deepspeed") is not None:
        import torch

        others = ("intel_extension_for_pytorch", "torch_npu", "torch_sdaa")  # accelerators DeepSpeed also detects
        if not torch.cuda.is_available() and not any(importlib.util.find_spec(m) for m in others):
            os.environ["DS_ACCELERATOR"] = "cpu"
    if on_terminal():
        return
    import datasets
    import transformers

    datasets.disable_progress_bars()
    transformers.utils.logging.disable_progress_bar()
