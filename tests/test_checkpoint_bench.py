"""scripts/bench_save.py runs on CPU with a tiny model and reports a stall per save for both modes (issue 21d; the
H200 numbers come from the same script with --shape llama-1b / llama-8b-lora)."""
from __future__ import annotations

from script_modules import script_module


def test_bench_save_tiny_cpu(tmp_path):
    bench = script_module("bench_save")
    out = tmp_path / "save.json"
    results = bench.main(["--shape", "tiny", "--saves", "2", "--save-every", "3", "--out", str(out)])
    assert out.exists()
    sync, background = results["synchronous"], results["background"]
    assert sync["save_every"] == 3
    assert background["save_every"] == bench.spaced_save_every(sync)
    for r in (sync, background):
        assert r["saves_timed"] == 2 and len(r["stalls_s"]) == 2 and r["step_s"] > 0 and r["checkpoint_gib"] > 0
        assert r["host_peak_over_before_gib"] >= 0 and r["host_rss_before_gib"] > 0


def test_background_saves_are_spaced_to_outlast_a_synchronous_save():
    bench = script_module("bench_save")
    # a 10 s save at 0.1 s a step: 3 x 10 / 0.1 = 300 steps between saves
    assert bench.spaced_save_every({"step_s": 0.1, "stall_per_save_s": 10.0}) == 300
    assert bench.spaced_save_every({"step_s": 0.1, "stall_per_save_s": 0.05}) == 4  # never under 4
    assert bench.spaced_save_every({"step_s": 0.0, "stall_per_save_s": 1.0}) == 4


def test_host_peak_sees_a_transient_allocation():
    bench = script_module("bench_save")
    import time

    with bench.HostPeak() as host:
        before = bench.resident_bytes()
        block = b"\x01" * (64 << 20)  # 64 MiB, written
        time.sleep(0.05)
        del block
    assert host.peak - before > 48 << 20
