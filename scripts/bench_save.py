#!/usr/bin/env python
"""The training step's stall per checkpoint save, synchronous vs background (issue 21d).

    python scripts/bench_save.py --shape llama-1b --out save_llama1b.json      # H200: full FT, weights + AdamW
    python scripts/bench_save.py --shape llama-8b-lora --out save_8b_lora.json  # H200: LoRA r16, trainable saves
    python scripts/bench_save.py --shape tiny                                   # CPU smoke run (the test uses it)

Random weights, random tokens, hf_accel.Trainer. A step's time is the interval between two ``on_step_end`` events
(the device synchronized), so the interval after a saving step includes that save's stall on the training loop. The
stall per save is the mean interval after saving steps minus the median interval of the other steps.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402
import transformers  # noqa: E402

from hf_accel.bench.workloads import WORKLOADS  # noqa: E402
from hf_accel.training.trainer import AccelArguments, Trainer  # noqa: E402

TINY = dict(vocab_size=96, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2)
# (config kwargs, LoRA, tokens per step): the bench workloads' shapes (hf_accel.bench.workloads)
SHAPES = {"tiny": (TINY, False, 64), "llama-1b": (WORKLOADS["llama-1b"].config_kwargs, False, 4096),
          "llama-8b-lora": (WORKLOADS["llama-8b-lora"].config_kwargs, True, 4096)}


class StepTimes(transformers.TrainerCallback):
    def __init__(self) -> None:
        self.ends: list[float] = []

    def on_step_end(self, args, state, control, **kwargs):
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        self.ends.append(time.perf_counter())


def build_model(shape: str) -> torch.nn.Module:
    config, lora, _ = SHAPES[shape]
    on_gpu = torch.cuda.is_available()
    cfg = transformers.LlamaConfig(**config, attn_implementation="sdpa", use_cache=False)
    with torch.device("cuda" if on_gpu else "cpu"):
        model = transformers.LlamaForCausalLM(cfg).to(torch.bfloat16 if on_gpu else torch.float32)
    if lora:
        from peft import LoraConfig, get_peft_model

        model = get_peft_model(model, LoraConfig(r=16, lora_alpha=32, lora_dropout=0.0, task_type="CAUSAL_LM",
                                                 target_modules=list(WORKLOADS["llama-8b-lora"].lora_targets)))
    return model


def run(shape: str, mode: str, steps: int, save_every: int, out_dir: str) -> dict[str, float]:
    config, lora, seq = SHAPES[shape]
    torch.manual_seed(0)
    model = build_model(shape)
    data = [{"input_ids": torch.randint(1, config["vocab_size"], (seq,)).tolist()} for _ in range(steps)]
    on_gpu = torch.cuda.is_available()
    args = transformers.TrainingArguments(
        output_dir=out_dir, max_steps=steps, per_device_train_batch_size=1, save_strategy="steps",
        save_steps=save_every, save_total_limit=1, logging_steps=steps, report_to="none", use_cpu=not on_gpu,
        bf16=on_gpu,
        disable_tqdm=True, dataloader_num_workers=0, optim="adamw_torch", learning_rate=1e-5)
    timer = StepTimes()
    accel = AccelArguments(async_save=mode == "background", save="trainable" if lora else "full",
                           print_summary=False, backend="auto" if on_gpu else "reference")
    trainer = Trainer(model=model, args=args, train_dataset=data, accel=accel, callbacks=[timer])
    start = time.perf_counter()
    trainer.train()
    total = time.perf_counter() - start
    intervals = [b - a for a, b in zip(timer.ends, timer.ends[1:])]  # interval i follows step i + 1
    after_save = [t for i, t in enumerate(intervals) if (i + 1) % save_every == 0]
    normal = [t for i, t in enumerate(intervals) if (i + 1) % save_every != 0]
    kept = sorted(Path(out_dir).glob("checkpoint-*"))  # save_total_limit=1 keeps the last one
    size = sum(f.stat().st_size for f in kept[-1].rglob("*") if f.is_file()) if kept else 0
    step = statistics.median(normal) if normal else 0.0
    stall = statistics.mean(after_save) - step if after_save else 0.0
    return {"mode": mode, "step_s": step, "stall_per_save_s": stall,
            "saves_timed": len(after_save), "checkpoint_gib": size / 2**30, "total_s": total}


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", choices=sorted(SHAPES), default="tiny")
    p.add_argument("--steps", type=int, default=13)
    p.add_argument("--save-every", type=int, default=4)
    p.add_argument("--out", default=None, help="write the results as JSON here")
    args = p.parse_args(argv)
    results = {"shape": args.shape, "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"}
    for mode in ("synchronous", "background"):
        with tempfile.TemporaryDirectory() as tmp:
            results[mode] = run(args.shape, mode, args.steps, args.save_every, os.path.join(tmp, "run"))
        print(json.dumps(results[mode]), flush=True)
    sync, bg = results["synchronous"]["stall_per_save_s"], results["background"]["stall_per_save_s"]
    results["background_over_sync"] = bg / sync if sync > 0 else None
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=2))
    return results


if __name__ == "__main__":
    main()
