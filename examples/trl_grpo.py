"""hf_accel's TRL GRPOTrainer: TRL's GRPO with the scoring forwards (left-padded prompt + right-padded completion)
packed padding-free and hf_accel's attention; generation stays TRL's (``model.generate`` here, vLLM where configured).
Offline, CPU, seconds; on a GPU the same script takes the fast path by itself.

    python examples/trl_grpo.py

Prompts from the embedded default task; the reward scores each completion against the task's right answer: the
share of its first characters that are digits (the format) plus the share of the answer's digits it has right, in
place. The mean reward TRL logs rises as the policy learns. docs/guide/dpo-grpo.md says what is faster and what stays
TRL's.
"""
import tempfile

import torch
from datasets import Dataset
from trl import GRPOConfig

from hf_accel.data.default_task import build_tokenizer, make_examples, solve, tiny_llama
from hf_accel.training.grpo import GRPOTrainer
from hf_accel.training.trainer import AccelArguments

tokenizer = build_tokenizer()
model = tiny_llama(len(tokenizer), hidden_size=64)
on_gpu = torch.cuda.is_available()
prompts = Dataset.from_list([{"prompt": ex["prompt"]} for ex in make_examples(400, seed=0)])


def answer_reward(prompts, completions, **kwargs):
    """Format (digits) and correctness (the right digit in each place), 0 to 2 a completion."""
    rewards = []
    for prompt, completion in zip(prompts, completions):
        task, digits = prompt.rstrip("=").split(":")
        answer = solve(task, digits)
        head = completion[:len(answer)]
        digit_share = sum(ch.isdigit() for ch in head) / len(answer)
        right_share = sum(a == b for a, b in zip(head, answer)) / len(answer)
        rewards.append(digit_share + right_share)
    return rewards


with tempfile.TemporaryDirectory() as out:
    trainer = GRPOTrainer(
        model=model, reward_funcs=answer_reward,
        args=GRPOConfig(output_dir=out, max_steps=20, per_device_train_batch_size=16, num_generations=8,
                        max_completion_length=8, learning_rate=1e-2, beta=0.0, logging_steps=5, save_strategy="no",
                        report_to="none", bf16=on_gpu, use_cpu=not on_gpu),
        train_dataset=prompts,
        processing_class=tokenizer,
        accel=AccelArguments(),  # the defaults: the scoring forwards packed into one row, the model patched
    )
    print(trainer.patch_report)
    trainer.train()
    for entry in trainer.state.log_history:
        if "reward" in entry:
            print(f"step {entry['step']}: mean reward {entry['reward']:.3f} (of 2), loss {entry['loss']:.4f}")
