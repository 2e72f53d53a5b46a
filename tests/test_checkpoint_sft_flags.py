"""hf-accel sft's checkpoint flags (issue 17.3): a rerun into a used --output-dir is refused before anything is
loaded, --overwrite starts clean, --save-total-limit bounds the checkpoints, --save trainable writes selective ones."""
from __future__ import annotations

import os

import pytest

from hf_accel.errors import UsageError

TINY = ["--max-steps", "2", "--save-steps", "1", "--eval-examples", "0", "--logging-steps", "1",
        "--max-tokens-per-batch", "64"]


@pytest.fixture(scope="module")
def sft():
    from hf_accel.cli import sft

    return sft


def test_rerun_refused_overwrite_clears_limit_and_trainable(tmp_path, sft, capsys, monkeypatch):
    import torch

    monkeypatch.setattr(torch, "set_num_threads", lambda n: None)  # leave the test process's threads alone
    out = str(tmp_path / "out")
    sft.main([*TINY, "--output-dir", out, "--save-total-limit", "1"])
    assert sorted(d for d in os.listdir(out) if d.startswith("checkpoint")) == ["checkpoint-2"]
    with pytest.raises(UsageError, match="already holds files of an earlier run.*Continue that run \\(--resume\\)"):
        sft.main([*TINY, "--output-dir", out])
    sft.main([*TINY, "--output-dir", out, "--overwrite", "--save", "trainable"])
    ckpts = sorted(d for d in os.listdir(out) if d.startswith("checkpoint"))
    assert ckpts == ["checkpoint-1", "checkpoint-2"]
    assert all(os.path.exists(os.path.join(out, c, "trainable.safetensors")) for c in ckpts)
