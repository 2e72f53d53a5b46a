"""Shared seam for families whose attention goes through transformers' AttentionInterface (Llama, GPT-NeoX).

The patch registers hf_accel's attention + mask functions under our own name, switches this model instance to it with
``set_attn_implementation`` and tags each attention module with its backend; undo restores the previous name.
"""
from __future__ import annotations

from collections.abc import Callable

from hf_accel.attention.hf_attention import ATTN_NAME, BACKEND_ATTR, register


def patch_registry_family(model, attention_cls: type, backend: str) -> tuple[list[str], list[Callable[[], None]]]:
    register()
    previous = model.config._attn_implementation
    names, undo = [], []
    for name, module in model.named_modules():
        if isinstance(module, attention_cls):
            setattr(module, BACKEND_ATTR, backend)
            names.append(name)
            undo.append(lambda m=module: m.__dict__.pop(BACKEND_ATTR, None))
    model.set_attn_implementation(ATTN_NAME)
    undo.append(lambda: model.set_attn_implementation(previous))
    return names, undo


def training_dropout(config) -> float:
    """Attention dropout applied in training (transformers passes config.attention_dropout to the kernel)."""
    return float(getattr(config, "attention_dropout", 0.0) or 0.0)
