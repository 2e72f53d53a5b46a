"""The text model of a multimodal checkpoint as a causal LM of its own, sharing the multimodal model's modules.

AutoModelForCausalLM builds Gemma 3 (4B-27B) and Gemma 4 checkpoints as their ``...ForConditionalGeneration`` class: a
vision (or audio) tower, a projector and the language model. ``patch()`` serves the language model, not the model
around it (image tokens attend both ways, the towers have attention of their own). ``text_model(model)`` gives the
language model and the LM head as the text config's own causal-LM class (``Gemma3ForCausalLM``, ...), built on the
meta device and given the multimodal model's modules: nothing is copied or loaded twice, training it trains the
multimodal model's weights, and it computes the multimodal model's text-only logits exactly. Its ``save_pretrained``
writes a text-only checkpoint of that class.
"""
from __future__ import annotations

from typing import Any

import torch

from .errors import ConfigurationError, UnsupportedModel


def is_multimodal(config: Any) -> bool:
    """Whether AutoModelForCausalLM builds ``config`` as a model around a text model (Gemma 3 4B-27B's and Gemma 4's
    ``...ForConditionalGeneration``), whose text model ``text_model`` takes apart. Qwen3.5's checkpoints, multimodal
    too, build as their text config's causal LM: not such a model."""
    from .facts import causal_lm_class

    get_text = getattr(config, "get_text_config", None)
    if not callable(get_text) or get_text(decoder=True) is config:
        return False
    try:
        return causal_lm_class(config).config_class is type(config)
    except UnsupportedModel:
        return False


def text_model(model: Any) -> Any:
    """The causal LM of ``model``'s text config, holding ``model``'s language model and LM head (the same modules).

    ``model``: a transformers multimodal model with a language model and an LM head (Gemma 3 / Gemma 4
    ``...ForConditionalGeneration``, ...), not yet wrapped by PEFT (apply PEFT to what this returns). The result
    is in ``model``'s train / eval mode; patch it, train it, or give it to hf_accel's Trainers."""
    from .facts import causal_lm_class

    if hasattr(model, "get_base_model"):
        raise ConfigurationError(
            f"text_model() takes the transformers model, not a PEFT model ({type(model).__name__}): call it before "
            "get_peft_model, and apply PEFT to the text model it returns.")
    config = getattr(model, "config", None)
    get_text = getattr(config, "get_text_config", None)
    if not callable(get_text):
        raise ConfigurationError(f"text_model() takes a transformers model; got {type(model).__name__}.")
    text = get_text(decoder=True)
    if text is config:
        raise ConfigurationError(
            f"{type(model).__name__} (model_type {config.model_type!r}) has no text sub-config: it is a text model "
            "already. Patch it as it is.")
    decoder, head = model.get_decoder(), model.get_output_embeddings()
    if decoder is model or getattr(decoder, "config", None) is not text or head is None:
        raise UnsupportedModel(
            f"{type(model).__name__} (model_type {config.model_type!r}) keeps no language model built on its text "
            "config (get_decoder()) beside an LM head (get_output_embeddings()), so text_model() cannot take them "
            "apart. Train it unpatched.")
    cls = causal_lm_class(text)
    with torch.device("meta"):  # no weights of its own: the multimodal model's modules go in below
        out = cls(text)
    setattr(out, out.base_model_prefix, decoder)
    out.set_output_embeddings(head)
    left = [name for name, t in (*out.named_parameters(), *out.named_buffers()) if t.is_meta]
    if left:
        raise UnsupportedModel(
            f"{cls.__name__} holds weights beyond the language model and the LM head ({', '.join(left[:3])}), which "
            f"{type(model).__name__} does not share with it: text_model() cannot build it. Train the model unpatched.")
    # a quantized model (bitsandbytes 4-bit, ...) stays one: PEFT, the Trainer and save_pretrained read its state
    for name in ("hf_quantizer", "is_quantized", "quantization_method"):
        if name in model.__dict__:
            setattr(out, name, model.__dict__[name])
    quantization = getattr(config, "quantization_config", None)
    if quantization is not None:
        text.quantization_config = quantization  # the sub-config the text model saves as its own
    generation_config = getattr(model, "generation_config", None)
    if generation_config is not None:
        out.generation_config = generation_config
    return out.train(model.training)
