"""GPT-NeoX family (Pythia, ...): partial rotary, parallel or sequential residual; one seam, the attention function.

Touches: the model's attention implementation (hf_accel's registered function for this instance) and one attribute on
each ``GPTNeoXAttention``. The fused ``query_key_value`` projection, partial RoPE and both residual layouts stay
transformers' own, so LoRA on ``query_key_value`` / ``dense`` works unchanged.
"""
from transformers.models.gpt_neox.modeling_gpt_neox import GPTNeoXAttention

from ._registry_family import ATTENTIONS, patch_registry_family, training_dropout  # noqa: F401 (family API)

MODEL_TYPES = ("gpt_neox",)
LORA_TARGETS = ("query_key_value", "dense", "dense_h_to_4h", "dense_4h_to_h")
TOUCHES = "GPTNeoXAttention via transformers' AttentionInterface"


def apply(model, backend: str):
    return patch_registry_family(model, GPTNeoXAttention, backend)


def head_shape(config) -> tuple[int, int, int]:
    return config.num_attention_heads, config.num_attention_heads, config.hidden_size // config.num_attention_heads
