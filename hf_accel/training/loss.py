"""Loss normalisation that does not depend on how samples are grouped into batches.

A step's loss is ``sum of token cross-entropies over all its targets / number of targets in the whole step`` (all
gradient-accumulation micro-batches, all ranks). This is transformers' ``num_items_in_batch`` convention: the
Trainer counts ``labels[..., 1:] != -100`` over the micro-batches of a step and the model's ``ForCausalLMLoss``
divides a summed cross-entropy by it. Padded, packed and regrouped batches of the same samples then give the same
loss and the same gradients; a per-micro-batch mean does not (it weights short batches more).

Per-sequence averaging (``per_document_loss_sum`` / ``count_documents``) instead gives every document the same weight:
``loss = sum over documents of (the document's mean token CE) / number of documents in the step``.
"""
from __future__ import annotations

from typing import Iterable

import torch
import torch.distributed as dist
import torch.nn.functional as F

from ..errors import InvalidBatch

IGNORE_INDEX = -100


def shift_labels(labels: torch.Tensor, ignore_index: int = IGNORE_INDEX) -> torch.Tensor:
    """Targets aligned with logits, as ForCausalLMLoss does: position t predicts ``labels[t + 1]``; the last
    position of a row predicts nothing. ``labels (B, S) -> (B, S)``."""
    return F.pad(labels, (0, 1), value=ignore_index)[..., 1:]


def count_target_tokens(labels: torch.Tensor, ignore_index: int = IGNORE_INDEX) -> torch.Tensor:
    """Number of prediction targets in ``labels (B, S)`` (the Trainer's ``labels[..., 1:] != -100``)."""
    return labels[..., 1:].ne(ignore_index).sum()


def _all_reduce_sum(count: torch.Tensor) -> torch.Tensor:
    if dist.is_available() and dist.is_initialized():
        count = count.clone()
        dist.all_reduce(count, op=dist.ReduceOp.SUM)
    return count


def global_num_items(micro_batch_labels: Iterable[torch.Tensor], ignore_index: int = IGNORE_INDEX) -> torch.Tensor:
    """Targets over all micro-batches of one optimizer step, summed over ranks when torch.distributed is
    initialised (the Trainer's ``num_items_in_batch`` with ``average_tokens_across_devices=True``)."""
    counts = [count_target_tokens(labels, ignore_index) for labels in micro_batch_labels]
    if not counts:
        raise InvalidBatch("global_num_items received no micro-batch; pass the labels of every micro-batch of a step.")
    return _all_reduce_sum(torch.stack(counts).sum())


def summed_causal_lm_loss(logits: torch.Tensor, labels: torch.Tensor, ignore_index: int = IGNORE_INDEX) -> torch.Tensor:
    """Sum of token cross-entropies (fp32) of ``logits (B, S, V)`` against shifted ``labels (B, S)``."""
    if logits.shape[:-1] != labels.shape:
        raise InvalidBatch(f"logits {tuple(logits.shape)} and labels {tuple(labels.shape)} disagree on (B, S).")
    targets = shift_labels(labels, ignore_index).to(logits.device)
    return F.cross_entropy(
        logits.float().flatten(0, -2), targets.flatten(), ignore_index=ignore_index, reduction="sum"
    )


def causal_lm_loss(
    logits: torch.Tensor, labels: torch.Tensor, num_items_in_batch: torch.Tensor | int, ignore_index: int = IGNORE_INDEX
) -> torch.Tensor:
    """``summed_causal_lm_loss / num_items_in_batch``; a step without any target gives 0 (not NaN)."""
    total = summed_causal_lm_loss(logits, labels, ignore_index)
    if torch.is_tensor(num_items_in_batch):
        num_items_in_batch = num_items_in_batch.to(total.device)
    return total / (num_items_in_batch if float(num_items_in_batch) > 0 else 1)


def document_ids(labels: torch.Tensor, position_ids: torch.Tensor | None = None) -> torch.Tensor:
    """Index of the document each token belongs to, ``(B, S) long``, numbered over the whole batch.

    Packed batches: a document starts wherever ``position_ids == 0``. Padded batches (``position_ids=None``): one
    document per row.
    """
    if position_ids is None:
        rows = torch.arange(labels.shape[0], device=labels.device)
        return rows[:, None].expand_as(labels)
    if position_ids.shape != labels.shape:
        raise InvalidBatch(f"position_ids {tuple(position_ids.shape)} and labels {tuple(labels.shape)} differ.")
    starts = position_ids.eq(0)
    starts[:, 0] = True  # a row always starts a document (documents never span rows)
    return starts.flatten().cumsum(0).view_as(labels) - 1


def per_document_loss_sum(
    logits: torch.Tensor,
    labels: torch.Tensor,
    position_ids: torch.Tensor | None = None,
    ignore_index: int = IGNORE_INDEX,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-sequence averaging: returns (sum over documents of their mean token CE, number of documents with a
    target). Divide the first by the step's global document count (``count_documents`` summed like
    ``global_num_items``). Documents without targets (e.g. padding tails) count for nothing."""
    targets = shift_labels(labels, ignore_index).to(logits.device)
    token_ce = F.cross_entropy(
        logits.float().flatten(0, -2), targets.flatten(), ignore_index=ignore_index, reduction="none"
    )
    doc = document_ids(labels, position_ids).to(logits.device).flatten()
    is_target = targets.flatten().ne(ignore_index)
    num_docs = int(doc.max()) + 1  # host sync, once per call: sizes the per-document accumulators
    ce_sum = torch.zeros(num_docs, device=logits.device).index_add(0, doc, token_ce * is_target)
    n_targets = torch.zeros(num_docs, device=logits.device).index_add(0, doc, is_target.float())
    has_target = n_targets > 0
    return (ce_sum[has_target] / n_targets[has_target]).sum(), has_target.sum()


def count_documents(
    labels: torch.Tensor, position_ids: torch.Tensor | None = None, ignore_index: int = IGNORE_INDEX
) -> torch.Tensor:
    """Documents with at least one target in a batch (the denominator for per-sequence averaging)."""
    targets = shift_labels(labels, ignore_index).ne(ignore_index).flatten()
    doc = document_ids(labels, position_ids).flatten()
    return torch.tensor(doc[targets].unique().numel(), dtype=torch.long)


def global_num_documents(
    micro_batches: Iterable[tuple[torch.Tensor, torch.Tensor | None]], ignore_index: int = IGNORE_INDEX
) -> torch.Tensor:
    """Documents with a target over all ``(labels, position_ids or None)`` micro-batches of a step, and over ranks
    when torch.distributed is initialised."""
    counts = [count_documents(labels, pos, ignore_index) for labels, pos in micro_batches]
    if not counts:
        raise InvalidBatch("global_num_documents received no micro-batch.")
    return _all_reduce_sum(torch.stack(counts).sum())
