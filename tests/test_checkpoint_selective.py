"""Selective checkpoints (issue 21a): AccelArguments(save="trainable") writes only the parameters that train plus a
fingerprint of the frozen part; resume onto the same base repeats an uninterrupted run's losses exactly, and onto a
different base it is refused before anything is loaded."""
from __future__ import annotations

import os

import pytest
import torch
from safetensors import safe_open

from hf_accel.errors import CheckpointError, ConfigurationError
from hf_accel.training.selective import FINGERPRINT_FILE, TRAINABLE_FILE
from tests.checkpoint_runs import LOSS_RTOL, accel, losses, model, trainer

SETUPS = {"frozen_embeddings": dict(frozen_embeddings=True), "lora": dict(lora=True)}


@pytest.mark.parametrize("setup", list(SETUPS))
@pytest.mark.parametrize("async_save", [False, True], ids=["sync", "async"])
def test_trainable_only_checkpoint_resumes_exactly(tmp_path, setup, async_save):
    kw = SETUPS[setup]
    ref = trainer(tmp_path / "ref", model(**kw))
    ref.train()
    out = tmp_path / "run"
    trainer(out, model(**kw), accel=accel(save="trainable", async_save=async_save), stop_at=4).train()
    ckpt = out / "checkpoint-4"
    assert {TRAINABLE_FILE, FINGERPRINT_FILE} <= set(os.listdir(ckpt)) and not (ckpt / "model.safetensors").exists()
    m = model(**kw)
    trainable = {n for n, p in m.named_parameters() if p.requires_grad}
    with safe_open(str(ckpt / TRAINABLE_FILE), "pt") as f:
        assert set(f.keys()) == trainable  # nothing frozen was written
    resumed = trainer(out, m, accel=accel(save="trainable", async_save=async_save))
    resumed.train(resume_from_checkpoint=True)
    assert losses(resumed) == pytest.approx(losses(ref), rel=LOSS_RTOL)


@pytest.mark.parametrize("setup", list(SETUPS))
def test_resume_onto_a_different_base_is_refused(tmp_path, setup):
    kw = SETUPS[setup]
    out = tmp_path / "run"
    trainer(out, model(**kw), accel=accel(save="trainable"), stop_at=2).train()
    other = model(seed=1, **kw)  # same architecture, other weights
    before = {n: p.detach().clone() for n, p in other.named_parameters()}
    with pytest.raises(CheckpointError, match=r"another base model \(.*values differ"):
        trainer(out, other, accel=accel(save="trainable")).train(resume_from_checkpoint=True)
    assert all((p == before[n]).all() for n, p in other.named_parameters())  # nothing was loaded


def test_save_mode_is_checked(tmp_path):
    with pytest.raises(ConfigurationError, match="save='everything'.*allowed: 'full'"):
        trainer(tmp_path, accel=accel(save="everything"))


@pytest.mark.parametrize("numel", [1, 2, 255, 256, 257, 2**25 + 1, 525_336_576])  # the last: Llama-3's embedding
def test_fingerprint_sample_indices_stay_in_range_and_evenly_spaced(numel):
    """The frozen fingerprint's sample: integer indices, first and last element included, never past the end (a
    float32 linspace gave index 525,336,576 for a 525,336,576-element embedding: a device-side assert on the H200)."""
    from hf_accel.training.selective import SAMPLE, sample_indices

    idx = sample_indices(numel)
    assert idx.dtype == torch.long and len(idx) == min(numel, SAMPLE)
    assert idx[0] == 0 and idx[-1] == numel - 1 and bool((idx[1:] > idx[:-1]).all())
    exact = [i * (numel - 1) / max(len(idx) - 1, 1) for i in range(len(idx))]
    assert max(abs(a - b) for a, b in zip(idx.tolist(), exact)) < 1


def test_fingerprint_hashes_a_large_frozen_tensor():
    """A frozen tensor past 2**24 elements hashes (uint8 keeps the test light); a change at a sampled element shows."""
    from hf_accel.training.selective import _sample_hash, sample_indices

    t = torch.zeros(2**25 + 7, dtype=torch.uint8)
    before = _sample_hash(t)
    t[sample_indices(t.numel())[-1]] = 1
    assert _sample_hash(t) != before
