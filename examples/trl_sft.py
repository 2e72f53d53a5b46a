"""hf_accel's TRL SFTTrainer: TRL's padding-free BFD packing with hf_accel's attention and, in TRL's loss form, its
fused loss (TRL's metrics alongside). Offline, CPU, seconds; on a GPU the same script takes the fast path by itself.

    python examples/trl_sft.py

The settings are the ones docs/guide/speedups-and-backends.md ("Through TRL") gives for the fastest run: packing,
bf16 (on a GPU), no full gradient checkpointing where the model fits (SFTConfig turns it on by default), metrics read
back once per log. ``use_liger_kernel=True`` would be harmless (hf_accel's compiled layers trace liger's forwards as
the stock ones, the LM head is hf_accel's) and is not needed.
"""
import tempfile

import torch
from datasets import Dataset
from trl import SFTConfig

from hf_accel.data.default_task import build_tokenizer, make_examples, tiny_llama
from hf_accel.training.trainer import AccelArguments, SFTTrainer

tokenizer = build_tokenizer()
model = tiny_llama(len(tokenizer), hidden_size=64)
on_gpu = torch.cuda.is_available()

with tempfile.TemporaryDirectory() as out:
    trainer = SFTTrainer(
        model=model,
        args=SFTConfig(output_dir=out, max_steps=10, packing=True, max_length=256, per_device_train_batch_size=2,
                       learning_rate=3e-3, logging_steps=2, save_strategy="no", report_to="none", bf16=on_gpu,
                       use_cpu=not on_gpu, gradient_checkpointing=False),
        train_dataset=Dataset.from_list(make_examples(300, seed=0)),  # prompt/completion: TRL trains completions
        processing_class=tokenizer,
        # fused_ce="auto" (the default) serves the loss on CUDA; True here so the CPU run shows it too
        accel=AccelArguments(backend="auto", fused_ce=True),
    )
    print(trainer.patch_report)
    trainer.train()
