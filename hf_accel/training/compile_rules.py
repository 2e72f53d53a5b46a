"""When a Trainer's ``compile`` request stands: explicit requests that cannot work raise before patching, and
"auto" stands down where something else compiles the model, under FSDP1 (not measured there) and under DeepSpeed
(measured slower than eager there, likely as its gather hooks around every submodule break the compiled graphs;
docs/MULTI_GPU.md). FSDP2 keeps it (measured faster there). The reason goes into patch()'s options, so the report's
compile line says it.
"""
from __future__ import annotations

from typing import Any

from ..errors import ConfigurationError


def check_explicit(trainer: Any) -> None:
    """Explicit requests that cannot work raise here, before patching ("auto" stands down instead)."""
    accel = trainer.accel
    compile_asked = accel.compile not in (False, None, "auto")
    if accel.fused_ce is True and not accel.patch:
        raise ConfigurationError("fused_ce=True works through hf_accel.patch; it needs AccelArguments(patch=True).")
    if compile_asked and not accel.patch:
        raise ConfigurationError("compile=True works through hf_accel.patch; it needs AccelArguments(patch=True).")
    if compile_asked and getattr(trainer.args, "torch_compile", False):
        raise ConfigurationError(
            "AccelArguments(compile=...) compiles the decoder layers and TrainingArguments(torch_compile=True) the "
            "whole model; use one. AccelArguments(compile=True) keeps attention on hf_accel's kernel."
        )


def stand_down_reason(trainer: Any) -> str | None:
    """Why "auto" compile is off for this Trainer (the patch report's compile line says it), or None."""
    if trainer.accel.compile != "auto":
        return None
    if getattr(trainer.args, "torch_compile", False):
        return "TrainingArguments(torch_compile=True) compiles the whole model instead"
    if getattr(trainer, "is_fsdp_enabled", False) and not getattr(trainer.accelerator, "is_fsdp2", False):
        return "stands down under FSDP1 (not measured there; FSDP2 keeps it)"
    if getattr(trainer, "is_deepspeed_enabled", False):
        return "stands down under DeepSpeed (measured slower there than eager; FSDP2 keeps it)"
    return None


def compile_setting(trainer: Any) -> Any:
    """AccelArguments.compile for patch(): as given, or for "auto" False where it stands down."""
    if trainer.accel.compile != "auto":
        return trainer.accel.compile
    return False if stand_down_reason(trainer) else "auto"
