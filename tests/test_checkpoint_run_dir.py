"""One output folder holds one run (issue 17.3): a new run refuses a folder holding an earlier run's files (or clears
it when asked), resume continues only the same run, and save_total_limit bounds the checkpoints kept."""
from __future__ import annotations

import json
import os

import pytest

from hf_accel.errors import ConfigurationError
from hf_accel.training.run_dir import RUN_RECORD
from tests.checkpoint_runs import LOSS_RTOL, STEPS, accel, losses, trainer


def names(folder) -> list[str]:
    return sorted(os.listdir(folder))


def test_new_run_refuses_a_folder_with_an_earlier_runs_files(tmp_path):
    out = tmp_path / "run"
    trainer(out, stop_at=4).train()
    before = names(out)
    t = trainer(out)
    with pytest.raises(ConfigurationError, match="already holds files of an earlier run.*Resume that run.*overwrite_output_dir=True"):
        t.train()
    assert t.state.global_step == 0 and names(out) == before  # refused before training, nothing written


def test_overwrite_clears_the_earlier_run(tmp_path):
    out = tmp_path / "run"
    trainer(out).train()  # checkpoints 2, 4, 6
    (out / "stale.txt").write_text("earlier run")
    t = trainer(out, accel=accel(overwrite_output_dir=True), stop_at=2)
    t.train()
    assert names(out) == ["checkpoint-2"]
    first = json.loads((out / "checkpoint-2" / RUN_RECORD).read_text())["run_id"]
    assert first == t._run_record["run_id"]


def test_resume_refuses_a_checkpoint_of_other_settings(tmp_path):
    out = tmp_path / "run"
    trainer(out, stop_at=2).train()
    with pytest.raises(ConfigurationError, match="training.learning_rate: checkpoint 0.01, now 0.02"):
        trainer(out, learning_rate=2e-2).train(resume_from_checkpoint=True)


def test_resume_past_max_steps_is_refused_not_a_silent_no_op(tmp_path):
    """Issue 17.3's run: --resume --max-steps 120 on a folder at step 600 trained 0 steps and overwrote the model."""
    out = tmp_path / "run"
    trainer(out).train()
    with pytest.raises(ConfigurationError, match=f"at step {STEPS} and this run stops at max_steps=4"):
        trainer(out, max_steps=4).train(resume_from_checkpoint=True)


def test_resume_continues_the_same_run_and_save_total_limit_bounds_checkpoints(tmp_path):
    out = tmp_path / "run"
    ref = trainer(tmp_path / "ref")
    ref.train()
    first = trainer(out, stop_at=4, save_total_limit=1)
    first.train()
    assert names(out) == ["checkpoint-4"]
    second = trainer(out, save_total_limit=1)
    second.train(resume_from_checkpoint=True)
    assert names(out) == ["checkpoint-6"]
    assert second._run_record["run_id"] == first._run_record["run_id"]
    assert losses(second) == pytest.approx(losses(ref), rel=1e-6)


def test_resuming_an_older_checkpoint_sets_the_later_ones_aside(tmp_path):
    out = tmp_path / "run"
    trainer(out).train()
    t = trainer(out, stop_at=4)
    t.train(resume_from_checkpoint=str(out / "checkpoint-2"))
    assert names(out) == ["checkpoint-2", "checkpoint-4", "superseded-checkpoint-4", "superseded-checkpoint-6"]


@pytest.mark.parametrize("async_save", [False, True], ids=["sync", "async"])
def test_a_resumed_run_logs_what_the_uninterrupted_run_logs(tmp_path, async_save):
    """Logging every 4 steps, resumed from the checkpoint of step 2: the log at step 4 averages steps 1-4, as the
    uninterrupted run's does (transformers alone restarts the window at the resume: steps 3-4 only), and the resumed
    call's train_loss is what transformers reports for that call without the restored window."""
    import shutil

    from hf_accel.training.checkpoint_hooks import RestoreLossWindow

    whole = trainer(tmp_path / "whole", logging_steps=4)
    whole.train()
    cut = tmp_path / "cut"
    trainer(cut, logging_steps=4, stop_at=2, accel=accel(async_save=async_save)).train()
    shutil.copytree(cut, tmp_path / "cut-stock")
    resumed = trainer(cut, logging_steps=4, accel=accel(async_save=async_save))
    result = resumed.train(resume_from_checkpoint=True)
    assert losses(whole) and losses(resumed) == pytest.approx(losses(whole), rel=LOSS_RTOL)
    stock = trainer(tmp_path / "cut-stock", logging_steps=4, accel=accel(async_save=async_save))
    stock.remove_callback(RestoreLossWindow)
    stock_result = stock.train(resume_from_checkpoint=True)
    assert losses(stock) != pytest.approx(losses(whole), rel=LOSS_RTOL)  # what the window changes
    assert result.training_loss == pytest.approx(stock_result.training_loss, rel=1e-6)
