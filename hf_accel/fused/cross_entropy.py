"""Chunked (fused) linear cross-entropy: the LM-head matmul and the loss without the full (N, V) logits.

Four paths, chosen per call by `linear_cross_entropy` (`method`; the autograd functions live in `ce_functions`):
- "inline", `_GradInForwardLinearCE` (the default for a plain ``nn.Linear`` head): each chunk's logits, loss and
  gradients are computed in the forward (on CUDA the softmax/gradient step is hf_accel's Triton kernel),
  no recomputation, no host sync;
- "recompute", `_ChunkedLinearCE`: the forward keeps only the per-token log-sum-exp (N floats), the backward
  recomputes each chunk's logits (least memory; also what a no-grad forward of "inline" runs);
- "liger": liger-kernel's fused kernel (CUDA, plain head; it synchronises with the host once per call);
- "module", for any other head (e.g. a PEFT LoRA layer): the head's own forward is run per chunk under
  non-reentrant activation checkpointing, so adapters get their gradients and chunk logits are not kept.

Where the batch says which positions have a target (``target_rows``: the packing collator's
``hf_accel_target_rows``), only those hidden rows reach the head: a masked position's logits, gradients and loss are
never computed (prompt tokens in SFT data). The gather comes before any of the paths, which see fewer rows.

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

from ..binding import bind_forward
from ..errors import ConfigurationError, InvalidBatch
from ..memory.chunks import CHUNK_BYTES, auto_chunk_size  # noqa: F401 (CHUNK_BYTES re-exported)
from .ce_functions import IGNORE_INDEX, _ChunkedLinearCE, _GradInForwardLinearCE, _module_chunked_sum

logger = logging.getLogger(__name__)

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
    undo = bind_forward(head, lambda h_nh, y_n: summed_loss(h_nh, y_n, head_forward))
    try:
        return head(hidden_nh, labels_n)  # pre-hooks may cast / wrap hidden_nh: use what the call passes on
    finally:
        undo()


def _liger_sum(hidden_nh: torch.Tensor, head: nn.Linear, labels_n: torch.Tensor,
               softcap: float | None) -> torch.Tensor:
    from liger_kernel.transformers.functional import liger_fused_linear_cross_entropy

    return liger_fused_linear_cross_entropy(
        hidden_nh, head.weight, labels_n, bias=head.bias, ignore_index=IGNORE_INDEX, reduction="sum",
        softcap=softcap,
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
    if method == "liger" and hidden_nh.shape[0] == 0:  # no target row: nothing for its kernel (which syncs) to do
        return "inline"
    if method == "liger" and not (liger_available() and hidden_nh.is_cuda):
        _warn_once("liger-missing", "Liger fused CE requested but liger-kernel is not installed or the device is not "
                   "CUDA; using hf_accel's inline path.")
        return "inline"
    return "inline" if method == "auto" else method


def linear_cross_entropy(
    hidden_nh: torch.Tensor,
    lm_head: nn.Module,
    labels_n: torch.Tensor,
    *,
    reduction: Reduction = "mean",
    num_items_in_batch: int | torch.Tensor | None = None,
    chunk_size: int | None = None,
    method: Method = "auto",
    softcap: float | None = None,
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
    `softcap`: the logits become ``softcap * tanh(logits / softcap)`` first (Gemma 2's final logit soft-capping).
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
            return _liger_sum(h_nh, lm_head, y_n, softcap)
        if path == "inline" and torch.is_grad_enabled():
            return _GradInForwardLinearCE.apply(h_nh, lm_head.weight, lm_head.bias, y_n, chunk_size, softcap)
        if path in ("inline", "recompute"):
            return _ChunkedLinearCE.apply(h_nh, lm_head.weight, lm_head.bias, y_n, chunk_size, softcap)
        return _module_chunked_sum(h_nh, head_forward, y_n, chunk_size, softcap)

    total = _one_head_call(lm_head, summed_loss, hidden_nh, labels_n)
    if num_items_in_batch is not None:
        return total / num_items_in_batch
    if reduction == "sum":
        return total
    return total / (labels_n != IGNORE_INDEX).sum().clamp(min=1)


def _check_target_rows(rows_t: torch.Tensor, labels_n: torch.Tensor) -> None:
    """The rows must index the flattened positions and cover every target (rows without one add nothing). The dtype
    and shape are host metadata; the values are checked only where they are on the host (a check of device values
    would cost a sync: there an index out of range fails in the gather, a missing target would go unseen)."""
    if rows_t.dim() != 1 or rows_t.dtype not in (torch.int64, torch.int32):
        raise InvalidBatch(f"{TARGET_ROWS_KEY} must be a 1-D int64 tensor of flattened (B*S) positions, got "
                           f"{rows_t.dtype} of shape {tuple(rows_t.shape)}; build it with DataCollatorForPacking("
                           "target_rows=True) or leave it out (every row is then computed).")
    if rows_t.is_cuda or labels_n.is_cuda:
        return
    n = labels_n.shape[0]
    if rows_t.numel() and (int(rows_t.min()) < 0 or int(rows_t.max()) >= n):
        raise InvalidBatch(f"{TARGET_ROWS_KEY} holds positions outside [0, {n}) (the batch's B*S positions).")
    covered = torch.zeros(n, dtype=torch.bool)
    covered[rows_t] = True
    missing = ((labels_n != IGNORE_INDEX) & ~covered).nonzero().flatten()
    if missing.numel() or torch.unique(rows_t).numel() != rows_t.numel():
        raise InvalidBatch(
            f"{TARGET_ROWS_KEY} does not match the batch's labels: {missing.numel()} target positions missing (e.g. "
            f"{missing[:5].tolist()}) or a position listed twice. Were the labels changed after collating? Build the "
            "rows from the final labels, or drop the key (every row is then computed).")


def causal_lm_loss_from_hidden(
    model: nn.Module,
    hidden_states: torch.Tensor,
    labels: torch.Tensor,
    num_items_in_batch: int | torch.Tensor | None = None,
    *,
    shift_labels: torch.Tensor | None = None,
    target_rows: torch.Tensor | None = None,
    chunk_size: int | None = None,
    method: Method = "auto",
    softcap: float | None = None,
) -> torch.Tensor:
    """Causal-LM loss from the decoder's last hidden states (B, S, H) and unshifted labels (B, S).

    Shifts like transformers' `ForCausalLMLoss` (position t predicts label t+1; the last position of each row has no
    target), uses the model's output embedding module (works for PEFT models and tied heads), and returns mean over
    target tokens, or sum / num_items_in_batch. The labels move, not the hidden states: no copy of (B, S, H).
    ``shift_labels`` (B, S), as transformers takes it: targets already aligned with the positions (position t
    predicts shift_labels[t], e.g. a sequence-parallel shard's), used as they are; ``labels`` is then not read.
    ``target_rows`` (T,) int64: the flattened (B*S) positions whose target is not -100 (a superset does no harm), as
    the packing collator lists them; only those rows of hidden states go through the head. Same loss and gradients
    as every row (a masked row adds nothing to either), without the masked rows' LM-head work.
    ``softcap``: the model's final logit soft-cap (its family's ``final_logit_softcap``), None for none.
    """
    head = model.get_output_embeddings()
    if head is None:
        raise ConfigurationError(f"{type(model).__name__} has no output embeddings (lm_head); pass a causal-LM model.")
    hidden_nh = hidden_states.reshape(-1, hidden_states.shape[-1])
    if shift_labels is not None:
        labels_n = shift_labels.reshape(-1).to(hidden_states.device)
    else:
        labels_n = F.pad(labels[:, 1:], (0, 1), value=IGNORE_INDEX).reshape(-1).to(hidden_states.device)
    if target_rows is not None:
        _check_target_rows(target_rows, labels_n)
        rows_t = target_rows.to(hidden_nh.device, non_blocking=True)  # the collator's list: no host read here
        hidden_nh, labels_n = hidden_nh.index_select(0, rows_t), labels_n.index_select(0, rows_t)
    return linear_cross_entropy(
        hidden_nh, head, labels_n, num_items_in_batch=num_items_in_batch, chunk_size=chunk_size, method=method,
        softcap=softcap,
    )


_STOCK_FORWARD = "_hf_accel_stock_forward"
# The batch key DataCollatorForPacking(target_rows=True) emits (hf_accel.data.collators.TARGET_ROWS_KEY; data/ and
# fused/ do not import each other): (T,) int64 flattened positions with a target.
TARGET_ROWS_KEY = "hf_accel_target_rows"


def _body(model: torch.nn.Module) -> torch.nn.Module:
    """The CausalLM's body (the module holding its decoder layers): ``model.<base_model_prefix>``, or for a class
    whose prefix names no attribute (Llama 4's "language_model" on Llama4ForCausalLM) its child holding the layers."""
    from transformers.modeling_layers import GradientCheckpointingLayer

    body = getattr(model, model.base_model_prefix, None)
    if isinstance(body, torch.nn.Module) and body is not model:
        return body
    return next(child for child in model.children()
                if any(isinstance(m, GradientCheckpointingLayer) for m in child.modules()))


def bind_fused_loss(model: nn.Module, *, chunk_size: int | None = None, method: Method = "auto",
                    softcap: float | None = None) -> Callable[[], None]:
    """Bind a ``forward`` on this ``*ForCausalLM`` instance that, in training with labels, returns the loss computed
    from the decoder's hidden states by ``causal_lm_loss_from_hidden`` (no full logits; ``logits`` is None).

    Because the loss is computed inside the model's own forward, DDP / FSDP wrappers see it like any forward
    (gradients are reduced, root parameters gathered). Evaluation, generation and calls without labels run the stock
    forward. The collator's ``hf_accel_target_rows`` (the positions with a target) is taken out of every call, so it
    never reaches transformers' code; a training call with labels computes only those rows of the head (a call that
    also brings ``shift_labels`` computes every row: the rows were listed from ``labels``). ``softcap``: the final
    logit soft-cap the stock forward applies after the head (Gemma 2), applied by the fused loss the same way.
    Returns the action that restores the stock forward exactly.
    """
    from transformers.modeling_outputs import CausalLMOutputWithPast

    # the output's cache field: `cache` from transformers 5.25 on (`past_key_values` a deprecated alias), before it
    # `past_key_values`
    cache_field = "cache" if "cache" in CausalLMOutputWithPast.__dataclass_fields__ else "past_key_values"

    stock = model.forward  # (patch() binds only where the instance has none of its own: resolve_speedups)

    def forward(self, *args, labels=None, num_items_in_batch=None, **kwargs):
        target_rows = kwargs.pop(TARGET_ROWS_KEY, None)  # batch metadata for this loss only
        as_tuple = kwargs.get("return_dict", getattr(self.config, "return_dict", True)) is False
        # (a tuple's fields sit where logits would; a mixture of experts asked for its router logits adds their
        # load-balancing loss to the loss in its own forward)
        router_logits = kwargs.get("output_router_logits", getattr(self.config, "output_router_logits", False))
        if labels is None or not self.training or args or as_tuple or router_logits:
            if num_items_in_batch is not None:
                kwargs["num_items_in_batch"] = num_items_in_batch
            return stock(*args, labels=labels, **kwargs)
        kwargs.pop("logits_to_keep", None)
        shift_labels = kwargs.pop("shift_labels", None)  # transformers' loss kwarg: pre-shifted targets
        if shift_labels is not None:
            target_rows = None  # targets not from `labels`, where the rows were listed: take every row
        out = _body(self)(**kwargs)
        loss = causal_lm_loss_from_hidden(self, out.last_hidden_state, labels, num_items_in_batch,
                                          shift_labels=shift_labels, target_rows=target_rows, chunk_size=chunk_size,
                                          method=method, softcap=softcap)
        return CausalLMOutputWithPast(loss=loss, logits=None, hidden_states=getattr(out, "hidden_states", None),
                                      attentions=getattr(out, "attentions", None),
                                      **{cache_field: getattr(out, cache_field, None)})

    # Keep the stock signature visible: Trainer picks dataset columns by inspecting model.forward.
    stock_sig = inspect.signature(stock)
    self_param = inspect.Parameter("self", inspect.Parameter.POSITIONAL_OR_KEYWORD)
    forward.__signature__ = stock_sig.replace(parameters=[self_param, *stock_sig.parameters.values()])
    model.__dict__[_STOCK_FORWARD] = stock
    unbind = bind_forward(model, types.MethodType(forward, model))

    def undo() -> None:
        unbind()
        model.__dict__.pop(_STOCK_FORWARD, None)

    return undo
