"""Every example runs offline on CPU (as a user would run it: a fresh interpreter) and learns: its loss goes down
(GRPO's: its mean reward goes up)."""
from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
# subprocess runs: the Trainer / TRL ones are `slow` (the lower-transformers CI pass keeps the plain loop)
EXAMPLES = ["patch_plain_loop.py", pytest.param("trainer_lora.py", marks=pytest.mark.slow),
            pytest.param("trl_sft.py", marks=pytest.mark.slow), pytest.param("trainer_qlora.py", marks=pytest.mark.slow),
            pytest.param("trl_dpo.py", marks=pytest.mark.slow), pytest.param("trl_grpo.py", marks=pytest.mark.slow)]


@pytest.mark.parametrize("name", EXAMPLES)
def test_example_runs_and_learns(tmp_path, name):
    if name.startswith("trl_"):
        pytest.importorskip("trl")
    if name == "trainer_qlora.py":
        pytest.importorskip("bitsandbytes", reason="needs bitsandbytes (pip install 'hf_accel[qlora]')")
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "PYTHONPATH": str(ROOT)}
    proc = subprocess.run([sys.executable, str(ROOT / "examples" / name)], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stderr[-3000:]
    if name == "trl_grpo.py":
        rewards = [float(x) for x in re.findall(r"mean reward ([0-9.]+)", proc.stdout)]
        assert len(rewards) >= 2 and rewards[-1] > rewards[0], proc.stdout[-2000:]
        return
    losses = [float(x) for x in re.findall(r"(?<!train_)loss'?:? '?([0-9.]+)", proc.stdout)]
    assert len(losses) >= 2, proc.stdout[-2000:]
    assert losses[-1] < losses[0]
