"""FlexAttention: a block-sparse document mask plus score_mods (ALiBi, softcap) in one kernel.

Forward-correct everywhere (eager flex runs a math reference on CPU, without backward); fast only compiled on CUDA, which is what ``varlen``
does there. The window / softcap / ALiBi code paths are right in eager mode (CPU tests) but fail to compile on torch 2.11, so
the capabilities declare the document mask only.
"""
from __future__ import annotations

import functools

import torch

from .backend import Backend, document_ids
from .base import ALL_FLOAT_DTYPES, AttnOptions, Capabilities


@functools.lru_cache(maxsize=1)
def _compiled_flex():
    from torch.nn.attention.flex_attention import flex_attention

    return torch.compile(flex_attention, dynamic=True)


class FlexBackend(Backend):
    name = "flex"
    capabilities = Capabilities(
        devices=frozenset({"cuda", "cpu"}),
        dtypes=ALL_FLOAT_DTYPES,
        max_head_dim=256,
        head_dim_multiple=8,
        # Measured on the H200 (torch 2.11, 2026-11-29): compiled flex with a window in mask_mod, or any score_mod
        # (ALiBi, softcap) capturing tensors, fails in inductor ("all unwrapped values must be FakeTensor").
        # Only the document mask is declared until that is fixed; ALiBi training goes to SDPA's float bias.
        window=False,
        softcap=False,
        alibi=False,
        alibi_backward=False,
        backward_devices=frozenset({"cuda"}),
        notes=("compiled on CUDA; document mask only (score_mods fail to compile in torch 2.11); no CPU backward",),
    )

    def unavailable_reason(self) -> str | None:
        try:
            from torch.nn.attention import flex_attention  # noqa: F401
        except ImportError:
            return "this torch has no torch.nn.attention.flex_attention"
        return None

    def varlen(self, q_thd, k_thd, v_thd, cu_q, cu_k, max_q, max_k, opts: AttnOptions) -> torch.Tensor:
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention

        total_q, total_k = q_thd.shape[0], k_thd.shape[0]
        doc_q, doc_k = document_ids(cu_q, total_q), document_ids(cu_k, total_k)
        # Positions local to each document; queries are the last tokens of their document.
        seq_q, seq_k = (cu_q[1:] - cu_q[:-1]).to(torch.long), (cu_k[1:] - cu_k[:-1]).to(torch.long)
        pos_q = torch.arange(total_q, device=q_thd.device) - cu_q.to(torch.long)[doc_q] + (seq_k - seq_q)[doc_q]
        pos_k = torch.arange(total_k, device=k_thd.device) - cu_k.to(torch.long)[doc_k]
        causal, (left, right) = opts.causal, opts.window

        def mask_mod(b, h, q_idx, kv_idx):
            keep = doc_q[q_idx] == doc_k[kv_idx]
            rel = pos_k[kv_idx] - pos_q[q_idx]
            if causal:
                keep = keep & (rel <= 0)
            if left is not None:
                keep = keep & (rel >= -left)
            if right is not None:
                keep = keep & (rel <= right)
            return keep

        slopes, softcap = opts.alibi_slopes, opts.softcap

        def score_mod(score, b, h, q_idx, kv_idx):
            if softcap:
                score = torch.tanh(score / softcap) * softcap
            if slopes is not None:
                rel = (pos_k[kv_idx] - pos_q[q_idx]).to(torch.float32)
                score = score + slopes[h] * (rel if causal else -rel.abs())
            return score

        on_cuda = q_thd.device.type == "cuda"
        block_mask = create_block_mask(mask_mod, None, None, total_q, total_k, device=q_thd.device, _compile=on_cuda)
        if slopes is not None:
            slopes = slopes.to(device=q_thd.device, dtype=torch.float32)
        attend = _compiled_flex() if on_cuda else flex_attention
        q, k, v = (x.transpose(0, 1).unsqueeze(0) for x in (q_thd, k_thd, v_thd))  # (1, H, T, D)
        out = attend(
            q, k, v,
            score_mod=score_mod if (softcap or slopes is not None) else None,
            block_mask=block_mask, scale=opts.scale, enable_gqa=q.shape[1] != k.shape[1],
        )
        return out.squeeze(0).transpose(0, 1)
