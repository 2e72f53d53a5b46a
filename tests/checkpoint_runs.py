"""Tiny training runs for the checkpoint tests: a 2-layer Llama built in code, a fixed token dataset, AdamW (its
state must round-trip), a linear schedule (so a wrong step count shows in the loss) and random sampling (so the
sampler and RNG state must round-trip too)."""
from __future__ import annotations

import random

import torch
import transformers

from hf_accel.training.trainer import AccelArguments, Trainer
from tests.tiny_models import VOCAB, make

STEPS, SAVE_EVERY = 6, 2
LOSS_RTOL = 1e-6  # same process, same CPU kernels: a resumed run repeats the uninterrupted run's arithmetic


def data(n: int = 40) -> list[dict]:
    rng = random.Random(0)
    return [{"input_ids": [rng.randrange(1, VOCAB) for _ in range(rng.randrange(4, 14))]} for _ in range(n)]


def model(*, frozen_embeddings: bool = False, lora: bool = False, seed: int = 0) -> torch.nn.Module:
    m = make("llama-gqa", seed=seed).train()
    if frozen_embeddings:
        m.get_input_embeddings().weight.requires_grad_(False)
    if lora:
        from peft import LoraConfig, get_peft_model

        torch.manual_seed(1)
        m = get_peft_model(m, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"],
                                         init_lora_weights=False))
    return m


def args(out, **kw) -> transformers.TrainingArguments:
    base = dict(output_dir=str(out), per_device_train_batch_size=4, max_steps=STEPS, save_strategy="steps",
                save_steps=SAVE_EVERY, logging_steps=1, report_to="none", use_cpu=True, seed=0, disable_tqdm=True,
                dataloader_num_workers=0, lr_scheduler_type="linear", learning_rate=1e-2, optim="adamw_torch")
    base.update(kw)
    return transformers.TrainingArguments(**base)


class StopAt(transformers.TrainerCallback):
    """Ends training after ``step`` (its save still happens): an interrupted run without killing anything."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step >= self.step:
            control.should_training_stop = True


def trainer(out, m=None, *, accel: AccelArguments | None = None, stop_at: int | None = None, **kw) -> Trainer:
    accel = accel or AccelArguments(backend="reference", print_summary=False)
    return Trainer(model=m if m is not None else model(), args=args(out, **kw), train_dataset=data(), accel=accel,
                   callbacks=[StopAt(stop_at)] if stop_at else None)


def accel(**kw) -> AccelArguments:
    return AccelArguments(backend="reference", print_summary=False, **kw)


def losses(t) -> list[float]:
    return [log["loss"] for log in t.state.log_history if "loss" in log]
