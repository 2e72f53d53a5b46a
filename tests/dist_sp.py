"""hf_accel.Trainer for one process of a launch, with or without Ulysses sequence parallelism (``--sp N``: accelerate
``ParallelismConfig(sp_backend="deepspeed", sp_size=N)``), on a tiny Llama and 24 different documents: the
token-budget sampler deals the same packed rows in the same order to one process and, one row per rank and step
in turn, to a sequence-parallel group, so the per-step losses of the two are comparable step by step. Writes
``<out>/losses.rank<R>.json``. Used by tests/test_sequence_parallel.py. ``--lora`` and ``--checkpointing offload``:
the Llama-3-8B long-document setting (LoRA, layer inputs in host memory) in miniature.
"""
import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from multi_gpu_runs import leave_process_group  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--sp", type=int, default=1)
    p.add_argument("--out", required=True)
    p.add_argument("--fused-ce", action="store_true")
    p.add_argument("--lora", action="store_true", help="LoRA r=8 on the attention and MLP projections (peft)")
    p.add_argument("--checkpointing", default=None, help="hf_accel checkpointing policy, e.g. offload")
    args = p.parse_args()
    from transformers import TrainingArguments

    import hf_accel
    from hf_accel.data.default_task import tiny_llama

    model = tiny_llama(64, seed=0, hidden_size=64)
    if args.lora:
        from peft import LoraConfig, get_peft_model

        targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
        model = get_peft_model(model, LoraConfig(r=8, lora_alpha=16, target_modules=targets, init_lora_weights=False))
    g = torch.Generator().manual_seed(0)
    # 24 different 20-token documents: every step packs three into one 60-token row (the token budget), whose two
    # 30-token shards cut the middle one in two, so attention must cross the shard boundary; different documents, so
    # a step that trains another row than one process's (or the same row twice) changes the losses
    docs = [torch.randint(3, 64, (20,), generator=g).tolist() for _ in range(24)]
    rows = [{"input_ids": doc, "labels": doc} for doc in docs]
    kw = {}
    if args.sp > 1:
        from accelerate import ParallelismConfig

        kw["parallelism_config"] = ParallelismConfig(sp_backend="deepspeed", sp_size=args.sp)
    training = TrainingArguments(
        output_dir=args.out, max_steps=4, learning_rate=3e-3, lr_scheduler_type="constant", logging_steps=1,
        report_to=[], save_strategy="no", per_device_train_batch_size=1, use_cpu=args.sp == 1, seed=0,
        dataloader_num_workers=0, **kw)
    accel = hf_accel.AccelArguments(max_tokens_per_batch=60, fused_ce=args.fused_ce, print_summary=False,
                                    checkpointing=args.checkpointing)
    trainer = hf_accel.Trainer(model=model, args=training, train_dataset=rows, accel=accel)
    trainer.train()
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    attn = model.config._attn_implementation
    offloader = getattr(trainer._accel_applied_policy, "offloader", None)  # what offloaded checkpointing moved
    # what that name resolves to: hf_accel's function, or DeepSpeed's Ulysses wrapper around it
    function = ALL_ATTENTION_FUNCTIONS.get(attn)
    with open(os.path.join(args.out, f"losses.rank{os.environ.get('RANK', '0')}.json"), "w") as f:
        json.dump({"losses": losses, "attn": attn, "patched": hf_accel.patch_report(model) is not None,
                   "attn_function": getattr(function, "__qualname__", type(function).__name__),
                   "offloaded": offloader.stats.unpacked if offloader is not None else None}, f)
    leave_process_group()  # sft.py's own exit under sequence parallelism is tested by its launch


if __name__ == "__main__":
    main()
