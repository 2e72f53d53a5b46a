"""Collators: packed-batch invariants (hypothesis over random lengths), padded output, overflow and bad input."""
import logging

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from hf_accel.data.collators import DataCollatorForPacking, DataCollatorForPadding
from hf_accel.errors import ConfigurationError, InvalidBatch

PAD = 0


def make_features(lengths, with_labels=True):
    """Documents whose token ids are unique across the batch (1 + running index), labels = ids (or absent)."""
    features, start = [], 1
    for n in lengths:
        ids = list(range(start, start + n))
        start += n
        features.append({"input_ids": ids, "labels": list(ids)} if with_labels else {"input_ids": ids})
    return features


def documents_of(batch):
    """Split a packed batch back into documents using cu_seq_lens over the flattened tokens."""
    cu = batch["cu_seq_lens_q"].tolist()
    flat = {k: batch[k].flatten().tolist() for k in ("input_ids", "labels", "position_ids")}
    return [{k: v[a:b] for k, v in flat.items()} for a, b in zip(cu[:-1], cu[1:])]


lengths_st = st.lists(st.integers(1, 40), min_size=1, max_size=12)


@settings(max_examples=150, deadline=None)
@given(lengths=lengths_st, max_tokens=st.one_of(st.none(), st.integers(40, 90)), multiple=st.sampled_from([None, 8]))
def test_packed_batch_invariants(lengths, max_tokens, multiple):
    # single-token documents have no target; keep them so that every token can be accounted for
    features = make_features(lengths)
    collator = DataCollatorForPacking(PAD, max_tokens=max_tokens, pad_to_multiple_of=multiple, all_masked="keep")
    batch = collator(features)
    B, S = batch["input_ids"].shape
    cu = batch["cu_seq_lens_q"]
    assert cu.dtype == torch.int32 and torch.equal(cu, batch["cu_seq_lens_k"])
    assert cu[0] == 0 and cu[-1] == B * S and bool((cu[1:] > cu[:-1]).all())
    assert "attention_mask" not in batch
    assert isinstance(batch["max_length_q"], int) and batch["max_length_q"] == int((cu[1:] - cu[:-1]).max())
    if multiple:
        assert S % multiple == 0
    if max_tokens is not None:
        assert S <= (max_tokens if multiple is None else -(-max_tokens // multiple) * multiple)
    # documents never span rows: every row boundary is a document boundary
    assert set(range(0, B * S + 1, S)) <= set(cu.tolist())
    docs = documents_of(batch)
    real = [d for d in docs if d["input_ids"][0] != PAD]
    # every real token appears exactly once, and each document is contiguous and intact
    assert sorted(tuple(d["input_ids"]) for d in real) == sorted(tuple(f["input_ids"]) for f in features)
    for d in docs:
        assert d["position_ids"] == list(range(len(d["input_ids"])))  # restart per document
        assert d["labels"][0] == -100  # nothing predicts across a boundary
    for d in real:
        assert d["labels"][1:] == d["input_ids"][1:]
    for d in (d for d in docs if d["input_ids"][0] == PAD):  # padding tails are dummy documents
        assert set(d["input_ids"]) == {PAD} and set(d["labels"]) == {-100}
    # the per-token shifted target never belongs to another document
    flat_labels = batch["labels"].flatten().tolist()
    for b in cu[1:-1].tolist():
        assert flat_labels[b] == -100
    # no padding beyond the tail: padded slots = B*S - real tokens
    assert sum(len(d["input_ids"]) for d in real) == sum(lengths)


@settings(max_examples=50, deadline=None)
@given(lengths=st.lists(st.integers(1, 60), min_size=1, max_size=8), max_tokens=st.integers(5, 30))
def test_split_and_truncate_keep_or_count_every_token(lengths, max_tokens):
    features = make_features(lengths)
    split = DataCollatorForPacking(PAD, max_tokens=max_tokens, overflow="split", all_masked="keep")
    docs = [d for d in documents_of(split(features)) if d["input_ids"][0] != PAD]
    assert sorted(t for d in docs for t in d["input_ids"]) == list(range(1, sum(lengths) + 1))
    assert max(len(d["input_ids"]) for d in docs) <= max_tokens
    assert split.stats.split_docs == sum(n > max_tokens for n in lengths)

    trunc = DataCollatorForPacking(PAD, max_tokens=max_tokens, overflow="truncate", all_masked="keep")
    docs = [d for d in documents_of(trunc(features)) if d["input_ids"][0] != PAD]
    assert sum(len(d["input_ids"]) for d in docs) + trunc.stats.truncated_tokens == sum(lengths)
    assert trunc.stats.truncated_docs == sum(n > max_tokens for n in lengths)


def test_overflow_error_names_the_options():
    with pytest.raises(InvalidBatch, match="overflow='truncate'"):
        DataCollatorForPacking(PAD, max_tokens=4)(make_features([3, 9]))


def test_padding_collator_right_and_left():
    features = make_features([3, 5], with_labels=False)
    right = DataCollatorForPadding(PAD, pad_to_multiple_of=4)(features)
    assert right["input_ids"].shape == (2, 8)
    assert right["attention_mask"].tolist() == [[1, 1, 1, 0, 0, 0, 0, 0], [1, 1, 1, 1, 1, 0, 0, 0]]
    assert right["labels"][0].tolist() == [-100, 2, 3, -100, -100, -100, -100, -100]
    left = DataCollatorForPadding(PAD, padding_side="left")(features)
    assert left["input_ids"][0].tolist() == [PAD, PAD, 1, 2, 3]
    assert left["labels"][0].tolist() == [-100, -100, -100, 2, 3]  # the pad before "1" must not predict it
    assert left["attention_mask"][0].tolist() == [0, 0, 1, 1, 1]


def test_upstream_padding_is_removed_by_attention_mask():
    feature = {"input_ids": [5, 6, PAD], "attention_mask": [1, 1, 0], "labels": [5, 6, -100]}
    batch = DataCollatorForPacking(PAD)([feature])
    assert batch["input_ids"].tolist() == [[5, 6]]


def test_fallback_to_padding_keeps_documents_and_targets(caplog):
    features = make_features([4, 7, 2])
    collator = DataCollatorForPacking(PAD, max_tokens=16)
    packed = collator(features)
    with caplog.at_level(logging.WARNING, logger="hf_accel.data.collators"):
        collator.use_padding("backend 'sdpa' has no varlen support")
        collator.use_padding("backend 'sdpa' has no varlen support")
    assert sum("no varlen support" in r.message for r in caplog.records) == 1
    padded = collator(features)
    assert "attention_mask" in padded and "cu_seq_lens_q" not in padded
    assert padded["input_ids"].shape == (3, 7)
    # the same target tokens
    assert sorted(packed["labels"][packed["labels"] != -100].tolist()) == sorted(
        padded["labels"][padded["labels"] != -100].tolist()
    )


def test_stats_count_everything():
    collator = DataCollatorForPacking(PAD, max_tokens=8, overflow="truncate", drop_empty=True, pad_to_multiple_of=8)
    features = make_features([3, 10]) + [{"input_ids": []}, {"input_ids": [7, 8], "labels": [-100, -100]}]
    collator(features)
    s = collator.stats
    assert (s.documents, s.real_tokens, s.truncated_docs, s.truncated_tokens) == (2, 11, 1, 2)
    assert (s.empty_docs_dropped, s.all_masked_docs, s.slots) == (1, 1, 16)
    assert s.padding_fraction == pytest.approx(5 / 16)


# --- bad input -----------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("collator_cls", [DataCollatorForPacking, DataCollatorForPadding])
def test_empty_document_raises_unless_dropped(collator_cls):
    with pytest.raises(InvalidBatch, match="drop_empty=True"):
        collator_cls(PAD)([{"input_ids": [1, 2]}, {"input_ids": []}])
    collator = collator_cls(PAD, drop_empty=True)
    assert collator([{"input_ids": [1, 2]}, {"input_ids": []}])["input_ids"].numel() == 2
    assert collator.stats.empty_docs_dropped == 1


@pytest.mark.parametrize("collator_cls", [DataCollatorForPacking, DataCollatorForPadding])
def test_float_input_ids_raise(collator_cls):
    with pytest.raises(InvalidBatch, match="dtype torch.float32"):
        collator_cls(PAD)([{"input_ids": torch.tensor([1.0, 2.0])}])
    with pytest.raises(InvalidBatch, match="expected ints"):
        collator_cls(PAD)([{"input_ids": [1.0, 2.0]}])


@pytest.mark.parametrize("collator_cls", [DataCollatorForPacking, DataCollatorForPadding])
def test_ragged_labels_raise(collator_cls):
    with pytest.raises(InvalidBatch, match="labels has length 2 but input_ids has 3"):
        collator_cls(PAD)([{"input_ids": [1, 2, 3], "labels": [1, 2]}])


def test_all_masked_policies():
    features = [{"input_ids": [1, 2, 3]}, {"input_ids": [4, 5], "labels": [4, -100]}]
    with pytest.raises(InvalidBatch, match="no target token"):
        DataCollatorForPacking(PAD, all_masked="error")(features)
    dropped = DataCollatorForPacking(PAD)
    assert dropped(features)["input_ids"].tolist() == [[1, 2, 3]] and dropped.stats.all_masked_docs == 1
    kept = DataCollatorForPacking(PAD, all_masked="keep")
    assert kept(features)["input_ids"].numel() == 5 and kept.stats.all_masked_docs == 1
    with pytest.raises(InvalidBatch, match="had no target token"):
        DataCollatorForPadding(PAD)([features[1]])


def test_bad_configuration_raises():
    with pytest.raises(ConfigurationError):
        DataCollatorForPacking(PAD, overflow="drop")
    with pytest.raises(ConfigurationError):
        DataCollatorForPadding(PAD, padding_side="middle")
    with pytest.raises(InvalidBatch, match="empty list"):
        DataCollatorForPadding(PAD)([])
