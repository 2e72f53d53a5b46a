"""hf_accel's Trainer + LoRA (PEFT) on a raw prompt/completion dataset. Offline, CPU, seconds.

    python examples/trainer_lora.py
"""
import tempfile

from peft import LoraConfig, get_peft_model
from transformers import TrainingArguments

from hf_accel.data.default_task import build_tokenizer, make_examples, tiny_llama
from hf_accel.training.trainer import AccelArguments, Trainer

tokenizer = build_tokenizer()
model = get_peft_model(tiny_llama(len(tokenizer), hidden_size=64), LoraConfig(
    r=8, lora_alpha=16, target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
    task_type="CAUSAL_LM"))

with tempfile.TemporaryDirectory() as out:
    trainer = Trainer(
        model=model,
        args=TrainingArguments(output_dir=out, max_steps=12, per_device_train_batch_size=8, learning_rate=3e-3,
                               logging_steps=4, save_strategy="no", report_to="none", use_cpu=True),
        train_dataset=make_examples(200, seed=0),  # raw prompt/completion pairs: tokenized by the Trainer
        processing_class=tokenizer,
        # packed batches of at most 96 tokens, hf_accel's attention, checkpoint every second layer
        accel=AccelArguments(backend="auto", packing=True, max_tokens_per_batch=96, checkpointing="every_2"),
    )
    trainer.train()  # logs tokens/s, padding and data-wait fractions (and MFU on a known GPU); prints a summary
    trainer.save_model(out)  # the LoRA adapter
