"""Per-layer shards (issue 21b): one safetensors file per decoder layer with the standard index; from_pretrained
loads the folder to the same weights, a partial load reads only the files of the layers asked for, and a run
resumes from such checkpoints with an uninterrupted run's losses."""
from __future__ import annotations

import os

import pytest
import torch
from transformers import AutoModelForCausalLM

from hf_accel.training import shards
from tests.checkpoint_runs import LOSS_RTOL, accel, losses, trainer
from tests.tiny_models import make


@pytest.mark.parametrize("variant", ["llama-gqa", "neox-parallel", "falcon-7b-mqa"])
def test_per_layer_shards_load_with_from_pretrained(tmp_path, variant):
    model = make(variant)
    shards.save_layer_shards(model, str(tmp_path))
    files = sorted(f for f in os.listdir(tmp_path) if f.endswith(".safetensors"))
    layers = model.config.num_hidden_layers
    assert files == sorted([shards.layer_file(i) for i in range(layers)] +
                           [shards.EMBEDDINGS_FILE, shards.REST_FILE])
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path, attn_implementation="sdpa")
    for name, t in model.state_dict().items():
        torch.testing.assert_close(loaded.state_dict()[name], t, rtol=0, atol=0, msg=name)


def test_partial_load_reads_only_those_layers(tmp_path, monkeypatch):
    model = make("llama-gqa", seed=0)
    model.config.num_hidden_layers = 4
    model = type(model)(model.config)
    shards.save_layer_shards(model, str(tmp_path))
    opened = []
    real = shards.safe_open
    monkeypatch.setattr(shards, "safe_open", lambda path, **kw: opened.append(os.path.basename(path)) or
                        real(path, **kw))
    got = shards.load_layer_range(str(tmp_path), 1, 2)
    assert opened == [shards.layer_file(1), shards.layer_file(2)]
    state = model.state_dict()
    assert set(got) == {n for n in state if ".layers.1." in n or ".layers.2." in n}
    for name, t in got.items():
        torch.testing.assert_close(t, state[name], rtol=0, atol=0)


@pytest.mark.parametrize("async_save", [False, True], ids=["sync", "async"])
def test_run_resumes_from_layer_shards(tmp_path, async_save):
    ref = trainer(tmp_path / "ref")
    ref.train()
    out = tmp_path / "run"
    trainer(out, accel=accel(layer_shards=True, async_save=async_save), stop_at=4).train()
    assert (out / "checkpoint-4" / shards.INDEX_FILE).exists()
    assert not (out / "checkpoint-4" / "model.safetensors").exists()
    resumed = trainer(out, accel=accel(layer_shards=True, async_save=async_save))
    resumed.train(resume_from_checkpoint=True)
    assert losses(resumed) == pytest.approx(losses(ref), rel=LOSS_RTOL)
