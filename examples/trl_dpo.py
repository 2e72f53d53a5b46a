"""hf_accel's TRL DPOTrainer: TRL's DPO with the chosen and rejected rows packed padding-free and hf_accel's attention,
for the policy and for its reference, LoRA through TRL's ``peft_config`` (the reference is the policy with its adapter
disabled). Offline, CPU, seconds; on a GPU the same script takes the fast path by itself.

    python examples/trl_dpo.py

Pairs from the embedded default task: the right answer chosen, a degenerate one (all nines, as long) rejected. The
loss starts at ln 2 (the policy is its own reference at the first step) and falls as the policy learns the
preference; TRL's reward metrics (``rewards/margins``, ``rewards/accuracies``) are logged as TRL logs them.
docs/guide/dpo-grpo.md says what is faster and what stays TRL's.
"""
import tempfile

import torch
from datasets import Dataset
from peft import LoraConfig
from trl import DPOConfig

from hf_accel.data.default_task import build_tokenizer, make_examples, tiny_llama
from hf_accel.training.dpo import DPOTrainer
from hf_accel.training.trainer import AccelArguments

tokenizer = build_tokenizer()
model = tiny_llama(len(tokenizer), hidden_size=64)
on_gpu = torch.cuda.is_available()
examples = [ex for ex in make_examples(600, seed=0) if set(ex["completion"]) != {"9"}]
pairs = Dataset.from_list([{"prompt": ex["prompt"], "chosen": ex["completion"], "rejected": "9" * len(ex["completion"])}
                           for ex in examples])

with tempfile.TemporaryDirectory() as out:
    trainer = DPOTrainer(
        model=model, ref_model=None,  # with peft_config: the reference is the policy with its adapter disabled
        args=DPOConfig(output_dir=out, max_steps=20, per_device_train_batch_size=8, learning_rate=2e-2, beta=0.1,
                       logging_steps=5, save_strategy="no", report_to="none", bf16=on_gpu, use_cpu=not on_gpu,
                       max_length=None),
        train_dataset=pairs,
        processing_class=tokenizer,
        peft_config=LoraConfig(r=16, lora_alpha=32, target_modules=["q_proj", "k_proj", "v_proj", "o_proj",
                                                                    "gate_proj", "up_proj", "down_proj"]),
        accel=AccelArguments(),  # the defaults: chosen / rejected packed into one row, the model patched
    )
    print(trainer.patch_report)
    trainer.train()
    for entry in trainer.state.log_history:
        if "loss" in entry:
            print(f"step {entry['step']}: loss {entry['loss']:.4f}, margins {entry['rewards/margins']:.4f}, "
                  f"accuracy {entry['rewards/accuracies']:.2f}")
