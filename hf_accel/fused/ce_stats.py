"""The inline fused loss with what TRL's SFTTrainer weighs and logs (``hf_accel.SFTTrainer`` serves TRL's loss with it).

Per chunk of rows, besides the loss and its gradients (`ce_functions._grads_in_forward`: three matmuls per chunk, no
recomputation), the chunk's logits give, while they exist:

- the entropy of each row's next-token distribution, ``lse - sum_v p_v z_v`` (TRL's ``entropy`` metric),
- whether the row's label is the first maximum of its logits (TRL's ``mean_token_accuracy``: ``torch.argmax``'s
  tie rule, the same as TRL's kernel),

summed over the target rows into two numbers on the device (no host read), and TRL's loss forms (`LossForm`):

- ``dft``: each row's loss weighted by its own label probability, not differentiated (TRL's ``loss_type="dft"``:
  ``-log p * p.detach()``), so each row's gradient is ``p_label * (softmax - onehot)``;
- ``label_smoothing`` eps: ``(1 - eps) * CE + eps * (lse - mean_v z_v)`` per row (transformers' ``LabelSmoother``,
  whose smoothed term is ``sum_v -log p_v / V``), gradient ``softmax - (1 - eps) * onehot - eps / V``.

On CUDA the per-row work is one Triton program per row (`ce_stats_kernel`), elsewhere `ce_grad_stats_` in torch.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from ..memory.chunks import auto_chunk_size
from .ce_functions import IGNORE_INDEX, _GradInForwardLinearCE, _grads_in_forward, _triton_kernels_on
from .cross_entropy import _is_plain_linear, _one_head_call


@dataclass(frozen=True)
class LossForm:
    """How each target row's loss is formed: ``dft`` (weighted by its detached label probability) and / or
    ``label_smoothing`` (eps in [0, 1))."""

    dft: bool = False
    label_smoothing: float = 0.0


def ce_grad_stats_(logits_cv: torch.Tensor, labels_c: torch.Tensor, form: LossForm
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One chunk in torch: returns (summed loss in ``form``, summed entropy, top-1 count) over the rows whose label
    is not -100, and overwrites ``logits_cv`` (C, V) with d(summed loss)/d logits (zero rows where ignored). fp32
    math whatever the logits' dtype; the reference the Triton kernel is held to."""
    x = logits_cv.to(torch.promote_types(logits_cv.dtype, torch.float32))
    valid_c1 = (labels_c != IGNORE_INDEX).unsqueeze(1)
    target_c1 = torch.where(valid_c1, labels_c.unsqueeze(1), 0)
    lse_c1 = torch.logsumexp(x, dim=-1, keepdim=True)
    ce_c1 = lse_c1 - x.gather(1, target_c1)
    p = torch.exp(x - lse_c1)
    entropy_c = lse_c1.squeeze(1) - (p * x).sum(-1)
    top1_c = x.argmax(-1) == target_c1.squeeze(1)
    onehot = torch.arange(x.shape[1], device=x.device).unsqueeze(0) == target_c1
    eps = form.label_smoothing
    if eps:
        loss_c1 = (1 - eps) * ce_c1 + eps * (lse_c1 - x.mean(-1, keepdim=True))
        grad = p - (1 - eps) * onehot.to(x.dtype) - eps / x.shape[1]
    else:
        loss_c1, grad = ce_c1, p - onehot.to(x.dtype)
    if form.dft:
        weight_c1 = torch.exp(-ce_c1)  # the label's probability, a constant of the loss
        loss_c1, grad = loss_c1 * weight_c1, grad * weight_c1
    logits_cv.copy_(grad * valid_c1)
    valid_c = valid_c1.squeeze(1)
    return (loss_c1.squeeze(1) * valid_c).sum(), (entropy_c * valid_c).sum(), (top1_c & valid_c).sum()


def _stats_kernel(device: torch.device) -> Callable:
    if _triton_kernels_on(device):
        from .ce_stats_kernel import ce_grad_stats_triton_

        return ce_grad_stats_triton_
    return ce_grad_stats_


class _GradInForwardLinearCEStats(torch.autograd.Function):
    """`_GradInForwardLinearCE` in a `LossForm`, also returning ``stats`` (2,) fp32: the summed entropy and the top-1
    count of the target rows (not differentiable)."""

    @staticmethod
    def forward(ctx, hidden_nh, weight_vh, bias_v, labels_n, chunk_size: int, softcap: float | None,
                form: LossForm):
        stats = torch.zeros(2, dtype=torch.float32, device=hidden_nh.device)
        kernel = _stats_kernel(hidden_nh.device)

        def ce_grad(logits_cv: torch.Tensor, labels_c: torch.Tensor) -> torch.Tensor:
            loss, entropy, top1 = kernel(logits_cv, labels_c, form)
            stats[0] += entropy
            stats[1] += top1
            return loss

        total = _grads_in_forward(ctx, hidden_nh, weight_vh, bias_v, labels_n, chunk_size, softcap, ce_grad)
        ctx.mark_non_differentiable(stats)
        return total, stats

    @staticmethod
    def backward(ctx, grad_total, _grad_stats):
        return (*_GradInForwardLinearCE.backward(ctx, grad_total), None)


def linear_cross_entropy_stats(hidden_nh: torch.Tensor, lm_head: nn.Module, labels_n: torch.Tensor, *,
                               form: LossForm = LossForm(), chunk_size: int | None = None,
                               softcap: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Summed loss of ``lm_head(hidden_nh)`` against ``labels_n`` (-100 ignored) in ``form``, its gradients
    computed in the forward, and ``stats`` (2,): the summed entropy and top-1 count of the target rows.

    hidden_nh (N, H), labels_n (N,), already shifted; ``lm_head`` a plain ``nn.Linear`` (FSDP2's wrapped class too),
    called once through its ``__call__`` (`cross_entropy._one_head_call`); for training calls (grad enabled).
    ``softcap``: the final logit soft-cap, applied before everything else."""
    if not _is_plain_linear(lm_head):
        raise TypeError(f"linear_cross_entropy_stats needs a plain nn.Linear head, got {type(lm_head).__name__}")
    if not 0.0 <= form.label_smoothing < 1.0:
        raise ValueError(f"label_smoothing must be in [0, 1), got {form.label_smoothing}")
    if chunk_size is None:
        chunk_size = auto_chunk_size(hidden_nh.shape[0], lm_head.out_features, hidden_nh.element_size())

    def summed(h_nh: torch.Tensor, y_n: torch.Tensor, _head_forward) -> tuple[torch.Tensor, torch.Tensor]:
        return _GradInForwardLinearCEStats.apply(h_nh, lm_head.weight, lm_head.bias, y_n, chunk_size, softcap, form)

    return _one_head_call(lm_head, summed, hidden_nh, labels_n)
