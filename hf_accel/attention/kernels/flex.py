"""FlexAttention: a block-sparse document mask plus score_mods (ALiBi, softcap) in one kernel.

On CUDA ``flex_attention`` is compiled once, at module level, with static shapes (``dynamic=False``): checked on a
GPU (tests/gpu), a document ``mask_mod`` and an ALiBi ``score_mod`` reading per-head slopes and positions from
captured tensors compile, and forward and backward match fp32 math (head_dim 64/128, GQA 8/2). (An earlier
dynamic-shape compile failed with "all unwrapped values must be FakeTensor".) Static shapes would recompile for every
new token count, so packed rows are padded up to a few lengths per octave (`bucket_length`); the padding is one more
document, unseen by real tokens and dropped from the output. The block mask is built once per batch layout and shared
by every layer (and the checkpoint recompute).

Off CUDA, flex runs eagerly as torch's math reference: forward only (torch raises on a CPU backward). Windows and
softcap are computed by the same mods but not declared until a GPU test covers them compiled.
"""
from __future__ import annotations

import functools
import math
from typing import Callable

import torch

from .backend import Backend, document_ids
from .base import ALL_FLOAT_DTYPES, AttnOptions, Capabilities

_MIN_BUCKET_STEP = 128  # flex's block size: shorter rows are padded to a multiple of it
_BUCKETS_PER_OCTAVE = 8  # at most 12.5% padding, at most 8 compiled shapes per doubling of the row length


def bucket_length(total: int) -> int:
    """The padded length a row of ``total`` tokens runs at (a few static shapes per octave)."""
    octave = 2 ** math.floor(math.log2(max(total, 1)))
    step = max(_MIN_BUCKET_STEP, octave // _BUCKETS_PER_OCTAVE)
    return -(-total // step) * step


@functools.lru_cache(maxsize=1)
def _compiled_flex() -> Callable:
    from torch.nn.attention.flex_attention import flex_attention

    return torch.compile(flex_attention, dynamic=False)


@functools.lru_cache(maxsize=1)
def _compiled_block_mask() -> Callable:
    """create_block_mask compiled (what its deprecated ``_compile=True`` did inside torch, minus the warning)."""
    from torch.nn.attention.flex_attention import create_block_mask

    return torch.compile(create_block_mask)


def flex_mods(doc_q, doc_k, pos_q, pos_k, opts: AttnOptions, slopes: torch.Tensor | None):
    """(mask_mod, score_mod or None) over packed tokens.

    doc_q (Tq,) / doc_k (Tk,): document index of each token; pos_q / pos_k: its position within the document
    (queries aligned to the end of their document). slopes: (Hq,) fp32 ALiBi slopes or None. The mods only index
    these captured tensors, so one compiled kernel serves every batch of the same padded length.
    """
    causal, (left, right), softcap = opts.causal, opts.window, opts.softcap

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

    def score_mod(score, b, h, q_idx, kv_idx):
        if softcap:
            score = torch.tanh(score / softcap) * softcap
        if slopes is not None:
            rel = (pos_k[kv_idx] - pos_q[q_idx]).to(torch.float32)
            score = score + slopes[h] * (rel if causal else -rel.abs())
        return score

    return mask_mod, (score_mod if (softcap or slopes is not None) else None)


def packed_layout(cu_q: torch.Tensor, cu_k: torch.Tensor, total_q: int, total_k: int, pad: int):
    """doc and position ids (doc_q, doc_k, pos_q, pos_k) of a packed row, plus `pad` tokens forming one extra
    document at the end (id -1) that sees only itself (so no query row is fully masked)."""
    doc_q, doc_k = document_ids(cu_q, total_q), document_ids(cu_k, total_k)
    seq_q, seq_k = (cu_q[1:] - cu_q[:-1]).to(torch.long), (cu_k[1:] - cu_k[:-1]).to(torch.long)
    pos_q = torch.arange(total_q, device=cu_q.device) - cu_q.to(torch.long)[doc_q] + (seq_k - seq_q)[doc_q]
    pos_k = torch.arange(total_k, device=cu_k.device) - cu_k.to(torch.long)[doc_k]
    if pad:
        tail = torch.arange(pad, device=cu_q.device)
        minus = torch.full((pad,), -1, dtype=doc_q.dtype, device=cu_q.device)
        doc_q, doc_k = torch.cat([doc_q, minus]), torch.cat([doc_k, minus])
        pos_q, pos_k = torch.cat([pos_q, tail]), torch.cat([pos_k, tail])
    return doc_q, doc_k, pos_q, pos_k


class FlexBackend(Backend):
    name = "flex"
    capabilities = Capabilities(
        devices=frozenset({"cuda", "cpu"}),
        dtypes=ALL_FLOAT_DTYPES,
        max_head_dim=256,
        head_dim_multiple=8,
        window=False,
        softcap=False,
        # ALiBi (Falcon-RW, packed): doc mask_mod + ALiBi score_mod, compiled; fwd+bwd checked against fp32 math on
        # CUDA (tests/gpu/test_long_context_gpu.py::test_flex_alibi_matches_fp32_math).
        alibi=True,
        alibi_backward=True,
        backward_devices=frozenset({"cuda"}),
        notes=("compiled on CUDA (static shapes, rows padded to a few lengths per octave); document mask + ALiBi; "
               "no CPU backward",),
    )

    def unavailable_reason(self) -> str | None:
        try:
            from torch.nn.attention import flex_attention  # noqa: F401
        except ImportError:
            return "this torch has no torch.nn.attention.flex_attention"
        return None

    def varlen(self, q_thd, k_thd, v_thd, cu_q, cu_k, max_q, max_k, opts: AttnOptions) -> torch.Tensor:
        from torch.nn.attention.flex_attention import flex_attention

        total_q, total_k = q_thd.shape[0], k_thd.shape[0]
        on_cuda = q_thd.device.type == "cuda"
        # static shapes when compiled: self-attention rows are padded to their bucket (cross lengths run as they are)
        pad = bucket_length(total_q) - total_q if (on_cuda and total_q == total_k) else 0
        block_mask, score_mod = _mask_and_mods(cu_q, cu_k, total_q, total_k, pad, opts, on_cuda)
        q, k, v = (x.transpose(0, 1).unsqueeze(0) for x in (q_thd, k_thd, v_thd))  # (1, H, T, D)
        if pad:
            q, k, v = (torch.nn.functional.pad(x, (0, 0, 0, pad)) for x in (q, k, v))
        attend = _compiled_flex() if on_cuda else flex_attention
        out = attend(q, k, v, score_mod=score_mod, block_mask=block_mask, scale=opts.scale,
                     enable_gqa=q.shape[1] != k.shape[1])
        return out.squeeze(0).transpose(0, 1)[:total_q]


_LAST_MASK: list = []  # [(key, cu_q, cu_k, result)]: the current batch layout's block mask, shared by every layer


def _mask_and_mods(cu_q, cu_k, total_q, total_k, pad, opts: AttnOptions, on_cuda: bool):
    """The block mask and score_mod for this layout. Every layer of a forward (and its checkpoint recompute) passes
    the same cu tensors (memoised by hf_accel.attention.varlen), so the mask is built once per batch."""
    from torch.nn.attention.flex_attention import create_block_mask

    slopes = opts.alibi_slopes
    key = (total_q, total_k, pad, opts.causal, opts.window, opts.softcap, on_cuda)
    if _LAST_MASK and _LAST_MASK[0][1] is cu_q and _LAST_MASK[0][2] is cu_k and _LAST_MASK[0][0] == key:
        block_mask, layout = _LAST_MASK[0][3]
    else:
        layout = packed_layout(cu_q, cu_k, total_q, total_k, pad)
        mask_mod, _ = flex_mods(*layout, opts, None)
        build = _compiled_block_mask() if on_cuda else create_block_mask
        block_mask = build(mask_mod, None, None, total_q + pad, total_k + pad, device=cu_q.device)
        _LAST_MASK[:] = [(key, cu_q, cu_k, (block_mask, layout))]
    if slopes is not None:
        slopes = slopes.to(device=cu_q.device, dtype=torch.float32)
    return block_mask, flex_mods(*layout, opts, slopes)[1]
