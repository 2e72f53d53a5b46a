"""PyTorch's built-in memory-efficient attention (``aten::_efficient_attention_forward``, the CUTLASS kernel SDPA's
"efficient" path runs): varlen through ``cu_seqlens``, any head_dim, dropout; CUDA only, no extra package.

The flash-class kernels stop at head_dim 256 (their tiles of Q, K and V no longer fit in shared memory); Gemma 4's
global layers have 512. Before this backend those layers took the padded ``sdpa`` path: each packed row cut back into
a (documents, longest) batch with an explicit mask. This kernel reads the packed tokens as they are (batch 1, one
sequence per document through ``cu_seqlens``), so no padding and no mask are built. Queries align to the end of their
document (``custom_mask_type`` 2, causal from the bottom right), as flash-attention's varlen does. It has no grouped
heads: K and V are repeated to the query heads. Differentiable through aten's own backward
(``_efficient_attention_backward``, which takes the same ``cu_seqlens``).
"""
from __future__ import annotations

import torch

from .backend import Backend, aten_cuda_op_reason, repeat_kv_heads
from .base import ALL_FLOAT_DTYPES, AttnOptions, Capabilities

NO_MASK, CAUSAL_FROM_BOTTOM_RIGHT = 0, 2  # aten's custom_mask_type values


class MemEfficientBackend(Backend):
    name = "mem-efficient"
    capabilities = Capabilities(
        devices=frozenset({"cuda"}),
        dtypes=ALL_FLOAT_DTYPES,
        min_capability=(5, 0),
        max_head_dim=1 << 16,
        head_dim_multiple=8,  # the aligned kernels; SDPA itself asks for a multiple of 8
        dropout=True,
        notes=("PyTorch's CUTLASS kernel, varlen; any head_dim (Gemma 4's 512-wide global layers); K/V heads "
               "repeated for GQA; no window, softcap or sinks",),
    )

    def unavailable_reason(self) -> str | None:
        return aten_cuda_op_reason("_efficient_attention_forward")

    def varlen(self, q_thd, k_thd, v_thd, cu_q, cu_k, max_q, max_k, opts: AttnOptions) -> torch.Tensor:
        heads = q_thd.shape[1]
        k_thd, v_thd = repeat_kv_heads(k_thd, heads), repeat_kv_heads(v_thd, heads)
        grad = torch.is_grad_enabled() and any(x.requires_grad for x in (q_thd, k_thd, v_thd))
        out = torch.ops.aten._efficient_attention_forward(
            q_thd.unsqueeze(0), k_thd.unsqueeze(0), v_thd.unsqueeze(0), None,
            cu_q.to(torch.int32), cu_k.to(torch.int32), max_q, max_k,
            opts.dropout_p, CAUSAL_FROM_BOTTOM_RIGHT if opts.causal else NO_MASK, grad,
            scale=opts.scale,
        )[0]
        return out.squeeze(0)
