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
    return family_for(model_type)


__all__ = ["FAMILIES", "Family", "FusableKind", "LayerAttention", "LayerBytes", "family_for", "family_of",
           "supported_model_types"]
