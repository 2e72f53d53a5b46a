#!/usr/bin/env python
"""Checkpointing benchmark: peak memory and tokens/s per policy, next to the offline estimate.

GPU (H200): `python scripts/bench_checkpointing.py --out bench_ckpt.json` runs Llama-1B shapes full fine-tuning and
Llama-8B shapes LoRA r=16 on all linear layers, on packed SFT batches, for none / full / every_2 / every_4 / op /
budget at three budgets (25/50/75% of the way from the estimated full-checkpointing peak to the no-checkpointing peak).
CPU smoke: `--tiny` (tiny Llama, 2 steps). Writes JSON to --out and prints a markdown table last.
"""
import argparse
import gc
import json
import os
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402
from transformers import AutoModelForCausalLM, LlamaConfig  # noqa: E402

import hf_accel  # noqa: E402
from hf_accel.errors import ConfigurationError  # noqa: E402
from hf_accel.memory.checkpointing import policy_from_spec, remove_checkpointing  # noqa: E402
from hf_accel.memory.spec import parse_bytes  # noqa: E402
from hf_accel.memory.estimate import estimate_training_memory, load_config  # noqa: E402

LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
FIXED = ["none", "full", "every_2", "every_4", "op"]
WORKLOADS = {  # name: (shape, lora rank, tokens per step, timed steps)
    "llama-1b-full": ("llama-3.2-1b", None, 16384, 6),
    "llama-8b-lora16": ("llama-3-8b", 16, 8192, 4),
}


def sft_lengths(n: int, seed: int) -> list[int]:
    try:
        from hf_accel.data.prepare import sft_lengths as lengths
        return lengths(n, seed=seed)
    except ImportError:  # log-normal stand-in for SFT chat lengths
        gen = torch.Generator().manual_seed(seed)
        return torch.exp(5.86 + torch.randn(n, generator=gen)).round().clamp(16, 4096).long().tolist()


def packed_batch(tokens: int, vocab: int, seed: int, device) -> dict:
    """One row of `tokens` tokens: documents cut from SFT lengths, position_ids restarting, first labels -100."""
    lengths, total = [], 0
    for n in sft_lengths(4 * tokens // 16, seed):
        n = min(n, tokens - total)
        lengths.append(n)
        total += n
        if total == tokens:
            break
    gen = torch.Generator().manual_seed(seed)
    input_ids = torch.randint(0, vocab, (1, tokens), generator=gen)
    position_ids = torch.cat([torch.arange(n) for n in lengths])[None]
    labels = input_ids.clone()
    labels[position_ids == 0] = -100
    cu = torch.tensor([0] + lengths).cumsum(0).to(torch.int32)
    batch = {"input_ids": input_ids, "labels": labels, "position_ids": position_ids, "cu_seq_lens_q": cu,
             "cu_seq_lens_k": cu}
    batch = {k: v.to(device) for k, v in batch.items()}
    batch.update(max_length_q=max(lengths), max_length_k=max(lengths))
    return batch


def build_model(config, lora_rank, device, dtype):
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    model.config.use_cache = False
    hf_accel.patch(model)
    if lora_rank:
        import peft

        model = peft.get_peft_model(model, peft.LoraConfig(r=lora_rank, lora_alpha=2 * lora_rank,
                                                           lora_dropout=0.0, target_modules=LORA_TARGETS))
    return model.train()


def run_policy(model, spec, batches, device) -> dict:
    policy = policy_from_spec(spec)
    try:
        policy.apply(model)
    except ConfigurationError as err:  # a budget no plan fits (the error names the smallest that does)
        return {"tokens_per_s": None, "step_s": None, "peak_gib": "infeasible", "policy": str(err), "choices": None}
    params = [p for p in model.parameters() if p.requires_grad]
    cuda = torch.device(device).type == "cuda"
    optimizer = torch.optim.AdamW(params, lr=1e-5, fused=cuda)
    try:
        times = []
        for step, batch in enumerate(batches):
            if cuda and step == 1:
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats()
            start = time.perf_counter()
            model(**batch).loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            if cuda:
                torch.cuda.synchronize()
            times.append(time.perf_counter() - start)
        timed = times[1:] or times  # the first step warms up kernels and allocates optimizer states
        tokens = sum(b["input_ids"].numel() for b in batches[1:] or batches)
        result = {"tokens_per_s": tokens / sum(timed), "step_s": sum(timed) / len(timed),
                  "peak_gib": torch.cuda.max_memory_allocated() / 1024**3 if cuda else None}
    except torch.OutOfMemoryError:
        result = {"tokens_per_s": None, "step_s": None, "peak_gib": "OOM"}
    plan = getattr(policy, "plan", None)
    result.update(policy=policy.describe(), choices=list(plan.choices) if plan is not None else None)
    del optimizer
    remove_checkpointing(model)
    gc.collect()
    if cuda:
        torch.cuda.empty_cache()
    return result


def budgets(config, lora, tokens, device_bytes) -> list[str]:
    """Three budgets between the estimated full-checkpointing and no-checkpointing peaks."""
    low = estimate_training_memory(config, lora_rank=lora, batch_tokens=tokens, checkpointing="full").peak_bytes
    high = estimate_training_memory(config, lora_rank=lora, batch_tokens=tokens, checkpointing="none").peak_bytes
    points = [low + f * (high - low) for f in (0.25, 0.5, 0.75)]
    return [f"budget:{p / 1024**3:.1f}GiB" if p >= 1024**3 else f"budget:{p / 1024**2:.1f}MiB" for p in points]


def bench_workload(name, config, lora, tokens, steps, device, dtype) -> list[dict]:
    model = build_model(config, lora, device, dtype)
    batches = [packed_batch(tokens, config.vocab_size, seed, device) for seed in range(steps + 1)]
    device_bytes = torch.cuda.get_device_properties(device).total_memory if device == "cuda" else None
    dtype_name = {torch.bfloat16: "bf16", torch.float32: "fp32"}[dtype]
    rows = []
    for spec in FIXED + budgets(config, lora, tokens, device_bytes):
        if spec.startswith("budget:"):
            policy = policy_from_spec(spec)
            policy.sample_batch = batches[0]
            spec_to_run = policy
        else:
            spec_to_run = spec
        result = run_policy(model, spec_to_run, batches, device)
        estimate = estimate_training_memory(config, dtype=dtype_name, lora_rank=lora, batch_tokens=tokens,
                                            checkpointing=spec, device_bytes=device_bytes)
        result.update(workload=name, spec=spec, estimate_peak_gib=estimate.peak_bytes / 1024**3)
        print(json.dumps(result), flush=True)
        rows.append(result)
    del model
    gc.collect()
    return rows


def _measured(row) -> bool:
    return isinstance(row["peak_gib"], float) and row["tokens_per_s"] is not None


def best_fixed_within(rows, workload: str, budget_gib: float) -> dict | None:
    """The fastest fixed policy of `workload` whose measured peak fits `budget_gib` (the budget mode's yardstick)."""
    fits = [r for r in rows if r["workload"] == workload and r["spec"] in FIXED and _measured(r)
            and r["peak_gib"] <= budget_gib]
    return max(fits, key=lambda r: r["tokens_per_s"], default=None)


def annotate(rows) -> list[dict]:
    """Add, per row, estimate/measured and, for budget rows, the best fixed policy within the same budget."""
    for r in rows:
        r["estimate_over_measured"] = r["estimate_peak_gib"] / r["peak_gib"] if _measured(r) else None
        if r["spec"].startswith("budget:"):
            budget = parse_bytes(r["spec"][7:]) / 1024**3
            best = best_fixed_within(rows, r["workload"], budget)
            r["budget_gib"] = budget
            r["fits_budget"] = (r["peak_gib"] <= budget) if _measured(r) else None
            r["best_fixed_within_budget"] = best["spec"] if best else None
            r["vs_best_fixed"] = r["tokens_per_s"] / best["tokens_per_s"] if best and _measured(r) else None
    return rows


def markdown(rows) -> str:
    def fmt(v, spec="{:.1f}"):
        return "-" if v is None else (v if isinstance(v, str) else spec.format(v))

    lines = ["| workload | policy | tokens/s | peak GiB | estimated peak GiB | estimate / measured "
             "| best fixed policy within the budget | budget mode vs it |", "|---|---|---:|---:|---:|---:|---|---:|"]
    for r in rows:
        budget = r["spec"].startswith("budget:")
        best = (r["best_fixed_within_budget"] or "none fits") if budget else ""
        fits = {True: " (fits)", False: " (**over budget**)"}.get(r.get("fits_budget"), "")
        lines.append(
            f"| {r['workload']} | {r['spec']}{fits} | {fmt(r['tokens_per_s'], '{:.0f}')} | {fmt(r['peak_gib'], '{:.2f}')}"
            f" | {fmt(r['estimate_peak_gib'], '{:.2f}')} | {fmt(r['estimate_over_measured'], '{:.2f}')} | {best}"
            f" | {fmt(r.get('vs_best_fixed'), '{:.2f}x') if budget else ''} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="bench_checkpointing.json")
    parser.add_argument("--tiny", action="store_true", help="tiny Llama on CPU, 2 steps (smoke test)")
    parser.add_argument("--workloads", default=",".join(WORKLOADS), help=f"comma-separated of {list(WORKLOADS)}")
    args = parser.parse_args()
    if args.tiny:
        config = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                             num_attention_heads=4, num_key_value_heads=2)
        rows = bench_workload("tiny-llama", config, None, 256, 2, "cpu", torch.float32)
    else:
        device = "cuda" if torch.cuda.is_available() else "cpu"
        rows = []
        for name in args.workloads.split(","):
            shape, lora, tokens, steps = WORKLOADS[name]
            rows += bench_workload(name, load_config(shape), lora, tokens, steps, device, torch.bfloat16)
    rows = annotate(rows)
    with open(args.out, "w") as f:
        json.dump(rows, f, indent=1)
    print(markdown(rows))


if __name__ == "__main__":
    main()
