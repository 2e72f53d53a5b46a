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
