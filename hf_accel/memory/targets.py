"""What checkpointing acts on: a model's decoder layers, the switches already around them (transformers' enable
method, FSDP's own activation checkpointing) and the ops whose outputs op-level checkpointing keeps.

The policies in `checkpointing` decide which of these to checkpoint; this module only finds them.
"""
from __future__ import annotations

import functools
from typing import Callable

import torch
from torch import nn
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts
from transformers.modeling_layers import GradientCheckpointingLayer

from .._compat import launcher_flag
from ..errors import ConfigurationError

_DEFAULT_SAVE_OP_NAMES = (
    # matmuls (nn.Linear decomposes to mm / addmm under the dispatcher)
    "mm", "addmm", "bmm", "baddbmm", "linear", "_addmm_activation",
    # the MoE experts' grouped GEMMs (hf_accel.patches.experts on CUDA)
    "_grouped_mm",
    # attention kernels: their outputs are the most expensive thing in a layer to recompute
    "_scaled_dot_product_flash_attention", "_scaled_dot_product_efficient_attention",
    "_scaled_dot_product_cudnn_attention", "_scaled_dot_product_flash_attention_for_cpu",
    "_flash_attention_forward", "_efficient_attention_forward",
)


_GROUPED_GEMM_OPS = (("hf_accel", "experts_grouped_mm"), ("transformers", "grouped_mm_fallback"))


def default_save_ops() -> frozenset:
    """Ops whose outputs op-level checkpointing keeps: matmuls, attention kernels,
    hf_accel.attention.kernels.SAVEABLE_OPS."""
    packets = {getattr(torch.ops.aten, name) for name in _DEFAULT_SAVE_OP_NAMES if hasattr(torch.ops.aten, name)}
    # grouped GEMMs that are custom ops: the stand-in the facts probe runs on fake tensors (hf_accel.patches.experts)
    # and transformers' fallback where torch's grouped GEMM does not serve
    for namespace, name in _GROUPED_GEMM_OPS:
        ops = getattr(torch.ops, namespace)
        if hasattr(ops, name):
            packets.add(getattr(ops, name))
    try:  # read at apply time: the flash-attn-4 custom op registers itself when its backend module is imported
        from ..attention import kernels

        packets |= {_as_packet(op) for op in getattr(kernels, "SAVEABLE_OPS", ())}
    except ImportError:
        pass
    return frozenset(packets)


def _as_packet(op) -> torch._ops.OpOverloadPacket:
    """Accept an OpOverloadPacket, an OpOverload, a `torch.library.custom_op` object or a "ns::name" string."""
    if isinstance(op, str):
        namespace, name = op.split("::")
        return getattr(getattr(torch.ops, namespace), name.split(".")[0])
    op = getattr(op, "_opoverload", op)
    return getattr(op, "overloadpacket", op)


# Marks the checkpoint functions of op-level layers: compiled layers (hf_accel.fused.compiling) run eagerly under them,
# since the selective-checkpoint policy must see every op.
OP_LEVEL_ATTR = "_hf_accel_op_level"
# The call slot nn.Module.__call__ prefers when set (what nn.Module.compile sets): hf_accel.fused.compiling binds
# compiled layers there, and the memory probe (hf_accel.memory.plan) wraps it to attribute what a layer saves.
CALL_SLOT = "_compiled_call_impl"


def _op_level_context_fn(save_ops: frozenset) -> Callable:
    def policy_fn(ctx, op, *args, **kwargs):
        packet = getattr(op, "overloadpacket", op)
        return CheckpointPolicy.MUST_SAVE if packet in save_ops else CheckpointPolicy.PREFER_RECOMPUTE

    return functools.partial(create_selective_checkpoint_contexts, policy_fn)


# ----------------------------------------------------------------------------------------------- model plumbing
def base_model(model: nn.Module) -> nn.Module:
    """The transformers model under a PEFT wrapper (or the model itself)."""
    get_base = getattr(model, "get_base_model", None)
    return get_base() if callable(get_base) else model


def decoder_layers(model: nn.Module) -> list[nn.Module]:
    """The model's GradientCheckpointingLayers (decoder layers) in forward order."""
    return [m for m in base_model(model).modules() if isinstance(m, GradientCheckpointingLayer)]


def decoder_mlps(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """(name, module) of each decoder layer's ``mlp`` (Llama, GPT-NeoX and Falcon all name it so), in forward order."""
    names = {id(m): n for n, m in base_model(model).named_modules()}
    found = []
    for layer in decoder_layers(model):
        mlp = getattr(layer, "mlp", None)
        if isinstance(mlp, nn.Module):
            found.append((names.get(id(mlp), "mlp"), mlp))
    return found


def _hf_enable_function(model: nn.Module) -> Callable:
    """transformers 5.23 names it activation_checkpointing_enable; 5.17 gradient_checkpointing_enable."""
    for name in ("activation_checkpointing_enable", "gradient_checkpointing_enable"):
        fn = getattr(model, name, None)
        if callable(fn):
            return fn
    raise ConfigurationError(
        f"{type(model).__name__} has neither activation_checkpointing_enable nor gradient_checkpointing_enable; "
        "hf_accel checkpointing needs a transformers PreTrainedModel (transformers >=5.17,<6)."
    )


def fsdp_activation_checkpointing_active(model: nn.Module) -> bool:
    """Best effort: FSDP's own activation checkpointing is on (wrapped layers, accelerate state or its env var)."""
    try:
        from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointWrapper

        if any(isinstance(m, CheckpointWrapper) for m in model.modules()):
            return True
    except ImportError:
        pass
    try:
        from accelerate.state import AcceleratorState, is_initialized

        plugin = getattr(AcceleratorState(), "fsdp_plugin", None) if is_initialized() else None
        if plugin is not None and getattr(plugin, "activation_checkpointing", False):
            return True
    except ImportError:
        pass
    return launcher_flag("ACCELERATE_USE_FSDP") and launcher_flag("FSDP_ACTIVATION_CHECKPOINTING")
