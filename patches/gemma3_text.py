"""Gemma 3 family, text only (``Gemma3ForCausalLM``, model_type gemma3_text: 1B and the text towers' shapes): Gemma
2's layout (scaled embeddings, ``query_pre_attn_scalar`` scaling, four (1 + w) RMSNorms, GEGLU) with a per-head
(1 + w) RMSNorm on q and k, 5 sliding-window layers to 1 global by default (each with its own RoPE base), and
optional attention / final logit soft-capping; one seam, the attention function.

Touches: this model's attention implementation (hf_accel's registered function for its forwards) and one attribute
on each ``Gemma3Attention``. q_norm / k_norm and both RoPEs run inside transformers' own code, before the seam.
Bidirectional Gemma 3 (``use_bidirectional_attention``, embedding models) is refused: its window is two-sided.
"""
from transformers.models.gemma3.modeling_gemma3 import Gemma3Attention, Gemma3MLP, Gemma3RMSNorm

from hf_accel.errors import UnsupportedModel

from ._family import Family, fusable_by_class
from ._registry_family import ATTENTIONS, patch_registry_family
from .gemma2 import gemma_kinds, gemma_layer_attention
from .llama import PROJECTIONS, head_shape, llama_layer_bytes, mlp_width


def apply(model, backend: str):
    if getattr(model.config, "use_bidirectional_attention", False):
        raise UnsupportedModel(
            "Gemma 3 with use_bidirectional_attention=True (an embedding model: every query sees a two-sided window) "
            "has no hf_accel patch; train it unpatched.")
    return patch_registry_family(model, Gemma3Attention, backend)


FAMILY = Family(
    name="gemma3_text",
    model_types=("gemma3_text",),
    seam="attention_interface",
    touches="Gemma3Attention via transformers' AttentionInterface",
    attentions=ATTENTIONS,
    lora_targets=PROJECTIONS,
    apply=apply,
    head_shape=head_shape,
    mlp_width=mlp_width,
    layer_bytes=lambda config, b: llama_layer_bytes(config, b, norms=4, qk_norm=True),
    fusable=fusable_by_class(gemma_kinds(Gemma3RMSNorm, Gemma3MLP)),  # q_norm / k_norm included, as liger binds them
    layer_attention=gemma_layer_attention,
    final_logit_softcap=lambda config: getattr(config, "final_logit_softcapping", None) or None,
)
