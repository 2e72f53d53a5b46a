"""fused_ce on the GPU: the "inline" method (inductor-compiled softmax/gradient step, fp32 weight-gradient
accumulation) in bf16 against the fp32 plain head, held to the error of the bf16 plain head; Liger as a second
yardstick where installed. Llama-3 vocabulary (128,256), a packed step's worth of tokens."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from hf_accel.data.collators import target_positions
from hf_accel.fused.cross_entropy import causal_lm_loss_from_hidden, liger_available, linear_cross_entropy

pytestmark = pytest.mark.gpu

N, H, V = 4099, 2048, 128256  # N not a multiple of the chunk: the last chunk is short


def _loss_and_grads(hidden0, head, labels, n_items, method=None, chunk=None):
    hidden = hidden0.detach().clone().requires_grad_(True)
    head.weight.grad = None
    if method is None:
        loss = F.cross_entropy(head(hidden).float(), labels, ignore_index=-100, reduction="sum") / n_items
    else:
        loss = linear_cross_entropy(hidden, head, labels, num_items_in_batch=n_items, chunk_size=chunk, method=method)
    loss.backward()
    return loss.detach().float(), hidden.grad.float(), head.weight.grad.float()


def _rel(a, b):
    return ((a - b).norm() / b.norm()).item()


@pytest.mark.parametrize("chunk", [None, 1024])
def test_inline_ce_within_bf16_error(chunk):
    torch.manual_seed(0)
    head32 = nn.Linear(H, V, bias=False, device="cuda")
    nn.init.normal_(head32.weight, std=0.02)
    head16 = nn.Linear(H, V, bias=False, device="cuda", dtype=torch.bfloat16)
    head16.weight.data.copy_(head32.weight.data)
    hidden = torch.randn(N, H, device="cuda")
    labels = torch.randint(0, V, (N,), device="cuda")
    labels[::5] = -100
    n_items = (labels != -100).sum()  # a device tensor, as the Trainer passes it: no host sync anywhere

    want = _loss_and_grads(hidden, head32, labels, n_items)
    base = _loss_and_grads(hidden.bfloat16(), head16, labels, n_items)
    got = _loss_and_grads(hidden.bfloat16(), head16, labels, n_items, method="inline", chunk=chunk)
    assert abs(got[0] - want[0]) <= 2 * abs(base[0] - want[0]) + 1e-3
    for g_got, g_base, g_want in zip(got[1:], base[1:], want[1:]):
        assert _rel(g_got, g_want) <= 2 * _rel(g_base, g_want) + 1e-3, (_rel(g_got, g_want), _rel(g_base, g_want))
    if liger_available():
        liger = _loss_and_grads(hidden.bfloat16(), head16, labels, n_items, method="liger")
        print("rel grad err vs fp32: inline", [_rel(g, w) for g, w in zip(got[1:], want[1:])],
              "liger", [_rel(g, w) for g, w in zip(liger[1:], want[1:])],
              "bf16 plain", [_rel(g, w) for g, w in zip(base[1:], want[1:])])


def test_inline_ce_no_grad_forward_matches():
    """Evaluation with labels under no_grad takes the loss-only pass and gives the same loss."""
    torch.manual_seed(1)
    head = nn.Linear(H, V, bias=False, device="cuda", dtype=torch.bfloat16)
    hidden = torch.randn(N, H, device="cuda", dtype=torch.bfloat16)
    labels = torch.randint(0, V, (N,), device="cuda")
    with torch.no_grad():
        evaluated = linear_cross_entropy(hidden, head, labels, method="inline")
    trained = linear_cross_entropy(hidden.requires_grad_(True), head, labels, method="inline")
    torch.testing.assert_close(evaluated, trained.detach(), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("vocab", [1000, 50304, 128256])
def test_triton_ce_grad_matches_torch(vocab):
    """hf_accel's Triton row kernel vs the pure-torch `ce_grad_` on the same bf16 logits (both fp32 math): loss and
    the in-place gradient rows, ignored rows zero; a label outside the vocabulary gives NaN, not a silent value."""
    from hf_accel.fused.ce_kernel import ce_grad_triton_
    from hf_accel.fused.ce_functions import ce_grad_

    torch.manual_seed(2)
    logits = (torch.randn(333, vocab, device="cuda") * 4).bfloat16()
    labels = torch.randint(0, vocab, (333,), device="cuda")
    labels[::7] = -100
    mine, ref = logits.clone(), logits.clone()
    loss = ce_grad_triton_(mine, labels)
    want = ce_grad_(ref, labels)
    torch.testing.assert_close(loss, want, rtol=1e-5, atol=1e-3)
    torch.testing.assert_close(mine.float(), ref.float(), rtol=0, atol=2 ** -8)  # one bf16 rounding apart at most
    assert mine[::7].abs().sum() == 0
    bad = labels.clone()
    bad[3] = vocab
    assert torch.isnan(ce_grad_triton_(logits.clone(), bad))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_triton_scale_matches_torch(dtype):
    """The backward's one-pass scale (fp32 product, one rounding) equals `_scale_`'s blockwise fp32 copies bit for
    bit, over a length that is no multiple of the kernel's block; the scale stays on the device."""
    from hf_accel.fused.ce_functions import _scale_
    from hf_accel.fused.ce_kernel import scale_triton_

    torch.manual_seed(4)
    grad = torch.randn(3 * 4096 + 77, device="cuda").to(dtype)
    scale = torch.tensor(1 / 11000, device="cuda")  # rounded to bf16 first it would differ by 0.2%
    mine = scale_triton_(grad.clone(), scale)
    want = _scale_(grad.clone(), scale, block=1000)
    assert torch.equal(mine, want)
    assert not torch.equal(grad * scale.to(dtype), want)  # a low-precision product differs: the test can tell


def test_inline_fp32_head_under_bf16_autocast():
    """fp32 weights under bf16 autocast (Trainer bf16=True on an fp32 model): the head computes in bf16 like the
    unfused F.linear, the weight gradient accumulates in fp32 through addmm(out_dtype=float32); gradients come back
    fp32, within 2x the unfused autocast head's error against full fp32."""
    torch.manual_seed(3)
    head = nn.Linear(H, V, bias=False, device="cuda")
    nn.init.normal_(head.weight, std=0.02)
    hidden = torch.randn(N, H, device="cuda")
    labels = torch.randint(0, V, (N,), device="cuda")
    n_items = (labels != -100).sum()
    want = _loss_and_grads(hidden, head, labels, n_items)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        base = _loss_and_grads(hidden, head, labels, n_items)
        got = _loss_and_grads(hidden, head, labels, n_items, method="inline")
    assert head.weight.grad.dtype == torch.float32
    assert abs(got[0] - want[0]) <= 2 * abs(base[0] - want[0]) + 1e-3
    for g_got, g_base, g_want in zip(got[1:], base[1:], want[1:]):
        assert _rel(g_got, g_want) <= 2 * _rel(g_base, g_want) + 1e-3


class _Head(nn.Module):
    """What causal_lm_loss_from_hidden needs of a model: its output embeddings."""

    def __init__(self, head: nn.Module):
        super().__init__()
        self.lm_head = head

    def get_output_embeddings(self):
        return self.lm_head


def _prompt_masked_labels(rows: int, seq: int, gen: torch.Generator) -> torch.Tensor:
    """Packed rows of documents of 64-700 tokens, each one's first 40-60% masked (a prompt) and its first label
    -100, as DataCollatorForPacking builds them."""
    labels = torch.randint(0, V, (rows, seq), generator=gen)
    for row in range(rows):
        start = 0
        while start < seq:
            n = int(torch.randint(64, 700, (1,), generator=gen))
            prompt = int(n * (0.4 + 0.2 * float(torch.rand(1, generator=gen))))
            labels[row, start:start + prompt] = -100
            start += n
    return labels


def _causal_loss_and_grads(model, hidden0, labels, n_items, rows=None):
    hidden = hidden0.detach().clone().requires_grad_(True)
    model.lm_head.weight.grad = None
    if rows is None and hidden0.dtype == torch.float32:  # the fp32 reference: full logits, stock shift
        shifted = F.pad(labels[:, 1:], (0, 1), value=-100).flatten()
        logits = model.lm_head(hidden.flatten(0, 1)).float()
        loss = F.cross_entropy(logits, shifted, ignore_index=-100, reduction="sum") / n_items
    else:
        loss = causal_lm_loss_from_hidden(model, hidden, labels, n_items, target_rows=rows, method="inline")
    loss.backward()
    return loss.detach().float(), hidden.grad.float(), model.lm_head.weight.grad.float()


def test_target_rows_within_bf16_error_of_every_row():
    """Issue 39a on CUDA: the fused loss on the collator's target rows only (Triton row kernel, bf16) against the
    fp32 full-logits loss over every row, held to the error of the same bf16 fused loss over every row; the hidden
    states' gradient is exactly zero on positions without a target."""
    gen = torch.Generator().manual_seed(4)
    torch.manual_seed(4)
    head32 = nn.Linear(H, V, bias=False, device="cuda")
    nn.init.normal_(head32.weight, std=0.02)
    head16 = nn.Linear(H, V, bias=False, device="cuda", dtype=torch.bfloat16)
    head16.weight.data.copy_(head32.weight.data)
    labels = _prompt_masked_labels(2, 4099, gen)
    rows = target_positions(labels).cuda()
    labels = labels.cuda()
    assert rows.numel() < 0.65 * labels.numel()
    n_items = (labels[:, 1:] != -100).sum()
    hidden = torch.randn(2, 4099, H, device="cuda")
    want = _causal_loss_and_grads(_Head(head32), hidden, labels, n_items)
    every = _causal_loss_and_grads(_Head(head16), hidden.bfloat16(), labels, n_items)
    got = _causal_loss_and_grads(_Head(head16), hidden.bfloat16(), labels, n_items, rows)
    assert abs(got[0] - want[0]) <= 2 * abs(every[0] - want[0]) + 1e-3
    for g_got, g_every, g_want in zip(got[1:], every[1:], want[1:]):
        assert _rel(g_got, g_want) <= 2 * _rel(g_every, g_want) + 1e-3, (_rel(g_got, g_want), _rel(g_every, g_want))
    masked = torch.ones(labels.numel(), dtype=torch.bool, device="cuda")
    masked[rows] = False
    assert got[1].flatten(0, 1)[masked].abs().max() == 0


def test_target_rows_none_at_all():
    """A micro-batch of prompts only: no row reaches the head (the Triton kernel gets an empty chunk), the loss is 0
    and the weight gradient exactly zero."""
    head = nn.Linear(H, V, bias=False, device="cuda", dtype=torch.bfloat16)
    labels = torch.full((1, 512), -100, device="cuda")
    rows = torch.empty(0, dtype=torch.long, device="cuda")
    loss, grad_hidden, grad_weight = _causal_loss_and_grads(
        _Head(head), torch.randn(1, 512, H, device="cuda", dtype=torch.bfloat16), labels, torch.tensor(9, device="cuda"),
        rows)
    assert loss.item() == 0 and grad_weight.abs().max() == 0 and grad_hidden.abs().max() == 0


@pytest.mark.parametrize("method", ["inline", "recompute", "liger"])
def test_final_logit_softcap_within_bf16_error(method):
    """Gemma 2's final soft-cap inside the fused loss (the Triton row kernel between the cap and its derivative):
    against the fp32 head capped as transformers caps, held to the error of the bf16 capped head. Scores well past
    the cap (weights std 0.2), so the cap shapes the loss."""
    if method == "liger" and not liger_available():
        pytest.skip("liger-kernel not installed")
    torch.manual_seed(2)
    cap = 15.0  # random scores reach ~54 at std 0.2: at least 3x the cap, so the cap shapes the loss
    head32 = nn.Linear(H, V, bias=False, device="cuda")
    nn.init.normal_(head32.weight, std=0.2)
    head16 = nn.Linear(H, V, bias=False, device="cuda", dtype=torch.bfloat16)
    head16.weight.data.copy_(head32.weight.data)
    hidden = torch.randn(N, H, device="cuda")
    labels = torch.randint(0, V, (N,), device="cuda")
    n_items = (labels != -100).sum()

    def run(h0, head, fused: bool):
        h = h0.detach().clone().requires_grad_(True)
        head.weight.grad = None
        if fused:
            loss = linear_cross_entropy(h, head, labels, num_items_in_batch=n_items, method=method, softcap=cap)
        else:
            logits = torch.tanh(head(h) / cap) * cap
            loss = F.cross_entropy(logits.float(), labels, reduction="sum") / n_items
        loss.backward()
        return loss.detach().float(), h.grad.float(), head.weight.grad.float()

    want, base, got = run(hidden, head32, False), run(hidden.bfloat16(), head16, False), \
        run(hidden.bfloat16(), head16, True)
    assert head32(hidden[:64]).abs().max() > 3 * cap
    assert abs(got[0] - want[0]) <= 2 * abs(base[0] - want[0]) + 1e-3
    for g_got, g_base, g_want in zip(got[1:], base[1:], want[1:]):
        assert _rel(g_got, g_want) <= 2 * _rel(g_base, g_want) + 1e-3, (_rel(g_got, g_want), _rel(g_base, g_want))
