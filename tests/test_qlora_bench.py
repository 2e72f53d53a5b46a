"""The QLoRA bench rows on the CPU (tiny shapes, bitsandbytes' CPU backend): each builds its 4-bit base by its
workload's route (the file route for llama-8b-qlora, the on-device builder for llama-70b-qlora), trains its timed
steps with finite losses, and its patch report says what ran (compiled layers are CUDA-only under "auto", so the rows
that rely on the defaults are checked for the defaults' choices on a faked CUDA device in tests/test_qlora.py).
Unsloth's rows skip the 70B workload with the reason."""
from __future__ import annotations

import math

import pytest

pytest.importorskip("bitsandbytes", reason="needs bitsandbytes (pip install 'hf_accel[qlora]')")

from benchlib import configs  # noqa: E402
from benchlib.configs import CONFIGS, Options, missing_requirement  # noqa: E402
from benchlib.presets import get_preset  # noqa: E402
from benchlib.train import RunSettings, Timing  # noqa: E402
from benchlib.workloads import WORKLOADS, DataSpec, build_config, make_data  # noqa: E402


def run(config: str, workload: str, options: Options = Options()) -> tuple[Timing, object]:
    settings = RunSettings(WORKLOADS[workload], "cpu", True, steps=2, warmup=1, step_time_budget=60.0)
    data = make_data(DataSpec.tiny(), build_config(settings.workload, tiny=True).vocab_size, steps=3)
    timing = Timing()
    model = CONFIGS[config].run(settings, data, options, timing)
    return timing, model


@pytest.mark.parametrize("config, workload", [
    *((config, workload) for config in ("hf_accel-qlora", "hf_accel-qlora-budget")
      for workload in ("llama-8b-qlora", "llama-70b-qlora")),
    ("hf_accel-qlora-kbit", "llama-8b-qlora"), ("hf_accel-qlora-bf16-budget", "llama-8b-qlora")])
def test_hf_accel_qlora_rows_train_on_a_4bit_base(config, workload):
    import bitsandbytes as bnb
    import torch

    timing, model = run(config, workload)
    assert len(timing.losses) == 2 and all(math.isfinite(x) for x in timing.losses)
    assert sum(isinstance(m, bnb.nn.Linear4bit) for m in model.modules()) == 2 * 7
    report = next(n for n in timing.notes if n.startswith("patch: "))
    assert "LoRA cast skip: not bound" not in report  # PEFT's 4-bit LoRA layers take the skip
    if config.endswith("budget"):
        assert f"checkpointing: memory budget {configs.QLORA_BUDGET.removeprefix('budget:').lower()}: per layer" in report, report
    # hf_accel's recipe (hf_accel-qlora, issue 70) keeps the norms, embeddings and head bf16 as loaded; PEFT's recipe
    # (the kbit and budget rows) makes them fp32 (an fp32 residual stream), the bf16 row casts them back; the
    # adapters stay PEFT's fp32 in every row
    kept = {p.dtype for n, p in model.named_parameters() if "lora_" not in n and p.is_floating_point()}
    peft_recipe = config.endswith("kbit") or (config.endswith("budget") and "bf16" not in config)
    assert kept == {torch.float32 if peft_recipe else torch.bfloat16}
    assert {p.dtype for n, p in model.named_parameters() if "lora_" in n} == {torch.float32}


@pytest.mark.parametrize("config, workload", [("trl-qlora", "llama-70b-qlora"), ("trl-qlora-kbit", "llama-8b-qlora"),
                                              ("hf_accel-qlora-sft", "llama-8b-qlora"),
                                              ("hf_accel-qlora-sft-liger", "llama-8b-qlora")])
def test_trl_qlora_rows_build_and_train_through_trl(monkeypatch, config, workload):
    """TRL's rows with sdpa for flash-attn-4 and without Liger (its Triton kernels need CUDA), and hf_accel's
    SFTTrainer row: the model each trains is the 4-bit base with the LoRA TRL added from peft_config (what each row
    gives TRL: tests/test_bench_anchors.py)."""
    pytest.importorskip("trl", reason="needs trl (pip install 'hf_accel[trl]')")
    run_trl = configs.run_trl
    monkeypatch.setattr(configs, "run_trl", lambda *a, liger, **k: run_trl(*a, liger=False, **k))
    timing, model = run(config, workload, Options(substitute_attn="sdpa"))
    assert len(timing.losses) == 2 and all(math.isfinite(x) for x in timing.losses)
    assert sum(type(m).__module__ == "peft.tuners.lora.bnb" for m in model.modules()) == 2 * 7


def test_unsloth_rows_skip_workloads_built_on_the_device():
    options = Options()
    for name in ("unsloth", "unsloth-qlora"):
        reason = missing_requirement(CONFIGS[name], "cuda", "llama", options, WORKLOADS["llama-70b-qlora"])
        assert reason and "loads its model from files" in reason and "disk" in reason, reason
        assert "loads its model" not in (missing_requirement(CONFIGS[name], "cuda", "llama", options,
                                                             WORKLOADS["llama-8b-qlora"]) or "")


def test_qlora_presets_name_the_target_rows():
    eight = get_preset("llama-8b-qlora")
    assert {"trl-qlora", "trl-qlora-noliger", "trl-qlora-kbit", "unsloth-qlora", "hf_accel-qlora",
            "hf_accel-qlora-kbit"} <= set(eight.configs)
    seventy = get_preset("llama-70b-qlora")
    assert seventy.workload == "llama-70b-qlora" and WORKLOADS[seventy.workload].qlora_build == "device"
    assert seventy.configs[0] == "hf_accel-qlora"  # the headline row first, before the time budget runs out
    config = build_config(WORKLOADS["llama-70b-qlora"])
    assert (config.hidden_size, config.intermediate_size, config.num_hidden_layers) == (8192, 28672, 80)
    assert (config.num_attention_heads, config.num_key_value_heads, config.vocab_size) == (64, 8, 128256)
