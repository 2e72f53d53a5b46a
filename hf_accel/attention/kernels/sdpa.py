"""PyTorch SDPA serving packed batches by regrouping: each document becomes a row of a (docs, max_len) batch.

Right-padded rows need no mask under causal attention (a real query never sees a later pad key), so the plain causal
case runs SDPA's fused flash / cuDNN kernels; window and ALiBi add an explicit mask or bias.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from .backend import Backend, allowed_bias, document_ids
from .base import ALL_FLOAT_DTYPES, AttnOptions, Capabilities


def _regroup_index(cu: torch.Tensor, max_len: int, total: int):
    """Gather index (docs, max_len) into the packed tokens, and which of its slots are real."""
    arange = torch.arange(max_len, device=cu.device)
    starts = cu[:-1].to(torch.long)
    lengths = (cu[1:] - cu[:-1]).to(torch.long)
    real = arange[None, :] < lengths[:, None]
    index = (starts[:, None] + arange[None, :]).clamp(max=max(total - 1, 0))
    return index, real


def _scatter_index(cu: torch.Tensor, max_len: int, total: int) -> torch.Tensor:
    """For each packed token, its slot in the flattened (docs * max_len) regrouped layout."""
    doc = document_ids(cu, total)
    return doc * max_len + (torch.arange(total, device=cu.device) - cu[:-1].to(torch.long)[doc])


class SDPABackend(Backend):
    name = "sdpa"
    capabilities = Capabilities(
        devices=frozenset({"cpu", "cuda", "mps", "xpu"}),
        dtypes=ALL_FLOAT_DTYPES,
        max_head_dim=1 << 16,
        window=True,
        dropout=True,
        alibi=True,
        alibi_backward=True,
        notes=("packed documents regrouped into a padded batch; window/ALiBi via an explicit mask",),
    )

    def varlen(self, q_thd, k_thd, v_thd, cu_q, cu_k, max_q, max_k, opts: AttnOptions) -> torch.Tensor:
        total_q, total_k = q_thd.shape[0], k_thd.shape[0]
        index_q, real_q = _regroup_index(cu_q, max_q, total_q)
        index_k, real_k = _regroup_index(cu_k, max_k, total_k)
        q = q_thd[index_q].transpose(1, 2)  # (docs, Hq, max_q, D)
        k = k_thd[index_k].transpose(1, 2)
        v = v_thd[index_k].transpose(1, 2)
        same_layout = cu_q is cu_k and max_q == max_k
        plain_causal = opts.causal and not opts.has_window and opts.alibi_slopes is None and same_layout
        mask = None if plain_causal else self._mask(real_q, real_k, opts, q.dtype)
        out = F.scaled_dot_product_attention(
            q, k, v,
            attn_mask=mask,
            dropout_p=opts.dropout_p,
            is_causal=plain_causal,
            scale=opts.scale,
            enable_gqa=q.shape[1] != k.shape[1],
        )
        out_flat = out.transpose(1, 2).reshape(-1, *out.shape[1:2], out.shape[-1])  # (docs*max_q, Hq, D)
        return out_flat[_scatter_index(cu_q, max_q, total_q)]

    @staticmethod
    def _mask(real_q, real_k, opts: AttnOptions, dtype) -> torch.Tensor:
        """Bool (docs, 1, Q, K) mask, or a float (docs, H, Q, K) bias when ALiBi is on."""
        max_q, max_k = real_q.shape[1], real_k.shape[1]
        k_pos = torch.arange(max_k, device=real_q.device)
        lengths_q, lengths_k = real_q.sum(1), real_k.sum(1)
        # Queries are the last tokens of their document: shift so q_pos aligns with k_pos at the document's end.
        q_pos = torch.arange(max_q, device=real_q.device)[None, :] + (lengths_k - lengths_q)[:, None]
        allowed, bias = allowed_bias(q_pos, k_pos, opts)  # (docs, Q, K), (docs, H, Q, K)
        allowed &= real_k[:, None, :]
        # Padded query rows would see nothing: let them see key 0 so no NaN reaches the backward pass.
        allowed[:, :, 0] |= ~real_q
        if bias is None:
            return allowed[:, None]
        return bias.masked_fill(~allowed[:, None], float("-inf")).to(dtype)
