#!/usr/bin/env python
"""Preference and RL training steps through TRL (issue 73c): hf_accel.DPOTrainer / GRPOTrainer against TRL's own
trainers in their fastest documented settings, on the same model, data and rollouts, one process per configuration.

    python scripts/bench_preference.py --trainer dpo --workload llama-8b-lora
    python scripts/bench_preference.py --trainer grpo --workload qwen3-8b-lora --configs trl-liger,hf_accel
    python scripts/bench_preference.py --trainer dpo --device cpu --tiny          # the CPU smoke run

Data. DPO: pairs from the SFT bench's document lengths (benchlib.workloads: log-normal around 350 tokens): each
document's first 40-60% is the prompt, the rest the chosen completion, the next document's completion the rejected one.
GRPO: the same prompts, ``--generations`` completions each; generation is not timed: TRL's own ``rollout_func`` hook
hands every configuration the same fixed completions (the documents' completions, cut to
``--max-completion-length``), and a deterministic reward (the completion's length parity plus a hash of its ids)
gives every group distinct rewards. The ids are written as word-level text (``t123``) that a word-level tokenizer
turns back into the same ids, since TRL's trainers tokenize text themselves.

Configurations (every one: the workload's model (bf16 on CUDA, fp32 on the CPU), LoRA r=16 through peft_config,
gradient checkpointing where the workload has it, fused AdamW, a constant learning rate, ``--batch`` pairs or
prompts a step):
  trl        TRL's trainer, ``padding_free=True`` (DPO), ``attn_implementation="flash_attention_4"`` (sdpa on the
             CPU or with --substitute-attn)
  trl-liger  the same with ``use_liger_kernel=True``: Liger's fused DPO / GRPO loss (TRL's Liger integration)
  hf_accel   hf_accel.DPOTrainer / GRPOTrainer with ``AccelArguments()`` defaults (patch(), packing under TRL's fused
             LM head), TRL's arguments otherwise as in ``trl``

Reported per configuration: steady tokens/s (real tokens of the policy's forwards, the median timed step), peak GiB,
the losses. The ratio is against the faster of trl / trl-liger in the same run. Records: JSON + markdown under --out.
"""
from __future__ import annotations

import argparse
import datetime as dt
import hashlib
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

for _key, _value in (("HF_HUB_OFFLINE", "1"), ("HF_DATASETS_OFFLINE", "1"), ("HF_HUB_DISABLE_TELEMETRY", "1"),
                     ("TOKENIZERS_PARALLELISM", "false")):
    os.environ.setdefault(_key, _value)
REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # run from a checkout without installing
sys.path.insert(0, str(REPO / "scripts"))

import torch  # noqa: E402

CONFIGS = {
    "trl": "TRL's trainer, padding_free=True (DPO), flash_attention_4",
    "trl-liger": "as trl, use_liger_kernel=True (Liger's fused DPO / GRPO loss)",
    "hf_accel": "hf_accel.DPOTrainer / GRPOTrainer, AccelArguments() defaults, TRL's arguments as in trl",
}
STOCK = ("trl", "trl-liger")
FA4 = "flash_attention_4"


# ------------------------------------------------------------------------------------------------------------ data
def word_tokenizer(vocab_size: int):
    """A word-level tokenizer whose word ``t{i}`` is id i (pad 0, eos 1, unk 2; a document's ids are 3 and up): text
    written by ``as_text`` tokenizes back into the same ids."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": 0, "<eos>": 1, "<unk>": 2, **{f"t{i}": i for i in range(3, vocab_size)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>", unk_token="<unk>")


def as_text(ids: list[int], leading_space: bool = False) -> str:
    return (" " if leading_space else "") + " ".join(f"t{i}" for i in ids)


def pairs(data, count: int) -> list[dict[str, list[int]]]:
    """``count`` (prompt, chosen, rejected) id lists from the bench's SFT-shaped documents (ids >= 3: no pad, eos or
    unk inside a document)."""
    out = []
    n = len(data.samples)
    for i in range(count):
        doc, other = data.samples[i % n], data.samples[(i + 1) % n]
        p, q = data.prompts[i % n], data.prompts[(i + 1) % n]
        fix = [max(3, t) for t in doc]
        out.append({"prompt": fix[:max(1, p)], "chosen": fix[max(1, p):] or [3],
                    "rejected": [max(3, t) for t in other[max(1, q):]] or [4]})
    return out


def reward(completion_ids: list[int]) -> float:
    """Deterministic and spread within a group: the length's parity plus a hash of the ids."""
    digest = hashlib.sha256(str(completion_ids).encode()).digest()
    return (len(completion_ids) % 2) + digest[0] / 255.0


# ------------------------------------------------------------------------------------------------- one config, run
def run_config(args: argparse.Namespace) -> dict:
    from benchlib.train import RunSettings, build_model, lora_config
    from benchlib.workloads import WORKLOADS, DataSpec, build_config, make_data

    settings = RunSettings(WORKLOADS[args.workload], args.device, args.tiny, steps=args.steps, warmup=args.warmup,
                           step_time_budget=1e9)
    vocab = build_config(settings.workload, args.tiny).vocab_size
    spec = DataSpec.tiny() if args.tiny else DataSpec()
    spec = DataSpec(**{**spec.__dict__, "prompt_share": (0.4, 0.6)})
    total_steps = args.warmup + args.steps
    data = make_data(spec, vocab, steps=total_steps)
    attn = "sdpa" if (args.config == "hf_accel" or args.substitute_attn or not args.device.startswith("cuda")) else FA4
    model = build_model(settings, attn)
    tokenizer = word_tokenizer(vocab)
    cuda = args.device.startswith("cuda")
    liger = args.config == "trl-liger"
    common = dict(max_steps=total_steps, per_device_train_batch_size=args.batch, gradient_accumulation_steps=1,
                  learning_rate=1e-6, lr_scheduler_type="constant", warmup_steps=0,
                  optim="adamw_torch_fused" if cuda else "adamw_torch", bf16=cuda, use_cpu=not cuda,
                  gradient_checkpointing=settings.workload.checkpointing,
                  gradient_checkpointing_kwargs={"use_reentrant": False}, save_strategy="no", report_to="none",
                  disable_tqdm=True, dataloader_num_workers=0, seed=0, logging_steps=1, use_liger_kernel=liger)
    step_tokens: list[int] = []
    if args.trainer == "dpo":
        trainer_cls, config, dataset, per_step = _dpo(args, data, common, step_tokens)
    else:
        trainer_cls, config, dataset, per_step = _grpo(args, data, common, step_tokens)
    ends: list[float] = []

    from transformers import TrainerCallback

    class Clock(TrainerCallback):
        def on_step_end(self, targs, state, control, **kwargs):
            if cuda:
                torch.cuda.synchronize()
            ends.append(time.perf_counter())

    extra = {"peft_config": lora_config(settings.workload, model)} if settings.workload.lora else {}
    if args.config == "hf_accel":
        from hf_accel.training.trainer import AccelArguments

        extra["accel"] = AccelArguments(print_summary=False)
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    trainer = trainer_cls(model=model, args=config, train_dataset=dataset, processing_class=tokenizer,
                          callbacks=[Clock()], **extra, **per_step)
    start = time.perf_counter()
    trainer.train()
    steps = [b - a for a, b in zip([start, *ends], ends)][args.warmup:]
    tokens = step_tokens[args.warmup:len(steps) + args.warmup]
    rates = sorted(t / s for t, s in zip(tokens, steps))
    losses = [e["loss"] for e in trainer.state.log_history if "loss" in e]
    return {"config": args.config, "status": "ok", "description": CONFIGS[args.config],
            "timed_steps": len(steps), "step_seconds": steps, "step_tokens": tokens,
            "steady_tokens_per_s": rates[len(rates) // 2] if rates else None,
            "tokens_per_s": sum(tokens) / sum(steps) if steps else None,
            "peak_gib": torch.cuda.max_memory_allocated() / 2**30 if cuda else None, "losses": losses,
            "notes": list(getattr(getattr(trainer, "patch_report", None), "notes", []) or [])}


def _dpo(args, data, common: dict, step_tokens: list[int]):
    import trl
    from datasets import Dataset

    examples = pairs(data, args.batch * (args.warmup + args.steps))
    for start in range(0, len(examples), args.batch):  # sequential sampling: the pairs of each step, in order
        step = examples[start:start + args.batch]
        step_tokens.append(sum(2 * len(e["prompt"]) + len(e["chosen"]) + len(e["rejected"]) + 2 for e in step))
    dataset = Dataset.from_list([{"prompt": as_text(e["prompt"]), "chosen": as_text(e["chosen"], True),
                                  "rejected": as_text(e["rejected"], True)} for e in examples])
    config = trl.DPOConfig(output_dir=tempfile.mkdtemp(prefix="bench-dpo-"), max_length=None,
                           padding_free=args.config != "hf_accel", train_sampling_strategy="sequential",
                           dataset_num_proc=None, beta=0.1, **common)
    if args.config == "hf_accel":
        from hf_accel.training.dpo import DPOTrainer
    else:
        DPOTrainer = trl.DPOTrainer
    return DPOTrainer, config, dataset, {}


def _grpo(args, data, common: dict, step_tokens: list[int]):
    import trl
    from datasets import Dataset

    g = args.generations
    prompts_per_step = args.batch // g
    examples = pairs(data, prompts_per_step * (args.warmup + args.steps))
    by_prompt = {as_text(e["prompt"]): e for e in examples}
    served: dict[str, int] = {}

    def completion(example: dict, k: int) -> list[int]:
        ids = (example["chosen"] + example["rejected"])[k % 3:][:args.max_completion_length]
        return ids[:max(1, len(ids) - k)]

    for start in range(0, len(examples), prompts_per_step):
        step = examples[start:start + prompts_per_step]
        step_tokens.append(sum(len(e["prompt"]) + len(completion(e, k)) for e in step for k in range(g)))

    def rollout(prompts: list, trainer) -> dict:
        """The same completions for every configuration: the k-th time a prompt comes, its k-th completion."""
        prompt_ids, completion_ids = [], []
        for text in prompts:
            example = by_prompt[text]
            k = served[text] = served.get(text, -1) + 1
            prompt_ids.append(example["prompt"])
            completion_ids.append(completion(example, k % g))
        return {"prompt_ids": prompt_ids, "completion_ids": completion_ids, "logprobs": None}

    def reward_fn(completions, completion_ids, **kwargs) -> list[float]:
        return [reward(ids) for ids in completion_ids]

    dataset = Dataset.from_list([{"prompt": as_text(e["prompt"])} for e in examples])
    common = {**common, "per_device_train_batch_size": args.batch}
    config = trl.GRPOConfig(output_dir=tempfile.mkdtemp(prefix="bench-grpo-"), num_generations=g,
                            max_completion_length=args.max_completion_length, beta=args.beta,
                            shuffle_dataset=False, **common)
    if args.config == "hf_accel":
        from hf_accel.training.grpo import GRPOTrainer
    else:
        GRPOTrainer = trl.GRPOTrainer
    return GRPOTrainer, config, dataset, {"reward_funcs": reward_fn, "rollout_func": rollout}


# ------------------------------------------------------------------------------------------------------- the parent
def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--trainer", choices=("dpo", "grpo"), default="dpo")
    parser.add_argument("--workload", default="llama-8b-lora")
    parser.add_argument("--configs", default=",".join(CONFIGS))
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--tiny", action="store_true", help="the workload's tiny shape (the CPU smoke run)")
    parser.add_argument("--substitute-attn", default=None, help="attention for the trl configs instead of FA4")
    parser.add_argument("--steps", type=int, default=6, help="timed steps")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--batch", type=int, default=8, help="pairs (DPO) or completions (GRPO) a step")
    parser.add_argument("--generations", type=int, default=4, help="GRPO: completions per prompt")
    parser.add_argument("--max-completion-length", type=int, default=512)
    parser.add_argument("--beta", type=float, default=0.04, help="GRPO: the KL coefficient (a reference forward)")
    parser.add_argument("--config-timeout", type=float, default=900)
    parser.add_argument("--out", default=str(REPO / "benchmarks" / "results"))
    parser.add_argument("--config", help=argparse.SUPPRESS)  # the child: one configuration
    parser.add_argument("--result", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    unknown = [c for c in args.configs.split(",") if c not in CONFIGS]
    if unknown:
        parser.error(f"unknown configs {unknown}; known: {', '.join(CONFIGS)}")
    if args.trainer == "grpo" and args.batch % args.generations:
        parser.error(f"--batch {args.batch} must be a multiple of --generations {args.generations}")
    return args


def _child(args: argparse.Namespace, argv: list[str], config: str) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        result = Path(tmp) / "result.json"
        cmd = [sys.executable, __file__, *argv, "--config", config, "--result", str(result)]
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=args.config_timeout)
        except subprocess.TimeoutExpired:
            return {"config": config, "status": f"timed out after {args.config_timeout:.0f} s"}
        if proc.returncode != 0 or not result.exists():
            return {"config": config, "status": f"failed (exit {proc.returncode})", "log_tail": proc.stderr[-3000:]}
        return json.loads(result.read_text())


def table(results: list[dict]) -> str:
    ok = [r for r in results if r.get("status") == "ok" and r.get("steady_tokens_per_s")]
    stock = [r for r in ok if r["config"] in STOCK]
    best = max(stock, key=lambda r: r["steady_tokens_per_s"], default=None)
    lines = ["| config | steady tokens/s | vs best stock | peak GiB | last loss | status |", "|---|---|---|---|---|---|"]
    for r in results:
        rate = r.get("steady_tokens_per_s")
        ratio = f"{rate / best['steady_tokens_per_s']:.2f}x" if rate and best else ""
        peak = f"{r['peak_gib']:.1f}" if r.get("peak_gib") else ""
        loss = f"{r['losses'][-1]:.4f}" if r.get("losses") else ""
        lines.append(f"| {r['config']} | {rate:,.0f} | {ratio} | {peak} | {loss} | {r['status']} |" if rate else
                     f"| {r['config']} | | | | | {r.get('status')} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    if args.config:
        Path(args.result).write_text(json.dumps(run_config(args)))
        return
    from benchlib.report import repeat_command, versions, write_outputs

    results = []
    for config in args.configs.split(","):  # each row as it ends: a run cut short still shows the rows it finished
        results.append(_child(args, argv, config))
        print(table(results[-1:]).splitlines()[-1], flush=True)
    text = table(results)
    now = dt.datetime.now(dt.timezone.utc)
    record = {"command": repeat_command("scripts/bench_preference.py", argv), "date": now.isoformat(timespec="seconds"),
              "trainer": args.trainer, "workload": args.workload, "device": args.device, "versions": versions(),
              "settings": {k: v for k, v in vars(args).items() if k not in ("config", "result", "out")},
              "results": results}
    stem = f"{args.trainer}_{args.workload}{'_tiny' if args.tiny else ''}_{now:%Y%m%dT%H%M%SZ}"
    json_path, _ = write_outputs(Path(args.out), stem, record, text)
    print(f"record: {json_path}")
    print(text)
    if any(r.get("status") != "ok" for r in results):
        for r in results:
            if r.get("log_tail"):
                print(f"--- {r['config']}: {r['status']}\n{r['log_tail']}", file=sys.stderr)


if __name__ == "__main__":
    main()
