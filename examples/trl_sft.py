"""hf_accel's TRL SFTTrainer: TRL's padding-free BFD packing with hf_accel's attention. Offline, CPU, seconds.

    python examples/trl_sft.py
"""
import tempfile

from datasets import Dataset
from trl import SFTConfig

from hf_accel.data.default_task import build_tokenizer, make_examples, tiny_llama
from hf_accel.training.trainer import AccelArguments, SFTTrainer

tokenizer = build_tokenizer()
model = tiny_llama(len(tokenizer), hidden_size=64)

with tempfile.TemporaryDirectory() as out:
    trainer = SFTTrainer(
        model=model,
        args=SFTConfig(output_dir=out, max_steps=10, packing=True, max_length=256, per_device_train_batch_size=2,
                       learning_rate=3e-3, logging_steps=2, save_strategy="no", report_to="none", use_cpu=True,
                       gradient_checkpointing=False),
        train_dataset=Dataset.from_list(make_examples(300, seed=0)),  # prompt/completion: TRL trains completions
        processing_class=tokenizer,
        accel=AccelArguments(backend="auto"),
    )
    trainer.train()
