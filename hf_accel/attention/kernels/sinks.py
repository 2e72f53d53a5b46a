"""Attention sinks (gpt-oss's ``s_aux``) on a flash kernel that returns its log-sum-exp, exactly.

A sink is one more logit per head, ``s_h``, in every row's softmax denominator, with no value. A kernel that runs
attention without it and returns (out, lse) gives the sink's result by a correction: the row's log-sum-exp with the
sink is ``lse' = logaddexp(lse, s)``, and ``out' = out * exp(lse - lse')``. Flash kernels' backward takes (out, lse) as
saved: handed (out', lse') it computes the probabilities exp(S - lse'), which are the sink softmax's, and the row term
D = rowsum(dout * out') of the sink output, so dq, dk and dv are the sink attention's. The sink's own gradient is
``d s_h = -sum over rows of exp(s_h - lse') * D`` (its probability times the row term, negated).
"""
from __future__ import annotations

import torch


def with_sinks(out_thd: torch.Tensor, lse_ht: torch.Tensor, sinks_h: torch.Tensor
               ) -> tuple[torch.Tensor, torch.Tensor]:
    """(out', lse'): out_thd (T, H, D), lse_ht (H, T) fp32 of attention without sinks -> with sinks (H,)."""
    lse2 = torch.logaddexp(lse_ht, sinks_h.to(lse_ht.dtype)[:, None])
    scale = torch.exp(lse_ht - lse2).transpose(0, 1).unsqueeze(-1)  # (T, H, 1)
    return (out_thd.to(_math(out_thd)) * scale).to(out_thd.dtype), lse2


def _math(t: torch.Tensor) -> torch.dtype:
    return torch.promote_types(t.dtype, torch.float32)  # at least fp32


def sinks_grad(dout_thd: torch.Tensor, out2_thd: torch.Tensor, lse2_ht: torch.Tensor, sinks_h: torch.Tensor
               ) -> torch.Tensor:
    """d loss / d sinks (H,), from the output's gradient and the corrected (out', lse')."""
    row = (dout_thd.to(_math(out2_thd)) * out2_thd.to(_math(out2_thd))).sum(-1)  # (T, H)
    return -(torch.exp(sinks_h.to(lse2_ht.dtype)[:, None] - lse2_ht) * row.transpose(0, 1)).sum(-1).to(sinks_h.dtype)
