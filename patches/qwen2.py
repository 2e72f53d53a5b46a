"""Qwen2 / Qwen2.5 family: Llama's layout with biases on q, k and v (and optional sliding-window layers, off in the
released checkpoints); one seam, the attention function.

Touches: this model's attention implementation (hf_accel's registered function for its forwards) and one attribute
on each ``Qwen2Attention``. The biased projections, RoPE and the KV cache stay transformers' own, so LoRA on any
projection works unchanged. Layers marked "sliding_attention" in ``config.layer_types`` ask the kernel for their
window.
"""
from transformers.models.qwen2.modeling_qwen2 import Qwen2Attention, Qwen2MLP, Qwen2RMSNorm

from ._family import Family, LayerAttention, fusable_by_class, sliding_layers
from ._registry_family import ATTENTIONS, patch_registry_family
from .llama import OUTPUT_PROJECTIONS, PROJECTIONS, head_shape, llama_kinds, llama_layer_bytes, mlp_width

FAMILY = Family(
    name="qwen2",
    model_types=("qwen2",),
    seam="attention_interface",
    touches="Qwen2Attention via transformers' AttentionInterface",
    attentions=ATTENTIONS,
    lora_targets=PROJECTIONS,
    apply=lambda model, backend: patch_registry_family(model, Qwen2Attention, backend),
    head_shape=head_shape,
    mlp_width=mlp_width,
    layer_bytes=llama_layer_bytes,
    fusable=fusable_by_class(llama_kinds(Qwen2RMSNorm, Qwen2MLP)),
    output_projections=lambda config: OUTPUT_PROJECTIONS,
    layer_attention=lambda config, i: LayerAttention(window=sliding_layers(config, i)),
)
