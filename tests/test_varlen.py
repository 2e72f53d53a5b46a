"""Batch metadata: documents from padding masks and position_ids, once per forward, int32 guard."""
from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import hf_accel
from hf_accel.attention import varlen
from hf_accel.errors import InvalidBatch
from tiny_models import VOCAB, make


def _rows_from_docs(rows: list[list[int]], width: int, left: bool):
    """Build mask and position_ids for rows holding documents of the given lengths, padded to width."""
    mask = torch.zeros(len(rows), width, dtype=torch.long)
    pos = torch.zeros(len(rows), width, dtype=torch.long)
    for r, docs in enumerate(rows):
        used = sum(docs)
        offset = width - used if left else 0
        mask[r, offset:offset + used] = 1
        pos[r, offset:offset + used] = torch.cat([torch.arange(n) for n in docs])
    return mask, pos


@settings(max_examples=60, deadline=None)
@given(
    rows=st.lists(st.lists(st.integers(1, 6), min_size=1, max_size=4), min_size=1, max_size=4),
    extra=st.integers(0, 3),
    left=st.booleans(),
)
def test_documents_from_mask_and_positions(rows, extra, left):
    width = max(sum(r) for r in rows) + extra
    mask, pos = _rows_from_docs(rows, width, left)
    meta = varlen.from_mask_and_positions(mask, pos, len(rows), width, torch.device("cpu"))
    lengths = [n for docs in rows for n in docs]
    assert meta.cu_seqlens.dtype == torch.int32
    assert meta.cu_seqlens.tolist() == [0, *torch.tensor(lengths).cumsum(0).tolist()]
    assert isinstance(meta.max_seqlen, int) and meta.max_seqlen == max(lengths)
    # unpad keeps exactly the real tokens in order; pad puts them back and zeroes the rest
    x = torch.arange(len(rows) * width, dtype=torch.float32).view(len(rows), width, 1, 1)
    real = x[mask.bool()]
    assert torch.equal(meta.unpad(x).flatten(), real.flatten())
    assert torch.equal(meta.pad(meta.unpad(x)), x * mask[..., None, None])


@settings(max_examples=60, deadline=None)
@given(
    rows=st.lists(st.lists(st.integers(1, 5), min_size=1, max_size=3), min_size=1, max_size=3),
    holes=st.lists(st.tuples(st.integers(0, 2), st.integers(0, 15), st.integers(1, 3)), max_size=4),
    positions=st.sampled_from(["restarting", "continuing", "slot"]),
)
def test_masked_slots_never_start_documents(rows, holes, positions):
    """Holes (masked slots anywhere in a row) only remove tokens: the documents are the same real tokens."""
    if positions != "restarting":  # one document per row, positions running on across holes or jumping over them
        rows = [[sum(docs)] for docs in rows]
    slots = [[(1, p) for n in docs for p in range(n)] for docs in rows]  # (real, position) per slot
    for row, at, size in holes:
        if row < len(slots):
            slots[row][at:at] = [(0, 99)] * size
    width = max(len(r) for r in slots)
    slots = [r + [(0, 0)] * (width - len(r)) for r in slots]
    mask = torch.tensor([[real for real, _ in r] for r in slots])
    pos = torch.tensor([[p for _, p in r] for r in slots])
    if positions == "continuing":  # what generate() passes
        pos = (mask.cumsum(1) - 1).clamp_min(0)
    elif positions == "slot":  # transformers' default positions
        pos = torch.arange(width).expand(len(rows), width)
    meta = varlen.from_mask_and_positions(mask, pos, len(rows), width, torch.device("cpu"))
    lengths = [n for docs in rows for n in docs]
    assert meta.cu_seqlens.tolist() == [0, *torch.tensor(lengths).cumsum(0).tolist()]
    assert torch.equal(meta.indices if meta.indices is not None else torch.arange(mask.numel()),
                       mask.flatten().nonzero().squeeze(1))


def test_plain_batch_without_mask_or_positions_is_one_document_per_row():
    meta = varlen.from_mask_and_positions(None, None, 3, 5, torch.device("cpu"))
    assert meta.cu_seqlens.tolist() == [0, 5, 10, 15] and meta.indices is None and meta.max_seqlen == 5


def test_holes_never_start_documents_but_restarts_do():
    """Documents start at each row's first real token and where positions restart; a jump splits only without a
    mask (transformers' own rule for packed rows)."""
    cpu = torch.device("cpu")
    mask = torch.tensor([[1, 1, 0, 0, 1, 1, 1]])
    jumping = torch.arange(7)[None]  # positions jump over the hole
    assert varlen.from_mask_and_positions(mask, jumping, 1, 7, cpu).cu_seqlens.tolist() == [0, 5]
    continuing = torch.tensor([[0, 1, 1, 1, 2, 3, 4]])
    assert varlen.from_mask_and_positions(mask, continuing, 1, 7, cpu).cu_seqlens.tolist() == [0, 5]
    assert varlen.from_mask_and_positions(mask, None, 1, 7, cpu).cu_seqlens.tolist() == [0, 5]
    restart = torch.tensor([[0, 1, 9, 9, 0, 1, 2]])  # a packed row whose second document follows a hole
    assert varlen.from_mask_and_positions(mask, restart, 1, 7, cpu).cu_seqlens.tolist() == [0, 2, 5]
    forward_jump = torch.tensor([[0, 1, 2, 7, 8]])
    assert varlen.from_mask_and_positions(None, forward_jump, 1, 5, cpu).cu_seqlens.tolist() == [0, 3, 5]
    assert varlen.from_mask_and_positions(torch.ones(1, 5), forward_jump, 1, 5, cpu).cu_seqlens.tolist() == [0, 5]


def test_int32_overflow_is_refused():
    with pytest.raises(InvalidBatch, match="int32"):
        varlen.from_cu_seqlens(torch.tensor([0, 4], dtype=torch.int32), 4, 2**16, 2**16, torch.device("cpu"))


def test_all_padding_is_refused():
    with pytest.raises(InvalidBatch, match="no real token"):
        varlen.from_mask_and_positions(torch.zeros(2, 3), None, 2, 3, torch.device("cpu"))


def test_key_padding_from_4d_masks():
    mask2d = torch.tensor([[1, 1, 1, 0], [0, 1, 1, 1]], dtype=torch.bool)
    causal = torch.tril(torch.ones(4, 4, dtype=torch.bool))
    mask4d = causal[None, None] & mask2d[:, None, None, :]
    assert torch.equal(varlen.key_padding_from_4d(mask4d), mask2d)
    additive = torch.zeros(2, 1, 4, 4).masked_fill(~mask4d, torch.finfo(torch.float32).min) + 0.3
    assert torch.equal(varlen.key_padding_from_4d(additive), mask2d)
    # a block-diagonal (packed) causal mask, as transformers >= 5.24 builds for Falcon: documents [0, 1] and [2, 3]
    doc = torch.tensor([0, 0, 1, 1])
    packed4d = (causal & (doc[:, None] == doc[None, :]))[None, None].expand(2, 1, 4, 4) & mask2d[:, None, None, :]
    assert torch.equal(varlen.key_padding_from_4d(packed4d), mask2d)


@pytest.mark.parametrize("variant", ["llama-gqa", "falcon-rw-alibi", "neox-parallel"])
def test_metadata_computed_once_per_forward(variant, monkeypatch):
    model = make(variant).train()
    hf_accel.patch(model)
    calls = []
    real = varlen.from_mask_and_positions
    monkeypatch.setattr(varlen, "from_mask_and_positions", lambda *a, **k: calls.append(1) or real(*a, **k))
    ids = torch.randint(0, VOCAB, (2, 9))
    mask = torch.ones_like(ids)
    mask[1, 6:] = 0
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model(input_ids=ids, attention_mask=mask, labels=ids).loss.backward()
    assert len(calls) == 1  # not once per layer, and checkpoint recomputation reuses it


def test_collator_metadata_needs_no_host_layout(monkeypatch):
    model = make("llama-gqa")
    hf_accel.patch(model)
    monkeypatch.setattr(varlen, "from_mask_and_positions", lambda *a, **k: pytest.fail("derived from the layout"))
    cu = torch.tensor([0, 4, 9], dtype=torch.int32)
    pos = torch.tensor([[0, 1, 2, 3, 0, 1, 2, 3, 4]])
    model(input_ids=torch.randint(0, VOCAB, (1, 9)), position_ids=pos, cu_seq_lens_q=cu, cu_seq_lens_k=cu,
          max_length_q=5, max_length_k=5)
