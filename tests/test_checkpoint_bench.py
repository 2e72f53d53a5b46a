"""scripts/bench_save.py runs on CPU with a tiny model and reports a stall per save for both modes (issue 21d; the
H200 numbers come from the same script with --shape llama-1b / llama-8b-lora)."""
from __future__ import annotations

from script_modules import script_module


def test_bench_save_tiny_cpu(tmp_path):
    bench = script_module("bench_save")
    out = tmp_path / "save.json"
    results = bench.main(["--shape", "tiny", "--steps", "7", "--save-every", "3", "--out", str(out)])
    assert out.exists()
    for mode in ("synchronous", "background"):
        r = results[mode]
        assert r["saves_timed"] == 2 and r["step_s"] > 0 and r["checkpoint_gib"] > 0
