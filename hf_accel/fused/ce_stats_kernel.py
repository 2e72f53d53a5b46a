"""The Triton row kernel of `ce_stats` (CUDA): `ce_kernel`'s two passes over each row of a chunk's logits, with TRL's
statistics and loss forms added.

Pass one keeps, online, the row's max, sum of exp, sum of ``exp * z`` (the entropy), sum of ``z`` (label smoothing's
mean logit) and the first index of the max (top-1); pass two overwrites the row with its gradient
(``softmax - (1 - eps) * onehot - eps / V``, times the label probability under DFT; zero where the label is ignored).
Per row it stores the loss, the entropy and the top-1 flag; torch sums them. Math in fp32, the gradient stored in the
logits' dtype. Imported only where Triton and CUDA are; `ce_stats.ce_grad_stats_` is the same in torch (and the
reference tests/gpu/test_trl_loss_gpu.py holds this to; on a CPU Triton's interpreter runs it, TRITON_INTERPRET=1).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .ce_kernel import MAX_BLOCK


@triton.jit
def _ce_grad_stats_rows(
    logits_ptr, row_stride, labels_ptr, loss_ptr, entropy_ptr, top1_ptr, ignore_index, eps,
    n_cols: tl.constexpr, DFT: tl.constexpr, SMOOTH: tl.constexpr, BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    row_ptr = logits_ptr + row * row_stride
    label = tl.load(labels_ptr + row)
    valid = label != ignore_index
    target = tl.where(valid, label, 0)

    run_max = tl.full([], float("-inf"), tl.float32)
    run_sum = tl.zeros([], dtype=tl.float32)
    run_xsum = tl.zeros([], dtype=tl.float32)  # sum of exp(z - max) * z
    z_sum = tl.zeros([], dtype=tl.float32)
    arg = tl.zeros([], dtype=tl.int64)
    for start in range(0, n_cols, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        mask = cols < n_cols
        x = tl.load(row_ptr + cols, mask=mask, other=float("-inf")).to(tl.float32)
        x_or_0 = tl.where(mask, x, 0.0)
        block_max = tl.max(x, axis=0)
        block_arg = tl.argmax(x, axis=0, tie_break_left=True).to(tl.int64) + start
        arg = tl.where(block_max > run_max, block_arg, arg)  # strictly greater: an earlier maximum stays first
        new_max = tl.maximum(run_max, block_max)
        rescale = tl.exp(run_max - new_max)
        e = tl.where(mask, tl.exp(x - new_max), 0.0)
        run_sum = run_sum * rescale + tl.sum(e, axis=0)
        run_xsum = run_xsum * rescale + tl.sum(e * x_or_0, axis=0)
        z_sum += tl.sum(x_or_0, axis=0)
        run_max = new_max
    lse = run_max + tl.log(run_sum)
    in_range = (target >= 0) & (target < n_cols)
    picked = tl.load(row_ptr + target, mask=in_range, other=float("nan")).to(tl.float32)
    ce = lse - picked
    loss = ce
    if SMOOTH:
        loss = (1 - eps) * ce + eps * (lse - z_sum / n_cols)
    weight = valid.to(tl.float32)
    if DFT:
        weight = weight * tl.exp(-ce)
    tl.store(loss_ptr + row, tl.where(valid, loss * weight, 0.0))
    tl.store(entropy_ptr + row, tl.where(valid, lse - run_xsum / run_sum, 0.0))
    tl.store(top1_ptr + row, (valid & (arg == target)).to(tl.float32))

    for start in range(0, n_cols, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        mask = cols < n_cols
        x = tl.load(row_ptr + cols, mask=mask, other=0.0).to(tl.float32)
        onehot = (cols == target).to(tl.float32)
        if SMOOTH:
            grad = tl.exp(x - lse) - (1 - eps) * onehot - eps / n_cols
        else:
            grad = tl.exp(x - lse) - onehot
        tl.store(row_ptr + cols, (grad * weight).to(logits_ptr.dtype.element_ty), mask=mask)


def ce_grad_stats_triton_(logits_cv: torch.Tensor, labels_c: torch.Tensor, form, ignore_index: int = -100
                          ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`ce_stats.ce_grad_stats_` on CUDA: (summed loss in ``form``, summed entropy, top-1 count) over the target rows
    of ``logits_cv`` (C, V), last dim contiguous; the rows become their gradients."""
    rows, cols = logits_cv.shape
    if logits_cv.stride(1) != 1:
        raise ValueError("ce_grad_stats_triton_ needs logits whose last dimension is contiguous")
    per_row = torch.empty(3, rows, dtype=torch.float32, device=logits_cv.device)  # loss, entropy, top-1
    if rows:
        block = min(MAX_BLOCK, triton.next_power_of_2(cols))
        _ce_grad_stats_rows[(rows,)](
            logits_cv, logits_cv.stride(0), labels_c.contiguous(), per_row[0], per_row[1], per_row[2],
            ignore_index, float(form.label_smoothing), n_cols=cols, DFT=bool(form.dft),
            SMOOTH=bool(form.label_smoothing), BLOCK=block, num_warps=32 if block >= 8192 else 8,
        )
    loss, entropy, top1 = per_row.sum(1)
    return loss, entropy, top1
