"""Memory-aware background saves (issue 21c), the CPU-checkable part: the snapshot goes into host buffers that are
allocated once and reused by every save (about 1.0x the checkpoint on the host, no per-save copies), and when the
host lacks the memory for them the save is written synchronously with one log line saying why."""
from __future__ import annotations

import logging

import pytest
import torch

from hf_accel.training.checkpoint_io import verify_checkpoint
from hf_accel.training.snapshot import SnapshotBuffers
from tests.checkpoint_runs import LOSS_RTOL, accel, losses, trainer


def nbytes(state) -> int:
    return sum(t.numel() * t.element_size() for t in state.values())


def test_buffers_are_allocated_once_and_hold_one_copy():
    state = {"a": torch.randn(64, 32), "b": torch.arange(10)}
    buffers = SnapshotBuffers(pin=False, available=lambda: 1 << 40)
    first = buffers.copy(state)
    ptrs = {k: v.data_ptr() for k, v in first.items()}
    state["a"].add_(1.0)
    second = buffers.copy(state)
    assert {k: v.data_ptr() for k, v in second.items()} == ptrs  # reused, not reallocated
    assert torch.equal(second["a"], state["a"]) and second["a"].data_ptr() != state["a"].data_ptr()
    assert buffers.nbytes == nbytes(state)


def test_shortfall_counts_only_buffers_not_yet_held():
    state = {"a": torch.zeros(1024)}  # 4 KiB
    free = {"bytes": 4096}
    buffers = SnapshotBuffers(pin=False, available=lambda: free["bytes"])
    assert "host memory is short" in buffers.shortfall(state)  # 4 KiB free, 4 KiB + 20% needed
    free["bytes"] = 4096 * 2
    assert buffers.shortfall(state) is None
    buffers.copy(state)
    free["bytes"] = 0
    assert buffers.shortfall(state) is None  # already held: nothing more is needed
    state["b"] = torch.zeros(8)
    assert buffers.shortfall(state) is not None


def test_background_saves_reuse_buffers_and_fall_back_when_memory_is_short(tmp_path, caplog):
    ref = trainer(tmp_path / "ref")
    ref.train()
    t = trainer(tmp_path / "bg", accel=accel(async_save=True))
    seen = []
    real_copy = t._buffers.copy
    t._buffers.copy = lambda state: seen.append({k: v.data_ptr() for k, v in real_copy(state)["model"].items()}) \
        or real_copy(state)
    t.train()
    assert len(seen) == 3 and seen[0] == seen[1] == seen[2]
    assert losses(t) == losses(ref)
    short = trainer(tmp_path / "short", accel=accel(async_save=True))
    short._buffers = SnapshotBuffers(pin=False, available=lambda: 0)
    with caplog.at_level(logging.WARNING, logger="hf_accel"):
        short.train()
    lines = [r.message for r in caplog.records if "synchronously" in r.message]
    assert [line.split("writing ")[1] for line in lines] == [f"checkpoint-{s} synchronously" for s in (2, 4, 6)]
    assert all("host memory is short" in line for line in lines)
    for step in (2, 4, 6):
        assert verify_checkpoint(str(tmp_path / "short" / f"checkpoint-{step}")) is None
    # the streamed single-file checkpoint written from the buffers resumes exactly
    resumed = trainer(tmp_path / "bg")
    resumed.train(resume_from_checkpoint=str(tmp_path / "bg" / "checkpoint-4"))
    assert losses(resumed) == pytest.approx(losses(ref), rel=LOSS_RTOL)


def test_tied_weights_share_one_buffer():
    """A tied embedding / LM head is one tensor under two names: one host buffer serves both, so the writer sees the
    tie (the file holds it once, as a synchronous save's) and the host holds it once."""
    w = torch.randn(16, 8)
    state = {"embed.weight": w, "head.weight": w, "other": torch.randn(4)}
    buffers = SnapshotBuffers(pin=False, available=lambda: 1 << 40)
    assert buffers.shortfall(state) is None
    copied = buffers.copy(state)
    assert copied["embed.weight"] is copied["head.weight"] and torch.equal(copied["head.weight"], w)
    assert buffers.nbytes == w.numel() * 4 + 4 * 4
    view = {"a": w, "a_t": w.t()}  # same storage, another layout: two tensors, two buffers
    assert buffers.copy(view)["a_t"].shape == (8, 16)


def test_background_checkpoint_of_a_tied_model_matches_the_synchronous_one(tmp_path):
    import os

    from tests.tiny_models import make

    files = {}
    for name, async_save in (("sync", False), ("bg", True)):
        m = make("llama-gqa", seed=0).train()
        m.config.tie_word_embeddings = True
        m.lm_head.weight = m.get_input_embeddings().weight
        t = trainer(tmp_path / name, m, accel=accel(async_save=async_save), max_steps=2)
        t.train()
        files[name] = os.path.getsize(tmp_path / name / "checkpoint-2" / "model.safetensors")
    assert files["bg"] == files["sync"]


def test_reserved_buffers_serve_the_first_copy():
    """reserve() allocates on a thread what copy() will need; copy() takes those buffers instead of allocating, tied
    tensors get one; a host that lacks the memory gets no reservation."""
    w = torch.randn(32, 8)
    state = {"a": w, "tied": w, "b": torch.randn(5)}
    buffers = SnapshotBuffers(pin=False, available=lambda: 1 << 40)
    assert buffers.reserve(state)
    assert buffers.nbytes == (w.numel() + 5) * 4  # joined: held before any copy
    held = {id(b) for b in buffers._buffers.values()}
    copied = buffers.copy(state)
    assert {id(v) for v in copied.values()} == held and torch.equal(copied["b"], state["b"])
    assert not SnapshotBuffers(pin=False, available=lambda: 0).reserve(state)


def test_background_saves_reserve_their_buffers_after_the_first_step(tmp_path):
    t = trainer(tmp_path / "bg", accel=accel(async_save=True))
    reserved_at, held_at_first_copy = [], []
    real_reserve, real_copy = t._buffers.reserve, t._buffers.copy
    t._buffers.reserve = lambda state, **kw: reserved_at.append(t.state.global_step) or real_reserve(state, **kw)
    t._buffers.copy = lambda state: held_at_first_copy.append(t._buffers.nbytes) or real_copy(state)
    t.train()
    assert reserved_at == [1]
    live = t._live_state()
    unique = {(x.data_ptr(), x.shape): x for x in
              [*live["model"].values(), *[v for s in live["optimizer"]["state"].values() for v in s.values()
                                          if torch.is_tensor(v)]]}
    assert held_at_first_copy[0] == sum(x.numel() * x.element_size() for x in unique.values())


def test_trainable_background_saves_fingerprint_the_base_before_the_first_save(tmp_path):
    from tests.checkpoint_runs import model

    t = trainer(tmp_path / "lora", model(lora=True), accel=accel(async_save=True, save="trainable"))
    at_first_copy = []
    real_copy = t._buffers.copy
    t._buffers.copy = lambda state: at_first_copy.append(t._frozen_fingerprint is not None) or real_copy(state)
    t.train()
    assert at_first_copy[0] is True
