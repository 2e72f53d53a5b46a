"""hf_accel.DPOTrainer on CUDA (issue 73): its defaults (compiled layers, flash-attn-4 where installed, chosen and
rejected packed into one row, for the policy and for the reference) against plain ``trl.DPOTrainer`` on the same
pairs, LoRA r=16 with the adapter disabled as the reference.

Three runs: TRL in fp32 (the reference), TRL in bf16, ours in bf16. Each step's loss and reward margin of ours stays
within test_trl_sft_gpu's BF16_FACTOR times the bf16 TRL run's own error against fp32, plus a floor: the policy's
forward runs compiled and the reference's eagerly (no grad), so their bf16 roundings differ where TRL's coincide
(run 42: a first-step loss of 0.6778 against ln 2 on Llama-3-8B shapes). The LoRA B factors start non-zero, so the
policy differs from its reference from the first step and the margins mean something."""
from __future__ import annotations

import pytest
import torch
from test_trl_sft_gpu import TARGETS, load, saved_llama, within_bf16_error  # noqa: F401 (saved_llama: a fixture)

pytestmark = pytest.mark.gpu
trl = pytest.importorskip("trl")

STEPS = 6
LOSS_FLOOR = 5e-3  # relative
MARGIN_FLOOR = 5e-2  # absolute (the reward margins are beta times summed log-prob differences)


def pairs():
    from datasets import Dataset

    from hf_accel.data.default_task import make_examples

    ex = make_examples(129, seed=0, min_len=8, max_len=40)
    return Dataset.from_list([{"prompt": a["prompt"], "chosen": a["completion"], "rejected": b["completion"]}
                              for a, b in zip(ex, ex[1:])])


def run(cls, folder, tmp, bf16: bool, **kw):
    from peft import LoraConfig

    from hf_accel.data.default_task import build_tokenizer

    torch.manual_seed(1)
    args = trl.DPOConfig(output_dir=str(tmp), per_device_train_batch_size=8, max_steps=STEPS, logging_steps=1,
                         save_strategy="no", report_to="none", seed=0, learning_rate=2e-4, bf16=bf16, beta=0.1,
                         train_sampling_strategy="sequential", lr_scheduler_type="constant", max_length=None,
                         gradient_checkpointing=False)
    lora = LoraConfig(r=16, lora_alpha=32, lora_dropout=0.0, target_modules=TARGETS, init_lora_weights=False,
                      task_type="CAUSAL_LM")
    trainer = cls(model=load(folder, "lora", torch.bfloat16 if bf16 else torch.float32), ref_model=None, args=args,
                  train_dataset=pairs(), processing_class=build_tokenizer(), peft_config=lora, **kw)
    trainer.train()
    return trainer, [e for e in trainer.state.log_history if "loss" in e]


def test_dpo_trainer_trains_like_trl(saved_llama, tmp_path):
    from hf_accel.training.dpo import DPOTrainer
    from hf_accel.training.trainer import AccelArguments

    _, fp32 = run(trl.DPOTrainer, saved_llama, tmp_path / "fp32", bf16=False)
    _, stock16 = run(trl.DPOTrainer, saved_llama, tmp_path / "stock", bf16=True)
    ours, mine = run(DPOTrainer, saved_llama, tmp_path / "ours", bf16=True,
                     accel=AccelArguments(print_summary=False))
    notes = ours.patch_report.notes
    print(ours.patch_report, *(f"\n{key}: fp32 {[e[key] for e in fp32]}\nstock bf16 {[e[key] for e in stock16]}\n"
                               f"ours {[e[key] for e in mine]}" for key in ("loss", "rewards/margins")))
    assert len(mine) == len(fp32) == STEPS
    within_bf16_error(mine, stock16, fp32, "loss", LOSS_FLOOR)
    within_bf16_error(mine, stock16, fp32, "rewards/margins", MARGIN_FLOOR, relative=False)
    assert any(n.startswith("chosen / rejected: padding-free") for n in notes), notes
    assert any(n.startswith("reference: the policy with its PEFT adapter disabled") for n in notes), notes
