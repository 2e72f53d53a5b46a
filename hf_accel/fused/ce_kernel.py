"""The custom GPU kernels of the inline fused cross-entropy.

`ce_grad_triton_`: per row of a chunk's logits, the loss and, in place, d(sum CE)/d logits = softmax - onehot(label)
(a zero row where the label is ignored). One Triton program per row: an online max / sum-exp pass, then a pass that
overwrites the row with its gradient; math in fp32, the row stored back in the logits' dtype.

`scale_triton_`: the backward's grad *= grad_output in one read and one write of a low-precision gradient, the product
in fp32 with the scale read on the device (no host sync), where torch's form takes an fp32 copy, a multiply and a
copy back per block (three passes and three launches a block; docs/guide/speedups-and-backends.md, "Measured",
has what they cost a step).

Imported only where Triton and CUDA are (the pure-torch `hf_accel.fused.ce_functions.ce_grad_` and `_scale_` are the
same computations elsewhere, and the references the GPU tests hold these to).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

MAX_BLOCK = 32768


@triton.jit
def _ce_grad_rows(
    logits_ptr, row_stride, labels_ptr, loss_ptr, ignore_index, n_cols: tl.constexpr, BLOCK: tl.constexpr
):
    row = tl.program_id(0).to(tl.int64)
    row_ptr = logits_ptr + row * row_stride
    label = tl.load(labels_ptr + row)
    valid = label != ignore_index
    target = tl.where(valid, label, 0)

    run_max = tl.full([], float("-inf"), tl.float32)
    run_sum = tl.zeros([], dtype=tl.float32)
    for start in range(0, n_cols, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        x = tl.load(row_ptr + cols, mask=cols < n_cols, other=float("-inf")).to(tl.float32)
        new_max = tl.maximum(run_max, tl.max(x, axis=0))
        run_sum = run_sum * tl.exp(run_max - new_max) + tl.sum(tl.exp(x - new_max), axis=0)
        run_max = new_max
    lse = run_max + tl.log(run_sum)
    # a label outside [0, V) makes the row's loss NaN (visible in the loss) instead of reading out of bounds
    in_range = (target >= 0) & (target < n_cols)
    picked = tl.load(row_ptr + target, mask=in_range, other=float("nan")).to(tl.float32)
    tl.store(loss_ptr + row, tl.where(valid, lse - picked, 0.0))

    keep = valid.to(tl.float32)
    for start in range(0, n_cols, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        mask = cols < n_cols
        x = tl.load(row_ptr + cols, mask=mask, other=0.0).to(tl.float32)
        grad = tl.exp(x - lse) - (cols == target).to(tl.float32)
        tl.store(row_ptr + cols, (grad * keep).to(logits_ptr.dtype.element_ty), mask=mask)


def ce_grad_triton_(logits_cv: torch.Tensor, labels_c: torch.Tensor, ignore_index: int = -100) -> torch.Tensor:
    """Summed CE of the rows of `logits_cv` (C, V), CUDA, last dim contiguous; the rows become their gradients."""
    rows, cols = logits_cv.shape
    if logits_cv.stride(1) != 1:
        raise ValueError("ce_grad_triton_ needs logits whose last dimension is contiguous")
    loss_c = torch.empty(rows, dtype=torch.float32, device=logits_cv.device)
    if rows == 0:  # an empty chunk (no target rows): nothing to launch
        return loss_c.sum()
    block = min(MAX_BLOCK, triton.next_power_of_2(cols))
    _ce_grad_rows[(rows,)](
        logits_cv, logits_cv.stride(0), labels_c.contiguous(), loss_c, ignore_index, n_cols=cols,
        BLOCK=block, num_warps=32 if block >= 8192 else 8,
    )
    return loss_c.sum()


@triton.jit
def _scale_inplace(x_ptr, scale_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    scale = tl.load(scale_ptr).to(tl.float32)
    x = tl.load(x_ptr + offs, mask=mask).to(tl.float32)
    tl.store(x_ptr + offs, (x * scale).to(x_ptr.dtype.element_ty, fp_downcast_rounding="rtne"), mask=mask)


def scales_in_one_pass(grad: torch.Tensor) -> bool:
    """Whether `scale_triton_` takes this gradient: contiguous, bf16 or fp16."""
    return grad.is_contiguous() and grad.dtype in (torch.bfloat16, torch.float16)


def scale_triton_(grad: torch.Tensor, scale: torch.Tensor, block: int = 4096) -> torch.Tensor:
    """grad *= scale in place (CUDA, contiguous, bf16 or fp16), the product in fp32 and rounded to nearest even
    once to grad's dtype, as `_scale_` rounds; `scale` a one-element tensor on grad's device."""
    if not scales_in_one_pass(grad):
        raise ValueError(f"scale_triton_ needs a contiguous bf16 or fp16 gradient, got {grad.dtype}")
    n = grad.numel()
    if n:
        _scale_inplace[(triton.cdiv(n, block),)](grad, scale.reshape(1), n, BLOCK=block, num_warps=8)
    return grad
