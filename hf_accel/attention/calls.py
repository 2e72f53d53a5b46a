"""What one attention call asks of a kernel, read from the call itself.

transformers' attention modules call the function registered under the config's implementation as
``fn(module, query, key, value, attention_mask, scaling=..., dropout=..., **kwargs)``; what a family adds to plain
causal attention arrives in that call: ``sliding_window`` (or the module's own), ``softcap`` (Gemma 2), ``s_aux``
(gpt-oss's attention sinks), ``is_causal``, and through the layer's type in ``config.layer_types`` a chunked layer
(Llama 4). ``read_call`` turns one call into a ``CallAsks``; the seam builds the kernel's options from it, and
``hf_accel.facts`` reads the same thing from a probe forward to say, before training, which kernel serves each
layer.

Anything else a call passes that is not one of transformers' own model keyword arguments (``TransformersKwargs``,
``FlashAttentionKwargs``: position_ids, the collator's cu_seq_lens, output flags) is a request no hf_accel kernel
expresses (T5's ``position_bias``, a sparse-attention ``indices``, ...): ``CallAsks.unknown`` names it, and that
call runs transformers' own attention.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

# Keyword arguments the seam reads itself (beyond transformers' model-level ones)
HANDLED = frozenset({"sliding_window", "softcap", "s_aux", "is_causal"})
# The sliding window of a model whose attention calls do not pass one and whose mask carries it (PhiMoE builds a
# sliding-window mask and calls attention without ``sliding_window``): read from that mask by the facts probe, set on
# each attention module by the seam's patch, and read here after the call's own word and the module's attribute.
MASK_WINDOW_ATTR = "_hf_accel_mask_window"
OURS = "hf_accel_"  # keyword arguments hf_accel's own hooks pass down (hf_attention.LAYER_POSITIONS, the hybrids')
# What a forward hands every layer and carries no attention meaning of its own
_PASSED_DOWN = frozenset({"cache_position", "position_embeddings", "use_cache", "past_key_values", "past_key_value",
                          "cache", "return_dict", "labels", "logits_to_keep", "token_type_ids"})


@functools.lru_cache(maxsize=1)
def model_kwargs() -> frozenset[str]:
    """The keyword arguments transformers itself passes from a model's forward down to its attention calls."""
    from transformers.modeling_flash_attention_utils import FlashAttentionKwargs
    from transformers.utils.generic import TransformersKwargs

    return frozenset(TransformersKwargs.__annotations__) | frozenset(FlashAttentionKwargs.__annotations__)


@dataclass(frozen=True)
class CallAsks:
    """One attention call's needs. ``window``: keys a query sees, itself included (transformers' count); ``chunk``:
    a query sees only keys of its own chunk of this many positions (counted from its document's start);
    ``sinks``: (H_q,) learned logits joining every softmax's denominator; ``unknown``: keyword arguments no kernel
    expresses (the call runs transformers' own attention)."""

    scale: float
    causal: bool = True
    window: int | None = None
    softcap: float | None = None
    dropout: float = 0.0
    sinks: torch.Tensor | None = None
    chunk: int | None = None
    unknown: tuple[str, ...] = ()


def layer_type(module: torch.nn.Module) -> str | None:
    """The layer's entry in ``config.layer_types`` ("full_attention", "sliding_attention", "chunked_attention", ...),
    None where the config has none."""
    types = getattr(module.config, "layer_types", None)
    index = getattr(module, "layer_idx", None)
    if types is None or index is None or not 0 <= index < len(types):
        return None
    return types[index]


def read_call(module: torch.nn.Module, head_dim: int, scaling: float | None, dropout: float, kwargs: dict
              ) -> CallAsks:
    """What this call asks for. ``head_dim``: the query's; ``scaling``/``dropout``/``kwargs`` as the call passed them."""
    # the call's own word first, None included: EXAONE 4 keeps config.sliding_window on every attention module and
    # passes it only from its sliding layers (as transformers' flash path reads it: the keyword alone)
    window = kwargs["sliding_window"] if "sliding_window" in kwargs else (
        getattr(module, "sliding_window", None) or getattr(module, MASK_WINDOW_ATTR, None))
    chunk = None
    if layer_type(module) == "chunked_attention":
        chunk = getattr(module.config, "attention_chunk_size", None)
    known = model_kwargs() | HANDLED | _PASSED_DOWN
    unknown = tuple(sorted(k for k, v in kwargs.items()
                           if v is not None and k not in known and not k.startswith(OURS)))
    is_causal = kwargs.get("is_causal")
    return CallAsks(
        scale=scaling if scaling is not None else head_dim ** -0.5,
        causal=bool(getattr(module, "is_causal", True) if is_causal is None else is_causal),
        window=int(window) if window else None,
        softcap=float(kwargs["softcap"]) if kwargs.get("softcap") else None,
        dropout=float(dropout or 0.0),
        sinks=kwargs.get("s_aux"),
        chunk=int(chunk) if chunk else None,
        unknown=unknown,
    )
