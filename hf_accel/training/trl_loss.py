"""TRL's SFT loss and metrics from hf_accel's fused loss, inside ``hf_accel.SFTTrainer``.

TRL 1.16's ``SFTTrainer`` binds its own chunked LM head onto the model (``add_fused_lm_head``; ``compute_loss`` calls
``model(..., fused_lm_head=True)``): per-token log-probabilities, entropy and top-1 flags, each tile's logits
recomputed in the backward (four matmuls per chunk), and three host reads per micro-batch for its metrics.
``hf_accel.SFTTrainer`` binds one more layer on that forward (`bind_head`): a training call that names
``HEAD_KWARG`` runs the backbone as TRL's forward does, then the LM head through ``hf_accel.fused.ce_stats`` (three
matmuls per chunk, gradients in the forward, only the rows with a target: the collator lists them on the host,
`add_target_rows`), in TRL's loss form (``loss_type="dft"``, label smoothing), with the entropy and top-1 sums of the
target rows. `compute_loss` reduces them as TRL's ``compute_loss`` does (``num_items_in_batch``, the processes'
scale, the MoE auxiliary loss and its accumulation-steps division) and keeps the metrics as device tensors, read
back when the Trainer logs (`resolve_metrics`): the logged values are TRL's, from fewer host reads.

TRL's own ``compute_loss`` runs instead (told once, in the log and the PatchReport notes) for what the fused loss
does not compute: a ``compute_loss_func`` (it receives the model's logits), sequence / context parallelism (the loss
is reduced across ranks by TRL's own path), a model that scales its logits (``logit_scale``, ``logits_scaling``, ...),
an LM head that is not a plain ``nn.Linear`` (PEFT's ``modules_to_save=["lm_head"]``; checked per call),
``AccelArguments(fused_ce=False)``, and "auto" off CUDA. Evaluation (no gradient) always takes TRL's path: the same
forward, no gradient to gain from.
"""
from __future__ import annotations

import functools
import logging
import types
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from ..binding import bind_forward
from ..errors import ConfigurationError
from ..fused.ce_stats import LossForm, linear_cross_entropy_stats
from ..fused.cross_entropy import TARGET_ROWS_KEY, _is_plain_linear
from .loss import IGNORE_INDEX

logger = logging.getLogger("hf_accel")

HEAD_KWARG = "hf_accel_sft_loss"  # the LossForm of a training call hf_accel's head serves
# Config fields by which a model scales its logits before the loss (TRL's add_fused_lm_head reads the same ones).
LOGIT_SCALES = ("logit_scale", "output_multiplier", "lm_head_multiplier", "logits_scaling")
DEFERRED = "_hf_accel_pending"  # the trainer's pending (device) metric values, read back at logging


def unserved_reason(trainer: Any) -> str | None:
    """Why TRL's own loss serves this trainer's training steps (None: hf_accel's fused loss does)."""
    fused_ce = trainer.accel.fused_ce
    if fused_ce is False:
        return "AccelArguments(fused_ce=False)"
    device = next(trainer.model.parameters()).device
    if fused_ce == "auto" and device.type != "cuda":
        return f"fused_ce='auto' serves CUDA only; this model is on {device.type} (fused_ce=True serves it here)"
    if trainer.compute_loss_func is not None:
        return "a compute_loss_func receives the model's full logits"
    config = trainer.accelerator.parallelism_config
    if config is not None and (getattr(config, "sp_enabled", False) or getattr(config, "cp_enabled", False)):
        return "sequence / context parallelism shards the batch and reduces the loss across ranks"
    text_config = trainer.model.config.get_text_config()
    scales = {name: getattr(text_config, name) for name in LOGIT_SCALES if getattr(text_config, name, None)
              not in (None, 1, 1.0)}
    if scales:
        return f"the model scales its logits ({', '.join(f'{k}={v}' for k, v in scales.items())})"
    return None


def loss_form(args: Any, label_smoother: Any) -> LossForm:
    """TRL's loss form for ``args``: DFT, or the label smoother's epsilon where TRL applies it (nll only)."""
    if args.loss_type == "dft":
        return LossForm(dft=True)
    return LossForm(label_smoothing=float(label_smoother.epsilon) if label_smoother is not None else 0.0)


def _with_target_rows(batch: Any) -> Any:
    labels = batch.get("labels") if isinstance(batch, dict) else None
    if isinstance(labels, torch.Tensor) and labels.dim() == 2 and not labels.is_cuda:
        shifted = F.pad(labels[:, 1:], (0, 1), value=IGNORE_INDEX).reshape(-1)
        batch[TARGET_ROWS_KEY] = shifted.ne(IGNORE_INDEX).nonzero().squeeze(1)
    return batch


class _TorchCallWithTargetRows:
    """A DataCollatorMixin's ``torch_call`` (its class's), with the target rows added; an object, not a bound
    method, so that the collator pickles with it (worker processes)."""

    def __init__(self, collator: Any) -> None:
        self.collator = collator

    def __call__(self, examples: list) -> Any:
        return _with_target_rows(type(self.collator).torch_call(self.collator, examples))


class _TargetRows:
    """A plain collate function, with the target rows added (picklable for worker processes)."""

    def __init__(self, collate: Callable) -> None:
        self.collate = collate

    def __call__(self, *args, **kwargs) -> Any:
        return _with_target_rows(self.collate(*args, **kwargs))


def add_target_rows(collator: Callable) -> Callable:
    """``collator`` that also lists, on the host, the flattened (B*S) positions whose shifted label is a target
    (``TARGET_ROWS_KEY``), so that the head computes only those rows without a device read. A collator with a
    ``torch_call`` (transformers' DataCollatorMixin, TRL's collators) keeps its class (TRL checks it)."""
    if callable(getattr(type(collator), "torch_call", None)):
        collator.torch_call = _TorchCallWithTargetRows(collator)
        return collator
    return _TargetRows(collator)


def head_reason(model: torch.nn.Module) -> str | None:
    """Why this call's LM head cannot take hf_accel's loss (None: a plain ``nn.Linear``, FSDP2's wrapped one too)."""
    head = model.get_output_embeddings()
    if _is_plain_linear(head):
        return None
    return f"the LM head is a {type(head).__name__} (e.g. PEFT's modules_to_save), not a plain nn.Linear"


def bind_head(model: torch.nn.Module) -> Callable[[], None]:
    """Wrap ``model``'s forward (TRL's fused LM-head forward on the ``*ForCausalLM`` instance): a call with
    ``HEAD_KWARG`` runs `_fused_forward`, any other call the forward that was bound. Returns the undo (the trainer
    keeps the binding for the model's life, as TRL keeps its own)."""
    trl_forward = model.forward

    @functools.wraps(type(model).forward)  # as TRL's: generate() checks its model kwargs against this signature
    def forward(self, *args, **kwargs):
        form = kwargs.pop(HEAD_KWARG, None)
        rows = kwargs.pop(TARGET_ROWS_KEY, None)
        if form is None:
            return trl_forward(*args, **kwargs)
        return _fused_forward(self, self.get_output_embeddings(), form, rows, args, kwargs)

    return bind_forward(model, types.MethodType(forward, model))


def _fused_forward(self: torch.nn.Module, head: torch.nn.Module, form: LossForm, rows: torch.Tensor | None,
                   args: tuple, kwargs: dict) -> dict[str, Any]:
    """TRL's fused-head forward (backbone call, MoE auxiliary loss) with hf_accel's head: the summed loss in ``form``
    over the target rows, their count, and the entropy / top-1 sums (device tensors)."""
    kwargs.pop("fused_lm_head", None)
    kwargs.pop("num_items_in_batch", None)  # the reduction is compute_loss's
    labels, shift_labels = kwargs.pop("labels", None), kwargs.pop("shift_labels", None)
    text_config = self.config.get_text_config()
    kwargs["use_cache"] = False
    if getattr(text_config, "output_router_logits", False):
        kwargs.setdefault("output_router_logits", True)
    backbone_outputs = self.base_model(*args, **kwargs)
    hidden = backbone_outputs.last_hidden_state
    hidden_nh = hidden.reshape(-1, hidden.shape[-1]).to(head.weight.device)
    if shift_labels is not None:  # targets already aligned with the positions; the rows were listed from labels
        labels_n, rows = shift_labels.reshape(-1), None
    else:  # position t predicts label t + 1 (the labels move, not the hidden states)
        labels_n = F.pad(labels[:, 1:], (0, 1), value=IGNORE_INDEX).reshape(-1)
    labels_n = labels_n.to(hidden_nh.device)
    num_targets = labels_n.ne(IGNORE_INDEX).sum()
    if rows is not None:
        rows = rows.to(hidden_nh.device, non_blocking=True)
        hidden_nh, labels_n = hidden_nh.index_select(0, rows), labels_n.index_select(0, rows)
    summed, stats = linear_cross_entropy_stats(hidden_nh, head, labels_n, form=form,
                                               softcap=getattr(text_config, "final_logit_softcapping", None))
    aux_loss = None
    if kwargs.get("output_router_logits"):
        aux_loss = _load_balancing_loss(self, text_config, backbone_outputs, kwargs.get("attention_mask"))
    return {"summed_loss": summed, "num_targets": num_targets, "entropy_sum": stats[0], "top1": stats[1],
            "aux_loss": aux_loss}


def _load_balancing_loss(model: torch.nn.Module, text_config: Any, outputs: Any, attention_mask: Any):
    """The MoE load-balancing loss as TRL's fused forward computes it (Mixtral's ``load_balancing_loss_func``, of
    which every MoE family's modeling module holds its own copy: the model's own is used)."""
    import sys

    loss_func = getattr(sys.modules.get(type(model).__module__), "load_balancing_loss_func", None)
    if loss_func is None:
        raise ConfigurationError(
            f"router_aux_loss_coef is set, but {type(model).__name__}'s module defines no load_balancing_loss_func to "
            "compute the MoE auxiliary loss with; pass SFTConfig(router_aux_loss_coef=0.0) or "
            "AccelArguments(fused_ce=False) (TRL's own loss).")
    num_experts = getattr(text_config, "num_experts", None) or getattr(text_config, "num_local_experts", None)
    if num_experts is None:
        num_experts = model.num_experts
    return loss_func(outputs.router_logits, num_experts, text_config.num_experts_per_tok, attention_mask)


def compute_loss(trainer: Any, model: torch.nn.Module, inputs: dict, num_items_in_batch: Any,
                 rows: torch.Tensor | None) -> torch.Tensor:
    """TRL 1.16's ``SFTTrainer.compute_loss`` (its nll / dft / label-smoothing branches, training mode) with the
    loss and metrics from `_fused_forward`; the metrics stay device tensors until `resolve_metrics`."""
    args = trainer.args
    form = loss_form(args, trainer.label_smoother)
    inputs["use_cache"] = False
    if trainer.aux_loss_enabled:
        inputs["output_router_logits"] = True
    out = model(**inputs, fused_lm_head=True, **{HEAD_KWARG: form}, **({TARGET_ROWS_KEY: rows} if rows is not None
                                                                          else {}))
    return _reduce(trainer, out, inputs, num_items_in_batch, form)


def _reduce(trainer: Any, out: dict, inputs: dict, num_items_in_batch: Any, form: LossForm) -> torch.Tensor:
    args, accelerator = trainer.args, trainer.accelerator
    num_targets = out["num_targets"]
    if form.label_smoothing:  # transformers' LabelSmoother: its denominator is not clamped
        denominator = num_targets if num_items_in_batch is None else num_items_in_batch
        loss = out["summed_loss"] / torch.as_tensor(denominator, device=num_targets.device)
    else:
        num_tokens = num_targets if num_items_in_batch is None else num_items_in_batch
        loss = out["summed_loss"] / torch.as_tensor(num_tokens, device=num_targets.device).clamp(min=1)
    if args.average_tokens_across_devices and num_items_in_batch is not None:
        loss = loss * (accelerator.num_processes // trainer.get_tp_size())
    if trainer.aux_loss_enabled and not form.label_smoothing:  # TRL adds it on its nll / dft branch only
        steps = trainer.current_gradient_accumulation_steps if num_items_in_batch is not None else 1
        loss = loss + trainer.router_aux_loss_coef * out["aux_loss"] / steps
    _defer_metrics(trainer, inputs, num_targets, out["entropy_sum"], out["top1"], out["aux_loss"])
    return loss


def _defer_metrics(trainer: Any, inputs: dict, num_valid: torch.Tensor, entropy_sum: torch.Tensor,
                   top1: torch.Tensor, aux_loss: Any) -> None:
    """TRL's training metrics of one micro-batch, as device tensors (TRL reads each back at once: three host syncs
    per micro-batch)."""
    gather = trainer.accelerator.gather_for_metrics
    num_valid = gather(num_valid).sum()
    entropy_sum, num_correct = gather(entropy_sum.detach()).sum(), gather(top1).sum()
    metrics = trainer._metrics["train"]
    safe = num_valid.clamp(min=1)
    metrics["entropy"].append(torch.where(num_valid > 0, entropy_sum / safe, 0.0))
    metrics["mean_token_accuracy"].append(torch.where(num_valid > 0, num_correct / safe, 0.0))
    if "attention_mask" in inputs:
        tokens = gather(inputs["attention_mask"].sum()).sum()
    elif "position_ids" in inputs:
        position_ids = inputs["position_ids"]
        tokens = position_ids.size(1)  # host metadata: a device tensor of it would be a blocking copy
        if trainer.accelerator.num_processes > 1:
            tokens = gather(torch.tensor(tokens, device=position_ids.device)).sum()
    else:
        raise ValueError("Expected 'attention_mask' or 'position_ids' in inputs.")
    pending = trainer.__dict__.setdefault(DEFERRED, [])
    pending.append(tokens // trainer._tp_size)
    metrics["num_tokens"] = [trainer._total_train_tokens]  # brought up to date in resolve_metrics
    if trainer.aux_loss_enabled:
        metrics["aux_loss"].append(gather(aux_loss.detach()).mean())


def resolve_metrics(trainer: Any) -> None:
    """Read the deferred metrics back (one host read for all of them) into the plain numbers TRL's ``log`` averages,
    and add the deferred token counts to TRL's running total."""
    pending = trainer.__dict__.get(DEFERRED) or []
    metrics = trainer._metrics["train"]
    tensors = [v for values in metrics.values() for v in values if isinstance(v, torch.Tensor)]
    tensors += [t for t in pending if isinstance(t, torch.Tensor)]
    if not tensors and not pending:
        return
    numbers = iter([])
    if tensors:
        device = tensors[0].device
        numbers = iter(torch.stack([t.detach().double().reshape(()).to(device) for t in tensors]).tolist())
    for key, values in metrics.items():
        metrics[key] = [next(numbers) if isinstance(v, torch.Tensor) else v for v in values]
    if pending:
        trainer._total_train_tokens += int(sum(next(numbers) if isinstance(t, torch.Tensor) else t for t in pending))
        metrics["num_tokens"] = [trainer._total_train_tokens]
        pending.clear()
