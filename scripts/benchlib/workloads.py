"""Benchmark workloads: real architectures' shapes (random init, no hub), SFT-shaped lengths, token-budget steps.

The `completion` workloads train prompt-masked documents, as SFT data mostly is: each document is a prompt (system
and user turns) followed by its completion (the assistant's turn), and only the completion is a target. The prompt's
share of each document is drawn uniformly from `PROMPT_SHARE` (so 40-60% of every document's tokens are masked, the
first token always among them), independently of its length; every configuration trains the same masks."""
from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Iterable

import torch

from hf_accel.cli.shapes import BASES, LLAMA3_ROPE, ModelShape, shape_config

# Shapes shared by every tiny (CPU smoke) variant; only the family changes.
TINY = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, vocab_size=512)


@dataclass(frozen=True)
class Workload:
    """One model shape to benchmark. `config_kwargs` builds the real shape; `tiny_kwargs` the CPU smoke shape."""

    name: str
    family: str  # transformers model_type: llama, gpt_neox, falcon, qwen3, mistral, gemma2, qwen3_5_text, ...
    config_kwargs: dict[str, Any]
    tiny_kwargs: dict[str, Any]
    lora: bool = False  # LoRA r=16 on every linear layer of the decoder (peft)
    checkpointing: bool = False
    lora_targets: tuple[str, ...] = ()
    lora_experts: bool = False  # LoRA on the MoE experts' 3-D projections too (PEFT's target_parameters)
    notes: str = ""
    prompt_share: tuple[float, float] | None = None  # completion workloads: each document's masked prompt share range
    # QLoRA configs: "files" = the random bf16 model saved, then loaded in 4-bit (from_pretrained, as users load);
    # "device" = built in 4-bit on the device one weight at a time (benchlib.quantized_base): bf16 too large for disk / RAM
    qlora_build: str = "files"


_LLAMA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
_FUSED_TARGETS = ("query_key_value", "dense", "dense_h_to_4h", "dense_4h_to_h")
# the CPU smoke shapes of the Llama workloads
_LLAMA_1B_TINY = dict(TINY, intermediate_size=128, num_key_value_heads=2, tie_word_embeddings=True)
_LLAMA_8B_TINY = dict(TINY, intermediate_size=128, num_key_value_heads=2, tie_word_embeddings=False)
PROMPT_SHARE = (0.4, 0.6)  # the completion workloads: a document's prompt share, uniform in this range
# the other families' CPU smoke shapes (each keeps its family's feature: q/k norm, a window shorter than the tiny
# documents, soft-capping with sliding and global layers)
_GQA_TINY = dict(TINY, intermediate_size=128, num_key_value_heads=2, tie_word_embeddings=False)
_LONG_ROPE_TINY = dict(rope_parameters=dict(LLAMA3_ROPE, original_max_position_embeddings=64))
# issue 67f: the 2026 families. LoRA on the family's own targets: Qwen3.5 every decoder linear (its Gated DeltaNet's
# projections besides attention and MLP, what PEFT's "all-linear" adapts); the MoE families attention and experts (the
# experts' 3-D parameters through PEFT's target_parameters, named from the model: ``lora_experts``, issue 72d); Gemma 4
# attention and MLP (its global layers have no v_proj: their values are their keys).
_QWEN3_5_TARGETS = (*_LLAMA_TARGETS, "in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a", "out_proj")
_ATTENTION_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj")
# their CPU smoke shapes, each keeping its family's features: both Qwen3.5 layer kinds (Gated DeltaNet, gated
# attention with partial rotary); gpt-oss's sinks (every attention layer has them) on a sliding and a full layer, 4
# experts top-2; Qwen3-MoE's q/k norm and 4 experts top-2; Gemma 4's head_dim 16 / 32 on sliding / global layers,
# the global layer's one KV head whose values are its keys, the final soft-cap
_QWEN3_5_TINY = dict(_GQA_TINY, head_dim=16, layer_types=["linear_attention", "full_attention"],
                     linear_conv_kernel_dim=4, linear_key_head_dim=16, linear_value_head_dim=16, linear_num_key_heads=2,
                     linear_num_value_heads=4,
                     rope_parameters=dict(rope_type="default", rope_theta=10000000.0, partial_rotary_factor=0.25,
                                          mrope_interleaved=True, mrope_section=[1, 1, 0]))
_GPT_OSS_TINY = dict(_GQA_TINY, head_dim=16, num_local_experts=4, num_experts_per_tok=2, sliding_window=16,
                     layer_types=["sliding_attention", "full_attention"], attention_bias=True)
_QWEN3_MOE_TINY = dict(_GQA_TINY, head_dim=16, moe_intermediate_size=64, num_experts=4, num_experts_per_tok=2,
                       norm_topk_prob=True, mlp_only_layers=[])
_GEMMA4_TINY = dict(_GQA_TINY, head_dim=16, global_head_dim=32, num_global_key_value_heads=1, attention_k_eq_v=True,
                    num_kv_shared_layers=0, hidden_size_per_layer_input=0, sliding_window=16,
                    layer_types=["sliding_attention", "full_attention"], final_logit_softcapping=30.0,
                    tie_word_embeddings=True)


def _base(name: str) -> tuple[str, dict[str, Any]]:
    """(family, config kwargs) of the published shape ``name`` (hf_accel.cli.shapes.BASES), the kwargs a copy."""
    family, kwargs = BASES[name]
    return family, dict(kwargs)


WORKLOADS: dict[str, Workload] = {
    w.name: w
    for w in [
        Workload(
            "llama-1b", *_base("llama-1b"),
            dict(_LLAMA_1B_TINY),
            notes="Llama-3.2-1B shapes (rope scaling omitted: it does not change cost)",
        ),
        Workload(
            "llama-8b-lora", *_base("llama-8b"),
            dict(_LLAMA_8B_TINY),
            lora=True, checkpointing=True, lora_targets=_LLAMA_TARGETS,
            notes="Llama-3-8B shapes, LoRA r=16 alpha=32 on all decoder linears, gradient checkpointing on",
        ),
        Workload(  # issue 39d (preset fp8-8b): one GPU holds 8B full FT with checkpointing (bf16 weights, grads, AdamW)
            "llama-8b-full", *_base("llama-8b"),
            dict(_LLAMA_8B_TINY),
            checkpointing=True,
            notes="Llama-3-8B shapes, full FT on one GPU, gradient checkpointing on",
        ),
        Workload(  # issue 19: multi-GPU only (preset multi-gpu-8b); FSDP2's own activation checkpointing
            "llama-8b", *_base("llama-8b"),
            dict(_LLAMA_8B_TINY),
            notes="Llama-3-8B shapes, full FT, no checkpointing of its own: for bench.py --nproc with "
                  "fsdp2_checkpointing.yaml (FSDP2 checkpoints every decoder layer)",
        ),
        Workload(
            "llama-8b-qlora", *_base("llama-8b"),
            dict(_LLAMA_8B_TINY),
            lora=True, checkpointing=True, lora_targets=_LLAMA_TARGETS,
            notes="Llama-3-8B shapes, QLoRA: the base in bitsandbytes NF4 (bf16 compute), LoRA r=16 alpha=32 on all "
                  "decoder linears, gradient checkpointing on (the QLoRA configs quantize; others would not)",
        ),
        Workload(  # issue 38d: bf16 weights ~140 GB, past the GPU machine's disk and RAM: built in 4-bit on the GPU
            "llama-70b-qlora", *_base("llama-70b"),
            dict(_LLAMA_8B_TINY),
            lora=True, checkpointing=True, lora_targets=_LLAMA_TARGETS, qlora_build="device",
            notes="Llama-3-70B shapes, QLoRA: the base built in bitsandbytes NF4 on the GPU one weight at a time "
                  "(bf16 compute), LoRA r=16 alpha=32 on all decoder linears, gradient checkpointing on",
        ),
        Workload(
            "qwen3-8b-lora", *_base("qwen3-8b"), dict(_GQA_TINY, head_dim=16),
            lora=True, checkpointing=True, lora_targets=_LLAMA_TARGETS,
            notes="Qwen3-8B shapes (per-head q/k RMSNorm), LoRA r=16 alpha=32 on all decoder linears, gradient "
                  "checkpointing on",
        ),
        Workload(
            "mistral-7b-lora", *_base("mistral-7b"), dict(_GQA_TINY, sliding_window=16),
            lora=True, checkpointing=True, lora_targets=_LLAMA_TARGETS,
            notes="Mistral-7B-v0.1 shapes (sliding window 4096 on every layer; SFT documents up to 4096 tokens "
                  "never reach past it), LoRA r=16 alpha=32 on all decoder linears, gradient checkpointing on",
        ),
        Workload(
            "gemma2-9b-lora", *_base("gemma2-9b"),
            dict(_GQA_TINY, head_dim=16, query_pre_attn_scalar=16, sliding_window=16, attn_logit_softcapping=50.0,
                 final_logit_softcapping=30.0, tie_word_embeddings=True),
            lora=True, checkpointing=True, lora_targets=_LLAMA_TARGETS,
            notes="Gemma-2-9B shapes (attention soft-cap 50, final logit soft-cap 30, sliding 4096 / global layers "
                  "alternating, head_dim 256, vocabulary 256000, tied), LoRA r=16 alpha=32 on all decoder linears, "
                  "gradient checkpointing on",
        ),
        # issue 67f: the 2026 families people LoRA-tune on one GPU (not yet measured on a GPU)
        Workload(
            "qwen3.5-9b-lora", *_base("qwen3.5-9b"), dict(_QWEN3_5_TINY),
            lora=True, checkpointing=True, lora_targets=_QWEN3_5_TARGETS,
            notes="Qwen3.5-9B text model shapes (24 Gated DeltaNet + 8 gated full-attention layers, head_dim 256, "
                  "vocabulary 248320), LoRA r=16 alpha=32 on all decoder linears (attention, Gated DeltaNet, MLP), "
                  "gradient checkpointing on",
        ),
        Workload(
            "gpt-oss-20b-lora", *_base("gpt-oss-20b"), dict(_GPT_OSS_TINY),
            lora=True, checkpointing=True, lora_targets=_ATTENTION_TARGETS, lora_experts=True,
            notes="gpt-oss-20b shapes in bf16 (attention sinks, sliding 128 / full layers alternating, 32 experts "
                  "top-4), LoRA r=16 alpha=32 on the attention projections and the experts' gate_up / down "
                  "projections (PEFT's target_parameters), gradient checkpointing on",
        ),
        Workload(
            "qwen3-30b-a3b-lora", *_base("qwen3-30b-a3b"), dict(_QWEN3_MOE_TINY),
            lora=True, checkpointing=True, lora_targets=_ATTENTION_TARGETS, lora_experts=True,
            notes="Qwen3-30B-A3B shapes (48 layers, 128 experts top-8 of width 768), LoRA r=16 alpha=32 on the "
                  "attention projections and the experts' gate_up / down projections (PEFT's target_parameters), "
                  "gradient checkpointing on",
        ),
        Workload(
            "gemma4-12b-lora", *_base("gemma4-12b"), dict(_GEMMA4_TINY),
            lora=True, checkpointing=True, lora_targets=_LLAMA_TARGETS,
            notes="Gemma 4 12B text model shapes (5 sliding 1024 / 1 global layers, head_dim 256 / 512, the global "
                  "layers' values are their keys, final soft-cap 30, vocabulary 262144, tied), LoRA r=16 alpha=32 on "
                  "attention and MLP, gradient checkpointing on",
        ),
        Workload(
            "neox-1.4b", *_base("neox-1.4b"),
            dict(TINY, intermediate_size=256, rotary_pct=0.25, use_parallel_residual=True),
            notes="Pythia-1.4B shapes (max_position_embeddings raised to 4096 for the 4096-token tail)",
        ),
        Workload(
            "falcon-1b", *_base("falcon-1b"),
            dict(TINY, ffn_hidden_size=256, num_kv_heads=4, new_decoder_architecture=False, multi_query=False,
                 alibi=False, parallel_attn=True, bias=False),
            notes="Falcon ~1.3B: hidden 2048, 24 layers, 32 heads MHA, rotary, parallel attn, vocab 50304, tied",
        ),
        Workload(  # issue 22d: ALiBi on a flash path
            "falcon-rw-1b", *_base("falcon-rw-1b"),
            dict(TINY, new_decoder_architecture=False, multi_query=False, alibi=True, parallel_attn=False,
                 bias=True),
            notes="Falcon-RW-1B shapes: hidden 2048, 24 layers, 32 heads MHA, ALiBi (no rotary), sequential "
                  "attention + MLP, biases, vocab 50304, tied",
        ),
        # issue 39: prompt-masked SFT data (prompt + completion documents, the prompt masked)
        Workload(
            "llama-1b-completion", *_base("llama-1b"),
            dict(_LLAMA_1B_TINY),
            prompt_share=PROMPT_SHARE,
            notes="Llama-3.2-1B shapes, full FT, prompt-completion documents: each document's first 40-60% "
                  "(uniform) is its prompt, masked (-100); only completion tokens are targets",
        ),
        Workload(
            "llama-8b-lora-completion", *_base("llama-8b"),
            dict(_LLAMA_8B_TINY),
            lora=True, checkpointing=True, lora_targets=_LLAMA_TARGETS, prompt_share=PROMPT_SHARE,
            notes="Llama-3-8B shapes, LoRA r=16 alpha=32 on all decoder linears, gradient checkpointing on, "
                  "prompt-completion documents: each document's first 40-60% (uniform) is its prompt, masked",
        ),
        # issue 22: single long documents (the long-context preset), Llama-3 rope scaling as the real checkpoints
        Workload(
            "llama-8b-lora-long", *_base("llama-8b-long"),
            dict(_LLAMA_8B_TINY, **_LONG_ROPE_TINY),
            lora=True, checkpointing=True, lora_targets=_LLAMA_TARGETS,
            notes="Llama-3.1-8B shapes with its rope scaling, LoRA r=16 alpha=32 on all decoder linears, gradient "
                  "checkpointing on; one document per step",
        ),
        Workload(  # issue 40c: the longest QLoRA document within an 80 GiB device cap
            "llama-8b-qlora-long", *_base("llama-8b-long"),
            dict(_LLAMA_8B_TINY, **_LONG_ROPE_TINY),
            lora=True, checkpointing=True, lora_targets=_LLAMA_TARGETS,
            notes="Llama-3.1-8B shapes with its rope scaling, QLoRA: the base in bitsandbytes NF4 (bf16 compute), "
                  "LoRA r=16 alpha=32 on all decoder linears, gradient checkpointing on; one document per step",
        ),
        Workload(  # issue 71d: three of every four layers linear in the length (Gated DeltaNet)
            "qwen3.5-9b-lora-long", *_base("qwen3.5-9b"), dict(_QWEN3_5_TINY),
            lora=True, checkpointing=True, lora_targets=_QWEN3_5_TARGETS,
            notes="Qwen3.5-9B text model shapes (24 Gated DeltaNet + 8 gated attention layers), LoRA r=16 alpha=32 "
                  "on all decoder linears, gradient checkpointing on; one document per step",
        ),
        Workload(
            "llama-1b-long", *_base("llama-1b-long"),
            dict(_LLAMA_1B_TINY, **_LONG_ROPE_TINY),
            checkpointing=True,
            notes="Llama-3.2-1B shapes with Llama-3 rope scaling, full FT, gradient checkpointing on; one document "
                  "per step",
        ),
    ]
}


def with_positions(workload: Workload, length: int, tiny: bool = False) -> Workload:
    """`workload` with max_position_embeddings raised to `length` where its config has fewer (a long-context sweep's
    document must fit the positions; Llama-3's rope scaling does not depend on the field)."""
    kwargs = workload.tiny_kwargs if tiny else workload.config_kwargs
    if build_config(workload, tiny).max_position_embeddings >= length:
        return workload
    raised = {**kwargs, "max_position_embeddings": length}
    return replace(workload, **({"tiny_kwargs": raised} if tiny else {"config_kwargs": raised}))


def build_config(workload: Workload, tiny: bool = False):
    """The transformers config for `workload` (tiny: same family, CPU-sized)."""
    return shape_config(ModelShape(workload.family, workload.tiny_kwargs if tiny else workload.config_kwargs))


@dataclass(frozen=True)
class DataSpec:
    """SFT-shaped data and the per-optimizer-step token budget."""

    median: int = 350
    min_len: int = 16
    max_len: int = 4096
    sigma: float = 1.0
    tokens_per_step: int = 16384  # real (non-pad) tokens per optimizer step, every config
    padded_batch_size: int = 8  # micro-batch size of the padded configs
    seed: int = 0
    min_samples: int = 512
    prompt_share: tuple[float, float] | None = None  # each document's masked prompt share (uniform), or no masks

    @classmethod
    def tiny(cls) -> "DataSpec":
        return cls(median=24, min_len=4, max_len=96, tokens_per_step=384, padded_batch_size=4, min_samples=64)

    @classmethod
    def single_documents(cls, length: int, seed: int = 0) -> "DataSpec":
        """One document of exactly `length` tokens per optimizer step (the long-context preset)."""
        return cls(median=length, min_len=length, max_len=length, sigma=0.0, tokens_per_step=length,
                   padded_batch_size=1, seed=seed, min_samples=1)

    def num_samples(self, steps: int) -> int:
        """Enough samples for `steps` steps without reusing data (log-normal mean = median * exp(sigma^2 / 2))."""
        mean = self.median * math.exp(self.sigma**2 / 2)
        return max(self.min_samples, math.ceil(1.3 * steps * self.tokens_per_step / mean))


def _local_sft_lengths(n: int, seed: int, median: float, max_len: int, min_len: int, sigma: float) -> list[int]:
    gen = torch.Generator().manual_seed(seed)
    normal = torch.randn(n, generator=gen, dtype=torch.float64)
    return torch.exp(math.log(median) + sigma * normal).round().clamp(min_len, max_len).long().tolist()


def _lengths_fn() -> Callable[..., list[int]]:
    try:
        from hf_accel.data.prepare import sft_lengths
    except ImportError:
        return _local_sft_lengths
    return sft_lengths


def sft_lengths(n: int, spec: DataSpec) -> list[int]:
    """Log-normal SFT-like lengths (hf_accel.data.prepare.sft_lengths when present, else an equivalent local generator)."""
    return list(_lengths_fn()(n, seed=spec.seed, median=spec.median, max_len=spec.max_len, min_len=spec.min_len,
                              sigma=spec.sigma))


def make_samples(lengths: list[int], vocab_size: int, seed: int) -> list[list[int]]:
    """Random token ids, one list per sample (ids >= 1 so id 0 stays free as the pad id)."""
    gen = torch.Generator().manual_seed(seed + 1)
    flat = torch.randint(1, vocab_size, (sum(lengths),), generator=gen)
    return [chunk.tolist() for chunk in torch.split(flat, lengths)]


def greedy_steps(lengths: list[int], tokens_per_step: int) -> list[list[int]]:
    """Consecutive samples, in dataset order, grouped so each step holds at most `tokens_per_step` real tokens.

    This is what a stock loop sees (no length-aware sampler). A sample longer than the budget forms its own step.
    """
    steps: list[list[int]] = []
    current: list[int] = []
    used = 0
    for index, n in enumerate(lengths):
        if current and used + n > tokens_per_step:
            steps.append(current)
            current, used = [], 0
        current.append(index)
        used += n
    if current:
        steps.append(current)
    return steps


def micro_batches(step: list[int], batch_size: int) -> list[list[int]]:
    """Split one optimizer step's sample indices into micro-batches of at most `batch_size` samples."""
    return [step[i : i + batch_size] for i in range(0, len(step), batch_size)]


def prompt_lengths(lengths: list[int], share: tuple[float, float], seed: int) -> list[int]:
    """Each document's prompt length: its length times a share drawn uniformly from `share`, rounded, at least the
    first token (never a target anyway) and leaving at least one completion token."""
    low, high = share
    gen = torch.Generator().manual_seed(seed + 2)
    shares = low + (high - low) * torch.rand(len(lengths), generator=gen, dtype=torch.float64)
    return [min(max(1, round(f * n)), n - 1) if n > 1 else 1 for f, n in zip(shares.tolist(), lengths)]


@dataclass
class BenchData:
    lengths: list[int]
    samples: list[list[int]]
    spec: DataSpec
    source: str = field(default="")
    prompts: list[int] | None = None  # completion workloads: each sample's masked prompt length

    def labels(self, index: int) -> list[int] | None:
        """Sample `index`'s labels (-100 on its prompt), or None where every token is a target."""
        if self.prompts is None:
            return None
        p = self.prompts[index]
        return [-100] * p + self.samples[index][p:]

    def features(self, indices: Iterable[int] | None = None) -> list[dict[str, list[int]]]:
        """The samples as collator features: input_ids, and labels where the prompts are masked."""
        indices = range(len(self.samples)) if indices is None else indices
        return [{"input_ids": self.samples[i], **({} if self.prompts is None else {"labels": self.labels(i)})}
                for i in indices]

    def target_tokens(self) -> int | None:
        """Target tokens of the whole data set (completion tokens; a document's first token is never one), or None
        without masks."""
        if self.prompts is None:
            return None
        return sum(n - p for n, p in zip(self.lengths, self.prompts))


def make_data(spec: DataSpec, vocab_size: int, steps: int) -> BenchData:
    """Lengths + random token ids (+ prompt lengths) for `steps` optimizer steps (deterministic in spec.seed)."""
    n = spec.num_samples(steps)
    lengths = sft_lengths(n, spec)
    source = "hf_accel.data.prepare.sft_lengths" if _lengths_fn() is not _local_sft_lengths else "local log-normal"
    prompts = prompt_lengths(lengths, spec.prompt_share, spec.seed) if spec.prompt_share else None
    return BenchData(lengths, make_samples(lengths, vocab_size, spec.seed), spec, source, prompts)
