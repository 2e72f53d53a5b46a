"""GPT-NeoX family (Pythia, ...): partial rotary, parallel or sequential residual; one seam, the attention function.

Touches: this model's attention implementation (hf_accel's registered function for its forwards) and one attribute
on each ``GPTNeoXAttention``. The fused ``query_key_value`` projection, partial RoPE and both residual layouts stay
transformers' own, so LoRA on ``query_key_value`` / ``dense`` works unchanged.
"""
from transformers.models.gpt_neox.modeling_gpt_neox import GPTNeoXAttention

from ._family import Family, LayerBytes, affine_layer_norm, fusable_by_class
from ._registry_family import ATTENTIONS, patch_registry_family


def head_shape(config) -> tuple[int, int, int]:
    return config.num_attention_heads, config.num_attention_heads, config.hidden_size // config.num_attention_heads


def layer_bytes(config, b: int) -> LayerBytes:
    """Two LayerNorms, the fused qkv, attention output and log-sum-exp, the GELU MLP; the sequential residual keeps
    one more hidden-sized input."""
    h, heads, i = config.hidden_size, config.num_attention_heads, config.intermediate_size
    d = h // heads
    lse = 4 * heads
    sequential = 0 if config.use_parallel_residual else h * b + 8
    mlp = 2 * i * b  # the up projection's output and its GELU
    none = 10 * h * b + mlp + 16 + lse + sequential
    op = h * b + (3 * h + heads * d + h + i + h) * b + lse  # qkv, attention, dense, mlp
    return LayerBytes(none, op, h * b, mlp)


def output_projections(config) -> tuple[str, ...]:
    """The MLP's output projection only joins the residual stream; with the parallel residual the attention's too
    (sequential: the attention's output feeds the second LayerNorm)."""
    return ("attention.dense", "mlp.dense_4h_to_h") if config.use_parallel_residual else ("mlp.dense_4h_to_h",)


FAMILY = Family(
    name="gpt_neox",
    model_types=("gpt_neox",),
    seam="attention_interface",
    touches="GPTNeoXAttention via transformers' AttentionInterface",
    attentions=ATTENTIONS,
    lora_targets=("query_key_value", "dense", "dense_h_to_4h", "dense_4h_to_h"),
    apply=lambda model, backend: patch_registry_family(model, GPTNeoXAttention, backend),
    head_shape=head_shape,
    mlp_width=lambda config: config.intermediate_size,
    layer_bytes=layer_bytes,
    fusable=fusable_by_class(affine_layer_norm),
    output_projections=output_projections,
)
