"""Optional fused element-wise kernels (liger-kernel), bound to one model instance and undone exactly.

``patch(model, fused_ops=True)`` swaps the forward of each module the model's family names as fusable
(``Family.fusable``: RMSNorms, Gemma's (1 + w) RMSNorms, SwiGLU and GEGLU MLPs, affine LayerNorms) for liger-kernel's
Triton implementation, through liger's own per-instance binders, with the settings liger's own model patches use
(Gemma: ``offset=1``, ``casting_mode="gemma"``, not in place). Liger's public
``apply_liger_kernel_to_*`` functions rebind classes module-wide (every model in the process) and rotary globally, so
they are not used here. The MLP's projections are still called as modules, so LoRA keeps receiving its inputs.

Liger's forward serves only *eager training* calls (train mode, grad enabled, not being traced): evaluation and
generation run the module's own forward, so they compute exactly what the unpatched model computes, and while dynamo
traces (compiled decoder layers, where inductor fuses the layers' own norms / MLPs, or a user's
``torch.compile(model, fullgraph=True)`` of a decode step) it sees the module's own forward, never liger's Triton
kernels. Op-level checkpointed layers, which skip the compiled path, train through liger's kernels.
"""
from __future__ import annotations

import importlib.util
import types
from collections.abc import Callable

import torch
from torch import nn

from .. import foreign
from ..errors import BackendUnavailable


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


def _eager_only(module: nn.Module) -> None:
    """Keep liger's bound forward for eager training calls; the module's own forward otherwise (dynamo tracing,
    evaluation, generation)."""
    liger_forward = module.__dict__["forward"]
    own_forward = type(module).forward

    def forward(self, *args, **kwargs):
        if torch.compiler.is_compiling() or not (self.training and torch.is_grad_enabled()):
            return own_forward(self, *args, **kwargs)
        return liger_forward(*args, **kwargs)

    module.forward = types.MethodType(forward, module)


Fusable = list[tuple[str, nn.Module, str]]  # (name, module, kind) as a Family.fusable gives them


def apply(model: nn.Module, modules: Fusable) -> tuple[list[str], list[Callable[[], None]]]:
    """Bind liger's fused norms / gated MLPs to ``modules`` (the family's fusable modules of ``model``), for eager
    training calls only (see the module docstring). Raises BackendUnavailable when it cannot."""
    reason = unavailable_reason(model)
    if reason:
        raise BackendUnavailable(f"fused_ops=True needs liger-kernel on CUDA: {reason}. Pass fused_ops=False.")
    with foreign.quiet_liger_import():
        from liger_kernel.transformers.monkey_patch import (
            _patch_layer_norm_module,
            _patch_rms_norm_module,
            _patch_geglu_module,
            _patch_swiglu_module,
        )
        from liger_kernel.transformers.swiglu import LigerSwiGLUMLP

    binders = {
        "rms_norm": lambda m: _patch_rms_norm_module(m, eps=_eps(m)),
        # Gemma's (x * (1 + w)).to(dtype): what liger's Gemma 2 / 3 patches bind
        "rms_norm_gemma": lambda m: _patch_rms_norm_module(m, eps=_eps(m), offset=1.0, casting_mode="gemma",
                                                           in_place=False),
        # (x_norm * w) in fp32, then cast (Olmo 2's norms)
        "rms_norm_fp32": lambda m: _patch_rms_norm_module(m, eps=_eps(m), offset=0.0, casting_mode="gemma",
                                                          in_place=False),
        "swiglu": lambda m: _patch_swiglu_module(m, LigerSwiGLUMLP),
        "geglu": _patch_geglu_module,
        "layer_norm": lambda m: _patch_layer_norm_module(m, eps=m.eps),
    }
    return bind(modules, binders)


def _eps(norm: nn.Module) -> float:
    """Llama-style norms name it variance_epsilon, Gemma's and LayerNorm eps."""
    eps = getattr(norm, "variance_epsilon", None)
    return eps if eps is not None else norm.eps


def bind(modules: Fusable, binders: dict[str, Callable[[nn.Module], None]]
         ) -> tuple[list[str], list[Callable[[], None]]]:
    """Apply ``binders[kind]`` to each fusable module, for its eager training calls only; names and undo actions."""
    names, undo = [], []
    for name, module, kind in modules:

        def change(m, kind=kind):
            binders[kind](m)
            _eager_only(m)

        undo.append(_transaction(module, change))
        names.append(name)
    return names, undo


# ---- keeping liger's Triton kernels out of compiled graphs -----------------------------------------------------
# Liger bound by someone else (transformers' / TRL's use_liger_kernel: instance forwards of norms and MLPs, and
# modeling_llama.apply_rotary_pos_emb swapped globally) sits inside hf_accel's compiled decoder layers, and dynamo
# then traces liger's Triton kernels: torch's triton_kernel_wrap fails to analyse them and logs a CompilationError
# traceback per kernel (dozens per GPU run). Where dynamo meets one of liger's functions it traces the stock
# computation instead (torch.compiler.substitute_in_graph with hf_accel.foreign's stand-ins; inductor fuses it as it
# fuses the layers' own ops); eager calls keep running liger's kernels.
_substituted: set[int] = set()


def trace_stock_instead(original: Callable, stock: Callable) -> None:
    """Make dynamo trace ``stock`` wherever it meets ``original`` (same arguments); eager calls are unchanged."""
    if id(original) in _substituted:
        return
    torch.compiler.substitute_in_graph(original, skip_signature_check=True)(stock)
    _substituted.add(id(original))


def keep_liger_out_of_compiled_graphs() -> None:
    """Register the stock stand-ins of liger's norm, SwiGLU, GEGLU, LayerNorm and RoPE functions with dynamo (once
    each; only when liger has been imported, i.e. may be bound to a model)."""
    for original, stock in foreign.stand_ins():
        trace_stock_instead(original, stock)
