"""``hf-accel sft --model-shape``: random-init models of the benchmarked bases' shapes (CUDA, bf16).

``BASES`` holds the published shapes (transformers config keyword arguments) of the bases the benchmark trains; the
benchmark's workloads (scripts/benchlib/workloads.py) are built from them, so each shape has one definition. The
"-small" shapes keep their family's features (GQA, partial rotary and parallel residual, Falcon's parallel attention,
tied embeddings, head size) at 4 layers of width 1024, so a multi-GPU launch trains in seconds.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, NamedTuple

if TYPE_CHECKING:  # the names and configs are read without torch (hf-accel estimate-memory checks its MODEL first)
    import torch


class ModelShape(NamedTuple):
    family: str  # transformers model_type
    config_kwargs: dict[str, Any]


# Llama-3.1's rope scaling (what its long-context checkpoints ship); positions up to 256k for the longest runs
LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 8192, "rope_theta": 500000.0}
LONG_MAX_POSITIONS = 262144
_LONG_ROPE = dict(max_position_embeddings=LONG_MAX_POSITIONS, rope_parameters=LLAMA3_ROPE)
# Llama-3.2-1B, Llama-3-8B and Llama-3-70B shapes (each base adds its positions / rope)
_LLAMA_1B = dict(vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                 num_attention_heads=32, num_key_value_heads=8, tie_word_embeddings=True, rms_norm_eps=1e-5)
_LLAMA_8B = dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                 num_attention_heads=32, num_key_value_heads=8, tie_word_embeddings=False, rms_norm_eps=1e-5)
_LLAMA_70B = dict(vocab_size=128256, hidden_size=8192, intermediate_size=28672, num_hidden_layers=80,
                  num_attention_heads=64, num_key_value_heads=8, tie_word_embeddings=False, rms_norm_eps=1e-5)
_LLAMA3 = dict(rope_theta=500000.0, max_position_embeddings=8192)

# Qwen/Qwen3.5-9B text_config (model_type qwen3_5_text): 3 Gated DeltaNet layers then 1 full-attention layer (head_dim
# 256, gated output), x8. Read from a copy of the checkpoint's config.json (a test fixture of revision c2022362) and
# cross-checked: slime's scripts/models/qwen3.5-9B.sh (16 heads, 4 KV groups, kv-channels 256, 32 layers, hidden 4096,
# ffn 12288, vocab 248320, rotary base 1e7, rotary-percent 0.25, untied, output gate) and transformers'
# Qwen3_5TextConfig defaults (its "Qwen3.5-9B style" config: the same linear_* fields). The checkpoint's total
# (9,653,108,208 parameters) is exactly this text model + its vision tower + one MTP layer (tests/test_bench.py).
# max_position_embeddings 262144: the model card's native context and every other published Qwen3.5 config; the 9B's
# own value was not seen. The MTP layer (mtp_num_hidden_layers 1) is not built by transformers and not trained here.
QWEN3_5_9B = dict(
    vocab_size=248320, hidden_size=4096, intermediate_size=12288, num_hidden_layers=32, num_attention_heads=16,
    num_key_value_heads=4, head_dim=256, layer_types=(["linear_attention"] * 3 + ["full_attention"]) * 8,
    linear_conv_kernel_dim=4, linear_key_head_dim=128, linear_value_head_dim=128, linear_num_key_heads=16,
    linear_num_value_heads=32, hidden_act="silu", rms_norm_eps=1e-6, attention_bias=False, tie_word_embeddings=False,
    max_position_embeddings=262144,
    rope_parameters=dict(rope_type="default", rope_theta=10000000.0, partial_rotary_factor=0.25,
                         mrope_interleaved=True, mrope_section=[11, 11, 10]))
# openai/gpt-oss-20b: 24 layers alternating sliding (128) / full attention, learned sinks per head, 32 experts top-4
# (clamped SwiGLU, limit 7), attention biases, YaRN x32 over 4096. Sources: a summary of the checkpoint's config.json
# (EchoCog/gpt-oss-20b docs/gpt-oss-20b-architecture.md), transformers' GptOssConfig defaults (its 120B differs only in
# layers and experts) and Megatron/slime gpt-oss-20b model scripts (24 layers, hidden 2880, 64 heads, 8 KV groups,
# kv-channels 64, ffn 2880, vocab 201088, 32 experts top-4, rotary base 150000, untied). The checkpoint stores the
# experts in MXFP4; this shape is the bf16 model (dequantized, as the bf16 LoRA recipes train it).
GPT_OSS_20B = dict(
    vocab_size=201088, hidden_size=2880, intermediate_size=2880, num_hidden_layers=24, num_attention_heads=64,
    num_key_value_heads=8, head_dim=64, num_local_experts=32, num_experts_per_tok=4, sliding_window=128,
    layer_types=["sliding_attention", "full_attention"] * 12, attention_bias=True, rms_norm_eps=1e-5,
    swiglu_limit=7.0, router_aux_loss_coef=0.9, tie_word_embeddings=False, max_position_embeddings=131072,
    rope_parameters=dict(rope_type="yarn", rope_theta=150000.0, factor=32.0, beta_fast=32.0, beta_slow=1.0,
                         truncate=False, original_max_position_embeddings=4096))
# Qwen/Qwen3-30B-A3B: 48 layers, 128 experts top-8 (moe_intermediate_size 768, every layer sparse), per-head q/k norm.
# Sources: a copy of the checkpoint's config.json (a Qwen3 config collection's "Qwen3-30B-A3B" entry) and slime's
# scripts/models/qwen3-30B-A3B.sh (the same widths, heads, experts and rotary base).
QWEN3_30B_A3B = dict(
    vocab_size=151936, hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768, num_hidden_layers=48,
    num_attention_heads=32, num_key_value_heads=4, head_dim=128, num_experts=128, num_experts_per_tok=8,
    norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[], router_aux_loss_coef=0.001,
    tie_word_embeddings=False, rms_norm_eps=1e-6, max_position_embeddings=40960,
    rope_parameters=dict(rope_type="default", rope_theta=1000000.0))
# google/gemma-4-12B (released 2026-06, the published Gemma 4 size closest to 12B; the others are E2B, E4B, 26B-A4B,
# 31B): 48 layers, 5 sliding (1024, head_dim 256, 8 KV heads) : 1 global (head_dim 512, one KV head whose values are
# its keys: attention_k_eq_v), no KV-shared layers, no per-layer embeddings. Its checkpoint's text_config says
# model_type gemma4_unified_text, whose decoder is gemma4_text's without per-layer embeddings: built here as
# gemma4_text with hidden_size_per_layer_input=0 (the same parameters and logits, tests/test_bench.py). Sources: copies
# of its text_config in three projects' tests (mogemma, ltx-core-mlx, a GGUF converter's) and the config.json of
# deepseek-ai/dspark_gemma4_12b_block7 (a drafter at the same widths); model card: 11.95B parameters, 256K context.
# Not seen in the 12B's own config.json: final_logit_softcapping (30.0: the drafter's, E4B's and 31B's) and
# tie_word_embeddings (true: Gemma's, and the only value that gives the model card's 11.95B).
GEMMA4_12B = dict(
    vocab_size=262144, hidden_size=3840, intermediate_size=15360, num_hidden_layers=48, num_attention_heads=16,
    num_key_value_heads=8, head_dim=256, global_head_dim=512, num_global_key_value_heads=1, attention_k_eq_v=True,
    num_kv_shared_layers=0, hidden_size_per_layer_input=0, sliding_window=1024,
    layer_types=(["sliding_attention"] * 5 + ["full_attention"]) * 8, final_logit_softcapping=30.0,
    hidden_activation="gelu_pytorch_tanh", rms_norm_eps=1e-6, tie_word_embeddings=True, max_position_embeddings=262144,
    rope_parameters={"sliding_attention": dict(rope_type="default", rope_theta=10000.0),
                     "full_attention": dict(rope_type="proportional", partial_rotary_factor=0.25,
                                            rope_theta=1000000.0)})

BASES: dict[str, ModelShape] = {
    "llama-1b": ModelShape("llama", dict(_LLAMA_1B, rope_theta=500000.0, max_position_embeddings=131072)),
    "llama-8b": ModelShape("llama", dict(_LLAMA_8B, **_LLAMA3)),
    "llama-70b": ModelShape("llama", dict(_LLAMA_70B, **_LLAMA3)),
    # Llama-3's rope scaling on the 1B and 8B shapes, 256k positions (the long-context workloads)
    "llama-1b-long": ModelShape("llama", dict(_LLAMA_1B, **_LONG_ROPE)),
    "llama-8b-long": ModelShape("llama", dict(_LLAMA_8B, **_LONG_ROPE)),
    # the bases most fine-tunes start from besides Llama, at their published shapes
    "qwen3-8b": ModelShape("qwen3", dict(
        vocab_size=151936, hidden_size=4096, intermediate_size=12288, num_hidden_layers=36, num_attention_heads=32,
        num_key_value_heads=8, head_dim=128, tie_word_embeddings=False, rms_norm_eps=1e-6, rope_theta=1000000.0,
        max_position_embeddings=40960)),
    "mistral-7b": ModelShape("mistral", dict(  # Mistral-7B-v0.1
        vocab_size=32000, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
        num_key_value_heads=8, sliding_window=4096, tie_word_embeddings=False, rms_norm_eps=1e-5,
        rope_theta=10000.0, max_position_embeddings=32768)),
    "gemma2-9b": ModelShape("gemma2", dict(
        vocab_size=256000, hidden_size=3584, intermediate_size=14336, num_hidden_layers=42, num_attention_heads=16,
        num_key_value_heads=8, head_dim=256, query_pre_attn_scalar=256, sliding_window=4096,
        attn_logit_softcapping=50.0, final_logit_softcapping=30.0, tie_word_embeddings=True, rms_norm_eps=1e-6,
        max_position_embeddings=8192)),
    "neox-1.4b": ModelShape("gpt_neox", dict(  # Pythia-1.4B, positions raised to 4096 for the 4096-token tail
        vocab_size=50304, hidden_size=2048, intermediate_size=8192, num_hidden_layers=24, num_attention_heads=16,
        rotary_pct=0.25, use_parallel_residual=True, tie_word_embeddings=False, max_position_embeddings=4096)),
    "falcon-1b": ModelShape("falcon", dict(  # Falcon ~1.3B: rotary, parallel attention
        vocab_size=50304, hidden_size=2048, ffn_hidden_size=8192, num_hidden_layers=24, num_attention_heads=32,
        num_kv_heads=32, new_decoder_architecture=False, multi_query=False, alibi=False, parallel_attn=True,
        bias=False, tie_word_embeddings=True, max_position_embeddings=4096)),
    "falcon-rw-1b": ModelShape("falcon", dict(  # Falcon-RW-1B: ALiBi, sequential attention + MLP, biases
        vocab_size=50304, hidden_size=2048, num_hidden_layers=24, num_attention_heads=32,
        new_decoder_architecture=False, multi_query=False, alibi=True, parallel_attn=False, bias=True,
        tie_word_embeddings=True, max_position_embeddings=4096)),
    # issue 67f: the 2026 families people LoRA-tune on one GPU, text models at their checkpoints' config.json values
    # (sources and what could not be confirmed: the comment above each; parameter counts: tests/test_bench.py)
    "qwen3.5-9b": ModelShape("qwen3_5_text", QWEN3_5_9B),
    "gpt-oss-20b": ModelShape("gpt_oss", GPT_OSS_20B),
    "qwen3-30b-a3b": ModelShape("qwen3_moe", QWEN3_30B_A3B),
    "gemma4-12b": ModelShape("gemma4_text", GEMMA4_12B),
}

_SMALL = dict(hidden_size=1024, num_hidden_layers=4, vocab_size=32000)
# name -> (base shape, config overrides); args.MODEL_SHAPE_NAMES lists the names for the argument check
MODEL_SHAPES: dict[str, tuple[str, dict[str, Any]]] = {
    "llama-1b": ("llama-1b", {}),
    "llama-8b": ("llama-8b", {}),  # the whole model: --lora-r decides whether LoRA is added
    "neox-1.4b": ("neox-1.4b", {}),
    "falcon-1b": ("falcon-1b", {}),
    # the long-context workloads' shapes (Llama-3 rope scaling), with positions for --sequence-parallel runs past the
    # 256k one GPU holds
    "llama-8b-long": ("llama-8b-long", dict(max_position_embeddings=1048576)),
    "llama-1b-long": ("llama-1b-long", dict(max_position_embeddings=1048576)),
    "llama-small": ("llama-1b", dict(_SMALL, intermediate_size=4096, num_attention_heads=16, num_key_value_heads=4)),
    "neox-small": ("neox-1.4b", dict(_SMALL, intermediate_size=4096, num_attention_heads=8)),
    "falcon-small": ("falcon-1b", dict(_SMALL, ffn_hidden_size=4096, num_attention_heads=16, num_kv_heads=16)),
    # the LoRA workloads' shapes of the newer families (--lora-r decides whether LoRA is added) and their "-small"
    # cuts (q/k norm, the window, soft-capping with sliding / global layers kept)
    "qwen3-8b": ("qwen3-8b", {}),
    "mistral-7b": ("mistral-7b", {}),
    "gemma2-9b": ("gemma2-9b", {}),
    "qwen3-small": ("qwen3-8b", dict(_SMALL, intermediate_size=4096, num_attention_heads=16,
                                     num_key_value_heads=4, head_dim=64)),
    "mistral-small": ("mistral-7b", dict(_SMALL, intermediate_size=4096, num_attention_heads=16,
                                         num_key_value_heads=4, sliding_window=512)),
    "gemma2-small": ("gemma2-9b", dict(_SMALL, intermediate_size=4096, num_attention_heads=8,
                                       num_key_value_heads=4, head_dim=128, query_pre_attn_scalar=128,
                                       sliding_window=512)),
    # issue 67f: the 2026 families' shapes and their "-small" cuts (Gated DeltaNet beside gated full attention;
    # sinks with sliding / full layers and a few experts; 8 of 128 experts' routing; both Gemma 4 head dims)
    "qwen3.5-9b": ("qwen3.5-9b", {}),
    "gpt-oss-20b": ("gpt-oss-20b", {}),
    "qwen3-30b-a3b": ("qwen3-30b-a3b", {}),
    "gemma4-12b": ("gemma4-12b", {}),
    "qwen3.5-small": ("qwen3.5-9b", dict(_SMALL, intermediate_size=4096, num_attention_heads=8, num_key_value_heads=2,
                                         head_dim=128, linear_num_key_heads=8, linear_num_value_heads=16,
                                         layer_types=["linear_attention"] * 3 + ["full_attention"])),
    "gpt-oss-small": ("gpt-oss-20b", dict(_SMALL, intermediate_size=1024, num_attention_heads=16,
                                          num_key_value_heads=4, num_local_experts=8, num_experts_per_tok=2,
                                          layer_types=["sliding_attention", "full_attention"] * 2)),
    "qwen3-moe-small": ("qwen3-30b-a3b", dict(_SMALL, moe_intermediate_size=512, num_attention_heads=16,
                                              num_key_value_heads=4, head_dim=64, num_experts=16)),
    "gemma4-small": ("gemma4-12b", dict(_SMALL, intermediate_size=4096, num_attention_heads=8, num_key_value_heads=4,
                                        sliding_window=512,
                                        layer_types=["sliding_attention"] * 3 + ["full_attention"])),
}


def shape_config(shape: ModelShape) -> Any:
    """The transformers config of ``shape``, without a KV cache (packed batches are honoured by eager / sdpa only
    without one)."""
    from transformers import AutoConfig

    config = AutoConfig.for_model(shape.family, **shape.config_kwargs)
    config.use_cache = False
    return config


def model_shape_config(name: str) -> Any:
    """The transformers config of --model-shape ``name``: its base shape's, with the shape's overrides."""
    base, overrides = MODEL_SHAPES[name]
    family, kwargs = BASES[base]
    return shape_config(ModelShape(family, {**kwargs, **overrides}))


def build_model_shape(name: str, seed: int, device: torch.device | str) -> torch.nn.Module:
    """--model-shape ``name``, random init from ``seed`` on ``device``, in bf16 (the same weights on every rank), with
    the family's stock reference attention (sdpa; eager for Gemma 2, which transformers refuses SDPA for)."""
    import torch
    from transformers import AutoModelForCausalLM

    from ..patches import family_of

    config = model_shape_config(name)
    torch.manual_seed(seed)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, attn_implementation=family_of(config).reference_attention)
    return model.to(torch.bfloat16)
