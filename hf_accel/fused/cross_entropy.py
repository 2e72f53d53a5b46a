"""Chunked (fused) linear cross-entropy: the LM-head matmul and the loss without the full (N, V) logits.

Four paths, chosen per call by `linear_cross_entropy` (`method`):
- "inline", `_GradInForwardLinearCE` (the default for a plain ``nn.Linear`` head): each chunk's logits, loss and
  gradients are computed in the forward (on CUDA the softmax/gradient step is hf_accel's Triton kernel),
  no recomputation, no host sync;
- "recompute", `_ChunkedLinearCE`: the forward keeps only the per-token log-sum-exp (N floats), the backward
  recomputes each chunk's logits (least memory; also what a no-grad forward of "inline" runs);
- "liger": liger-kernel's fused kernel (CUDA, plain head; it synchronises with the host once per call);
- "module", for any other head (e.g. a PEFT LoRA layer): the head's own forward is run per chunk under
  non-reentrant activation checkpointing, so adapters get their gradients and chunk logits are not kept.

Whatever the path, the whole loss runs as ONE call of the head module's ``__call__`` (`_one_head_call`): a wrapper
that shards the head (FSDP2's ``fully_shard``, DeepSpeed ZeRO-3) then sees one forward of it, gathers its weight once
before, and reduces the weight gradient once, after the backward has finished with it.
"""
from __future__ import annotations

import importlib.util
import inspect
import logging
import types
from collections.abc import Callable
from typing import Literal, get_args

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from ..errors import ConfigurationError, InvalidBatch

logger = logging.getLogger(__name__)

IGNORE_INDEX = -100
CHUNK_BYTES = 512 * 2**20  # automatic chunks: one chunk's logits take about this much
Reduction = Literal["sum", "mean"]
Method = Literal["auto", "inline", "recompute", "liger", "module"]
METHODS: tuple[str, ...] = get_args(Method)
_warned: set[str] = set()


def _warn_once(key: str, message: str) -> None:
    if key not in _warned:
        _warned.add(key)
        logger.warning(message)


def liger_available() -> bool:
    """True when liger-kernel is importable (its kernels still need a CUDA device)."""
    return importlib.util.find_spec("liger_kernel") is not None


def _is_plain_linear(module: nn.Module) -> bool:
    # Exact type: subclasses (PEFT's lora.Linear is not one, but quantized heads are) may change the math. FSDP2's
    # fully_shard swaps a module's class for a generated FSDP<cls>(FSDPModule, cls) that keeps cls's math.
    cls = type(module)
    if cls is nn.Linear:
        return True
    if not torch.distributed.is_available():
        return False
    from torch.distributed.fsdp import FSDPModule

    return cls.__bases__ == (FSDPModule, nn.Linear)


def _chunk_ce_sum(logits_cv: torch.Tensor, labels_c: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits_cv.float(), labels_c, ignore_index=IGNORE_INDEX, reduction="sum")


class _ChunkedLinearCE(torch.autograd.Function):
    """Sum of token CE of `hidden_nh @ weight_vh.T + bias_v`; saves hidden, weight, labels and lse_n only."""

    @staticmethod
    def forward(ctx, hidden_nh, weight_vh, bias_v, labels_n, chunk_size: int):
        ctx.compute = _compute_dtype(hidden_nh.device, weight_vh.dtype)  # the backward recomputes the same logits
        lse_n = torch.empty(hidden_nh.shape[0], dtype=torch.float32, device=hidden_nh.device)
        total = torch.zeros((), dtype=torch.float32, device=hidden_nh.device)
        w_vh, b_v = _cast(weight_vh, ctx.compute), _cast(bias_v, ctx.compute)
        for start in range(0, hidden_nh.shape[0], chunk_size):
            sl = slice(start, start + chunk_size)
            logits_cv = _chunk_logits(hidden_nh[sl], w_vh, b_v).float()
            lse_n[sl] = torch.logsumexp(logits_cv, dim=-1)
            total += _chunk_ce_sum(logits_cv, labels_n[sl])
        ctx.chunk_size = chunk_size
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
        for start in range(0, hidden_nh.shape[0], ctx.chunk_size):
            sl = slice(start, start + ctx.chunk_size)
            h_ch, labels_c = hidden_nh[sl], labels_n[sl]
            logits_cv = _chunk_logits(h_ch, w_vh, b_v).float()
            # d(sum CE)/d logits = softmax - onehot(label), zero on ignored rows (no host sync)
            valid_c1 = (labels_c != IGNORE_INDEX).unsqueeze(1)
            dlogits_cv = torch.exp(logits_cv - lse_n[sl, None])
            dlogits_cv.scatter_add_(1, torch.where(valid_c1, labels_c.unsqueeze(1), 0), -valid_c1.float())
            dlogits_cv *= valid_c1 * grad_total
            if grad_hidden is not None:
                grad_hidden[sl] = (dlogits_cv.to(ctx.compute) @ w_vh).to(hidden_nh.dtype)
            if grad_weight is not None:
                grad_weight += dlogits_cv.t() @ h_ch.float()
            if grad_bias is not None:
                grad_bias += dlogits_cv.sum(0)
        grad_weight = grad_weight.to(weight_vh.dtype) if grad_weight is not None else None
        grad_bias = grad_bias.to(bias_v.dtype) if grad_bias is not None else None
        return grad_hidden, grad_weight, grad_bias, None, None


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


def _ce_grad_kernel(device: torch.device) -> Callable:
    """hf_accel's Triton kernel on CUDA (one read pass, one in-place write pass per row); `ce_grad_` elsewhere."""
    if device.type == "cuda" and importlib.util.find_spec("triton") is not None:
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


class _GradInForwardLinearCE(torch.autograd.Function):
    """Sum of token CE of `hidden_nh @ weight_vh.T + bias_v`, gradients computed chunk by chunk in the forward.

    Three matmuls per chunk (logits, grad of hidden, grad of weight) as in an unfused head, no recomputation, no host
    sync (the loss is a sum: the 1/N scale arrives as the backward's grad_output). Holds one chunk's logits at a time.
    The weight gradient accumulates in the weight's dtype: each chunk's matmul adds in fp32 and rounds once (N/chunk
    roundings, 8 for a 16k-token step over a 128k vocabulary; Liger's kernel does the same with 4x as many chunks);
    an fp32 accumulator would add 2 bytes per weight element at the step's memory peak.
    """

    @staticmethod
    def forward(ctx, hidden_nh, weight_vh, bias_v, labels_n, chunk_size: int):
        device = hidden_nh.device
        ce_grad = _ce_grad_kernel(device)
        want_hidden, want_weight = hidden_nh.requires_grad, weight_vh.requires_grad
        want_bias = bias_v is not None and bias_v.requires_grad
        # Under autocast the head runs in the autocast dtype, as the unfused F.linear would; gradients come back in
        # the dtypes of hidden, weight and bias (an fp32 weight accumulates its gradient in fp32).
        compute = _compute_dtype(device, weight_vh.dtype)
        with torch.autocast(device.type, enabled=False):
            h_nh, w_vh, b_v = hidden_nh.to(compute), weight_vh.to(compute), _cast(bias_v, compute)
            grad_hidden = torch.empty_like(h_nh) if want_hidden else None
            grad_weight = torch.empty_like(weight_vh) if want_weight else None
            grad_bias = torch.zeros_like(bias_v, dtype=torch.float32) if want_bias else None
            total = torch.zeros((), dtype=torch.float32, device=device)
            for start in range(0, h_nh.shape[0], chunk_size):
                sl = slice(start, start + chunk_size)
                h_ch = h_nh[sl]
                logits_cv = F.linear(h_ch, w_vh, b_v)
                total += ce_grad(logits_cv, labels_n[sl])
                dlogits_cv = logits_cv  # overwritten in place
                if grad_hidden is not None:
                    torch.mm(dlogits_cv, w_vh, out=grad_hidden[sl])
                if grad_weight is not None:
                    _accumulate_grad_weight_(grad_weight, dlogits_cv, h_ch, first=start == 0)
                if grad_bias is not None:
                    grad_bias += dlogits_cv.sum(0, dtype=torch.float32)
        ctx.save_for_backward(
            None if grad_hidden is None else grad_hidden.to(hidden_nh.dtype),
            grad_weight,
            None if grad_bias is None else grad_bias.to(bias_v.dtype),
        )
        return total

    @staticmethod
    def backward(ctx, grad_total):
        grads = tuple(None if g is None else _scale_(g, grad_total) for g in ctx.saved_tensors)
        return (*grads, None, None)


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
                        labels_n: torch.Tensor, chunk_size: int) -> torch.Tensor:
    """Run the head's forward per chunk under checkpointing: LoRA adapters get gradients, chunk logits are
    recomputed. `head_forward` is the head's own forward, not its __call__: the chunks run inside the one call of
    the head (`_one_head_call`), whose wrapper hooks must fire once."""

    def chunk_loss(h_ch: torch.Tensor, labels_c: torch.Tensor) -> torch.Tensor:
        return _chunk_ce_sum(head_forward(h_ch), labels_c)

    total = hidden_nh.new_zeros((), dtype=torch.float32)
    for start in range(0, hidden_nh.shape[0], chunk_size):
        sl = slice(start, start + chunk_size)
        total = total + checkpoint(chunk_loss, hidden_nh[sl], labels_n[sl], use_reentrant=False)
    return total


def _one_head_call(head: nn.Module, summed_loss: Callable[..., torch.Tensor], hidden_nh: torch.Tensor,
                   labels_n: torch.Tensor) -> torch.Tensor:
    """``summed_loss(hidden_nh, labels_n, head_forward)`` run as one call of ``head.__call__``.

    Reading ``head.weight`` outside the head's own call, or calling the head once per chunk, breaks a wrapper that
    shards it. FSDP2 gathers a module's weight in its forward pre-hook, may free it after the forward, and
    reduce-scatters the weight gradient (then frees the weight) when the gradient of that call's input is complete;
    with one call per chunk the first chunk's reduce-scatter ran before the other chunks' backward (on torch <= 2.12
    the next chunk's recompute then met the sharded weight: "aten.mm got mixed torch.Tensor and DTensor"). As one
    call, the pre-hook gathers the weight once, the backward (inline gradients, recomputed chunks) runs with it, and
    the single reduce-scatter comes after all chunks. torch's ``register_fsdp_forward_method`` does the same for a
    named method of an already-sharded module; this works whenever the module is wrapped, and for DeepSpeed ZeRO-3,
    whose gather hooks are also the module's forward hooks. No wrapper: the same math, one Python call more.
    """
    head_forward = head.forward  # the head's own forward (class or instance), for the "module" path's chunks
    if torch.compiler.is_compiling():  # a traced model: no module hooks to satisfy, no attribute swapping
        return summed_loss(hidden_nh, labels_n, head_forward)
    had_own = "forward" in head.__dict__
    own = head.__dict__.get("forward")
    head.forward = lambda h_nh, y_n: summed_loss(h_nh, y_n, head_forward)
    try:
        return head(hidden_nh, labels_n)  # pre-hooks may cast / wrap hidden_nh: use what the call passes on
    finally:
        if had_own:
            head.__dict__["forward"] = own
        else:
            del head.__dict__["forward"]


def _liger_sum(hidden_nh: torch.Tensor, head: nn.Linear, labels_n: torch.Tensor) -> torch.Tensor:
    from liger_kernel.transformers.functional import liger_fused_linear_cross_entropy

    return liger_fused_linear_cross_entropy(
        hidden_nh, head.weight, labels_n, bias=head.bias, ignore_index=IGNORE_INDEX, reduction="sum"
    )


def _pick_method(hidden_nh: torch.Tensor, head: nn.Module, method: Method) -> str:
    if method not in METHODS:
        raise ConfigurationError(f"method={method!r} is not one of {METHODS}.")
    if not _is_plain_linear(head):
        if method not in ("auto", "module"):
            _warn_once(f"{method}-not-plain", f"fused CE method {method!r} needs a plain nn.Linear head, got "
                       f"{type(head).__name__} (e.g. LoRA on lm_head); using the chunked module path, which trains "
                       "the adapters.")
        return "module"
    if method == "liger" and not (liger_available() and hidden_nh.is_cuda):
        _warn_once("liger-missing", "Liger fused CE requested but liger-kernel is not installed or the device is not "
                   "CUDA; using hf_accel's inline path.")
        return "inline"
    return "inline" if method == "auto" else method


def auto_chunk_size(num_tokens: int, vocab: int, element_size: int, budget_bytes: int = CHUNK_BYTES) -> int:
    """The largest power-of-two token chunk whose (chunk, vocab) logits fit in `budget_bytes` (at least 128)."""
    fit = max(1, budget_bytes // max(1, vocab * element_size))
    chunk = max(128, 1 << (fit.bit_length() - 1))
    return min(chunk, max(1, num_tokens))


def linear_cross_entropy(
    hidden_nh: torch.Tensor,
    lm_head: nn.Module,
    labels_n: torch.Tensor,
    *,
    reduction: Reduction = "mean",
    num_items_in_batch: int | torch.Tensor | None = None,
    chunk_size: int | None = None,
    method: Method = "auto",
) -> torch.Tensor:
    """Cross-entropy of `lm_head(hidden_nh)` against `labels_n` (-100 ignored), never building full (N, V) logits.

    hidden_nh: (N, H) already shifted and flattened; labels_n: (N,) long. The result is the summed token loss
    divided by `num_items_in_batch` when given (the transformers Trainer convention), else reduced by `reduction`
    ("mean" over non-ignored tokens; 0 when there are none).

    `method`: "inline" computes the gradients chunk by chunk during the forward (three matmuls per chunk, no host
    sync; the default for a plain ``nn.Linear`` head), "recompute" keeps only per-token log-sum-exp and recomputes
    the logits in the backward (least memory, a fourth matmul), "liger" uses liger-kernel's fused kernel (CUDA), and
    any other head (e.g. LoRA on lm_head) takes the "module" path: the head module per chunk under checkpointing.
    `chunk_size`: tokens per chunk; None sizes chunks so one chunk's logits take about 512 MiB.
    """
    if hidden_nh.dim() != 2 or labels_n.shape != hidden_nh.shape[:1]:
        raise InvalidBatch(
            f"linear_cross_entropy expects hidden (N, H) and labels (N,), got {tuple(hidden_nh.shape)} and "
            f"{tuple(labels_n.shape)}; flatten (B, S, H) to (B*S, H) after shifting."
        )
    if reduction not in ("sum", "mean"):
        raise ConfigurationError(f"reduction={reduction!r} is not supported; use 'sum' or 'mean'.")
    if chunk_size is not None and chunk_size < 1:
        raise ConfigurationError(f"chunk_size must be a positive int (or None for automatic), got {chunk_size}.")
    path = _pick_method(hidden_nh, lm_head, method)
    vocab = getattr(lm_head, "out_features", None) or lm_head.weight.shape[0]
    if not labels_n.is_cuda:  # host labels: the check costs no sync (on CUDA an out-of-range label gives a NaN loss)
        bad = labels_n[(labels_n >= vocab) | ((labels_n < 0) & (labels_n != IGNORE_INDEX))]
        if bad.numel():
            raise InvalidBatch(
                f"labels must be token ids in [0, {vocab}) or {IGNORE_INDEX} (ignored); got {bad.numel()} outside, "
                f"e.g. {bad[:5].tolist()}. Check that the tokenizer matches the model's vocabulary and the collator's "
                "ignore index."
            )
    if chunk_size is None:
        # the recompute path upcasts a chunk's logits to fp32; the others keep them in the head's dtype
        element = 4 if path in ("recompute", "module") else hidden_nh.element_size()
        chunk_size = auto_chunk_size(hidden_nh.shape[0], vocab, element)

    def summed_loss(h_nh: torch.Tensor, y_n: torch.Tensor, head_forward: Callable) -> torch.Tensor:
        # inside the head's call: lm_head.weight is the gathered (unsharded) weight here
        if path == "liger":
            return _liger_sum(h_nh, lm_head, y_n)
        if path == "inline" and torch.is_grad_enabled():
            return _GradInForwardLinearCE.apply(h_nh, lm_head.weight, lm_head.bias, y_n, chunk_size)
        if path in ("inline", "recompute"):
            return _ChunkedLinearCE.apply(h_nh, lm_head.weight, lm_head.bias, y_n, chunk_size)
        return _module_chunked_sum(h_nh, head_forward, y_n, chunk_size)

    total = _one_head_call(lm_head, summed_loss, hidden_nh, labels_n)
    if num_items_in_batch is not None:
        return total / num_items_in_batch
    if reduction == "sum":
        return total
    return total / (labels_n != IGNORE_INDEX).sum().clamp(min=1)


def causal_lm_loss_from_hidden(
    model: nn.Module,
    hidden_states: torch.Tensor,
    labels: torch.Tensor,
    num_items_in_batch: int | torch.Tensor | None = None,
    *,
    chunk_size: int | None = None,
    method: Method = "auto",
) -> torch.Tensor:
    """Causal-LM loss from the decoder's last hidden states (B, S, H) and unshifted labels (B, S).

    Shifts like transformers' `ForCausalLMLoss` (position t predicts label t+1; the last position of each row has no
    target), uses the model's output embedding module (works for PEFT models and tied heads), and returns mean over
    target tokens, or sum / num_items_in_batch. The labels move, not the hidden states: no copy of (B, S, H).
    """
    head = model.get_output_embeddings()
    if head is None:
        raise ConfigurationError(f"{type(model).__name__} has no output embeddings (lm_head); pass a causal-LM model.")
    hidden_nh = hidden_states.reshape(-1, hidden_states.shape[-1])
    labels_n = F.pad(labels[:, 1:], (0, 1), value=IGNORE_INDEX).reshape(-1).to(hidden_states.device)
    return linear_cross_entropy(
        hidden_nh, head, labels_n, num_items_in_batch=num_items_in_batch, chunk_size=chunk_size, method=method
    )


_STOCK_FORWARD = "_hf_accel_stock_forward"


def bind_fused_loss(model: nn.Module, *, chunk_size: int | None = None, method: Method = "auto") -> Callable[[], None]:
    """Bind a ``forward`` on this ``*ForCausalLM`` instance that, in training with labels, returns the loss computed
    from the decoder's hidden states by ``causal_lm_loss_from_hidden`` (no full logits; ``logits`` is None).

    Because the loss is computed inside the model's own forward, DDP / FSDP wrappers see it like any forward
    (gradients are reduced, root parameters gathered). Evaluation, generation and calls without labels run the stock
    forward. Returns the action that restores the stock forward exactly.
    """
    from transformers.modeling_outputs import CausalLMOutputWithPast

    stock = model.forward

    def forward(self, *args, labels=None, num_items_in_batch=None, **kwargs):
        if labels is None or not self.training or args:
            if num_items_in_batch is not None:
                kwargs["num_items_in_batch"] = num_items_in_batch
            return stock(*args, labels=labels, **kwargs)
        kwargs.pop("logits_to_keep", None)
        body = getattr(self, self.base_model_prefix)
        out = body(**kwargs)
        loss = causal_lm_loss_from_hidden(self, out.last_hidden_state, labels, num_items_in_batch,
                                          chunk_size=chunk_size, method=method)
        return CausalLMOutputWithPast(loss=loss, logits=None, past_key_values=getattr(out, "past_key_values", None))

    # Keep the stock signature visible: Trainer picks dataset columns by inspecting model.forward.
    stock_sig = inspect.signature(stock)
    self_param = inspect.Parameter("self", inspect.Parameter.POSITIONAL_OR_KEYWORD)
    forward.__signature__ = stock_sig.replace(parameters=[self_param, *stock_sig.parameters.values()])
    model.__dict__[_STOCK_FORWARD] = stock
    model.forward = types.MethodType(forward, model)

    def undo() -> None:
        model.__dict__.pop("forward", None)
        model.__dict__.pop(_STOCK_FORWARD, None)

    return undo
