"""The autograd functions behind `hf_accel.fused.cross_entropy` (which picks among them per call): the chunked
linear cross-entropy that recomputes logits in backward (`_ChunkedLinearCE`), the one that computes each chunk's
gradients in the forward (`_GradInForwardLinearCE`), and the chunked loss through any head module under activation
checkpointing (`_module_chunked_sum`), with the per-chunk helpers they share.

Each takes an optional ``softcap``: the logits become ``softcap * tanh(logits / softcap)`` before the loss (Gemma 2's
final logit soft-capping, applied by its ForCausalLM after the head), and the gradient through it is
``d loss / d capped * (1 - (capped / softcap) ** 2)``.
"""
from __future__ import annotations

import functools
import importlib.util
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from ..errors import ConfigurationError

IGNORE_INDEX = -100


def _chunk_starts(num_rows: int, chunk_size: int) -> range:
    """Chunk offsets over ``num_rows`` rows; one empty chunk when there are none (a batch gathered down to its
    target rows may have none), so that every gradient buffer is written and the loss stays on the graph."""
    return range(0, num_rows, chunk_size) if num_rows else range(1)


def _chunk_ce_sum(logits_cv: torch.Tensor, labels_c: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits_cv.float(), labels_c, ignore_index=IGNORE_INDEX, reduction="sum")


def soft_cap(logits: torch.Tensor, softcap: float | None) -> torch.Tensor:
    """``softcap * tanh(logits / softcap)`` in the logits' dtype, in transformers' order; the logits if None."""
    return logits if not softcap else torch.tanh(logits / softcap) * softcap


class _ChunkedLinearCE(torch.autograd.Function):
    """Sum of token CE of `hidden_nh @ weight_vh.T + bias_v`; saves hidden, weight, labels and lse_n only."""

    @staticmethod
    def forward(ctx, hidden_nh, weight_vh, bias_v, labels_n, chunk_size: int, softcap: float | None = None):
        ctx.compute = _compute_dtype(hidden_nh.device, weight_vh.dtype)  # the backward recomputes the same logits
        lse_n = torch.empty(hidden_nh.shape[0], dtype=torch.float32, device=hidden_nh.device)
        total = torch.zeros((), dtype=torch.float32, device=hidden_nh.device)
        w_vh, b_v = _cast(weight_vh, ctx.compute), _cast(bias_v, ctx.compute)
        for start in _chunk_starts(hidden_nh.shape[0], chunk_size):
            sl = slice(start, start + chunk_size)
            logits_cv = soft_cap(_chunk_logits(hidden_nh[sl], w_vh, b_v).float(), softcap)
            lse_n[sl] = torch.logsumexp(logits_cv, dim=-1)
            total += _chunk_ce_sum(logits_cv, labels_n[sl])
            del logits_cv  # not alive beside the next chunk's
        ctx.chunk_size, ctx.softcap = chunk_size, softcap
        ctx.has_bias = bias_v is not None
        ctx.save_for_backward(hidden_nh, weight_vh, bias_v, labels_n, lse_n)
        return total

    @staticmethod
    def backward(ctx, grad_total):
        hidden_nh, weight_vh, bias_v, labels_n, lse_n = ctx.saved_tensors
        grad_hidden = torch.empty_like(hidden_nh) if ctx.needs_input_grad[0] else None
        # fp32 accumulators: summing many chunk contributions in bf16 would lose the small ones
        grad_weight = torch.zeros_like(weight_vh, dtype=torch.float32) if ctx.needs_input_grad[1] else None
        grad_bias = torch.zeros_like(bias_v, dtype=torch.float32) if ctx.has_bias and ctx.needs_input_grad[2] else None
        w_vh, b_v = _cast(weight_vh, ctx.compute), _cast(bias_v, ctx.compute)
        for start in _chunk_starts(hidden_nh.shape[0], ctx.chunk_size):
            sl = slice(start, start + ctx.chunk_size)
            h_ch, labels_c = hidden_nh[sl], labels_n[sl]
            logits_cv = soft_cap(_chunk_logits(h_ch, w_vh, b_v).float(), ctx.softcap)
            # d(sum CE)/d logits = softmax - onehot(label), zero on ignored rows (no host sync)
            valid_c1 = (labels_c != IGNORE_INDEX).unsqueeze(1)
            dlogits_cv = torch.exp(logits_cv - lse_n[sl, None])
            dlogits_cv.scatter_add_(1, torch.where(valid_c1, labels_c.unsqueeze(1), 0), -valid_c1.float())
            dlogits_cv *= valid_c1 * grad_total
            if ctx.softcap:  # through the cap: d capped / d logits = 1 - (capped / softcap)^2
                dlogits_cv *= 1 - (logits_cv / ctx.softcap).square_()
            if grad_hidden is not None:
                grad_hidden[sl] = (dlogits_cv.to(ctx.compute) @ w_vh).to(hidden_nh.dtype)
            if grad_weight is not None:
                grad_weight += dlogits_cv.t() @ h_ch.float()
            if grad_bias is not None:
                grad_bias += dlogits_cv.sum(0)
            del logits_cv, dlogits_cv  # not alive beside the next chunk's
        grad_weight = grad_weight.to(weight_vh.dtype) if grad_weight is not None else None
        grad_bias = grad_bias.to(bias_v.dtype) if grad_bias is not None else None
        return grad_hidden, grad_weight, grad_bias, None, None, None


def _compute_dtype(device: torch.device, weight_dtype: torch.dtype) -> torch.dtype:
    """The dtype an unfused head's F.linear would compute in here: autocast's when it is on, else the weight's."""
    return torch.get_autocast_dtype(device.type) if torch.is_autocast_enabled(device.type) else weight_dtype


def _cast(t: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor | None:
    return None if t is None else t.to(dtype)


def _chunk_logits(h_ch: torch.Tensor, w_vh: torch.Tensor, b_v: torch.Tensor | None) -> torch.Tensor:
    """One chunk's logits in the (already cast) weight's dtype, the same in forward and backward: autocast is off
    here, the casts are explicit."""
    with torch.autocast(h_ch.device.type, enabled=False):
        return F.linear(h_ch.to(w_vh.dtype), w_vh, b_v)


def ce_grad_(logits_cv: torch.Tensor, labels_c: torch.Tensor) -> torch.Tensor:
    """Summed token CE of one chunk; overwrites `logits_cv` with d(sum CE)/d logits (softmax - onehot, 0 on ignored
    rows). Math in fp32 whatever the logits' dtype. The pure-torch form of `ce_kernel.ce_grad_triton_` (used on
    CUDA), run where Triton is not."""
    x = logits_cv.to(torch.promote_types(logits_cv.dtype, torch.float32))
    lse = torch.logsumexp(x, dim=-1, keepdim=True)
    valid = (labels_c != IGNORE_INDEX).unsqueeze(1)
    target = torch.where(valid, labels_c.unsqueeze(1), 0)
    loss = ((lse - x.gather(1, target)) * valid).sum()
    vocab = torch.arange(x.shape[1], device=x.device).unsqueeze(0)
    grad = (torch.exp(x - lse) - (vocab == target).to(x.dtype)) * valid
    logits_cv.copy_(grad)
    return loss


@functools.cache
def _triton_installed() -> bool:
    return importlib.util.find_spec("triton") is not None


def _triton_kernels_on(device: torch.device) -> bool:
    """Whether `ce_kernel`'s Triton kernels serve tensors on this device (CUDA, Triton installed)."""
    return device.type == "cuda" and _triton_installed()


def _ce_grad_kernel(device: torch.device) -> Callable:
    """hf_accel's Triton kernel on CUDA (one read pass, one in-place write pass per row); `ce_grad_` elsewhere."""
    if _triton_kernels_on(device):
        from .ce_kernel import ce_grad_triton_

        return ce_grad_triton_
    return ce_grad_


def _accumulate_grad_weight_(grad_vh: torch.Tensor, dlogits_cv: torch.Tensor, h_ch: torch.Tensor, first: bool) -> None:
    """grad_vh (+)= dlogits^T @ h. Same dtypes: one addmm (beta=0 on the first chunk ignores the uninitialised
    buffer). A wider gradient (fp32 weight under autocast): low-precision operands, accumulation in grad_vh's dtype."""
    if grad_vh.dtype == dlogits_cv.dtype:
        grad_vh.addmm_(dlogits_cv.t(), h_ch, beta=0 if first else 1)
    elif grad_vh.is_cuda:
        torch.addmm(grad_vh, dlogits_cv.t(), h_ch, beta=0 if first else 1, out_dtype=grad_vh.dtype, out=grad_vh)
    else:  # CPU has no mixed-dtype addmm
        grad_vh.addmm_(dlogits_cv.t().to(grad_vh.dtype), h_ch.to(grad_vh.dtype), beta=0 if first else 1)


def _chunk_grads_(h_ch: torch.Tensor, w_vh: torch.Tensor, b_v: torch.Tensor | None, labels_c: torch.Tensor,
                  softcap: float | None, ce_grad: Callable, grad_hidden_ch: torch.Tensor | None,
                  grad_weight: torch.Tensor | None, grad_bias: torch.Tensor | None, first: bool) -> torch.Tensor:
    """One chunk of `_GradInForwardLinearCE`: its summed CE, its rows of the hidden gradient written into
    `grad_hidden_ch`, its share of the weight and bias gradients added. Its logits live only in this call."""
    logits_cv = F.linear(h_ch, w_vh, b_v)
    if softcap:  # capped in place, as transformers caps (divide, tanh, multiply in the logits' dtype)
        tanh_cv = logits_cv.div_(softcap).tanh_()
        logits_cv = tanh_cv * softcap
    loss = ce_grad(logits_cv, labels_c)
    dlogits_cv = logits_cv  # overwritten in place
    if softcap:  # through the cap: 1 - tanh^2
        dlogits_cv.mul_(tanh_cv.square_().neg_().add_(1))
    if grad_hidden_ch is not None:
        torch.mm(dlogits_cv, w_vh, out=grad_hidden_ch)
    if grad_weight is not None:
        _accumulate_grad_weight_(grad_weight, dlogits_cv, h_ch, first=first)
    if grad_bias is not None:
        grad_bias += dlogits_cv.sum(0, dtype=torch.float32)
    return loss


def _grads_in_forward(ctx, hidden_nh, weight_vh, bias_v, labels_n, chunk_size: int, softcap: float | None,
                      ce_grad: Callable) -> torch.Tensor:
    """The forward of `_GradInForwardLinearCE` (and of `_GradInForwardLinearCEStats`, whose ``ce_grad`` also counts
    the chunk's statistics): the summed loss; the gradients, saved on ``ctx`` for the backward to scale."""
    device = hidden_nh.device
    want_hidden, want_weight = hidden_nh.requires_grad, weight_vh.requires_grad
    want_bias = bias_v is not None and bias_v.requires_grad
    # Under autocast the head runs in the autocast dtype, as the unfused F.linear would; gradients come back in
    # the dtypes of hidden, weight and bias (an fp32 weight accumulates its gradient in fp32).
    compute = _compute_dtype(device, weight_vh.dtype)
    with torch.autocast(device.type, enabled=False):
        w_vh, b_v = weight_vh.to(compute), _cast(bias_v, compute)
        grad_hidden = torch.empty_like(hidden_nh, dtype=compute) if want_hidden else None
        grad_weight = torch.empty_like(weight_vh) if want_weight else None
        grad_bias = torch.zeros_like(bias_v, dtype=torch.float32) if want_bias else None
        total = torch.zeros((), dtype=torch.float32, device=device)
        for start in _chunk_starts(hidden_nh.shape[0], chunk_size):
            sl = slice(start, start + chunk_size)
            # the hidden chunk is cast here, not the whole (N, H) at once; the chunk's logits die in the call
            total += _chunk_grads_(hidden_nh[sl].to(compute), w_vh, b_v, labels_n[sl], softcap, ce_grad,
                                   None if grad_hidden is None else grad_hidden[sl], grad_weight, grad_bias,
                                   first=start == 0)
        # the head's cast copy (1 GiB for a Llama-3 fp32 head under bf16 autocast) goes before grad_hidden widens
        del w_vh, b_v
    ctx.save_for_backward(
        None if grad_hidden is None else grad_hidden.to(hidden_nh.dtype),
        grad_weight,
        None if grad_bias is None else grad_bias.to(bias_v.dtype),
    )
    return total


class _GradInForwardLinearCE(torch.autograd.Function):
    """Sum of token CE of `hidden_nh @ weight_vh.T + bias_v`, gradients computed chunk by chunk in the forward.

    Three matmuls per chunk (logits, grad of hidden, grad of weight) as in an unfused head, no recomputation, no host
    sync (the loss is a sum: the 1/N scale arrives as the backward's grad_output). Holds one chunk's logits at a time.
    The weight gradient accumulates in the weight's dtype: each chunk's matmul adds in fp32 and rounds once (N/chunk
    roundings, 8 for a 16k-token step over a 128k vocabulary; Liger's kernel does the same with 4x as many chunks);
    an fp32 accumulator would add 2 bytes per weight element at the step's memory peak.
    """

    @staticmethod
    def forward(ctx, hidden_nh, weight_vh, bias_v, labels_n, chunk_size: int, softcap: float | None = None):
        return _grads_in_forward(ctx, hidden_nh, weight_vh, bias_v, labels_n, chunk_size, softcap,
                                 _ce_grad_kernel(hidden_nh.device))

    @staticmethod
    def backward(ctx, grad_total):
        if torch.is_grad_enabled() or getattr(ctx, "handed_out", False):
            raise ConfigurationError(
                "hf_accel's fused loss computes its gradients in the forward and hands them out once: a second "
                "backward through the same loss (retain_graph=True) or a second-order gradient (create_graph=True) "
                "cannot be taken from it. Patch with fused_ce=False for that step's model."
            )
        ctx.handed_out = True  # the gradients are scaled in place and may now be the parameters' .grad
        scale_ = _scale_kernel(grad_total.device)
        grads = tuple(None if g is None else scale_(g, grad_total) for g in ctx.saved_tensors)
        return (*grads, None, None, None)


def _scale_kernel(device: torch.device) -> Callable:
    """hf_accel's one-pass Triton kernel on CUDA for contiguous low-precision gradients; `_scale_` elsewhere."""
    if _triton_kernels_on(device):
        from .ce_kernel import scale_triton_, scales_in_one_pass

        def scale_(grad: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
            return scale_triton_(grad, scale) if scales_in_one_pass(grad) else _scale_(grad, scale)

        return scale_
    return _scale_


def _scale_(grad: torch.Tensor, scale: torch.Tensor, block: int = 1 << 24) -> torch.Tensor:
    """grad *= scale in place, the product taken in fp32 (a bf16 multiply would round `scale`, e.g. 1/N, first);
    low-precision grads go in blocks so the fp32 temporary stays small."""
    scale = scale.float()
    if grad.dtype in (torch.float32, torch.float64):
        return grad.mul_(scale)
    for part in grad.view(-1).split(block):
        part.copy_(part.float().mul_(scale))
    return grad


def _module_chunked_sum(hidden_nh: torch.Tensor, head_forward: Callable[[torch.Tensor], torch.Tensor],
                        labels_n: torch.Tensor, chunk_size: int, softcap: float | None = None) -> torch.Tensor:
    """Run the head's forward per chunk under checkpointing: LoRA adapters get gradients, chunk logits are
    recomputed. `head_forward` is the head's own forward, not its __call__: the chunks run inside the one call of
    the head (`_one_head_call`), whose wrapper hooks must fire once."""

    def chunk_loss(h_ch: torch.Tensor, labels_c: torch.Tensor) -> torch.Tensor:
        return _chunk_ce_sum(soft_cap(head_forward(h_ch), softcap), labels_c)

    total = hidden_nh.new_zeros((), dtype=torch.float32)
    for start in _chunk_starts(hidden_nh.shape[0], chunk_size):
        sl = slice(start, start + chunk_size)
        total = total + checkpoint(chunk_loss, hidden_nh[sl], labels_n[sl], use_reentrant=False)
    return total
