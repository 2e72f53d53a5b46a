"""The stock anchors are what their projects document as fastest, and say so (benchlib.anchors, issue 70).

Three layers, each able to fail on its own: (1) the anchor table holds the documented fastest settings (written out
here, with TRL's own defaults read live); (2) each TRL configuration gives TRL's trainer what the table says (a
stand-in trainer records the arguments: TRL's own would need CUDA for flash-attn-4 and Liger's Triton kernels);
(3) TRL's real SFTTrainer, built on the CPU from those arguments, does what the table says it does (padding-free,
completion-only loss, no PEFT kbit preparation of a 4-bit base, bf16 adapters on it). Plus: every preset runs each
anchor's competitors beside it, and bench.py prints the table into its record."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from benchlib import configs, train
from benchlib.anchors import ANCHOR_REVISION, ANCHORS, FA4, TrlRecipe, anchors_text, stock_anchors
from benchlib.configs import CONFIGS, Options
from benchlib.presets import PRESETS
from benchlib.train import RunSettings, Timing
from benchlib.workloads import WORKLOADS, DataSpec, build_config, make_data

trl = pytest.importorskip("trl", reason="needs trl (pip install 'hf_accel[trl]')")

# What each TRL anchor must be: TRL 1.16's fastest documented settings for the workload (its docs "Speeding up
# training" / "Reducing memory usage": packing with BFD, which is padding-free, on a FlashAttention kernel; "Liger
# Kernel Integration"; "PEFT integration": peft_config on the base, a 4-bit base passed as loaded), plus the two
# stock variants that compete with them (without Liger; PEFT's kbit preparation first).
DOCUMENTED = {
    "trl-fa4-packed": TrlRecipe(attn_implementation=FA4, packing_strategy="bfd", loss_type="nll", liger=False),
    "trl-fa4-packed-liger": TrlRecipe(attn_implementation=FA4, packing_strategy="bfd", loss_type="nll", liger=True),
    "trl-qlora": TrlRecipe(liger=True, quantized=True, kbit_preparation=False),
    "trl-qlora-noliger": TrlRecipe(liger=False, quantized=True, kbit_preparation=False),
    "trl-qlora-kbit": TrlRecipe(liger=True, quantized=True, kbit_preparation=True),
}
WORKLOADS_OF = {name: ("llama-1b", "llama-8b-lora", "llama-8b-lora-completion", "qwen3-30b-a3b-lora")
                for name in ("trl-fa4-packed", "trl-fa4-packed-liger")}
WORKLOADS_OF.update({name: ("llama-8b-qlora",) for name in ("trl-qlora", "trl-qlora-noliger", "trl-qlora-kbit")})


def test_every_stock_configuration_is_in_the_table_and_competitors_name_each_other():
    stock = {name for name, c in CONFIGS.items() if c.stock}
    assert stock == set(ANCHORS), stock ^ set(ANCHORS)
    for name, anchor in ANCHORS.items():
        assert set(anchor.competes_with) <= stock and name not in anchor.competes_with, name
        for other in anchor.competes_with:
            if ANCHORS[other].trl is not None and anchor.trl is not None:  # TRL's variants name each other
                assert name in ANCHORS[other].competes_with, (name, other)


def test_the_trl_anchors_hold_trl_s_documented_fastest_settings():
    fields = trl.SFTConfig.__dataclass_fields__
    assert {name for name, a in ANCHORS.items() if a.trl is not None} == set(DOCUMENTED)
    for name, recipe in DOCUMENTED.items():
        assert ANCHORS[name].trl == recipe, name
        # TRL's own defaults: BFD packing (padding-free once packing=True) and the plain NLL loss
        assert recipe.packing_strategy == fields["packing_strategy"].default == "bfd"
        assert recipe.loss_type == fields["loss_type"].default == "nll"
        assert recipe.attn_implementation == FA4
    record = stock_anchors(["trl-qlora", "hf_accel-qlora"])
    assert set(record) == {"trl-qlora"} and record["trl-qlora"]["trl"]["kbit_preparation"] is False
    assert "peft_config" in record["trl-qlora"]["settings"] and "trl-qlora-kbit" in record["trl-qlora"]["competes_with"]


class Captured(Exception):
    pass


def _capture(monkeypatch, name: str, workload: str) -> tuple[dict, list[str], object]:
    """Run configuration `name` on `workload`'s tiny shapes up to the trainer: TRL's SFTTrainer replaced by a stand-in
    that records its arguments; the attention each model was asked to use recorded (and sdpa built instead)."""
    calls, attn = [], []

    class StandIn:
        def __init__(self, model, args, train_dataset, processing_class, callbacks, **kwargs):
            calls.append(dict(model=model, args=args, train_dataset=train_dataset, processing_class=processing_class,
                              **kwargs))
            raise Captured

    def train_timed(cls, settings, timing, make):
        try:
            make(cls, None)
        except Captured:
            return None

    build, base = configs.build_model, configs.qlora_base
    monkeypatch.setattr(configs, "build_model", lambda s, a: attn.append(a) or build(s, "sdpa"))
    monkeypatch.setattr(configs, "qlora_base", lambda s, a, **k: attn.append(a) or base(s, "sdpa", **k))
    monkeypatch.setattr(trl, "SFTTrainer", StandIn)
    monkeypatch.setattr(train, "train_timed", train_timed)
    settings = RunSettings(WORKLOADS[workload], "cpu", True, steps=1, warmup=1, step_time_budget=1.0)
    spec = dataclasses.replace(DataSpec.tiny(), prompt_share=settings.workload.prompt_share)
    data = make_data(spec, build_config(settings.workload, tiny=True).vocab_size, steps=2)
    CONFIGS[name].run(settings, data, Options(), Timing())
    (call,) = calls
    return call, attn, data


@pytest.mark.parametrize("workload", ["qwen3-30b-a3b-lora", "gpt-oss-20b-lora", "qwen3-8b-lora"])
def test_the_unsloth_row_adapts_the_experts_the_trl_rows_adapt(monkeypatch, workload):
    """Unsloth's MoE LoRA takes PEFT's target_parameters: its row asks for the very names TRL's row gets (none on a
    dense workload), and its family check lets the MoE workloads through (issue 72d: Unsloth beside the anchors)."""
    from benchlib.apart import unsloth_expert_targets
    from benchlib.configs import REQUIREMENTS

    wl = WORKLOADS[workload]
    call, _, _ = _capture(monkeypatch, "trl-fa4-packed", workload)
    model = configs.build_model(RunSettings(wl, "cpu", True, steps=1, warmup=1, step_time_budget=1.0), "sdpa")
    trl_names = sorted(call["peft_config"].target_parameters or [])
    assert sorted(unsloth_expert_targets(model, wl).get("target_parameters", [])) == trl_names
    assert bool(trl_names) == wl.lora_experts
    assert REQUIREMENTS["unsloth-family"]("cuda", wl.family) is None
    assert "unsloth" in PRESETS[workload].configs if wl.lora_experts else True


@pytest.mark.parametrize("name, workload", [(n, w) for n, ws in WORKLOADS_OF.items() for w in ws])
def test_each_trl_configuration_gives_trl_what_the_table_says(monkeypatch, name, workload):
    bnb = pytest.importorskip("bitsandbytes") if "qlora" in name else None
    recipe = ANCHORS[name].trl
    call, attn, data = _capture(monkeypatch, name, workload)
    args, model, wl = call["args"], call["model"], WORKLOADS[workload]
    assert attn == [recipe.attn_implementation]
    assert args.packing and args.packing_strategy == recipe.packing_strategy and args.loss_type == recipe.loss_type
    assert args.use_liger_kernel == recipe.liger and args.gradient_checkpointing == wl.checkpointing
    # Liger's fused experts take no LoRA (bound on PEFT's ParamWrapper they fail): off where the experts carry LoRA
    assert args.liger_kernel_config == ({"swiglu": False} if recipe.liger and wl.lora_experts else None)
    assert args.completion_only_loss == (data.prompts is not None)
    assert ("completion_mask" in call["train_dataset"].column_names) == (data.prompts is not None)
    # LoRA as TRL's own path adds it: a peft_config with the base model, never a PeftModel built beforehand
    assert not hasattr(model, "peft_config")
    if wl.lora:
        peft = call["peft_config"]
        assert (peft.r, peft.lora_alpha, set(peft.target_modules)) == (16, 32, set(wl.lora_targets))
        assert bool(peft.target_parameters) == wl.lora_experts
    else:
        assert "peft_config" not in call
    if recipe.quantized:
        assert any(isinstance(m, bnb.nn.Linear4bit) for m in model.modules())
        # TRL's path leaves the base as loaded (bf16); PEFT's kbit preparation makes the rest fp32
        kept = {p.dtype for p in model.parameters() if p.is_floating_point()}
        assert kept == ({torch.float32} if recipe.kbit_preparation else {torch.bfloat16}), kept


@pytest.mark.parametrize("name, workload", [("trl-qlora", "llama-8b-qlora"),
                                            ("trl-fa4-packed-liger", "llama-8b-lora-completion")])
def test_trl_s_own_trainer_does_what_the_table_says(monkeypatch, name, workload):
    """TRL's SFTTrainer built on the CPU from the configuration's arguments (Liger off: its kernels need CUDA, and
    TRL applies them at train time): padding-free from BFD packing, the completion-only loss on prompt-masked data,
    and on a 4-bit base no kbit preparation (norms, embeddings, head stay bf16) and bf16 adapters. If a TRL release
    changes any of these, the anchor's description (anchors.ANCHORS) changes with it."""
    if "qlora" in name:
        pytest.importorskip("bitsandbytes")
    call, _, data = _capture(monkeypatch, name, workload)
    monkeypatch.undo()
    from trl import SFTTrainer

    args = dataclasses.replace(call.pop("args"), use_liger_kernel=False)
    trainer = SFTTrainer(**call, args=args)
    assert trainer.padding_free and trainer.data_collator.padding_free
    assert trainer.completion_only_loss == (data.prompts is not None)
    model = trainer.model
    assert hasattr(model, "peft_config") and model.peft_config["default"].r == 16
    adapters = {p.dtype for n, p in model.named_parameters() if "lora_" in n}
    others = {p.dtype for n, p in model.named_parameters() if "lora_" not in n and p.is_floating_point()}
    if ANCHORS[name].trl.quantized:
        assert adapters == others == {torch.bfloat16}, (adapters, others)
    else:
        assert adapters == others == {torch.float32}  # the CPU run's fp32 model; PEFT's fp32 adapters, uncast


# presets that run fewer than every competitor, and why
PARTIAL = {
    "llama-70b-qlora": "a 70B row takes ~5 minutes: TRL's Liger variant only; the others run beside it at 8B",
    "long-context": "one length a process: the long-context sweeps compare the strongest stacks at each length",
    "long-context-1b": "as long-context", "long-context-qlora": "as long-context",
    "long-context-qwen3.5": "as long-context",
    "multi-gpu": "FSDP2 launches: one stock stack per GPU count", "multi-gpu-8b-lora": "as multi-gpu",
    "multi-gpu-8b": "as multi-gpu",
}


def test_every_preset_runs_its_anchors_competitors_beside_them():
    """The faster of competing stock configurations is the anchor only if both ran: each preset that runs a TRL
    configuration runs the TRL variants it competes with (Liger's row skips itself, saying why, where Liger has no
    kernels for the family); the QLoRA preset runs TRL's QLoRA with and without Liger and on PEFT's preparation."""
    for preset in PRESETS.values():
        if preset.name in PARTIAL or preset.pending:
            continue
        for config in preset.configs:
            anchor = ANCHORS.get(config)
            if anchor is None or anchor.trl is None:
                continue
            rivals = {c for c in anchor.competes_with if ANCHORS[c].trl is not None}
            assert rivals <= set(preset.configs), (preset.name, config, rivals - set(preset.configs))
    assert {"trl-qlora", "trl-qlora-noliger", "trl-qlora-kbit", "unsloth-qlora", "hf_accel-qlora",
            "hf_accel-qlora-kbit"} <= set(PRESETS["llama-8b-qlora"].configs)


def test_bench_prints_the_table_of_its_stock_configurations_into_the_record():
    from script_modules import script_module

    bench = script_module("bench")
    args = bench.parse_args(["--workload", "llama-8b-qlora", "--configs", "trl-qlora,hf_accel-qlora", "--device",
                             "cpu", "--tiny"])
    record, table = bench.sweep_record(args, [], WORKLOADS["llama-8b-qlora"], [], 0.0)
    assert record["anchor_revision"] == ANCHOR_REVISION and set(record["anchors"]) == {"trl-qlora"}
    assert record["anchors"]["trl-qlora"] == ANCHORS["trl-qlora"].record()
    assert table.startswith(anchors_text(["trl-qlora"])) and "`trl-qlora` (TRL + Liger)" in table


def test_the_issue_70_gpu_queue_names_presets_configs_and_flags_that_exist():
    """scripts/gpu_queues/next70.txt: each bench job's preset and BENCH_ARGS parse as bench.py would take them, and
    each profile job names a workload (a typo would cost a GPU job)."""
    import re
    import shlex
    from pathlib import Path

    from script_modules import script_module

    bench = script_module("bench")
    jobs = [line for line in (Path(__file__).resolve().parents[1] / "scripts/gpu_queues/next70.txt").read_text()
            .splitlines() if line.strip() and not line.startswith("#")]
    benches = [job for job in jobs if "gpu_check.sh bench" in job]
    assert len(benches) >= 5
    for job in benches:
        extra = re.search(r'BENCH_ARGS="([^"]*)"', job)
        for preset in job.split("gpu_check.sh bench", 1)[1].split():
            args = bench.parse_args(["--preset", preset, *shlex.split(extra[1] if extra else "")])
            assert args.configs and args.workload in WORKLOADS, job
    for job in jobs:
        if "profile_step.py" in job:
            assert shlex.split(job)[shlex.split(job).index("--workload") + 1] in WORKLOADS, job
    covered = {job.split("gpu_check.sh bench", 1)[1].split()[0] for job in benches}
    assert {"llama-8b-qlora", "llama-8b-lora-completion", "llama-1b-completion", "llama-1b", "fp8-8b"} <= covered
