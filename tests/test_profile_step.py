"""scripts/profile_step.py on CPU (tiny shapes): it profiles what scripts/bench.py runs, LoRA and checkpointing
included, so the per-workload profiles in BENCHMARKS.md describe the benchmarked configurations."""
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "scripts"))

import profile_step  # noqa: E402


def _run(*argv):
    parser_args = ["--device", "cpu", "--tiny", "--warmup", "1", "--steps", "2", "--profile-steps", "0", *argv]
    ns = profile_step.build_parser().parse_args(parser_args)
    return profile_step.profile(ns)


def test_lora_workload_profiles_adapters_under_checkpointing():
    result = _run("--workload", "llama-8b-lora", "--fused-ce", "auto", "--checkpointing", "full")
    assert result["lora"] and result["checkpointing"] == "full"
    assert 0 < result["trainable_params"] < result["params"] / 2  # adapters only train
    assert len(result["step_seconds"]) == 2 and result["steady_step_s"] > 0


def test_full_fine_tune_workload_trains_every_parameter():
    result = _run("--workload", "neox-1.4b")
    assert not result["lora"] and result["checkpointing"] is None
    assert result["trainable_params"] == result["params"]


def test_qlora_workload_profiles_the_4bit_base_with_patch_defaults():
    import pytest

    bnb = pytest.importorskip("bitsandbytes", reason="needs bitsandbytes (pip install 'hf_accel[qlora]')")
    result = _run("--workload", "llama-8b-qlora", "--defaults")
    assert result["qlora"] and result["defaults"] and result["lora"]
    assert 0 < result["trainable_params"] < result["params"] / 2
    assert any(line.startswith("compile: ") for line in result["speedups"])  # patch(model)'s own choices
    assert len(result["step_seconds"]) == 2
    table = profile_step.table(result)
    assert "QLoRA (NF4 base)" in table and "patch(model) defaults" in table
    del bnb


def test_op_sites_name_the_code_that_launches_each_cast():
    """--op-sites (on CPU: host time) lists aten ops by call site with the Python frames outside torch: on the eager
    QLoRA layers of a CPU run, bitsandbytes' and PEFT's input casts show as copies launched from their modules."""
    import pytest

    pytest.importorskip("bitsandbytes", reason="needs bitsandbytes (pip install 'hf_accel[qlora]')")
    ns = profile_step.build_parser().parse_args(["--device", "cpu", "--tiny", "--warmup", "1", "--steps", "1",
                                                 "--profile-steps", "1", "--workload", "llama-8b-qlora",
                                                 "--defaults", "--op-sites"])
    result = profile_step.profile(ns)
    sites = result["op_sites"]
    assert sites and all(r["op"].startswith(("aten::", "bitsandbytes::")) for r in sites)
    assert not any(r["op"] in profile_step.MATMUL_OPS for r in sites)  # the kernel table has those
    assert sites == sorted(sites, key=lambda r: -r["ms_per_step"])
    copies = [r for r in sites if r["op"] == "aten::copy_"]
    assert any("bitsandbytes" in f or "peft" in f for r in copies for f in r["stack"]), copies
    assert all("/torch/" not in f for r in sites for f in r["stack"])
    assert "| aten op |" in profile_step.table(result)


def test_memory_peak_replays_the_trace_to_the_moment_of_most_live_bytes():
    """benchlib.memory_peak on a hand-made allocator trace (the CUDA history cannot be recorded on CPU): the peak
    is the most bytes alive at once, and what is alive then is grouped by allocating frame outside torch."""
    from benchlib.memory_peak import markdown, peak_table

    layer = [{"filename": "/site/torch/nn/modules/linear.py", "line": 1, "name": "forward"},
             {"filename": "/site/peft/tuners/lora/bnb.py", "line": 7, "name": "forward"}]
    loss = [{"filename": "/repo/hf_accel/fused/ce_functions.py", "line": 165, "name": "forward"}]
    mib = 2**20
    trace = [
        {"action": "alloc", "addr": 1, "size": 256 * mib, "frames": layer},
        {"action": "alloc", "addr": 2, "size": 256 * mib, "frames": layer},
        {"action": "alloc", "addr": 3, "size": 512 * mib, "frames": loss},
        {"action": "free_requested", "addr": 3, "size": 512 * mib},
        {"action": "alloc", "addr": 4, "size": 300 * mib, "frames": []},  # a backward thread's block
        {"action": "free_requested", "addr": 1, "size": 256 * mib},
        {"action": "alloc", "addr": 5, "size": 100 * mib, "frames": loss},
    ]
    result = peak_table({"device_traces": [trace]}, baseline=1024 * mib)
    assert result["step_peak_over_baseline_gib"] == 1.0 and result["peak_gib"] == 2.0  # 256 + 256 + 512 MiB
    assert result["peak_event"] == 2 and "ce_functions.py:165" in result["peak_allocation"]
    rows = {row["allocated_by"]: row for row in result["live_at_peak"]}
    assert rows["bnb.py:7 forward"]["blocks"] == 2 and rows["bnb.py:7 forward"]["gib"] == 0.5
    assert not any("no Python frame" in key for key in rows)  # the backward block came after the peak
    later = peak_table({"device_traces": [trace[:3] + trace[3:5] + [dict(trace[4], addr=6)]]}, baseline=0)
    assert any("300.0 MiB blocks" in row["allocated_by"] for row in later["live_at_peak"])
    assert "| bnb.py:7 forward | 0.500 | 2 |" in markdown(result)


def test_memory_peak_needs_cuda():
    import pytest

    with pytest.raises(SystemExit, match="--memory-peak reads CUDA"):
        profile_step.main(["--device", "cpu", "--tiny", "--memory-peak"])


def test_profiled_steps_continue_the_warmup_optimizer(monkeypatch):
    """The profiled steps are steady steps: they continue the timed steps' optimizer, so its state is not created
    again inside the profile (a fresh AdamW zero-fills two state tensors per parameter on its first step, which the
    12-05 GPU profile of Llama-1B showed as 147 bf16 fills a step that no training step launches)."""
    import functools

    monkeypatch.setattr(profile_step, "op_sites", functools.partial(profile_step.op_sites, top=10**6))
    ns = profile_step.build_parser().parse_args(["--device", "cpu", "--tiny", "--warmup", "1", "--steps", "1",
                                                 "--profile-steps", "1", "--workload", "neox-1.4b", "--op-sites"])
    result = profile_step.profile(ns)
    assert any(s["op"] == "aten::_fused_adamw_" for s in result["op_sites"]), "the profile holds optimizer steps"
    fills = [s for s in result["op_sites"] if s["op"] in ("aten::zeros_like", "aten::zero_", "aten::fill_")
             and not any("Backward" in f for f in s["stack"])]
    assert sum(s["calls_per_step"] for s in fills) < result["param_tensors"], fills


def test_kernel_gaps_split_host_waits_from_launch_spacing():
    """Run 36's profile left 11.4 ms of a 232 ms step outside kernels with only 0.5 ms in gaps over 20 µs: the
    shorter gaps, the kernel count and the span are summed too, so the rest can be told apart."""
    from types import SimpleNamespace

    import torch

    def kernel(start, end, key="k"):
        return SimpleNamespace(device_type=torch.autograd.DeviceType.CUDA, key=key,
                               time_range=SimpleNamespace(start=start, end=end))

    host = SimpleNamespace(device_type=torch.autograd.DeviceType.CPU, key="aten::mm",
                           time_range=SimpleNamespace(start=40, end=90))
    # µs: a 2 µs gap, a 70 µs wait, a kernel that overlaps the one before (no gap), a 1 µs gap
    events = [kernel(0, 10), kernel(12, 30, "a"), host, kernel(100, 150, "b"), kernel(140, 149), kernel(151, 160)]
    gaps = profile_step.kernel_gaps(events, steps=2)
    assert gaps["idle_ms_per_step"] == pytest.approx(0.070 / 2)
    assert gaps["short_gap_ms_per_step"] == pytest.approx(0.003 / 2)
    assert gaps["kernels_per_step"] == 2.5 and gaps["span_ms_per_step"] == pytest.approx(0.160 / 2)
    assert gaps["sites"] == [{"after": "a", "before": "b", "count_per_step": 0.5, "ms_per_step": pytest.approx(0.035)}]


def test_without_nested_breaks_profiles_that_row_and_needs_defaults():
    result = _run("--workload", "llama-1b", "--defaults", "--without-nested-breaks")
    assert result["without_nested_breaks"]
    compile_line = next(line for line in result["speedups"] if line.startswith("compile: "))
    assert "'nested_graph_breaks': False" in compile_line, compile_line  # as bench's row of that name patches
    with pytest.raises(SystemExit, match="--without-nested-breaks"):
        profile_step.main(["--workload", "llama-1b", "--device", "cpu", "--tiny", "--without-nested-breaks"])
