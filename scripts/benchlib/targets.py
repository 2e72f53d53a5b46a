"""Target tokens: how many positions of a batch have a target (a label that is not -100 after the causal shift),
and how many of a whole data set a configuration's own data path labels as targets (its collator over its prepared
data: for TRL the labels it builds from completion masks). The prompt-masked workloads' records hold both, so the
table can say that every configuration trains the same targets."""
from __future__ import annotations

from typing import Any, Iterable, Mapping

import torch


def target_count(batch: Mapping[str, Any]) -> int:
    """Non-ignored targets after the causal shift (what transformers' loss averages over)."""
    return int((batch["labels"][:, 1:] != -100).sum())


def targets_where_they_are(batch: Mapping[str, Any]) -> torch.Tensor:
    """target_count as a tensor where the batch is (no host read in a timed step); pre-shifted ``shift_labels`` as
    given (a sequence-parallel shard's)."""
    if batch.get("shift_labels") is not None:
        return (batch["shift_labels"] != -100).sum()
    return (batch["labels"][..., 1:] != -100).sum()


def data_targets(batches: Iterable[Mapping[str, Any]]) -> int:
    """Target tokens over batches that cover a data set once (a configuration's own collator over its own data)."""
    return sum(target_count(b) for b in batches)


def trainer_data_targets(trainer: Any, chunk: int = 64) -> int:
    """The target tokens of a trainer's whole prepared train_dataset through its own collator (TRL's: its packed
    rows and the labels it built from the completion masks)."""
    dataset = trainer.train_dataset
    return data_targets(trainer.data_collator([dataset[i] for i in range(start, min(start + chunk, len(dataset)))])
                        for start in range(0, len(dataset), chunk))
