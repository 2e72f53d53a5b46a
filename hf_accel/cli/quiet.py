"""Quiet by default: what a run prints is what a user can act on.

DeepSpeed, where installed, is imported by accelerate in runs that do not use it (``unwrap_model`` looks for its
engine class): 3 s of start-up and a warning that it "was unable to detect" a GPU. Outside a DeepSpeed launch no such
engine can exist, so the command tells accelerate's unwrap that DeepSpeed is absent there; inside one, where torch sees
no CUDA device, DeepSpeed is told the CPU up front (``DS_ACCELERATOR=cpu``, what its own detection falls back to).
bitsandbytes' CPU backend (installed for QLoRA) logs on import that an optional inference kernel from the hub is
missing, and offline the hub ``kernels`` package that looks it up that it skips a publisher check: nothing a training
run uses, so those two messages are dropped. torchao (installed for ``precision="fp8"``)
is imported by transformers' quantizer registry in every run; on a machine without CUDA it logs that its CUDA kernel
libraries fail to load (nothing a CPU run can use), and it registers enums with torch's pytree in a way torch now
calls deprecated: neither is for the user, so both are dropped (the load failure only where there is no CUDA).

Progress bars of the libraries below us (datasets' ``map``, tokenizing) draw only on a terminal; in a log file tqdm's
carriage-return chains are noise, and hf_accel's own progress prints one line per logging interval there instead.
"""
from __future__ import annotations

import importlib.util
import logging
import os
import sys

from .._compat import launcher_flag


def on_terminal() -> bool:
    return bool(getattr(sys.stderr, "isatty", lambda: False)())


def deepspeed_launch() -> bool:
    return launcher_flag("ACCELERATE_USE_DEEPSPEED")


class _DropMessage(logging.Filter):
    def __init__(self, text: str) -> None:
        super().__init__()
        self.text = text

    def filter(self, record: logging.LogRecord) -> bool:
        return self.text not in str(record.msg)


def quiet_libraries() -> None:
    """DeepSpeed kept out of runs that do not use it (and told the CPU where it would fall back to it), bitsandbytes'
    missing-inference-kernel message dropped; datasets' and transformers' progress bars off unless stderr is a
    terminal."""
    logging.getLogger("bitsandbytes.backends.cpu.ops").addFilter(_DropMessage("gemm_4bit_forward from kernels"))
    # the same lookup's first step, offline (the hub ``kernels`` package that bitsandbytes asks for that kernel)
    logging.getLogger("kernels._internals.hf_hub").addFilter(_DropMessage("Skipping publisher trust check"))
    logging.getLogger("torch.utils._pytree").addFilter(_DropMessage("is an Enum subclass and is now natively"))
    if importlib.util.find_spec("torchao") is not None:
        import torch

        if not torch.cuda.is_available():
            logging.getLogger("torchao").addFilter(_DropMessage("Failed to load"))
    if not deepspeed_launch():
        import accelerate.utils.other

        accelerate.utils.other.is_deepspeed_available = lambda: False  # unwrap_model's engine check: no engine here
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
