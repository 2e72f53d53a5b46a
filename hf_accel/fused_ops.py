"""Optional fused element-wise kernels (liger-kernel), bound to one model instance and undone exactly.

``patch(model, fused_ops=True)`` swaps the forward of each RMSNorm / SwiGLU MLP (Llama) and LayerNorm (GPT-NeoX,
Falcon) instance for liger-kernel's Triton implementation, through liger's own per-instance binders, and runs Llama's
rotary embedding through liger's fused RoPE kernel for this model's attention modules only. Liger's public
``apply_liger_kernel_to_*`` functions rebind classes module-wide (every model in the process) and rotary globally, so
they are not used here. The MLP's projections are still called as modules, so LoRA keeps receiving its inputs.
"""
from __future__ import annotations

import contextvars
import importlib.util
from collections.abc import Callable

import torch
from torch import nn

from .errors import BackendUnavailable


def unavailable_reason(model: nn.Module) -> str | None:
    if importlib.util.find_spec("liger_kernel") is None:
        return "liger-kernel is not installed (pip install 'hf_accel[liger]')"
    param = next(model.parameters(), None)
    if param is None or param.device.type != "cuda":
        return "liger-kernel's Triton kernels need the model on a CUDA device"
    return None


def _transaction(module: nn.Module, change: Callable[[nn.Module], None]) -> Callable[[], None]:
    """Apply ``change`` to a module's instance attributes; return the action that restores them exactly."""
    before = dict(module.__dict__)
    change(module)
    added = [k for k in module.__dict__ if k not in before]
    changed = {k: v for k, v in before.items() if module.__dict__.get(k, v) is not v}

    def undo() -> None:
        for key in added:
            module.__dict__.pop(key, None)
        module.__dict__.update(changed)

    return undo


# ---- fused RoPE, scoped to instances -------------------------------------------------------------------------------
# LlamaAttention.forward calls modeling_llama's module-level `apply_rotary_pos_emb`, so a kernel cannot be bound to one
# instance directly. While any model uses it, that global is a dispatcher which calls the fused kernel only inside a
# forward of an attention module bound here (a context variable, set and reset around that forward) and the stock
# function everywhere else; the last undo puts the stock function back.
_rope_inside = contextvars.ContextVar("hf_accel_fused_rope", default=None)
_rope_state: dict = {"users": 0, "stock": None, "dispatcher": None}


def _rope_dispatcher(stock: Callable) -> Callable:
    def apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=1):
        fused = _rope_inside.get()
        if fused is None or unsqueeze_dim != 1:
            return stock(q, k, cos, sin, unsqueeze_dim=unsqueeze_dim)
        return fused(q, k, cos, sin)

    apply_rotary_pos_emb.__wrapped__ = stock
    return apply_rotary_pos_emb


def bind_fused_rope(attention: nn.Module, rope: Callable) -> Callable[[], None]:
    """Run this LlamaAttention instance's RoPE through ``rope(q, k, cos, sin) -> (q, k)``; return the exact undo."""
    from transformers.models.llama import modeling_llama

    if _rope_state["users"] == 0:
        _rope_state["stock"] = modeling_llama.apply_rotary_pos_emb
        _rope_state["dispatcher"] = _rope_dispatcher(_rope_state["stock"])
        modeling_llama.apply_rotary_pos_emb = _rope_state["dispatcher"]
    _rope_state["users"] += 1
    stock_forward = type(attention).forward

    def forward(self, *args, **kwargs):
        token = _rope_inside.set(rope)
        try:
            return stock_forward(self, *args, **kwargs)
        finally:
            _rope_inside.reset(token)

    undo_forward = _transaction(attention, lambda m: setattr(m, "forward", forward.__get__(m)))

    def undo() -> None:
        undo_forward()
        _rope_state["users"] -= 1
        if _rope_state["users"] == 0:
            if modeling_llama.apply_rotary_pos_emb is _rope_state["dispatcher"]:
                modeling_llama.apply_rotary_pos_emb = _rope_state["stock"]
            _rope_state.update(stock=None, dispatcher=None)

    return undo


def _is_stock_llama_attention(module: nn.Module) -> bool:
    from transformers.models.llama.modeling_llama import LlamaAttention

    return type(module) is LlamaAttention  # subclasses of other families call their own module's RoPE


def apply(model: nn.Module) -> tuple[list[str], list[Callable[[], None]]]:
    """Bind liger's fused norms / SwiGLU to this model's modules. Raises BackendUnavailable when it cannot."""
    reason = unavailable_reason(model)
    if reason:
        raise BackendUnavailable(f"fused_ops=True needs liger-kernel on CUDA: {reason}. Pass fused_ops=False.")
    from liger_kernel.transformers.monkey_patch import (
        _patch_layer_norm_module,
        _patch_rms_norm_module,
        _patch_swiglu_module,
    )
    from liger_kernel.transformers.rope import liger_rotary_pos_emb
    from liger_kernel.transformers.swiglu import LigerSwiGLUMLP
    from transformers.models.llama.modeling_llama import LlamaMLP, LlamaRMSNorm

    names, undo = [], []
    for name, module in model.named_modules():
        if isinstance(module, LlamaRMSNorm):
            undo.append(_transaction(module, lambda m: _patch_rms_norm_module(m, eps=m.variance_epsilon)))
        elif isinstance(module, LlamaMLP) and module.config.hidden_act in ("silu", "swish"):
            undo.append(_transaction(module, lambda m: _patch_swiglu_module(m, LigerSwiGLUMLP)))
        elif isinstance(module, nn.LayerNorm) and module.elementwise_affine:
            undo.append(_transaction(module, lambda m: _patch_layer_norm_module(m, eps=m.eps)))
        elif _is_stock_llama_attention(module):
            undo.append(bind_fused_rope(module, liger_rotary_pos_emb))
        else:
            continue
        names.append(name)
    return names, undo

