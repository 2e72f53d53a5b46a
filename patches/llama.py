"""Llama family (Llama 1-3, GQA/MQA, every rope scaling type): one seam, the attention function.

Touches: the model's attention implementation (switched to hf_accel's registered function for this instance) and one
attribute on each ``LlamaAttention``. Projections, RoPE (any ``rope_type``) and the KV cache stay transformers' own,
so LoRA on any projection works unchanged.
"""
from transformers.models.llama.modeling_llama import LlamaAttention

from ._registry_family import ATTENTIONS, patch_registry_family, training_dropout  # noqa: F401 (family API)

MODEL_TYPES = ("llama",)
LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
TOUCHES = "LlamaAttention via transformers' AttentionInterface"


def apply(model, backend: str):
    return patch_registry_family(model, LlamaAttention, backend)


def head_shape(config) -> tuple[int, int, int]:
    """(query heads, kv heads, head_dim) as the attention kernels will see them."""
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    return config.num_attention_heads, config.num_key_value_heads or config.num_attention_heads, head_dim
