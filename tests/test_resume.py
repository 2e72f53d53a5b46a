"""Checkpoints that lose nothing: a run SIGKILLed inside a save resumes from the previous (complete) checkpoint and
then logs exactly the losses of an uninterrupted run (model, optimizer, scheduler, RNG and sampler position restored).

Real subprocesses of scripts/sft.py on the offline default task; the kill is made deterministic by the
HF_ACCEL_PAUSE_IN_SAVE hook, which makes the save of a chosen step sleep after writing its files, before the rename.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from hf_accel.training.checkpoint_io import STAGING_DIR
from tests.multi_gpu_runs import launch_killed_in_save

ROOT = Path(__file__).resolve().parent.parent
STEPS, SAVE_EVERY, KILL_AT = 12, 4, 8
LOSS_RTOL = 1e-6  # same process, same CPU kernels: resumed losses should be equal up to nondeterministic reductions
COMMON = ["--max-steps", str(STEPS), "--logging-steps", "1", "--max-tokens-per-batch", "160", "--eval-examples", "0",
          "--lr", "3e-3"]


def command(out: Path, *extra: str) -> list[str]:
    return [sys.executable, str(ROOT / "scripts" / "sft.py"), "--output-dir", str(out), *COMMON, *extra]


def sft(out: Path, *extra: str) -> subprocess.Popen:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
    return subprocess.Popen(command(out, *extra), env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True)


def finished_losses(proc: subprocess.Popen, out: Path) -> list[float]:
    log, _ = proc.communicate(timeout=300)
    assert proc.returncode == 0, log[-3000:]
    return json.loads((out / "metrics.json").read_text())["losses"]


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory) -> list[float]:
    out = tmp_path_factory.mktemp("uninterrupted")
    return finished_losses(sft(out), out)


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["sync", "async"])
def test_kill_during_save_then_resume_matches_uninterrupted(tmp_path, uninterrupted, mode):
    out = tmp_path / "run"
    extra = ["--save-steps", str(SAVE_EVERY)] + (["--async-save"] if mode == "async" else [])
    launch_killed_in_save(command(out, *extra), ROOT, KILL_AT, 240, tmp_path / "run.log")

    # the interrupted save left no checkpoint-8; checkpoint-4 is complete and loadable
    from transformers import AutoModelForCausalLM
    from transformers.trainer_utils import get_last_checkpoint

    assert not (out / f"checkpoint-{KILL_AT}").exists() and (out / STAGING_DIR).exists()
    last = get_last_checkpoint(str(out))
    assert Path(last).name == f"checkpoint-{SAVE_EVERY}"
    AutoModelForCausalLM.from_pretrained(last)
    assert json.loads((Path(last) / "trainer_state.json").read_text())["global_step"] == SAVE_EVERY

    resumed = finished_losses(sft(out, *extra, "--resume"), out)
    assert len(resumed) == len(uninterrupted) == STEPS
    assert resumed == pytest.approx(uninterrupted, rel=LOSS_RTOL)
    assert (out / f"checkpoint-{STEPS}").is_dir() and not (out / STAGING_DIR / f"checkpoint-{KILL_AT}").exists()
