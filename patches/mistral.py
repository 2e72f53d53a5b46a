"""Mistral family (7B v0.1-v0.3, Nemo): Llama's layout with an optional sliding window on every layer; one seam,
the attention function.

Touches: this model's attention implementation (hf_accel's registered function for its forwards) and one attribute
on each ``MistralAttention``. With ``config.sliding_window`` set (v0.1: 4096) every layer asks the kernel for that
window: kernels that declare window support get it, others are passed over for one that does (see the PatchReport).
"""
from transformers.models.mistral.modeling_mistral import MistralAttention, MistralMLP, MistralRMSNorm

from ._family import Family, LayerAttention, fusable_by_class
from ._registry_family import ATTENTIONS, patch_registry_family
from .llama import OUTPUT_PROJECTIONS, PROJECTIONS, head_shape, llama_kinds, llama_layer_bytes, mlp_width

FAMILY = Family(
    name="mistral",
    model_types=("mistral",),
    seam="attention_interface",
    touches="MistralAttention via transformers' AttentionInterface",
    attentions=ATTENTIONS,
    lora_targets=PROJECTIONS,
    apply=lambda model, backend: patch_registry_family(model, MistralAttention, backend),
    head_shape=head_shape,
    mlp_width=mlp_width,
    layer_bytes=llama_layer_bytes,
    fusable=fusable_by_class(llama_kinds(MistralRMSNorm, MistralMLP)),
    output_projections=lambda config: OUTPUT_PROJECTIONS,
    layer_attention=lambda config, i: LayerAttention(window=getattr(config, "sliding_window", None)),
)
