"""hf_accel.fused.ce_stats: the fused loss's per-row statistics and loss forms (what hf_accel.SFTTrainer serves TRL's
loss with), the pure-torch kernel against autograd on plain torch math, the Triton kernel (where Triton is installed)
against the torch one under Triton's CPU interpreter (tests/gpu/test_trl_loss_gpu.py runs it on CUDA)."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from hf_accel.fused.ce_stats import LossForm, ce_grad_stats_, linear_cross_entropy_stats


@pytest.mark.parametrize("form", [LossForm(), LossForm(dft=True), LossForm(label_smoothing=0.1),
                                  LossForm(dft=True, label_smoothing=0.2)], ids=["nll", "dft", "smooth", "both"])
def test_ce_grad_stats_matches_autograd(form):
    torch.manual_seed(0)
    logits = torch.randn(9, 40, dtype=torch.float64) * 3
    logits[3, 7] = logits[3].max() + 1
    logits[3, 20] = logits[3, 7]  # a tie: the first maximum is the prediction (torch.argmax, TRL's kernel)
    labels = torch.randint(0, 40, (9,))
    labels[2], labels[3] = -100, 7
    work = logits.clone()
    loss, entropy, top1 = ce_grad_stats_(work, labels, form)
    x = logits.clone().requires_grad_(True)
    logp = x.log_softmax(-1)
    valid = labels != -100
    ce = -logp.gather(1, labels.clamp(min=0)[:, None]).squeeze(1)
    row = (1 - form.label_smoothing) * ce + form.label_smoothing * -logp.mean(-1)
    if form.dft:
        row = row * torch.exp(-ce).detach()
    ref = (row * valid).sum()
    ref.backward()
    torch.testing.assert_close(loss, ref.detach())
    torch.testing.assert_close(work, x.grad)
    p = logp.exp()
    torch.testing.assert_close(entropy, (-(p * logp).sum(-1) * valid).sum().detach())
    assert int(top1) == int(((logits.argmax(-1) == labels) & valid).sum()) >= 1


def test_triton_stats_kernel_matches_torch_in_the_interpreter():
    pytest.importorskip("triton")
    code = r"""
import torch
import hf_accel.fused.ce_kernel as K
import hf_accel.fused.ce_stats_kernel as SK
from hf_accel.fused.ce_stats import LossForm, ce_grad_stats_
torch.manual_seed(0)
for vocab, dtype, block in [(50, torch.float32, 64), (300, torch.float32, 128), (1000, torch.bfloat16, 256)]:
    SK.MAX_BLOCK = block  # several blocks per row, a masked tail
    logits = (torch.randn(7, vocab) * 3).to(dtype)
    logits[2, 5] = logits[2].max() + 1
    logits[2, vocab - 3] = logits[2, 5]
    labels = torch.randint(0, vocab, (7,))
    labels[1], labels[2] = -100, 5
    for form in (LossForm(), LossForm(dft=True), LossForm(label_smoothing=0.1),
                 LossForm(dft=True, label_smoothing=0.2)):
        a, b = logits.clone(), logits.clone()
        for x, y in zip(ce_grad_stats_(a, labels, form), SK.ce_grad_stats_triton_(b, labels, form)):
            torch.testing.assert_close(x.float(), y.float(), rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(a.float(), b.float(), rtol=0, atol=1e-6 if dtype == torch.float32 else 1e-2)
print("ok")
"""
    env = dict(os.environ, TRITON_INTERPRET="1")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0 and "ok" in out.stdout, out.stderr[-3000:]


def test_linear_cross_entropy_stats_matches_the_plain_head():
    """Through a head: loss, hidden / weight / bias gradients and the statistics against the unfused head in fp32,
    chunked (three chunks, the last one short)."""
    torch.manual_seed(0)
    head = torch.nn.Linear(16, 50, bias=True)
    hidden = torch.randn(11, 16, requires_grad=True)
    labels = torch.randint(0, 50, (11,))
    labels[[1, 4]] = -100
    form = LossForm(dft=True)
    summed, stats = linear_cross_entropy_stats(hidden, head, labels, form=form, chunk_size=4)
    (summed / 9).backward()
    mine = [hidden.grad.clone(), head.weight.grad.clone(), head.bias.grad.clone()]
    hidden.grad = head.weight.grad = head.bias.grad = None
    logp = head(hidden).log_softmax(-1)
    valid = labels != -100
    lp = logp.gather(1, labels.clamp(min=0)[:, None]).squeeze(1)
    ref = (-(lp * lp.exp().detach()) * valid).sum()
    (ref / 9).backward()
    torch.testing.assert_close(summed, ref.detach())
    for got, want in zip(mine, [hidden.grad, head.weight.grad, head.bias.grad]):
        torch.testing.assert_close(got, want)
    p = logp.exp()
    torch.testing.assert_close(stats[0], (-(p * logp).sum(-1) * valid).sum().detach())
    assert stats[1] == ((logp.argmax(-1) == labels) & valid).sum()
