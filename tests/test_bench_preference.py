"""scripts/bench_preference.py (issue 73c) on the CPU: the word-level text turns back into the bench's ids, the pairs
come from the SFT-shaped documents, and (slow) the script's DPO and GRPO rows train hf_accel's trainers and TRL's on
the same data and replayed rollouts to the same losses, step by step."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
pytest.importorskip("trl", reason="needs trl (pip install 'hf_accel[trl]')")
sys.path.insert(0, str(REPO / "scripts"))

import bench_preference  # noqa: E402


def test_text_tokenizes_back_into_the_ids():
    tokenizer = bench_preference.word_tokenizer(512)
    ids = [3, 17, 511, 4]
    assert tokenizer(bench_preference.as_text(ids))["input_ids"] == ids
    joined = bench_preference.as_text(ids[:2]) + bench_preference.as_text(ids[2:], True) + tokenizer.eos_token
    assert tokenizer(joined)["input_ids"] == ids + [tokenizer.eos_token_id]


def test_pairs_split_the_documents_at_their_prompts():
    from benchlib.workloads import DataSpec, make_data

    spec = DataSpec(**{**DataSpec.tiny().__dict__, "prompt_share": (0.4, 0.6)})
    data = make_data(spec, 512, steps=2)
    pairs = bench_preference.pairs(data, 5)
    for i, pair in enumerate(pairs):
        doc = [max(3, t) for t in data.samples[i]]
        assert pair["prompt"] + pair["chosen"] == doc and min(pair["prompt"] + pair["rejected"]) >= 3
        assert pair["rejected"] != pair["chosen"]


@pytest.mark.slow  # two configurations a trainer, each its own process (~8 s)
@pytest.mark.parametrize("trainer, extra", [("dpo", ["--batch", "4"]),
                                            ("grpo", ["--batch", "8", "--generations", "4",
                                                      "--max-completion-length", "32"])])
def test_rows_train_trls_losses(tmp_path, trainer, extra):
    cmd = [sys.executable, str(REPO / "scripts" / "bench_preference.py"), "--trainer", trainer, "--device", "cpu",
           "--tiny", "--configs", "trl,hf_accel", "--steps", "2", "--warmup", "1", "--out", str(tmp_path), *extra]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    record = json.loads(next(tmp_path.glob(f"{trainer}_*.json")).read_text())
    assert record["command"].startswith(f"python scripts/bench_preference.py --trainer {trainer}")
    results = {r["config"]: r for r in record["results"]}
    assert all(r["status"] == "ok" and r["steady_tokens_per_s"] > 0 for r in results.values()), results
    ours, theirs = results["hf_accel"], results["trl"]
    assert len(ours["losses"]) == len(theirs["losses"]) == 3
    assert ours["losses"] == pytest.approx(theirs["losses"], rel=1e-4, abs=1e-6)
    assert ours["step_tokens"] == theirs["step_tokens"] and ours["timed_steps"] == 2
    assert proc.stdout.strip().splitlines()[-1].startswith("| hf_accel |")
