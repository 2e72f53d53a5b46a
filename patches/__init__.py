"""One module per model family, each patching exactly one seam (the attention) and describing the family in one
typed object, ``FAMILY`` (``patches/_family.py``). This registry lists them: adding a family is its file plus one
line here."""
from __future__ import annotations

from hf_accel.errors import UnsupportedModel

from . import falcon, gemma2, gemma3_text, gpt_neox, llama, mistral, qwen2, qwen3
from ._family import Family, FusableKind, LayerAttention, LayerBytes

FAMILIES: tuple[Family, ...] = (
    llama.FAMILY,
    gpt_neox.FAMILY,
    falcon.FAMILY,
    qwen2.FAMILY,
    qwen3.FAMILY,
    mistral.FAMILY,
    gemma2.FAMILY,
    gemma3_text.FAMILY,
)


def supported_model_types() -> tuple[str, ...]:
    return tuple(t for family in FAMILIES for t in family.model_types)


def family_for(model_type: str) -> Family:
    """The family serving ``model_type``; UnsupportedModel naming the supported ones otherwise."""
    for family in FAMILIES:
        if model_type in family.model_types:
            return family
    raise UnsupportedModel(
        f"hf_accel has no patch for model_type={model_type!r}; supported: {', '.join(supported_model_types())}. "
        "Train it unpatched, or open an issue with the model's config."
    )


def family_of(model) -> Family:
    """The family of a transformers model, a PEFT model or a config."""
    config = getattr(model, "config", model)
    model_type = getattr(config, "model_type", None)
    if model_type is None:
        raise UnsupportedModel(f"expected a transformers model or config, got {type(model).__name__}.")
    if model_type not in supported_model_types():
        _refuse_multimodal(model, config)
    return family_for(model_type)


def _refuse_multimodal(model, config) -> None:
    """A multimodal model whose text model hf_accel patches (Gemma 3 4B-27B, which AutoModelForCausalLM builds as
    Gemma3ForConditionalGeneration): say how to train the text model patched."""
    get_text = getattr(config, "get_text_config", None)
    text = get_text(decoder=True) if callable(get_text) else None
    text_type = getattr(text, "model_type", None)
    if text is None or text is config or text_type not in supported_model_types():
        return
    raise UnsupportedModel(
        f"{type(model).__name__} (model_type {config.model_type!r}) is a multimodal model: hf_accel patches its "
        f"text model (model_type {text_type!r}) but not the model around it (vision tower, image-token masks). "
        "For text-only training, patch the text model on its own: build its CausalLM from config.text_config on "
        "the meta device and give it this model's language model and LM head (the same weights; the recipe: "
        "docs/families.md, 'Multimodal checkpoints'); or train this model unpatched."
    )


__all__ = ["FAMILIES", "Family", "FusableKind", "LayerAttention", "LayerBytes", "family_for", "family_of",
           "supported_model_types"]
