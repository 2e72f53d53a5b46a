"""Shared seam for families whose attention goes through transformers' AttentionInterface (Llama, GPT-NeoX).

The patch registers hf_accel's attention + mask functions under our own name, switches this model instance to it with
``set_attn_implementation`` and tags each attention module with its backend; undo restores the previous name.

hf_accel's attention never materialises probabilities, so a call that asks for them (``output_attentions=True``, as
an argument or in the config) runs transformers' eager implementation, mask included, for that call only: a pre-hook
on the base model switches this instance's config to "eager" and its post-hook switches it back.
"""
from __future__ import annotations

from collections.abc import Callable

import torch

from hf_accel.attention.hf_attention import ATTN_NAME, BACKEND_ATTR, register, suspend_forward_record

ATTENTIONS_FALLBACK = "eager"
ATTENTIONS = "transformers' eager attention for that call (mask and probabilities as in the unpatched model)"


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
    undo += _attentions_fallback_hooks(model)
    return names, undo


def _attentions_fallback_hooks(model) -> list[Callable[[], None]]:
    """Hooks on the base model (every entry point passes through it) that run eager attention for calls asking for
    attention probabilities. Inside torch.compile nothing switches: traced calls already run SDPA, as stock does.
    The hooks read the config from the module they run on, so a deep copy of the patched model switches its own."""
    switched = []  # one entry per call in flight (calls nest)

    def before(module, args, kwargs):
        config = module.config
        switch = not torch.compiler.is_compiling() and config._attn_implementation == ATTN_NAME
        if not (switch and wants_attentions(config, kwargs)):
            switched.append(None)
            return
        config._attn_implementation_internal = ATTENTIONS_FALLBACK  # no validation: eager is always available
        switched.append(suspend_forward_record())  # eager's mask finds packed documents itself, as stock does

    def after(module, args, kwargs, output):
        resume = switched.pop() if switched else None
        if resume is not None:
            module.config._attn_implementation_internal = ATTN_NAME
            resume()

    base = model.base_model
    return [
        base.register_forward_pre_hook(before, with_kwargs=True).remove,
        base.register_forward_hook(after, with_kwargs=True, always_call=True).remove,
    ]


def wants_attentions(config, kwargs) -> bool:
    """Whether a model forward called with ``kwargs`` returns attention probabilities."""
    wanted = kwargs.get("output_attentions")
    return bool(getattr(config, "output_attentions", False) if wanted is None else wanted)


def training_dropout(config) -> float:
    """Attention dropout applied in training (transformers passes config.attention_dropout to the kernel)."""
    return float(getattr(config, "attention_dropout", 0.0) or 0.0)
