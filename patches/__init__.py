"""What a model needs beyond the generic seam, one module per need, and the registry that finds a model's family.

Every causal LM whose attention goes through transformers' ``AttentionInterface`` is served by the generic seam
with facts found from the model (``hf_accel.facts``): adding such a family costs no line here. A module here types
a ``Family`` only where a model reaches attention some other way (Falcon up to transformers 5.24, which builds its own
attention and, stock, attends across packed documents).
"""
from __future__ import annotations

from typing import Any

from hf_accel.errors import UnsupportedModel
from hf_accel.family import Family, FusableKind, LayerAttention, LayerBytes

from . import falcon

# Families typed by hand: models that need more than the generic seam
FAMILIES: tuple[Family, ...] = (falcon.FAMILY,)


def typed_family(model_type: str) -> Family | None:
    """The typed family serving ``model_type``, or None (the generic seam's, found from the model)."""
    return next((family for family in FAMILIES if model_type in family.model_types), None)


def family_of(model: Any) -> Family:
    """The family of a transformers model, a PEFT model's base or a config: typed for models needing more than the
    generic seam, else found from the model (``hf_accel.facts.found_family``). UnsupportedModel for a model that
    reaches attention through neither, and for a multimodal model whose text model could be patched (with how)."""
    config = getattr(model, "config", model)
    model_type = getattr(config, "model_type", None)
    if model_type is None:
        raise UnsupportedModel(f"expected a transformers model or config, got {type(model).__name__}.")
    typed = typed_family(model_type)
    if typed is not None:
        return typed
    _refuse_multimodal(model, config)
    from hf_accel.facts import found_family

    from .experts import prepare_probe_copy

    return found_family(model, prepare_copy=prepare_probe_copy)


def _refuse_multimodal(model, config) -> None:
    """A multimodal model (Gemma 3 4B-27B, which AutoModelForCausalLM builds as Gemma3ForConditionalGeneration): say
    how to train its text model patched."""
    get_text = getattr(config, "get_text_config", None)
    text = get_text(decoder=True) if callable(get_text) else None
    if text is None or text is config:
        return
    raise UnsupportedModel(
        f"{type(model).__name__} (model_type {config.model_type!r}) is a multimodal model: hf_accel patches its "
        f"text model (model_type {getattr(text, 'model_type', None)!r}) but not the model around it (vision tower, "
        "image-token masks). For text-only training, patch the text model on its own: hf_accel.text_model(model) "
        "gives it as its own causal LM holding this model's language model and LM head (the same weights; "
        "docs/families.md, 'Multimodal checkpoints'); or train this model unpatched."
    )


__all__ = ["FAMILIES", "Family", "FusableKind", "LayerAttention", "LayerBytes", "family_of", "typed_family"]
