"""scripts/profile_step.py on CPU (tiny shapes): it profiles what scripts/bench.py runs, LoRA and checkpointing
included, so the per-workload profiles in BENCHMARKS.md describe the benchmarked configurations."""
import sys
from pathlib import Path

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
