"""Attention sinks (gpt-oss's ``s_aux``): the reference kernel against gpt-oss's own eager formula, and the log-sum-exp
correction a flash kernel serves them by (``kernels.sinks``) against autograd through the reference.

A flash kernel's backward rebuilds the probabilities from the saved (out, lse) with the textbook rule
dS = P * (dP - rowsum(dout * out)); ``_flash_backward`` is that rule in plain torch, standing in for flash-attn-4's
kernel here (the kernel itself: tests/gpu/test_sinks_gpu.py)."""
from __future__ import annotations

import pytest
import torch

from hf_accel.attention.kernels import AttnOptions
from hf_accel.attention.kernels.reference import ReferenceBackend
from hf_accel.attention.kernels.sinks import sinks_grad, with_sinks

H, D = 4, 8
LENGTHS = [5, 1, 9]


def _inputs(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    total = sum(LENGTHS)
    q, k, v = (torch.randn(total, H, D, generator=g, dtype=torch.float64) for _ in range(3))
    sinks = torch.randn(H, generator=g, dtype=torch.float64) * 2
    cu = torch.tensor([0, *torch.tensor(LENGTHS).cumsum(0).tolist()], dtype=torch.int32)
    return q, k, v, sinks, cu


def _eager_gpt_oss(q, k, v, sinks, cu, scale):
    """gpt-oss's eager_attention_forward, one document at a time (its own formula: sinks concatenated to the
    logits, max subtracted, softmax, the sink column dropped)."""
    outs = []
    for a, b in zip(cu.tolist(), cu.tolist()[1:]):
        qd, kd, vd = (t[a:b].transpose(0, 1) for t in (q, k, v))
        logits = qd @ kd.transpose(-1, -2) * scale
        causal = torch.ones(b - a, b - a, dtype=torch.bool).tril()
        logits = logits.masked_fill(~causal, float("-inf"))
        combined = torch.cat([logits, sinks.view(-1, 1, 1).expand(-1, b - a, 1)], dim=-1)
        combined = combined - combined.max(dim=-1, keepdim=True).values
        probs = torch.softmax(combined, dim=-1)[..., :-1]
        outs.append((probs @ vd).transpose(0, 1))
    return torch.cat(outs)


def test_reference_kernel_computes_gpt_oss_sinks():
    q, k, v, sinks, cu = _inputs()
    opts = AttnOptions(scale=D ** -0.5, sinks=sinks)
    got = ReferenceBackend().varlen(q, k, v, cu, cu, max(LENGTHS), max(LENGTHS), opts)
    torch.testing.assert_close(got, _eager_gpt_oss(q, k, v, sinks, cu, D ** -0.5))
    without = ReferenceBackend().varlen(q, k, v, cu, cu, max(LENGTHS), max(LENGTHS), AttnOptions(scale=D ** -0.5))
    assert (got - without).abs().max() > 1e-2  # the sinks change the result (the test can fail)


def _plain_attention(q, k, v, cu, scale):
    """(out (T, H, D), lse (H, T)) without sinks: what a flash kernel returns."""
    outs, lses = [], []
    for a, b in zip(cu.tolist(), cu.tolist()[1:]):
        qd, kd, vd = (t[a:b].transpose(0, 1) for t in (q, k, v))
        logits = (qd @ kd.transpose(-1, -2) * scale).masked_fill(~torch.ones(b - a, b - a, dtype=torch.bool).tril(),
                                                                  float("-inf"))
        lse = torch.logsumexp(logits, dim=-1)
        outs.append((torch.exp(logits - lse[..., None]) @ vd).transpose(0, 1))
        lses.append(lse)
    return torch.cat(outs), torch.cat(lses, dim=1)


def _flash_backward(dout, q, k, v, out, lse, cu, scale):
    """The flash backward rule from saved (out, lse): dS = P * (dP - rowsum(dout * out)), P = exp(S - lse)."""
    dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    for a, b in zip(cu.tolist(), cu.tolist()[1:]):
        qd, kd, vd, od, dod = (t[a:b].transpose(0, 1) for t in (q, k, v, out, dout))
        logits = (qd @ kd.transpose(-1, -2) * scale).masked_fill(~torch.ones(b - a, b - a, dtype=torch.bool).tril(),
                                                                  float("-inf"))
        p = torch.exp(logits - lse[:, a:b, None])
        dv[a:b] = (p.transpose(-1, -2) @ dod).transpose(0, 1)
        dp = dod @ vd.transpose(-1, -2)
        ds = p * (dp - (dod * od).sum(-1, keepdim=True)) * scale
        dq[a:b] = (ds @ kd).transpose(0, 1)
        dk[a:b] = (ds.transpose(-1, -2) @ qd).transpose(0, 1)
    return dq, dk, dv


@pytest.mark.parametrize("seed", [0, 1])
def test_log_sum_exp_correction_gives_the_sink_attention_and_its_gradients(seed):
    q, k, v, sinks, cu = _inputs(seed)
    scale = D ** -0.5
    out, lse = _plain_attention(q, k, v, cu, scale)
    out2, lse2 = with_sinks(out, lse, sinks)
    # forward: the reference kernel's sinks
    leaves = [t.clone().requires_grad_(True) for t in (q, k, v, sinks)]
    ref = ReferenceBackend().varlen(*leaves[:3], cu, cu, max(LENGTHS), max(LENGTHS),
                                    AttnOptions(scale=scale, sinks=leaves[3]))
    torch.testing.assert_close(out2, ref.detach())
    # backward: the flash rule on the corrected (out', lse'), and the sinks' own gradient, against autograd
    dout = torch.randn(out.shape, generator=torch.Generator().manual_seed(seed + 7), dtype=out.dtype)
    ref.backward(dout)
    dq, dk, dv = _flash_backward(dout, q, k, v, out2, lse2, cu, scale)
    for got, leaf in zip((dq, dk, dv, sinks_grad(dout, out2, lse2, sinks)), leaves):
        torch.testing.assert_close(got, leaf.grad)
    # the uncorrected pair gives other gradients: the correction is what makes them right
    assert (_flash_backward(dout, q, k, v, out, lse, cu, scale)[0] - leaves[0].grad).abs().max() > 1e-3
