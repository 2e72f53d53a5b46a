"""Gemma 2 family: attention logit soft-capping, sliding-window and global layers alternating, scaled embeddings,
``query_pre_attn_scalar`` scaling, (1 + w) RMSNorms before and after attention and MLP, a GEGLU MLP, and soft-capped
final logits; one seam, the attention function.

Touches: this model's attention implementation (hf_accel's registered function for its forwards) and one attribute
on each ``Gemma2Attention``. transformers passes the scaling, the layer's window and the softcap to the attention
function; the seam hands them to the kernel, and a kernel that cannot soft-cap (or window) is passed over for one
that can. Embeddings, norms, RoPE and the final soft-cap stay transformers' own (the fused loss applies the final
soft-cap itself). transformers refuses SDPA for Gemma 2: its eager attention is the stock reference, and serves
decoding steps and attention probabilities here.
"""
from transformers.models.gemma2.modeling_gemma2 import Gemma2Attention, Gemma2MLP, Gemma2RMSNorm

from ._family import GELU_TANH, Family, LayerAttention, fusable_by_class, sliding_layers
from ._registry_family import ATTENTIONS, patch_registry_family
from .llama import PROJECTIONS, head_shape, llama_kinds, llama_layer_bytes, mlp_width


def gemma_layer_attention(config, layer_idx: int) -> LayerAttention:
    return LayerAttention(window=sliding_layers(config, layer_idx),
                          softcap=getattr(config, "attn_logit_softcapping", None) or None)


def gemma_kinds(norm_cls: type, mlp_cls: type):
    return llama_kinds(norm_cls, mlp_cls, activation="hidden_activation", acts=GELU_TANH, mlp_kind="geglu",
                       norm_kind="rms_norm_gemma")


FAMILY = Family(
    name="gemma2",
    model_types=("gemma2",),
    seam="attention_interface",
    touches="Gemma2Attention via transformers' AttentionInterface",
    attentions=ATTENTIONS,
    lora_targets=PROJECTIONS,
    apply=lambda model, backend: patch_registry_family(model, Gemma2Attention, backend),
    head_shape=head_shape,
    mlp_width=mlp_width,
    layer_bytes=lambda config, b: llama_layer_bytes(config, b, norms=4),
    fusable=fusable_by_class(gemma_kinds(Gemma2RMSNorm, Gemma2MLP)),
    layer_attention=gemma_layer_attention,
    final_logit_softcap=lambda config: getattr(config, "final_logit_softcapping", None) or None,
    reference_attention="eager",
)
