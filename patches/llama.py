"""Llama family (Llama 1-3, GQA/MQA, every rope scaling type): one seam, the attention function.

Touches: this model's attention implementation (hf_accel's registered function for its forwards) and one attribute
on each ``LlamaAttention``. Projections, RoPE (any ``rope_type``) and the KV cache stay transformers' own, so LoRA on
any projection works unchanged.
"""
from transformers.models.llama.modeling_llama import LlamaAttention, LlamaMLP, LlamaRMSNorm

from ._family import SILU, Family, LayerBytes, fusable_by_class
from ._registry_family import ATTENTIONS, patch_registry_family

PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
# the MLP's down projection only joins the residual stream (the attention's output feeds the post-attention norm)
OUTPUT_PROJECTIONS = ("mlp.down_proj",)


def head_shape(config) -> tuple[int, int, int]:
    """(query heads, kv heads, head_dim) as the attention kernels see them."""
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    return config.num_attention_heads, config.num_key_value_heads or config.num_attention_heads, head_dim


def mlp_width(config) -> int:
    return config.intermediate_size


def llama_layer_bytes(config, b: int, norms: int = 2, qk_norm: bool = False) -> LayerBytes:
    """Per token, what autograd saves in a Llama-style layer: ``norms`` RMSNorms (fp32 input copy, rsqrt, normalized,
    weighted), q/k/v after rotary, attention output and log-sum-exp, SwiGLU / GEGLU intermediates; ``qk_norm``: a
    per-head RMSNorm on q and k before rotary (Qwen3, Gemma 3)."""
    h = config.hidden_size
    heads, kv, d = head_shape(config)
    i = mlp_width(config)
    lse = 4 * heads
    norm = 4 * h + 4 + 2 * h * b
    qk = (heads + kv) * (4 * d + 4 + 2 * d * b) if qk_norm else 0
    mlp = 4 * i * b  # the gate and up projections' outputs, the activated gate, their product
    none = norms * norm + qk + (2 * heads * d + 2 * kv * d) * b + lse + mlp
    op = h * b + (2 * heads * d + 2 * kv * d + 2 * h + 2 * i) * b + lse + (norms - 2) * h * b
    return LayerBytes(none, op, h * b, mlp)


def llama_kinds(norm_cls: type, mlp_cls: type, activation: str = "hidden_act", acts=SILU, mlp_kind="swiglu",
                norm_kind="rms_norm"):
    """``fusable_by_class`` kinds for a Llama-style family: its RMSNorm class, its gated MLP class when the gate's
    activation (``config.<activation>``) is one liger's kernel computes."""

    def kinds(module):
        if isinstance(module, norm_cls):
            return norm_kind
        if isinstance(module, mlp_cls) and getattr(module.config, activation, None) in acts:
            return mlp_kind
        return None

    return kinds


FAMILY = Family(
    name="llama",
    model_types=("llama",),
    seam="attention_interface",
    touches="LlamaAttention via transformers' AttentionInterface",
    attentions=ATTENTIONS,
    lora_targets=PROJECTIONS,
    apply=lambda model, backend: patch_registry_family(model, LlamaAttention, backend),
    head_shape=head_shape,
    mlp_width=mlp_width,
    layer_bytes=llama_layer_bytes,
    fusable=fusable_by_class(llama_kinds(LlamaRMSNorm, LlamaMLP)),
    output_projections=lambda config: OUTPUT_PROJECTIONS,
)
