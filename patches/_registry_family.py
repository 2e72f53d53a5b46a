"""Shared seam for families whose attention goes through transformers' AttentionInterface (Llama, Qwen, Mistral,
Gemma, GPT-NeoX).

The patch registers hf_accel's attention + mask functions under our own name, tags each attention module with its
backend, gives each a routed view of the config (it reads hf_accel's name) and hooks the model's body so that each
forward builds its mask with hf_accel's mask function (``hf_accel.attention.routing``). Between forwards the config
reports the implementation the user chose, which also serves every call the seam leaves to transformers. Undo
removes the hooks, views and tags.
"""
from __future__ import annotations

from collections.abc import Callable

from hf_accel.attention.hf_attention import BACKEND_ATTR, register
from hf_accel.attention.routing import route_attention_modules, routing_hooks

ATTENTIONS = "transformers' eager attention for that call (mask and probabilities as in the unpatched model)"


def patch_registry_family(model, attention_cls: type, backend: str) -> tuple[list[str], list[Callable[[], None]]]:
    register()
    names, modules, undo = [], [], []
    for name, module in model.named_modules():
        if isinstance(module, attention_cls):
            setattr(module, BACKEND_ATTR, backend)
            names.append(name)
            modules.append(module)
            undo.append(lambda m=module: m.__dict__.pop(BACKEND_ATTR, None))
    undo += route_attention_modules(model, modules)
    undo += routing_hooks(model.base_model, model.config._attn_implementation)
    return names, undo
