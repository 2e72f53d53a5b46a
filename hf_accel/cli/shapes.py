"""``hf-accel sft --model-shape``: random-init models of the benchmark workloads' shapes (CUDA, bf16).

The "-small" shapes keep their family's features (GQA, partial rotary and parallel residual, Falcon's parallel
attention, tied embeddings, head size) at 4 layers of width 1024, so a multi-GPU launch trains in seconds.
"""
from __future__ import annotations

import dataclasses
from typing import Any

import torch

_SMALL = dict(hidden_size=1024, num_hidden_layers=4, vocab_size=32000)
# name -> (benchmark workload, config overrides); args.MODEL_SHAPE_NAMES lists the names for the argument check
MODEL_SHAPES: dict[str, tuple[str, dict[str, Any]]] = {
    "llama-1b": ("llama-1b", {}),
    "llama-8b": ("llama-8b-lora", {}),  # the whole model: --lora-r decides whether LoRA is added
    "neox-1.4b": ("neox-1.4b", {}),
    "falcon-1b": ("falcon-1b", {}),
    # the long-context workloads' shapes (Llama-3 rope scaling), with positions for --sequence-parallel runs past the
    # 256k one GPU holds
    "llama-8b-long": ("llama-8b-lora-long", dict(max_position_embeddings=1048576)),
    "llama-1b-long": ("llama-1b-long", dict(max_position_embeddings=1048576)),
    "llama-small": ("llama-1b", dict(_SMALL, intermediate_size=4096, num_attention_heads=16, num_key_value_heads=4)),
    "neox-small": ("neox-1.4b", dict(_SMALL, intermediate_size=4096, num_attention_heads=8)),
    "falcon-small": ("falcon-1b", dict(_SMALL, ffn_hidden_size=4096, num_attention_heads=16, num_kv_heads=16)),
    # the LoRA workloads' shapes of the newer families (--lora-r decides whether LoRA is added) and their "-small"
    # cuts (q/k norm, the window, soft-capping with sliding / global layers kept)
    "qwen3-8b": ("qwen3-8b-lora", {}),
    "mistral-7b": ("mistral-7b-lora", {}),
    "gemma2-9b": ("gemma2-9b-lora", {}),
    "qwen3-small": ("qwen3-8b-lora", dict(_SMALL, intermediate_size=4096, num_attention_heads=16,
                                          num_key_value_heads=4, head_dim=64)),
    "mistral-small": ("mistral-7b-lora", dict(_SMALL, intermediate_size=4096, num_attention_heads=16,
                                              num_key_value_heads=4, sliding_window=512)),
    "gemma2-small": ("gemma2-9b-lora", dict(_SMALL, intermediate_size=4096, num_attention_heads=8,
                                            num_key_value_heads=4, head_dim=128, query_pre_attn_scalar=128,
                                            sliding_window=512)),
}


def model_shape_config(name: str) -> Any:
    """The transformers config of --model-shape ``name``: its workload's, with the shape's overrides."""
    from ..bench.workloads import WORKLOADS, build_config

    workload, overrides = MODEL_SHAPES[name]
    base = WORKLOADS[workload]
    return build_config(dataclasses.replace(base, config_kwargs={**base.config_kwargs, **overrides}))


def build_model_shape(name: str, seed: int, device: torch.device | str) -> torch.nn.Module:
    """--model-shape ``name``, random init from ``seed`` on ``device``, in bf16 (the same weights on every rank), with
    the family's stock reference attention (sdpa; eager for Gemma 2, which transformers refuses SDPA for)."""
    from transformers import AutoModelForCausalLM

    from ..patches import family_of

    config = model_shape_config(name)
    torch.manual_seed(seed)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, attn_implementation=family_of(config).reference_attention)
    return model.to(torch.bfloat16)
