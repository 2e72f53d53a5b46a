"""Attention backends, each declaring its capabilities, and the registry that picks among them."""
from __future__ import annotations

import torch

from .base import AttentionRequest, AttnOptions, Capabilities, DeviceInfo
from .registry import BACKENDS, PREFERENCE, Selection, format_backends, list_backends, select

# Ops whose outputs selective-checkpoint policies should save rather than recompute.
SAVEABLE_OPS = [
    torch.ops.hf_accel.fa4_varlen_fwd.default,
    torch.ops.hf_accel.fa4_varlen_sinks_fwd.default,
    torch.ops.aten._flash_attention_forward.default,
    torch.ops.aten._scaled_dot_product_flash_attention.default,
    torch.ops.aten._scaled_dot_product_efficient_attention.default,
    torch.ops.aten._scaled_dot_product_cudnn_attention.default,
]


def _autocast(*tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
    device_type = tensors[0].device.type
    if not torch.is_autocast_enabled(device_type):
        return tensors
    dtype = torch.get_autocast_dtype(device_type)
    return tuple(t.to(dtype) if t.is_floating_point() and t.dtype != dtype else t for t in tensors)


def varlen_attention(
    q_thd: torch.Tensor,
    k_thd: torch.Tensor,
    v_thd: torch.Tensor,
    cu_q: torch.Tensor,
    cu_k: torch.Tensor,
    max_q: int,
    max_k: int,
    opts: AttnOptions,
    backend: str = "auto",
) -> torch.Tensor:
    """Attention over packed documents: q_thd (T, Hq, D), k/v_thd (T, Hkv, D) -> (T, Hq, D).

    Under autocast the inputs are cast to the autocast dtype first, as SDPA does, and the backend is chosen for that
    dtype: fp32 master weights under bf16 autocast (kbit preparation) give fp32 q/k after fp32 RoPE, and would
    otherwise pass over the half-precision kernels."""
    q_thd, k_thd, v_thd = _autocast(q_thd, k_thd, v_thd)
    chosen = select(AttentionRequest.build(q_thd, k_thd, opts), backend).backend
    return chosen.varlen(q_thd, k_thd, v_thd, cu_q, cu_k, max_q, max_k, opts)


__all__ = [
    "AttentionRequest", "AttnOptions", "BACKENDS", "Capabilities", "DeviceInfo", "PREFERENCE", "SAVEABLE_OPS",
    "Selection", "format_backends", "list_backends", "select", "varlen_attention",
]
