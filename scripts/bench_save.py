#!/usr/bin/env python
"""The training step's stall per checkpoint save, synchronous vs background (issue 21d).

    python scripts/bench_save.py --shape llama-1b --out save_llama1b.json      # H200: full FT, weights + AdamW
    python scripts/bench_save.py --shape llama-8b-lora --out save_8b_lora.json  # H200: LoRA r16, trainable saves
    python scripts/bench_save.py --shape tiny                                   # CPU smoke run (the test uses it)

Random weights, random tokens, hf_accel.Trainer. A step's time is the interval between two ``on_step_end`` events
(the device synchronized), so the interval after a saving step includes that save's stall on the training loop. The
stall per save is the mean interval after saving steps minus the median interval of the other steps.

The synchronous run goes first; the background run then spaces its saves so that the steps between two saves take
longer than a synchronous save (``--save-every auto``): a background write still running when the next save comes
makes that save wait, which measures the disk, not the stall (the interval is recorded). A sampler thread reads the
process's resident memory every 10 ms: ``host_peak_over_checkpoint`` is the peak during the run minus the resident
memory before training, over the checkpoint's size (issue 21c: at most 1.2).
"""
from __future__ import annotations

import argparse
import json
import os
import math
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402
import transformers  # noqa: E402

from benchlib.workloads import WORKLOADS  # noqa: E402
from hf_accel.training.snapshot import proc_bytes  # noqa: E402
from hf_accel.training.trainer import AccelArguments, Trainer  # noqa: E402

TINY = dict(vocab_size=96, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2)
# (config kwargs, LoRA, tokens per step): the bench workloads' shapes (benchlib.workloads)
SHAPES = {"tiny": (TINY, False, 64), "llama-1b": (WORKLOADS["llama-1b"].config_kwargs, False, 4096),
          "llama-8b-lora": (WORKLOADS["llama-8b-lora"].config_kwargs, True, 4096)}


class StepTimes(transformers.TrainerCallback):
    def __init__(self) -> None:
        self.ends: list[float] = []

    def on_step_end(self, args, state, control, **kwargs):
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        self.ends.append(time.perf_counter())


def resident_bytes() -> int:
    """This process's resident set size (VmRSS), 0 where /proc is missing."""
    return proc_bytes("/proc/self/status", "VmRSS") or 0


class HostPeak:
    """The peak resident memory while the block runs, sampled every ``period`` seconds on a thread."""

    def __init__(self, period: float = 0.01) -> None:
        self.period, self.peak, self._stop = period, 0, threading.Event()

    def _run(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, resident_bytes())
            self._stop.wait(self.period)

    def __enter__(self) -> "HostPeak":
        self.peak = resident_bytes()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, resident_bytes())


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
    before = resident_bytes()
    start = time.perf_counter()
    with HostPeak() as host:
        trainer.train()
    total = time.perf_counter() - start
    intervals = [b - a for a, b in zip(timer.ends, timer.ends[1:])]  # interval i follows step i + 1
    after_save = [t for i, t in enumerate(intervals) if (i + 1) % save_every == 0]
    normal = [t for i, t in enumerate(intervals) if (i + 1) % save_every != 0]
    kept = sorted(Path(out_dir).glob("checkpoint-*"))  # save_total_limit=1 keeps the last one
    size = sum(f.stat().st_size for f in kept[-1].rglob("*") if f.is_file()) if kept else 0
    step = statistics.median(normal) if normal else 0.0
    stall = statistics.mean(after_save) - step if after_save else 0.0
    return {"mode": mode, "step_s": step, "stall_per_save_s": stall, "save_every": save_every,
            "stalls_s": [t - step for t in after_save],
            "saves_timed": len(after_save), "checkpoint_gib": size / 2**30, "total_s": total,
            "host_rss_before_gib": before / 2**30, "host_peak_over_before_gib": (host.peak - before) / 2**30,
            "host_peak_over_checkpoint": (host.peak - before) / size if size else None}


def spaced_save_every(sync: dict[str, float], margin: float = 3.0, least: int = 4) -> int:
    """Steps between background saves so that training between two saves outlasts a background write with room to
    spare: ``margin`` synchronous saves (a write on the writer thread shares the CPU with training and takes longer
    than a synchronous one: at 1.5x, Llama-8B LoRA's third save still waited on the second's write on the H200)."""
    if sync["step_s"] <= 0:
        return least
    return max(least, math.ceil(margin * max(sync["stall_per_save_s"], 0.0) / sync["step_s"]))


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", choices=sorted(SHAPES), default="tiny")
    p.add_argument("--saves", type=int, default=3, help="saves timed per mode")
    p.add_argument("--save-every", type=int, default=4, help="steps between saves of the synchronous run")
    p.add_argument("--background-save-every", default="auto",
                   help="steps between background saves: 'auto' (outlast a synchronous save) or a number")
    p.add_argument("--out", default=None, help="write the results as JSON here")
    args = p.parse_args(argv)
    results = {"shape": args.shape, "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"}
    every = args.save_every
    for mode in ("synchronous", "background"):
        if mode == "background":
            every = (spaced_save_every(results["synchronous"]) if args.background_save_every == "auto"
                     else int(args.background_save_every))
        with tempfile.TemporaryDirectory() as tmp:
            results[mode] = run(args.shape, mode, args.saves * every + 1, every, os.path.join(tmp, "run"))
        print(json.dumps(results[mode]), flush=True)
    sync, bg = results["synchronous"]["stall_per_save_s"], results["background"]["stall_per_save_s"]
    results["background_over_sync"] = bg / sync if sync > 0 else None
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=2))
    return results


if __name__ == "__main__":
    main()
