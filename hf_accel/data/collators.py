"""Collators for causal-LM fine-tuning: dynamic padding and padding-free packing.

Both take pre-tokenized features (``input_ids``, optional ``labels``, optional ``attention_mask``) and emit the batch
format the patched models consume (see the package README):

- padded: ``input_ids``, ``labels`` (-100 on padding), ``attention_mask``, all ``(B, S) long``;
- packed: ``input_ids``, ``labels``, ``position_ids`` ``(B, S) long``; ``cu_seq_lens_q/k`` ``(num_docs + 1,) int32``
  over the flattened ``B * S`` tokens; ``max_length_q/k`` Python ints. The first label of every document is -100, so
  no token is trained to predict across a document boundary. A row's padding tail is its own dummy document.

With ``target_rows=True`` both also emit ``hf_accel_target_rows`` ``(T,) int64``: the flattened ``B * S`` positions
whose shifted label (what position t predicts: label t + 1) is a target, for hf_accel's fused loss, which then runs
the LM head on those rows only. A model not patched with the fused loss must not receive it (it is not a transformers
argument): the hf_accel Trainer turns it on only where the fused loss consumes it.

Nothing is dropped silently: every truncation, split, dropped empty or all-masked document is counted in
``collator.stats``.
"""
from __future__ import annotations

import logging
import math
from dataclasses import asdict, dataclass
from typing import Any, Literal, Mapping, Sequence

import torch

from ..errors import ConfigurationError, InvalidBatch
from .sampling import best_fit_decreasing

logger = logging.getLogger(__name__)

IGNORE_INDEX = -100
# Sequence-parallel rows only: 1 on document tokens, 0 on the padding tail, a (rows, length) tensor so that DeepSpeed's
# Ulysses loader shards it with the rest; the Trainer's throughput meter reads it and drops it before the model call.
REAL_TOKENS_KEY = "hf_accel_real_tokens"
# target_rows=True: the flattened positions with a target, which hf_accel's fused loss consumes (and removes)
TARGET_ROWS_KEY = "hf_accel_target_rows"

Feature = Mapping[str, Any]


@dataclass
class CollatorStats:
    """Running counters of what a collator saw and emitted (since construction or ``reset()``)."""

    batches: int = 0
    documents: int = 0  # documents emitted (a split document counts once per piece)
    real_tokens: int = 0
    slots: int = 0  # token positions emitted, real + padding
    truncated_docs: int = 0
    truncated_tokens: int = 0
    split_docs: int = 0
    empty_docs_dropped: int = 0
    all_masked_docs: int = 0  # documents with no target token (dropped or kept, see ``all_masked``)

    @property
    def padding_fraction(self) -> float:
        return 1.0 - self.real_tokens / self.slots if self.slots else 0.0

    def as_dict(self) -> dict[str, float]:
        return {**asdict(self), "padding_fraction": self.padding_fraction}

    def reset(self) -> None:
        for name in asdict(self):
            setattr(self, name, 0)


def _as_int_list(value: Any, field: str, index: int) -> list[int]:
    """Return ``value`` as a list of ints; raise InvalidBatch for float/bool tensors or non-integer entries."""
    if isinstance(value, torch.Tensor):
        if value.dtype.is_floating_point or value.dtype.is_complex or value.dtype == torch.bool:
            raise InvalidBatch(
                f"feature {index}: {field} has dtype {value.dtype}; token ids and labels must be integers "
                f"(torch.long). Tokenize with a tokenizer or cast with .long() before collating."
            )
        if value.dim() != 1:
            raise InvalidBatch(f"feature {index}: {field} has shape {tuple(value.shape)}; expected one 1-D sequence.")
        return value.tolist()
    if not isinstance(value, Sequence) or isinstance(value, (str, bytes)):
        raise InvalidBatch(f"feature {index}: {field} is a {type(value).__name__}; expected a list of ints.")
    out = list(value)
    for item in out:
        if isinstance(item, bool) or not isinstance(item, int):
            raise InvalidBatch(
                f"feature {index}: {field} contains {item!r} ({type(item).__name__}); expected ints only. "
                f"Float token ids usually mean the wrong column was passed; cast to int after checking."
            )
    return out


def validate_feature(feature: Feature, index: int = 0) -> tuple[list[int], list[int]]:
    """Check one feature and return its ``(input_ids, labels)``; labels default to the input ids.

    Positions where ``attention_mask`` is 0 (a feature padded upstream) are removed.
    Raises InvalidBatch for a missing ``input_ids``, non-integer values or fields of different lengths.
    """
    if "input_ids" not in feature:
        raise InvalidBatch(f"feature {index} has keys {sorted(feature)}; 'input_ids' is required.")
    ids = _as_int_list(feature["input_ids"], "input_ids", index)
    labels = ids if feature.get("labels") is None else _as_int_list(feature["labels"], "labels", index)
    mask = feature.get("attention_mask")
    mask = None if mask is None else _as_int_list(mask, "attention_mask", index)
    for name, other in (("labels", labels), ("attention_mask", mask)):
        if other is not None and len(other) != len(ids):
            raise InvalidBatch(
                f"feature {index}: {name} has length {len(other)} but input_ids has {len(ids)}; "
                f"they must be aligned token for token."
            )
    if mask is not None and not all(m == 1 for m in mask):
        keep = [i for i, m in enumerate(mask) if m]
        ids, labels = [ids[i] for i in keep], [labels[i] for i in keep]
    return list(ids), list(labels)


def target_positions(labels: torch.Tensor) -> torch.Tensor:
    """``(T,) int64``: the flattened positions ``b * S + s`` of ``labels (B, S)`` whose target ``labels[b, s + 1]``
    is not -100 (transformers' causal shift; the last position of a row predicts nothing). Host tensors: no sync."""
    has_target = torch.zeros(labels.shape, dtype=torch.bool)
    has_target[:, :-1] = labels[:, 1:] != IGNORE_INDEX
    return has_target.flatten().nonzero().flatten()


class _BaseCollator:
    """Shared validation and accounting: empty and all-masked documents; the target rows."""

    def __init__(
        self,
        pad_token_id: int,
        pad_to_multiple_of: int | None,
        drop_empty: bool,
        all_masked: Literal["drop", "keep", "error"],
        target_rows: bool = False,
    ) -> None:
        if pad_to_multiple_of is not None and pad_to_multiple_of < 1:
            raise ConfigurationError(f"pad_to_multiple_of={pad_to_multiple_of}; use a positive int or None.")
        if all_masked not in ("drop", "keep", "error"):
            raise ConfigurationError(f"all_masked={all_masked!r}; allowed: 'drop', 'keep', 'error'.")
        self.pad_token_id = int(pad_token_id)
        self.pad_to_multiple_of = pad_to_multiple_of
        self.drop_empty = drop_empty
        self.all_masked = all_masked
        self.target_rows = target_rows
        self.stats = CollatorStats()
        self._warned_all_masked = False

    def _round_up(self, length: int) -> int:
        m = self.pad_to_multiple_of
        return length if m is None else -(-length // m) * m

    def _documents(self, features: Sequence[Feature]) -> list[tuple[list[int], list[int]]]:
        """Validate features; drop (and count) empty and, by policy, all-masked ones."""
        if len(features) == 0:
            raise InvalidBatch("received an empty list of features; a batch needs at least one document.")
        docs = []
        for index, feature in enumerate(features):
            ids, labels = validate_feature(feature, index)
            if not ids:
                if not self.drop_empty:
                    raise InvalidBatch(
                        f"feature {index} has no tokens. Filter empty examples out of the dataset, or pass "
                        f"drop_empty=True to drop them here (they are counted in collator.stats.empty_docs_dropped)."
                    )
                self.stats.empty_docs_dropped += 1
                continue
            # The label of a document's first token is never a target (the model shifts labels by one).
            if all(label == IGNORE_INDEX for label in labels[1:]):
                self.stats.all_masked_docs += 1
                if self.all_masked == "error":
                    raise InvalidBatch(
                        f"feature {index} has no target token (all labels after the first are -100). "
                        f"Pass all_masked='drop' to skip such documents or 'keep' to train on them as context only."
                    )
                if self.all_masked == "drop":
                    self._warn_all_masked_once()
                    continue
            docs.append((ids, labels))
        if not docs:
            raise InvalidBatch(
                f"all {len(features)} features of this batch were empty or had no target token; "
                f"see collator.stats ({self.stats.as_dict()}). Filter such examples out of the dataset."
            )
        return docs

    def _warn_all_masked_once(self) -> None:
        if not self._warned_all_masked:
            self._warned_all_masked = True
            logger.warning(
                "dropping documents without any target token (all labels -100); "
                "they are counted in collator.stats.all_masked_docs (this warning is shown once)."
            )

    def _pad_rows(
        self, docs: Sequence[tuple[list[int], list[int]]], padding_side: Literal["left", "right"]
    ) -> dict[str, torch.Tensor]:
        """One document per row, padded to the longest (rounded up to ``pad_to_multiple_of``)."""
        seq_len = self._round_up(max(len(ids) for ids, _ in docs))
        input_ids = torch.full((len(docs), seq_len), self.pad_token_id, dtype=torch.long)
        labels = torch.full((len(docs), seq_len), IGNORE_INDEX, dtype=torch.long)
        attention_mask = torch.zeros((len(docs), seq_len), dtype=torch.long)
        for row, (ids, doc_labels) in enumerate(docs):
            span = slice(0, len(ids)) if padding_side == "right" else slice(seq_len - len(ids), seq_len)
            input_ids[row, span] = torch.tensor(ids, dtype=torch.long)
            # A document's first token is never a target; with left padding the pad before it would otherwise
            # be trained to predict it.
            labels[row, span] = torch.tensor([IGNORE_INDEX] + doc_labels[1:], dtype=torch.long)
            attention_mask[row, span] = 1
        self.stats.batches += 1
        self.stats.documents += len(docs)
        self.stats.real_tokens += sum(len(ids) for ids, _ in docs)
        self.stats.slots += input_ids.numel()
        return self._with_target_rows({"input_ids": input_ids, "labels": labels, "attention_mask": attention_mask})

    def _with_target_rows(self, batch: dict[str, Any]) -> dict[str, Any]:
        if self.target_rows:
            batch[TARGET_ROWS_KEY] = target_positions(batch["labels"])
        return batch


class DataCollatorForPadding(_BaseCollator):
    """Dynamic padding for causal LM: pad to the longest feature of the batch (optionally to a multiple).

    Labels default to ``input_ids``; padding and each document's first token get label -100 (the latter is never a
    target, as in packed mode), padding gets attention_mask 0. ``all_masked`` decides what
    happens to a document without any target token: "drop" (default; counted and warned once), "keep" (train on it
    as context only; it adds nothing to the loss), or "error". ``target_rows``: also emit ``TARGET_ROWS_KEY`` (the
    positions with a target) for hf_accel's fused loss (see the module docstring).
    """

    def __init__(
        self,
        pad_token_id: int,
        pad_to_multiple_of: int | None = None,
        padding_side: Literal["left", "right"] = "right",
        drop_empty: bool = False,
        all_masked: Literal["drop", "keep", "error"] = "drop",
        target_rows: bool = False,
    ) -> None:
        super().__init__(pad_token_id, pad_to_multiple_of, drop_empty, all_masked, target_rows)
        if padding_side not in ("left", "right"):
            raise ConfigurationError(f"padding_side={padding_side!r}; allowed: 'left', 'right'.")
        self.padding_side = padding_side

    def __call__(self, features: Sequence[Feature]) -> dict[str, torch.Tensor]:
        return self._pad_rows(self._documents(features), self.padding_side)


class DataCollatorForPacking(_BaseCollator):
    """Padding-free collator: packs documents into rows of at most ``max_tokens`` tokens (best fit decreasing).

    ``max_tokens=None`` puts the whole batch in one row. Documents longer than ``max_tokens`` follow ``overflow``:
    "error" raises InvalidBatch, "truncate" keeps the first ``max_tokens`` tokens, "split" cuts the document into
    ``max_tokens``-long pieces that become separate documents (each piece's first label is -100); all are counted.
    Rows shorter than the longest (or than ``pad_to_multiple_of``) get a padding tail that is its own dummy document.

    When the attention backend cannot do varlen, call ``use_padding(reason)`` (or pass ``fallback_to_padding=True``):
    the collator then emits padded batches (one document per row) with the same documents and targets.

    ``target_rows=True`` adds ``TARGET_ROWS_KEY``: the positions of the flattened rows whose shifted label is a target,
    listed here on the host like ``cu_seq_lens``, so hf_accel's fused loss runs the LM head on those rows only (prompt
    tokens cost no head work) without a device sync. Only for a model whose loss is hf_accel's fused loss
    (``patch(model, fused_ce=True)``, or "auto" on CUDA); the hf_accel Trainer sets it then. Not emitted under
    ``sequence_parallel`` (DeepSpeed's loader shards every tensor along the sequence; the loss then takes every row).
    """

    def __init__(
        self,
        pad_token_id: int,
        max_tokens: int | None = None,
        overflow: Literal["error", "truncate", "split"] = "error",
        pad_to_multiple_of: int | None = None,
        drop_empty: bool = False,
        all_masked: Literal["drop", "keep", "error"] = "drop",
        fallback_to_padding: bool = False,
        target_rows: bool = False,
    ) -> None:
        super().__init__(pad_token_id, pad_to_multiple_of, drop_empty, all_masked, target_rows)
        if max_tokens is not None and max_tokens < 1:
            raise ConfigurationError(f"max_tokens={max_tokens}; use a positive int or None (one row for the batch).")
        if overflow not in ("error", "truncate", "split"):
            raise ConfigurationError(f"overflow={overflow!r}; allowed: 'error', 'truncate', 'split'.")
        self.max_tokens = max_tokens
        self.overflow = overflow
        self.sp_size, self.sp_row_length = 1, None  # sequence_parallel()
        self.fallback_to_padding = False
        if fallback_to_padding:
            self.use_padding("fallback_to_padding=True was passed")

    def sequence_parallel(self, size: int, row_length: int | None = None) -> None:
        """Emit what Ulysses sequence parallelism (DeepSpeed's ``UlyssesSPDataLoaderAdapter``) can shard: rows whose
        length divides by ``size`` (the padding tail stays its own dummy document) and only (rows, length) tensors,
        so no ``cu_seq_lens_*`` / ``max_length_*`` (the attention wrapper gathers ``position_ids`` instead) and no
        ``TARGET_ROWS_KEY``, plus ``REAL_TOKENS_KEY``. ``row_length`` (the token budget): every row padded to it, rounded up to a multiple of
        ``size``, because the adapter all-gathers the rows of every rank in the group, which needs equal shapes
        (gloo refuses unequal ones)."""
        if size < 1:
            raise ConfigurationError(f"sequence parallel size {size}; use a positive int.")
        if row_length is not None and row_length < 1:
            raise ConfigurationError(f"row_length={row_length}; use a positive int or None.")
        if self.fallback_to_padding:
            raise ConfigurationError("sequence parallelism needs packed rows; this collator emits padded ones "
                                     "(an attention mask the Ulysses wrapper cannot shard)")
        base = self.pad_to_multiple_of or 1
        self.pad_to_multiple_of = base * size // math.gcd(base, size)
        self.sp_size, self.sp_row_length = size, row_length

    def use_padding(self, reason: str) -> None:
        """Switch to padded output (for backends without varlen support); logs ``reason`` once."""
        if not self.fallback_to_padding:
            logger.warning("DataCollatorForPacking emits padded batches instead of packed ones: %s", reason)
        self.fallback_to_padding = True

    def __call__(self, features: Sequence[Feature]) -> dict[str, Any]:
        docs = self._fit(self._documents(features))
        if self.fallback_to_padding:
            return self._pad_rows(docs, "right")
        return self._pack(docs)

    def _fit(self, docs: list[tuple[list[int], list[int]]]) -> list[tuple[list[int], list[int]]]:
        """Apply the overflow policy to documents longer than ``max_tokens``."""
        cap = self.max_tokens
        if cap is None:
            return docs
        fitted = []
        for index, (ids, labels) in enumerate(docs):
            if len(ids) <= cap:
                fitted.append((ids, labels))
            elif self.overflow == "error":
                raise InvalidBatch(
                    f"document {index} has {len(ids)} tokens, more than max_tokens={cap}. Pass overflow='truncate' "
                    f"or overflow='split' to the collator, raise max_tokens, or truncate when tokenizing."
                )
            elif self.overflow == "truncate":
                self.stats.truncated_docs += 1
                self.stats.truncated_tokens += len(ids) - cap
                fitted.append((ids[:cap], labels[:cap]))
            else:
                self.stats.split_docs += 1
                fitted.extend((ids[s : s + cap], labels[s : s + cap]) for s in range(0, len(ids), cap))
        return fitted

    def _pack(self, docs: list[tuple[list[int], list[int]]]) -> dict[str, Any]:
        cap = self.max_tokens if self.max_tokens is not None else sum(len(ids) for ids, _ in docs)
        rows = best_fit_decreasing([len(ids) for ids, _ in docs], cap)
        rows.sort(key=min)  # keep rows in roughly the incoming order, for readability of batches
        seq_len = self._round_up(max(sum(len(docs[d][0]) for d in row) for row in rows))
        if self.sp_size > 1 and self.sp_row_length is not None:
            target = self._round_up(self.sp_row_length)
            if seq_len > target:
                raise InvalidBatch(f"a packed row of {seq_len} tokens is longer than the sequence-parallel row length "
                                   f"{target}; batch at most {self.sp_row_length} tokens (the token budget) per row.")
            seq_len = target
        input_ids, labels, position_ids, doc_lens, real_lens = [], [], [], [], []
        for row in rows:
            row_ids, row_labels, row_pos = [], [], []
            for d in sorted(row):
                ids, doc_labels = docs[d]
                row_ids += ids
                row_labels += [IGNORE_INDEX] + doc_labels[1:]
                row_pos += range(len(ids))
                doc_lens.append(len(ids))
            tail = seq_len - len(row_ids)
            real_lens.append(len(row_ids))
            if tail:  # the padding tail is a dummy document, so no attention mask is needed
                row_ids += [self.pad_token_id] * tail
                row_labels += [IGNORE_INDEX] * tail
                row_pos += range(tail)
                doc_lens.append(tail)
            input_ids.append(row_ids)
            labels.append(row_labels)
            position_ids.append(row_pos)
        cu_seq_lens = torch.zeros(len(doc_lens) + 1, dtype=torch.int32)
        cu_seq_lens[1:] = torch.tensor(doc_lens, dtype=torch.int64).cumsum(0).to(torch.int32)
        max_length = max(doc_lens)
        self.stats.batches += 1
        self.stats.documents += len(docs)
        self.stats.real_tokens += sum(len(ids) for ids, _ in docs)
        self.stats.slots += len(rows) * seq_len
        rows_out = {
            "input_ids": torch.tensor(input_ids, dtype=torch.long),
            "labels": torch.tensor(labels, dtype=torch.long),
            "position_ids": torch.tensor(position_ids, dtype=torch.long),
        }
        if self.sp_size > 1:  # no target rows: a (T,) list cannot be sharded along the sequence
            real = torch.arange(seq_len)[None, :] < torch.tensor(real_lens)[:, None]  # the tail is not real
            return {**rows_out, REAL_TOKENS_KEY: real.to(torch.int8)}
        return self._with_target_rows({
            **rows_out,
            "cu_seq_lens_q": cu_seq_lens,
            "cu_seq_lens_k": cu_seq_lens.clone(),
            "max_length_q": max_length,
            "max_length_k": max_length,
        })
