"""QLoRA with hf_accel's Trainer: a base in bitsandbytes 4-bit (NF4), LoRA from PEFT, packed batches.
docs/qlora.md's recipe on the embedded tiny model. Offline; seconds on a CPU (bitsandbytes' CPU backend), bf16 on a GPU.

The base goes to PEFT as loaded: no prepare_model_for_kbit_training, whose fp32 norms, embeddings and LM head make
the step slower and larger (docs/qlora.md, "What each recipe costs"); the Trainer checkpoints every layer from
TrainingArguments(gradient_checkpointing=True), as PEFT's preparation would have.

    pip install 'hf_accel[qlora]'
    python examples/trainer_qlora.py
"""
import tempfile

import torch
from peft import LoraConfig, get_peft_model
from transformers import AutoModelForCausalLM, BitsAndBytesConfig, TrainingArguments

from hf_accel.data.default_task import build_tokenizer, make_examples, tiny_llama
from hf_accel.training.trainer import AccelArguments, Trainer

gpu = torch.cuda.is_available()
compute = torch.bfloat16 if gpu else torch.float32
tokenizer = build_tokenizer()

with tempfile.TemporaryDirectory() as base, tempfile.TemporaryDirectory() as out:
    tiny_llama(len(tokenizer), hidden_size=64).save_pretrained(base)  # stands in for a checkpoint on the hub
    model = AutoModelForCausalLM.from_pretrained(
        base, quantization_config=BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4",
                                                     bnb_4bit_compute_dtype=compute),
        dtype=compute, device_map={"": 0 if gpu else "cpu"})  # quantized where it trains; the rest stays `compute`
    model = get_peft_model(model, LoraConfig(r=8, lora_alpha=16, target_modules="all-linear", task_type="CAUSAL_LM"))

    trainer = Trainer(
        model=model,
        args=TrainingArguments(output_dir=out, max_steps=12, per_device_train_batch_size=8, learning_rate=3e-3,
                               logging_steps=4, save_strategy="no", report_to="none", bf16=gpu, use_cpu=not gpu,
                               gradient_checkpointing=True, gradient_checkpointing_kwargs={"use_reentrant": False}),
        train_dataset=make_examples(200, seed=0),  # raw prompt/completion pairs: tokenized by the Trainer
        processing_class=tokenizer,
        # packed batches of at most 96 tokens; the model's checkpointing becomes hf_accel's (trimmed; on a GPU the
        # layers' saved inputs go to host memory); print(trainer.patch_report) says what is on and why
        accel=AccelArguments(packing=True, max_tokens_per_batch=96),
    )
    trainer.train()
    trainer.save_model(out)  # the LoRA adapter
