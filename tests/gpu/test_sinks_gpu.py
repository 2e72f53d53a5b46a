"""Attention sinks (gpt-oss) on flash-attn-4 through the log-sum-exp correction (hf_accel.attention.kernels.sinks),
against fp32 math, with flash-attn's rule: out, dq, dk, dv and the sinks' gradient within twice the error bf16 math
makes, plus a small floor. The math of the correction is checked exactly on CPU (tests/test_sinks.py)."""
from __future__ import annotations

import pytest
import torch

from hf_accel.attention.kernels import AttnOptions, BACKENDS

pytestmark = pytest.mark.gpu

LENGTHS = (700, 64, 1500, 1, 300, 2048)
HQ, HKV, D = 16, 4, 64
FLOOR = 1e-3


def _run(backend: str, q, k, v, sinks, cu, dout, dtype, window=None):
    leaves = [t.detach().to(dtype).clone().requires_grad_(True) for t in (q, k, v, sinks)]
    opts = AttnOptions(scale=D ** -0.5, window=(window, None), sinks=leaves[3])
    out = BACKENDS[backend].varlen(*leaves[:3], cu, cu, max(LENGTHS), max(LENGTHS), opts)
    out.backward(dout.to(out.dtype))
    return [out.float(), *(t.grad.float() for t in leaves)]


@pytest.mark.parametrize("window", [None, 127])
def test_fa4_sinks_within_bf16_error_of_fp32_math(window):
    pytest.importorskip("flash_attn.cute")
    g = torch.Generator(device="cuda").manual_seed(0)
    total = sum(LENGTHS)
    q = torch.randn(total, HQ, D, device="cuda", generator=g)
    k, v = (torch.randn(total, HKV, D, device="cuda", generator=g) for _ in range(2))
    sinks = torch.randn(HQ, device="cuda", generator=g)
    dout = torch.randn(total, HQ, D, device="cuda", generator=g)
    cu = torch.tensor([0, *torch.tensor(LENGTHS).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
    ref = _run("reference", q, k, v, sinks, cu, dout, torch.float32, window)
    low = _run("reference", q, k, v, sinks, cu, dout, torch.bfloat16, window)
    got = _run("fa4", q, k, v, sinks, cu, dout, torch.bfloat16, window)
    for name, x, lo, r in zip(("out", "dq", "dk", "dv", "dsinks"), got, low, ref):
        scale = r.abs().max()
        err, base = ((x - r).abs().max() / scale).item(), ((lo - r).abs().max() / scale).item()
        assert err <= 2 * base + FLOOR, f"{name}: err {err:.2e} vs bf16 math {base:.2e}"
