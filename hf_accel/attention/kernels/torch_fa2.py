"""PyTorch's built-in FlashAttention-2 (``aten::_flash_attention_forward``): varlen, GQA, window, dropout; CUDA only.

It ships with every CUDA build of torch (no extra package) and is differentiable through aten's own backward.
"""
from __future__ import annotations

import torch

from .backend import Backend, aten_cuda_op_reason, flash_window
from .base import HALF_DTYPES, AttnOptions, Capabilities


class TorchFA2Backend(Backend):
    name = "torch-fa2"
    capabilities = Capabilities(
        devices=frozenset({"cuda"}),
        dtypes=HALF_DTYPES,
        min_capability=(8, 0),
        max_head_dim=256,
        head_dim_multiple=8,
        window=True,
        dropout=True,
        notes=("ALiBi slopes rejected by the torch 2.11 CUDA build; no softcap",),
    )

    def unavailable_reason(self) -> str | None:
        return aten_cuda_op_reason("_flash_attention_forward")

    def varlen(self, q_thd, k_thd, v_thd, cu_q, cu_k, max_q, max_k, opts: AttnOptions) -> torch.Tensor:
        left, right = flash_window(opts)
        out = torch.ops.aten._flash_attention_forward(
            q_thd, k_thd, v_thd, cu_q, cu_k, max_q, max_k,
            opts.dropout_p, opts.causal, False,
            scale=opts.scale, window_size_left=left, window_size_right=right,
        )[0]
        return out
