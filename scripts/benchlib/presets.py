"""Named runs of scripts/bench.py: one preset = one workload, its configurations and its step/time settings.

`python scripts/bench.py --preset NAME` runs a preset; flags given on the command line override its settings.
`scripts/gpu_check.sh bench [PRESET ...]` runs presets on the GPU machine within one device call each.

The four workload presets are issue 18's comparison: the stock anchors measured in the same run (the strongest stock
stack that computes the same thing, and HF's padded path where that is the only correct one), "hf_accel defaults"
(`hf_accel.patch(model)`, no flags) and "hf_accel best" (`patch(model, fused_ce=True, fused_ops=True,
compile=True)`). Timings were sized from the first runs (each configuration 35-60 s in its own process on one
GPU): every preset fits one 10-minute device call, `llama-1b` (the standard bench) in about 3 minutes (about 5 with
the Unsloth row, whose import, model files and load take ~1 minute; issue 20's rows run only where their packs are
installed: bench.py reports "not installed" otherwise).

The multi-GPU presets (issue 19, `bench.py --nproc`) need a machine with 2 GPUs (`nvidia-h200-x2`): each config runs
under `accelerate launch` with FSDP2 (examples/accelerate/fsdp2.yaml; the 8B full-FT preset fsdp2_checkpointing.yaml),
TRL + flash-attn-4 + Liger through SFTTrainer and hf_accel defaults through hf_accel.Trainer (token budget: the step's
16k tokens per GPU, so N GPUs train N times the tokens per step), and the table ends with the scaling (steady tokens/s
on 2 GPUs / on 1) and hf_accel / TRL at each count. Each launch costs ~40-90 s of start-up and compile: `multi-gpu`
(6 launches of Llama-1B) fits one 10-minute device call (about 7 minutes); `multi-gpu-8b-lora` (4 launches of 8B)
took 5.3 minutes and `multi-gpu-8b` 2.8 (BENCHMARKS.md, "Multi-GPU"); `multi-gpu-8b` (8B full FT) runs on 2 GPUs
only: its fp32 master weights and AdamW states (~128 GB) leave one 141 GB GPU no room.

The completion presets (issue 39) train prompt-masked documents (each document's first 40-60% masked, see
benchlib.workloads): TRL + flash-attn-4 + Liger through its prompt-completion form (`completion_mask`,
`completion_only_loss=True`) against hf_accel defaults (the fused loss over the target rows only), the same defaults
over every row (what the target rows save) and hf_accel best. Each is sized to fit one 10-minute device call (the
8B one takes most of it).

Issue 70: every preset runs the stock configurations that compete for its anchor side by side (TRL with and without
Liger; for QLoRA also PEFT's kbit preparation and Unsloth): the faster of the same run is the anchor
(benchlib.anchors says which configuration is which). Presets with two 8B TRL rows or more outgrow one 10-minute
device call: run them in the background queue (scripts/gpu_queue.sh, e.g. scripts/gpu_queues/next70.txt).

A preset whose code does not exist yet names the issue that will add it (`pending`); running it fails with
"not implemented yet: issue N" and what it will run.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class Preset:
    name: str
    description: str
    workload: str | None = None
    configs: tuple[str, ...] = ()
    settings: dict[str, Any] = field(default_factory=dict)  # bench.py argument defaults (argparse dest names)
    pending: str | None = None  # "issue N" while the code this preset needs does not exist

    def argv(self) -> list[str]:
        """The bench.py flags this preset stands for (for the recorded command and --list-presets)."""
        if self.pending:
            return []
        out = ["--workload", str(self.workload), "--configs", ",".join(self.configs)]
        for dest, value in self.settings.items():
            out += [f"--{dest.replace('_', '-')}", str(value)]
        return out


_DEFAULTS_AND_BEST = ("hf_accel-defaults", "hf_accel-best")
# TRL's two stock stacks for a bf16 model (anchors: the faster of the run is the anchor; Liger's row says where Liger
# has no kernels for the family)
_TRL = ("trl-fa4-packed-liger", "trl-fa4-packed")
_LONG_CONFIGS = ("trl-fa4-packed-liger", "hf-sdpa-padded", "unsloth", "hf_accel-best")  # unsloth: where its pack is
_MULTI_CONFIGS = ("trl-fa4-packed-liger", "hf_accel-defaults")
# sized like llama-8b-lora (6 timed steps of 16k tokens, a minute or two a configuration)
_FAMILY_LORA_SETTINGS = dict(steps=6, warmup=2, best_compile="on", best_checkpointing="budget:0.8", time_budget=700,
                             config_timeout=170)
_LONG_SETTINGS = dict(doc_lengths="16384,32768,65536,131072,262144", steps=2, warmup=1, best_checkpointing="offload",
                      best_compile="off", time_budget=560, config_timeout=400)
# issue 40: past 256k the layer inputs alone (4 GiB a layer at 512k) outgrow the device, and offloading all of them
# the host: hf_accel's row plans the split (device / host / spaced) under a memory budget a little under the GPU's
# A step past 256k takes minutes (2026-12-05: a 344k QLoRA step with its set-up, ~10-12 min), so a length's process
# may take up to 25 minutes; run the long lengths with --steps 1 --warmup 0 in a background queue (gpu_queue.sh).
# The budget is a share of the device (0.89: 125 GiB of an H200's 140.4, 70.5 of an H100's 79.2), so the preset runs
# on either card (run 32: a fixed 125 GiB was refused on an H100).
_LONG_8B_SETTINGS = dict(_LONG_SETTINGS, doc_lengths="16384,32768,65536,131072,262144,393216,524288",
                         best_checkpointing="budget:0.89", time_budget=3000, config_timeout=1500)
# An 80 GB card as torch counts it (H100 80GB HBM3: 79.18 GiB), rounded down: the card Unsloth's 342,733 tokens were
# measured on. A cap of 80 GiB is more than that card (refused on one, runs 31-32) and looser than it on an H200.
EIGHTY_GB_CARD_GIB = 79.17
# issue 40c: QLoRA within an 80 GB card (every config of the run capped, torch's per-process memory fraction), from
# 256k past Unsloth's published 342,733 tokens
_QLORA_LONG_SETTINGS = dict(doc_lengths="262144,344064,393216,458752,524288", steps=1, warmup=0,
                            best_checkpointing=f"budget:{EIGHTY_GB_CARD_GIB}GiB",
                            device_memory_cap_gib=EIGHTY_GB_CARD_GIB, time_budget=3000, config_timeout=1200)

PRESETS: dict[str, Preset] = {
    p.name: p
    for p in [
        Preset(
            "llama-1b", "Llama-3.2-1B shapes, full FT: TRL + flash-attn-4 with and without Liger vs hf_accel "
            "defaults / best, and Unsloth (full_finetuning=True) where its pack is installed",
            "llama-1b", (*_TRL, *_DEFAULTS_AND_BEST, "unsloth"),
            dict(steps=30, warmup=6, best_compile="on", time_budget=420, config_timeout=120),
        ),
        Preset(  # issue 39c: each lever beside the defaults and the TRL anchor, same run
            "llama-1b-levers", "Llama-3.2-1B shapes, full FT: hf_accel defaults vs the same with inductor's "
            "max-autotune matmuls, with CUDA graphs, with torch's FlashAttention-2 for flash-attn-4, and traced "
            "without dynamo's nested graph breaks, against TRL + flash-attn-4 with and without Liger",
            "llama-1b", (*_TRL, "hf_accel-defaults", "hf_accel-autotune", "hf_accel-cudagraphs", "hf_accel-torch-fa2",
                         "hf_accel-without-nested-breaks"),
            dict(steps=30, warmup=8, time_budget=620, config_timeout=200),
        ),
        # issue 39d: float8 training as an explicit opt-in beside bf16 (hf_accel defaults) and the TRL anchor; the
        # 1B over 200 timed steps, so the records hold both loss curves on the same data
        Preset(
            "fp8-1b", "Llama-3.2-1B shapes, full FT, 200 steps: hf_accel precision='fp8' (torchao float8, rowwise) vs "
            "bf16 (hf_accel defaults) and TRL + flash-attn-4 with and without Liger: tokens/s and the loss curves",
            "llama-1b", (*_TRL, "hf_accel-defaults", "hf_accel-fp8"),
            # 200 steps of ~0.27 s: the default 15 s of timed steps stopped every row near step 60 (run 24)
            dict(steps=200, warmup=6, step_time_budget=70, time_budget=620, config_timeout=170),
        ),
        Preset(
            "fp8-8b", "Llama-3-8B shapes, full FT (checkpointing): hf_accel precision='fp8' vs bf16 (hf_accel "
            "defaults) and TRL + flash-attn-4 with and without Liger",
            "llama-8b-full", ("hf_accel-defaults", "hf_accel-fp8", *_TRL),
            dict(steps=12, warmup=3, time_budget=740, config_timeout=180),
        ),
        Preset(
            "neox-1.4b", "GPT-NeoX 1.4B shapes, full FT: TRL + flash-attn-4 (Liger's row says it has no GPT-NeoX "
            "kernels) vs hf_accel defaults / best",
            "neox-1.4b", (*_TRL[::-1], *_DEFAULTS_AND_BEST),
            dict(steps=30, warmup=6, best_compile="on", time_budget=230, config_timeout=85),
        ),
        Preset(
            "falcon-1b", "Falcon ~1B, full FT: HF SDPA padded (stock packing attends across documents for Falcon) vs "
            "hf_accel defaults / best",
            "falcon-1b", ("hf-sdpa-padded", *_DEFAULTS_AND_BEST),
            dict(steps=15, warmup=6, best_compile="on", time_budget=220, config_timeout=80),
        ),
        Preset(
            "llama-8b-lora", "Llama-3-8B shapes, LoRA r=16 + checkpointing: TRL + flash-attn-4 with and without Liger "
            "(full checkpointing) vs hf_accel defaults / best (checkpointing budget:0.8), and Unsloth (its LoRA and "
            "offloaded checkpointing) where its pack is installed",
            "llama-8b-lora", (*_TRL[::-1], *_DEFAULTS_AND_BEST, "hf_accel-offload", "hf_accel-offload-mlp4k",
                              "unsloth"),
            dict(steps=6, warmup=2, best_compile="on", best_checkpointing="budget:0.8", time_budget=660,
                 config_timeout=150),
        ),
        # issue 36: the other bases people LoRA-tune, at their published shapes: the strongest stock stacks (TRL +
        # flash-attn-4 + Liger, Unsloth where its pack is installed) vs hf_accel defaults / best in the same run
        *[Preset(
            name, f"{shape} shapes, LoRA r=16 + checkpointing: TRL + flash-attn-4 with and without Liger (full "
            "checkpointing) vs hf_accel defaults / best (checkpointing budget:0.8), and Unsloth (its LoRA and "
            "offloaded checkpointing) where its pack is installed",
            name, (*_TRL, *_DEFAULTS_AND_BEST, *unsloth), _FAMILY_LORA_SETTINGS,
        ) for name, shape, unsloth in (
            ("qwen3-8b-lora", "Qwen3-8B", ("unsloth",)), ("mistral-7b-lora", "Mistral-7B-v0.1", ("unsloth",)),
            # Unsloth's compiled Gemma-2 layers failed in inductor on torch 2.11 (12-02): its eager row as well
            ("gemma2-9b-lora", "Gemma-2-9B (soft-capping, sliding / global layers)", ("unsloth", "unsloth-eager")))],
        # issue 67f: the 2026 families people LoRA-tune on one GPU, text models at their published shapes, LoRA r=16
        # + checkpointing: TRL + flash-attn-4 with and without Liger (liger-kernel 0.8.5 has kernels for all four
        # model types) vs hf_accel defaults / best (budget:0.8). Not yet measured on a GPU.
        Preset(
            "qwen3.5-9b-lora", "Qwen3.5-9B text model shapes (24 Gated DeltaNet + 8 gated attention layers), LoRA r=16 "
            "on all decoder linears + checkpointing: TRL + flash-attn-4 with and without Liger (stock packing of the "
            "Gated DeltaNet layers needs fla-core and causal-conv1d on CUDA: transformers refuses the packed rows "
            "otherwise, and those rows say so) and HF SDPA padded (stock's path that is right without them) vs "
            "hf_accel defaults / best (checkpointing budget:0.8)",
            "qwen3.5-9b-lora", (*_TRL, "hf-sdpa-padded", *_DEFAULTS_AND_BEST), _FAMILY_LORA_SETTINGS,
        ),
        *[Preset(
            name, f"{shape}, LoRA r=16 on the attention projections and the experts (PEFT's target_parameters, "
            "the same adapters in every row) + checkpointing: TRL + flash-attn-4 with and without Liger (full "
            "checkpointing) and Unsloth's MoE path (its grouped GEMM with LoRA split per expert, where its pack is "
            "installed) vs hf_accel defaults / best (checkpointing budget:0.8)",
            name, (*_TRL, *_DEFAULTS_AND_BEST, "unsloth"), _FAMILY_LORA_SETTINGS,
        ) for name, shape in (
            ("gpt-oss-20b-lora", "gpt-oss-20b shapes in bf16 (attention sinks, sliding 128 / full layers, 32 experts "
             "top-4)"),
            ("qwen3-30b-a3b-lora", "Qwen3-30B-A3B shapes (128 experts top-8)"))],
        Preset(
            "gemma4-12b-lora", "Gemma 4 12B text model shapes (sliding 1024 / global layers with head_dim 256 / 512, "
            "the global layers' values are their keys, final soft-cap), LoRA r=16 on attention and MLP + "
            "checkpointing: TRL + flash-attn-4 with and without Liger (flash-attn-4 takes head_dim up to 256: where "
            "transformers refuses it for the 512-wide global layers, those rows say so) and HF SDPA padded (a stock "
            "path that serves both head dims) vs hf_accel defaults / best (checkpointing budget:0.8)",
            "gemma4-12b-lora", (*_TRL, "hf-sdpa-padded", *_DEFAULTS_AND_BEST), _FAMILY_LORA_SETTINGS,
        ),
        Preset(
            "llama-8b-qlora", "Llama-3-8B shapes, QLoRA (bitsandbytes NF4 base, LoRA r=16, checkpointing): TRL's "
            "QLoRA path (peft_config on the base as loaded, flash-attn-4) with and without Liger and on PEFT's kbit "
            "preparation, Unsloth's QLoRA, vs hf_accel's recipe (the base as loaded, patch(model)), the same on "
            "PEFT's recipe, and hf_accel.SFTTrainer(peft_config=...), where the bitsandbytes / Unsloth packs are "
            "installed",
            "llama-8b-qlora", ("trl-qlora", "trl-qlora-noliger", "trl-qlora-kbit", "unsloth-qlora", "hf_accel-qlora",
                               "hf_accel-qlora-kbit", "hf_accel-qlora-sft"),
            # hf_accel's rows compile their layers now (bitsandbytes 4-bit): warm-up 3 covers the first graphs and a
            # recompile at a new token range; rows take ~100-120 s each: seven outgrow one 10-minute call (queue it)
            dict(steps=6, warmup=3, time_budget=1000, config_timeout=170),
        ),
        # issue 69c: the TRL route (hf_accel.SFTTrainer on TRL's own SFTConfig, with and without use_liger_kernel)
        # beside hf_accel.Trainer (no flags) and TRL's anchors, same run: within 3% of the Trainer's row, no more memory
        *[Preset(
            name, f"{shape}: hf_accel.SFTTrainer with TRL's SFTConfig, with and without use_liger_kernel, vs hf_accel "
            "defaults and TRL + flash-attn-4 with and without Liger",
            workload, (*_TRL, "hf_accel-defaults", "hf_accel-trainer", "hf_accel-trl", "hf_accel-trl-liger"),
            settings,
        ) for name, workload, shape, settings in (
            ("trl-route-1b", "llama-1b", "Llama-3.2-1B shapes, full FT",
             dict(steps=30, warmup=6, time_budget=560, config_timeout=120)),
            ("trl-route-8b-lora", "llama-8b-lora", "Llama-3-8B shapes, LoRA r=16 (peft_config) + checkpointing",
             dict(steps=6, warmup=2, time_budget=800, config_timeout=150)))],
        Preset(
            "trl-route-8b-qlora", "Llama-3-8B shapes, QLoRA: hf_accel.SFTTrainer(peft_config=...) on the NF4 base, "
            "with and without use_liger_kernel, vs hf_accel's QLoRA recipe and TRL's QLoRA path with and without "
            "Liger and on PEFT's kbit preparation, where the bitsandbytes pack is installed",
            "llama-8b-qlora", ("trl-qlora", "trl-qlora-noliger", "trl-qlora-kbit", "hf_accel-qlora",
                               "hf_accel-qlora-sft", "hf_accel-qlora-sft-liger"),
            dict(steps=6, warmup=3, time_budget=1100, config_timeout=170),
        ),
        Preset(  # issue 38d: a 16k-token step is ~6 x 70B x 16k FLOPs (tens of seconds on one GPU): few steps
            "llama-70b-qlora", "Llama-3-70B shapes, QLoRA (NF4 base built layer by layer on the GPU, LoRA r=16, "
            "checkpointing): hf_accel defaults vs TRL's QLoRA path + flash-attn-4 + Liger; Unsloth loads from files, "
            "which do not fit (its row says so)",
            # TRL's QLoRA path with Liger only: a 70B row takes ~5 minutes; its other stock variants (without Liger,
            # on PEFT's kbit preparation) run beside it at 8B (llama-8b-qlora)
            "llama-70b-qlora", ("hf_accel-qlora", "trl-qlora", "unsloth-qlora"),
            dict(steps=2, warmup=2, time_budget=580, config_timeout=330),
        ),
        Preset(
            "falcon-rw-1b", "Falcon-RW-1B shapes (ALiBi), full FT: HF SDPA padded (stock packing attends across "
            "documents for Falcon) vs hf_accel on SDPA with a dense ALiBi bias (the path before flex) vs hf_accel "
            "defaults (compiled flex, ALiBi as a score_mod)",
            "falcon-rw-1b", ("hf-sdpa-padded", "hf_accel-sdpa", "hf_accel-defaults"),
            # hf_accel defaults compile flex per new padded row length (~11 s each on the GPU): 120 s timed out
            dict(steps=15, warmup=6, time_budget=540, config_timeout=300),
        ),
        # issue 39b: prompt-masked SFT data, the same masks in every configuration
        Preset(
            "llama-1b-completion", "Llama-3.2-1B shapes, full FT, prompt-completion documents (40-60% of each "
            "masked): TRL + flash-attn-4 with and without Liger (completion_only_loss) vs hf_accel defaults (LM head "
            "on target rows only), the same over every row, and best",
            "llama-1b-completion", (*_TRL, *_DEFAULTS_AND_BEST, "hf_accel-defaults-all-rows"),
            dict(steps=30, warmup=6, best_compile="on", time_budget=480, config_timeout=120),
        ),
        Preset(
            "llama-8b-lora-completion", "Llama-3-8B shapes, LoRA r=16 + checkpointing, prompt-completion documents "
            "(40-60% of each masked): TRL + flash-attn-4 with and without Liger (completion_only_loss) vs hf_accel "
            "defaults (LM head on target rows only), the same over every row, and best (checkpointing budget:0.8)",
            "llama-8b-lora-completion",
            (*_TRL, *_DEFAULTS_AND_BEST, "hf_accel-defaults-all-rows"),
            # TRL's steps here are of two kinds (~1.7 s and ~2.35 s, 2026-12-03): twelve timed steps, not six, so
            # the median is not one kind by chance; the four rows took 377 s of the budget with six. The step-time
            # budget lets all twelve run (the default 15 s stopped TRL after seven on 2026-12-05). Five rows with
            # TRL's second stack (issue 70): past one 10-minute call
            dict(steps=12, warmup=2, step_time_budget=40, best_compile="on", best_checkpointing="budget:0.8",
                 time_budget=720, config_timeout=150),
        ),
        # issue 22: one document per step, each (config, length) in its own process, a config stopping at its first
        # OOM or timeout. Lengths past ~64k do not fit one 10-minute device call: run them apart with --doc-lengths
        # (and --configs), e.g. `--preset long-context --doc-lengths 131072,262144 --configs hf_accel-best`; on the
        # 2-GPU machine `--sweep-gpus 2` runs the configs side by side in one run.
        Preset(
            "long-context", "single documents of 16k-512k tokens, Llama-3-8B shapes with Llama-3 rope scaling, LoRA "
            "r=16: the longest length that trains and tokens/s + MFU + device and host peaks per length, for TRL + "
            "flash-attn-4 + Liger with checkpointing, HF sdpa with checkpointing, Unsloth (its offloaded "
            "checkpointing) where its pack is installed, hf_accel (fused loss and ops, a budget plan of 0.89 of the "
            "device: layer inputs on the device, in host memory or spaced); 1M tokens: --doc-lengths 1048576",
            "llama-8b-lora-long", _LONG_CONFIGS, _LONG_8B_SETTINGS,
        ),
        Preset(
            "long-context-qlora", "single documents of 256k-512k tokens, Llama-3-8B shapes, QLoRA (NF4 base, LoRA "
            f"r=16), every config capped at an 80 GB card's {EIGHTY_GB_CARD_GIB} GiB of device memory: hf_accel's "
            f"budget plan (budget:{EIGHTY_GB_CARD_GIB}GiB) on PEFT's recipe (fp32 residual stream) and on the base "
            "as Unsloth keeps it (bf16) vs Unsloth's QLoRA (published: 342,733 tokens on an 80 GB GPU) and TRL + "
            "flash-attn-4 + Liger on TRL's QLoRA path, where the bitsandbytes / Unsloth packs are installed",
            "llama-8b-qlora-long",
            ("hf_accel-qlora-budget", "hf_accel-qlora-bf16-budget", "unsloth-qlora", "trl-qlora"), _QLORA_LONG_SETTINGS,
        ),
        Preset(  # issue 71d: one document is one sequence, so stock's Gated DeltaNet layers are right without fla-core
            "long-context-qwen3.5", "single documents of 32k-256k tokens, Qwen3.5-9B text model shapes (24 Gated "
            "DeltaNet layers, linear in the length, + 8 attention layers), LoRA r=16 on all decoder linears: the "
            "longest length that trains and tokens/s + MFU + device and host peaks per length, for TRL + "
            "flash-attn-4 with and without Liger (checkpointing; transformers refuses TRL's position_ids rows for "
            "these layers without causal-conv1d, and those rows say so) and HF SDPA on the document as one row "
            "(stock's path that runs without it), vs hf_accel defaults / best (a budget plan of 0.89 of the device)",
            "qwen3.5-9b-lora-long", (*_TRL, "hf-sdpa-padded", "hf_accel-defaults", "hf_accel-best"),
            dict(_LONG_8B_SETTINGS, doc_lengths="32768,65536,131072,262144"),
        ),
        Preset(
            "long-context-1b", "as long-context, Llama-3.2-1B shapes, full FT",
            "llama-1b-long", _LONG_CONFIGS, _LONG_SETTINGS,
        ),
        # issue 19: FSDP2 on 1 and 2 GPUs (bench.py --nproc), each (config, count) in its own launch
        Preset(
            "multi-gpu", "Llama-3.2-1B shapes, full FT, FSDP2 on 1 and 2 GPUs: scaling (steady tokens/s on 2 / on "
            "1) and hf_accel defaults / best (compiled layers) vs TRL + flash-attn-4 + Liger under the same FSDP2 "
            "config, per-GPU memory",
            "llama-1b", (*_MULTI_CONFIGS, "hf_accel-best"),
            dict(nproc="1,2", steps=20, warmup=6, best_compile="on", time_budget=540, config_timeout=130),
        ),
        Preset(
            "multi-gpu-8b-lora", "as multi-gpu, Llama-3-8B shapes, LoRA r=16 + checkpointing; hf_accel best with "
            "the checkpointing memory budget 0.8 (as the llama-8b-lora preset) besides the defaults",
            "llama-8b-lora", (*_MULTI_CONFIGS, "hf_accel-best"),
            # ~2.5 min a (config, count) on the GPU: past one 10-minute device call, run it in the background
            dict(nproc="1,2", steps=6, warmup=3, best_compile="on", best_checkpointing="budget:0.8", time_budget=960,
                 config_timeout=200),
        ),
        Preset(
            "multi-gpu-8b", "Llama-3-8B shapes, full FT with FSDP2's activation checkpointing "
            "(fsdp2_checkpointing.yaml) on 2 GPUs: hf_accel defaults vs TRL + flash-attn-4 + Liger; hf_accel best "
            "under the same sharding (fsdp2.yaml) with its checkpointing memory budget 0.8 instead of FSDP's "
            "every layer",
            "llama-8b", (*_MULTI_CONFIGS, "hf_accel-best"),
            dict(nproc="2", accelerate_config="examples/accelerate/fsdp2_checkpointing.yaml",
                 best_accelerate_config="examples/accelerate/fsdp2.yaml", best_checkpointing="budget:0.8",
                 best_compile="on", steps=6, warmup=3, time_budget=780, config_timeout=260),
        ),
    ]
}


class PresetUnavailable(RuntimeError):
    """The preset's code does not exist yet (see Preset.pending)."""


def get_preset(name: str) -> Preset:
    """The preset `name`; raises PresetUnavailable for a pending one and KeyError (listing names) for unknown ones."""
    if name not in PRESETS:
        raise KeyError(f"unknown preset {name!r}; choose from {', '.join(PRESETS)}")
    preset = PRESETS[name]
    if preset.pending:
        raise PresetUnavailable(f"preset {name!r}: not implemented yet: {preset.pending} (it will run: "
                                f"{preset.description})")
    return preset


def describe() -> str:
    """One line per preset: name, what it compares, the flags it stands for (or the issue that will add it)."""
    lines = []
    for p in PRESETS.values():
        how = f"not implemented yet: {p.pending}" if p.pending else " ".join(p.argv())
        lines.append(f"{p.name}: {p.description}\n    {how}")
    return "\n".join(lines)
