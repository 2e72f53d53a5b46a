"""Qwen3 family (dense): Llama's layout with a per-head RMSNorm on q and k before RoPE; one seam, the attention
function.

Touches: this model's attention implementation (hf_accel's registered function for its forwards) and one attribute
on each ``Qwen3Attention``. q_norm / k_norm run inside transformers' own attention forward, before the seam, so the
kernel receives normalised q and k as stock SDPA does; LoRA on any projection works unchanged. Layers marked
"sliding_attention" in ``config.layer_types`` (``use_sliding_window``, off by default) ask the kernel for their
window.
"""
from transformers.models.qwen3.modeling_qwen3 import Qwen3Attention, Qwen3MLP, Qwen3RMSNorm

from ._family import Family, LayerAttention, fusable_by_class, sliding_layers
from ._registry_family import ATTENTIONS, patch_registry_family
from .llama import OUTPUT_PROJECTIONS, PROJECTIONS, head_shape, llama_kinds, llama_layer_bytes, mlp_width

FAMILY = Family(
    name="qwen3",
    model_types=("qwen3",),
    seam="attention_interface",
    touches="Qwen3Attention via transformers' AttentionInterface",
    attentions=ATTENTIONS,
    lora_targets=PROJECTIONS,
    apply=lambda model, backend: patch_registry_family(model, Qwen3Attention, backend),
    head_shape=head_shape,
    mlp_width=mlp_width,
    layer_bytes=lambda config, b: llama_layer_bytes(config, b, qk_norm=True),
    fusable=fusable_by_class(llama_kinds(Qwen3RMSNorm, Qwen3MLP)),  # q_norm / k_norm included, as liger binds them
    output_projections=lambda config: OUTPUT_PROJECTIONS,
    layer_attention=lambda config, i: LayerAttention(window=sliding_layers(config, i)),
)
