"""The long-context preset's plumbing (issue 22) on the CPU: tiny model, tiny lengths, one (config, length) per
process, a config's first OOM recorded as "OOM" and its longer lengths skipped."""
import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from script_modules import script_module

REPO = Path(__file__).resolve().parents[1]


def test_long_context_preset_trains_one_document_per_step_in_a_child(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, str(REPO / "scripts" / "bench.py"), "--preset", "long-context", "--device", "cpu",
           "--tiny", "--doc-lengths", "96", "--configs", "hf_accel-best", "--steps", "1", "--warmup", "1",
           "--out", str(tmp_path)]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    record = json.loads(next(tmp_path.glob("llama-8b-lora-long-tiny_*.json")).read_text())
    results = record["results"]
    assert [(r["config"], r["doc_length"]) for r in results] == [("hf_accel-best", 96)]
    for r, n in zip(results, (96,)):
        assert r["status"] == "ok", r.get("log_tail")
        assert r["step_tokens"] == [n] and r["tokens_per_s"] > 0  # one document of that length per step
        assert any("offload" in note for note in r["notes"])  # the preset's checkpointing reached the config
    assert record["model_config"]["rope_parameters"]["rope_type"] == "llama3"
    assert "| hf_accel-best | 96 |" in proc.stdout


def test_first_oom_skips_longer_lengths_and_table_names_longest(monkeypatch, tmp_path):
    bench = script_module("bench")
    statuses = {("a", 32): "ok", ("a", 64): "OOM", ("b", 32): "ok", ("b", 64): "ok", ("b", 128): "error: timeout"}
    ran = []

    def fake_run_one(args, name, timeout):
        ran.append((name, args.doc_length))
        return {"config": name, "doc_length": args.doc_length, "status": statuses[(name, args.doc_length)],
                "tokens_per_s": 10.0, "mfu": None}

    monkeypatch.setattr(bench, "run_one", fake_run_one)
    monkeypatch.setattr(bench, "CONFIGS", {n: dataclasses.replace(bench.CONFIGS["hf_accel-best"], name=n)
                                           for n in ("a", "b")})
    assert bench.main(["--workload", "llama-1b-long", "--configs", "a,b", "--doc-lengths", "128,32,64",
                       "--device", "cpu", "--tiny", "--out", str(tmp_path)]) == 0
    assert ran == [("a", 32), ("a", 64), ("b", 32), ("b", 64), ("b", 128)]
    results = json.loads(next(tmp_path.glob("*.json")).read_text())["results"]
    assert results[2] == {"config": "a", "doc_length": 128, "status": "skipped: OOM at a shorter length"}
    table = next(tmp_path.glob("*.md")).read_text()
    assert "| a | 32 |" in table and "| b | 64 |" in table  # the longest length each config trained


def test_child_records_cuda_oom_as_oom(monkeypatch, tmp_path):
    bench = script_module("bench")

    def out_of_memory(*args, **kwargs):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")

    config = dataclasses.replace(bench.CONFIGS["hf_accel-best"], run=out_of_memory)
    monkeypatch.setitem(bench.CONFIGS, "hf_accel-best", config)
    out = tmp_path / "result.json"
    bench.main(["--workload", "llama-1b-long", "--configs", "hf_accel-best", "--doc-length", "64", "--device", "cpu",
                "--tiny", "--child", str(out)])
    assert json.loads(out.read_text())["status"] == "OOM"
