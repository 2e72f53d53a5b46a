"""The attention function and mask function hf_accel registers with transformers under its own name.

A patched model's forwards select them for their duration only (``routing``: the config keeps reporting the user's
implementation). Training and prefill calls (queries as long as keys) go through the varlen seam and the chosen
kernel. Everything else runs the reported implementation's own function with its own mask, i.e. exactly what the
unpatched model computes: decoding steps behind a KV cache (queries shorter than keys), a 4D mask given by the caller,
outside training a forward given a padding mask that fills a KV cache or hides a slot (``routing``), and any
evaluation call traced by ``torch.compile`` (a
compiled decode step traces with ``fullgraph=True`` as the unpatched model's does; only a training call, module in
train mode with grad enabled, crosses into the seam's eager kernels).
"""
from __future__ import annotations

from collections.abc import Callable
from contextvars import ContextVar
from typing import NamedTuple

import torch
import transformers.masking_utils as masking_utils
from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface

from ..errors import UnsupportedModel
from .calls import MASK_WINDOW_ATTR, CallAsks, read_call
from .kernels import AttnOptions, varlen_attention
from .routing import ATTN_NAME, forward_padding_mask, runs_stock_forward, stock_attention, stock_mask
from .varlen import chunked, varlen_batch

BACKEND_ATTR = "_hf_accel_backend"
# on the attention modules of a model that computes its own positions (its forward takes no position_ids: BART's
# decoder as a causal LM): position_ids reaching a call through **kwargs tell no documents there, as stock SDPA reads
# them (the mask it builds has no packed documents, the positions do not restart)
OWN_POSITIONS_ATTR = "_hf_accel_own_positions"


def takes_position_ids(model: torch.nn.Module) -> bool:
    """Whether ``position_ids`` given to the causal LM reach a forward that takes them, so restarting ones start
    documents: down the modules from the causal LM to the one that holds its decoder layers, each forward takes
    them, or passes them on in ``**kwargs`` to the next (Whisper's decoder as a causal LM: its wrapper passes them to
    the decoder, which takes them; BART's decoder takes none)."""
    import inspect

    from transformers.modeling_layers import GradientCheckpointingLayer

    first = next((name for name, m in model.named_modules() if isinstance(m, GradientCheckpointingLayer)), "")
    holder = first.split(".")[:-2]  # "model.decoder" of "model.decoder.layers.0"
    path = [model]
    for part in holder:
        path.append(getattr(path[-1], part, None))
        if path[-1] is None:
            path = [model, getattr(model, "base_model", model)]  # layers not held by a plain attribute path
            break
    for module in path:
        parameters = inspect.signature(type(module).forward).parameters
        if "position_ids" in parameters:
            return True
        if not any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters.values()):
            return False
    return False


def hf_accel_mask(batch_size, q_length, kv_length, q_offset=0, kv_offset=0, attention_mask=None, **kwargs):
    """The caller's 2D padding mask, bool (B, S), or None, for the varlen seam; the reported implementation's own mask
    for the calls that run its function (queries shorter than keys, the forwards ``routing`` leaves to stock, anything
    traced by torch.compile)."""
    if q_length != kv_length or torch.compiler.is_compiling() or runs_stock_forward():
        return stock_mask()(
            batch_size=batch_size, q_length=q_length, kv_length=kv_length, q_offset=q_offset, kv_offset=kv_offset,
            attention_mask=attention_mask, **kwargs,
        )
    # Kept even when it masks nothing: a mask given to the model is the layout (positions that merely jump do not
    # start documents then, as in transformers), and the seam reads it in the same host copy as position_ids.
    # The same tensor for every mask of the forward (Gemma's and Qwen's sliding and full masks, each converted by
    # transformers on its own): the layout's memo is keyed by identity, so all layers share one host read of it.
    given = forward_padding_mask()
    if attention_mask is None:
        return None
    if given is not None and given.shape == attention_mask.shape and kv_length == given.shape[-1]:
        return given
    return attention_mask[:, -kv_length:]


def runs_stock(module: torch.nn.Module) -> bool:
    """Inside torch.compile, every call but a training one (train mode, grad enabled) takes transformers' own path.

    Decided from Python state dynamo guards on, never from tensor data, so a compiled decode step stays one graph.
    """
    return torch.compiler.is_compiling() and not (module.training and torch.is_grad_enabled())


def seam_attention(
    module: torch.nn.Module,
    q_bshd: torch.Tensor,
    k_bshd: torch.Tensor,
    v_bshd: torch.Tensor,
    *,
    attention_mask: torch.Tensor | None,
    position_ids: torch.Tensor | None,
    opts: AttnOptions,
    cu_seq_lens: torch.Tensor | None = None,
    max_length: int | None = None,
    chunk: int | None = None,
) -> torch.Tensor:
    """The one seam every family shares: (B, S, H, D) in, varlen kernel, (B, S, Hq, D) out. ``chunk``: each document
    is cut into pieces of that many tokens from its start, each attending within itself (Llama 4's chunked layers)."""
    batch, seq = q_bshd.shape[:2]
    meta = varlen_batch(
        batch_size=batch, seq_len=seq, device=q_bshd.device, attention_mask=attention_mask,
        position_ids=position_ids, cu_seq_lens=cu_seq_lens, max_length=max_length,
    )
    if chunk:
        meta = chunked(meta, chunk)
    out_thd = varlen_attention(
        meta.unpad(q_bshd), meta.unpad(k_bshd), meta.unpad(v_bshd),
        meta.cu_seqlens, meta.cu_seqlens, meta.max_seqlen, meta.max_seqlen, opts,
        backend=getattr(module, BACKEND_ATTR, "auto"),
    )
    return meta.pad(out_thd)


# Compiled decoder layers (patch(compile=True), training calls) break here, before the seam: metadata and kernel run
# eagerly, and no guard specialises on the per-step kwargs (max_length_q, cu_seq_lens_q). Falcon's seam caller breaks
# the same way.
@torch.compiler.disable
def _hf_accel_attention_varlen(module, q_bshd, k_bshd, v_bshd, attention_mask, scaling, dropout,
                               kwargs) -> torch.Tensor:
    asks = read_call(module, q_bshd.shape[-1], scaling, dropout, kwargs)
    holes = asks.window and attention_mask is not None and _holes(module, q_bshd, attention_mask, kwargs)
    if asks.unknown or holes:
        query, key, value = (t.transpose(1, 2) for t in (q_bshd, k_bshd, v_bshd))
        return stock_call(module, query, key, value, attention_mask, scaling, dropout, asks, kwargs)
    opts = AttnOptions(
        scale=asks.scale,
        causal=asks.causal,
        window=(asks.window - 1 if asks.window else None, None),  # transformers' window counts the query itself
        softcap=asks.softcap or 0.0,  # Gemma: scores -> softcap * tanh(scores / softcap)
        dropout_p=asks.dropout,
        sinks=asks.sinks,
    )
    position_ids, cu_seq_lens, max_length = _layout_kwargs(module, kwargs)
    return seam_attention(
        module, q_bshd, k_bshd, v_bshd, attention_mask=attention_mask, position_ids=position_ids, opts=opts,
        cu_seq_lens=cu_seq_lens, max_length=max_length, chunk=asks.chunk,
    )


def _layout_kwargs(module: torch.nn.Module, kwargs: dict
                   ) -> tuple[torch.Tensor | None, torch.Tensor | None, int | None]:
    """(position_ids, cu_seq_lens_q, max_length_q) of this call: as the call passed them, else as its decoder layer
    was given them (``LAYER_POSITIONS``: a layer that keeps position_ids to itself, as Llama 4's does; also in a
    checkpoint's recompute), else as the patched model's forward was. None of them in a model that computes its own
    positions (``OWN_POSITIONS_ATTR``)."""
    if getattr(module, OWN_POSITIONS_ATTR, False):
        return None, None, None
    if kwargs.get("position_ids") is not None or kwargs.get("cu_seq_lens_q") is not None:
        return kwargs.get("position_ids"), kwargs.get("cu_seq_lens_q"), kwargs.get("max_length_q")
    if kwargs.get(LAYER_POSITIONS) is not None:
        return kwargs[LAYER_POSITIONS], None, None
    record = _PATCHED_FORWARD.get()
    if record is None:
        return None, None, None
    return record.position_ids, record.cu_seq_lens, record.max_length


def _holes(module, q_bshd, attention_mask, kwargs) -> bool:
    """Whether the padding mask has holes inside a row (read from the forward's layout, memoised for every layer)."""
    batch, seq = q_bshd.shape[:2]
    position_ids, cu_seq_lens, max_length = _layout_kwargs(module, kwargs)
    return varlen_batch(batch_size=batch, seq_len=seq, device=q_bshd.device, attention_mask=attention_mask,
                        position_ids=position_ids, cu_seq_lens=cu_seq_lens, max_length=max_length).has_holes


def stock_call(module, query, key, value, attention_mask, scaling, dropout, asks: CallAsks, kwargs):
    """Transformers' own attention for one call the varlen layout cannot express, with the mask transformers builds
    for that layer: a call passing something no hf_accel kernel reads (``asks.unknown``), or a sliding window over a
    row with holes (transformers' window counts slots, holes included, where the varlen layout counts real tokens).
    query/key/value (B, H, S, D); ``attention_mask``: the forward's 2D padding mask or None (then packed documents
    come from position_ids, as in transformers). Returns (B, S, Hq, D)."""
    from transformers import masking_utils as mu

    batch, seq = query.shape[0], query.shape[2]
    if asks.chunk:
        left = (attention_mask.cumsum(-1) == 0).sum(-1) if attention_mask is not None else \
            torch.zeros(batch, dtype=torch.long, device=query.device)
        mask_function = mu.chunked_causal_mask_function(asks.chunk, left)
    elif asks.window:
        mask_function = mu.sliding_window_causal_mask_function(asks.window)
    else:
        mask_function = mu.causal_mask_function if asks.causal else (lambda *index: True)
    packed, position_ids = None, _layout_kwargs(module, kwargs)[0]
    if attention_mask is None and position_ids is not None:
        packed = (_transformers_find_packed or mu.find_packed_sequence_indices)(position_ids)
    if packed is not None:
        mask_function = mu.and_masks(mask_function, mu.packed_sequence_mask_function(packed))
    mask = stock_mask()(batch_size=batch, q_length=seq, kv_length=seq, mask_function=mask_function,
                        attention_mask=None if attention_mask is None else attention_mask.bool(),
                        allow_is_causal_skip=False, dtype=query.dtype, device=query.device)
    out, _ = stock_attention(module)(module, query, key, value, mask, dropout=dropout, scaling=scaling, **kwargs)
    return out


def hf_accel_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """transformers' attention interface: query (B, Hq, S, D), key/value (B, Hkv, S, D) -> ((B, S, Hq, D), None)."""
    if query.shape[2] != key.shape[2] and module.training and torch.is_grad_enabled() \
            and getattr(module, "is_causal", True) and getattr(attention_mask, "ndim", 2) == 2:
        # a causal training call (no KV cache in training) whose keys outnumber its queries, with the mask the seam
        # handed out: the attention appended keys of its own (DeepSeek V4's compressed slots), whose mask it would
        # have built from transformers' mask, not from hf_accel's
        raise UnsupportedModel(
            f"{type(module).__name__} attends to {key.shape[2]} keys for {query.shape[2]} queries in a training call: "
            "keys of its own beyond the sequence, masked from the mask transformers builds, which hf_accel's seam "
            "replaces. hf_accel cannot patch this model; train it unpatched (hf_accel.unpatch(model)).")
    stock = (
        query.shape[2] != key.shape[2]  # a decoding step behind a KV cache (or a static cache's prefill)
        or (attention_mask is not None and getattr(attention_mask, "ndim", None) != 2)  # a 4D (or block) mask
        or (runs_stock(module) and attention_mask is None)  # the stock mask, built under compile: None = causal only
        or runs_stock_forward()  # outside training: a KV cache filled from a padding mask, or a mask hiding a slot
    )
    if stock:
        return stock_attention(module)(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs
        )
    q_bshd, k_bshd, v_bshd = (t.transpose(1, 2) for t in (query, key, value))
    if torch.compiler.is_compiling():  # a compiled layer's training call: lay q/k/v out before the graph break
        # and hand the (B, S, H, D) tensors themselves across it, not (B, H, S, D) views of them: AOTAutograd makes a
        # gradient coming back into a graph contiguous in the shape of that graph's output, a copy for a view
        q_bshd, k_bshd, v_bshd = (kernel_layout(t) for t in (q_bshd, k_bshd, v_bshd))
    out = _hf_accel_attention_varlen(module, q_bshd, k_bshd, v_bshd, attention_mask, scaling, dropout, kwargs)
    return out, None


def kernel_layout(t_bshd: torch.Tensor) -> torch.Tensor:
    """(B, S, H, D) as the varlen kernels read it: contiguous, in the autocast dtype where autocast is on, as
    ``kernels.varlen_attention`` would cast it. For a seam called from a compiled layer, just before its graph
    break, so inductor writes the layout and the cast: into RoPE's (or the projection's) kernel where they share a
    graph (Falcon's seam; nested graph breaks, the default), else as one fused kernel of a graph of its own
    (tracing without them compiles transformers' attention function as a frame of its own), where after the break
    they were eager copies (~40 ms of a Llama-3-8B QLoRA step of 1.43 s, whose fp32 q/k/v came out of the graph
    head-major). The same values: a layout change and the cast the kernel call made."""
    device_type = t_bshd.device.type
    if torch.is_autocast_enabled(device_type) and t_bshd.is_floating_point():
        t_bshd = t_bshd.to(torch.get_autocast_dtype(device_type))
    return t_bshd.contiguous()


def register() -> None:
    """Register the attention and mask functions with transformers (idempotent, process-wide, our name only)."""
    AttentionInterface.register(ATTN_NAME, hf_accel_attention)
    AttentionMaskInterface.register(ATTN_NAME, hf_accel_mask)


# transformers' mask preparation looks for packed documents in position_ids when no attention mask is given
# (masking_utils.find_packed_sequence_indices) and, outside compilation, reads its result back to the host: one
# host sync at the start of every packed forward, which keeps the CPU from queueing the step ahead of the GPU.
# hf_accel's mask function never uses that result (the seam takes documents from cu_seq_lens / position_ids
# itself), so during a patched model's forward the search is skipped for exactly the position_ids tensor that
# forward was given. Every other call (unpatched models, other tensors, compiled tracing) runs transformers' own.
# This wrapper is hf_accel's one process-wide change (transformers has no per-model hook ahead of that search); it
# is inert outside a patched model's forward, so it stays installed after unpatch().
# The same record carries the forward's collator metadata (cu_seq_lens_q, max_length_q) to seams whose model does
# not pass keyword arguments down to attention (Falcon), so they need no host read of the layout either.
class _ForwardBatch(NamedTuple):
    position_ids: torch.Tensor | None
    cu_seq_lens: torch.Tensor | None
    max_length: int | None
    padding_mask: bool  # the forward was given an attention_mask


_PATCHED_FORWARD: ContextVar[_ForwardBatch | None] = ContextVar("hf_accel_forward_batch", default=None)
_transformers_find_packed: Callable | None = None


def _current(position_ids: torch.Tensor | None) -> _ForwardBatch | None:
    batch = _PATCHED_FORWARD.get()
    return batch if batch is not None and position_ids is not None and position_ids is batch.position_ids else None


def _find_packed_sequence_indices(position_ids: torch.Tensor) -> torch.Tensor | None:
    if not torch.compiler.is_compiling() and _current(position_ids) is not None:
        return None  # "no packed documents" to transformers; hf_accel's seam handles them
    return _transformers_find_packed(position_ids)


def collator_metadata(position_ids: torch.Tensor | None) -> tuple[torch.Tensor | None, int | None]:
    """(cu_seq_lens_q, max_length_q) the patched model's current forward was given with these very position_ids and
    no attention_mask (so the collator's documents are the whole layout), else (None, None)."""
    batch = _current(position_ids)
    if batch is None or batch.padding_mask or batch.cu_seq_lens is None or batch.max_length is None:
        return None, None
    return batch.cu_seq_lens, batch.max_length


def _install_packed_check_skip() -> None:
    global _transformers_find_packed
    current = getattr(masking_utils, "find_packed_sequence_indices", None)
    if current is None or current is _find_packed_sequence_indices:
        return  # another transformers layout (nothing to skip), or already installed
    _transformers_find_packed = current
    masking_utils.find_packed_sequence_indices = _find_packed_sequence_indices


def record_inner_forward(position_ids: torch.Tensor | None, cu_seq_lens: torch.Tensor | None,
                         max_length: int | None, padding_mask: bool) -> Callable[[], None]:
    """For a patched forward that runs the model's forward itself on inputs other than its own (the DPO / GRPO packed
    scoring call: padded rows in, one packed row through): the record then tells what that inner forward got, as its
    hooks would have, so layers that read it (hybrid models' linear-attention layers outside training) see the packed
    row's documents. Nothing outside a patched forward (an unpatched model keeps transformers' own packed search).
    Returns the undo."""
    if _PATCHED_FORWARD.get() is None:
        return lambda: None
    token = _PATCHED_FORWARD.set(_ForwardBatch(position_ids, cu_seq_lens, max_length, padding_mask))
    return lambda: _PATCHED_FORWARD.reset(token)


def suspend_forward_record() -> Callable[[], None]:
    """For a call that runs transformers' own attention inside a patched forward (output_attentions): its mask
    preparation then looks for packed documents itself, as in the unpatched model. Returns the undo."""
    token = _PATCHED_FORWARD.set(None)
    return lambda: _PATCHED_FORWARD.reset(token)


def forward_batch_hooks(model: torch.nn.Module) -> list[Callable[[], None]]:
    """Hooks that record a patched model's position_ids and collator metadata for the duration of its forward;
    returns their removers. Installs the packed-search skip that reads the record (once per process)."""
    _install_packed_check_skip()
    tokens = []

    def before(module, args, kwargs):
        if torch.compiler.is_compiling():
            tokens.append(None)  # traced calls take transformers' own path, which reads no record (and dynamo
            return  # cannot trace ContextVar.set)
        record = _ForwardBatch(kwargs.get("position_ids"), kwargs.get("cu_seq_lens_q"), kwargs.get("max_length_q"),
                               kwargs.get("attention_mask") is not None)
        tokens.append(_PATCHED_FORWARD.set(record))

    def after(module, args, kwargs, output):
        token = tokens.pop() if tokens else None
        if token is not None:
            _PATCHED_FORWARD.reset(token)

    return [
        model.register_forward_pre_hook(before, with_kwargs=True).remove,
        model.register_forward_hook(after, with_kwargs=True, always_call=True).remove,
    ]


GENERIC_ATTENTIONS = "transformers' eager attention for that call (mask and probabilities as in the unpatched model)"


def patch_attention_modules(model: torch.nn.Module, classes: tuple[type, ...], backend: str,
                            mask_window: int | None = None) -> tuple[list[str], list[Callable[[], None]]]:
    """The generic seam, for a model whose attention modules (instances of ``classes``) look their function up in
    transformers' AttentionInterface: registers hf_accel's attention and mask functions under our own name, tags each
    attention module with its backend, gives each a routed view of the config (it reads hf_accel's name) and hooks
    the model's body so that each forward builds its mask with hf_accel's mask function (``routing``). Between
    forwards the config reports the implementation the user chose, which also serves every call the seam leaves to
    transformers. ``mask_window``: the sliding window the model's mask carries and its calls do not pass
    (``MASK_WINDOW_ATTR``). Returns the patched module names and the undo actions (hooks, views and tags removed)."""
    from .routing import route_attention_modules, routing_hooks

    register()
    names, modules, undo = [], [], []
    own_positions = not takes_position_ids(model)
    for name, module in model.named_modules():
        if isinstance(module, classes):
            setattr(module, BACKEND_ATTR, backend)
            if own_positions:
                setattr(module, OWN_POSITIONS_ATTR, True)
            if mask_window:
                setattr(module, MASK_WINDOW_ATTR, mask_window)
            names.append(name)
            modules.append(module)
            undo.append(lambda m=module: _untag(m))
    undo += route_attention_modules(model, modules)
    undo += routing_hooks(model.base_model, model.config._attn_implementation)
    undo += _layer_position_hooks(model, modules)
    return names, undo


def _untag(module: torch.nn.Module) -> None:
    for attr in (BACKEND_ATTR, OWN_POSITIONS_ATTR, MASK_WINDOW_ATTR):
        module.__dict__.pop(attr, None)


# A decoder layer given position_ids that it does not pass down to its attention (Llama 4's) hands them on under this
# name through its **kwargs: its attention calls, and a checkpoint's recompute of the layer (which replays the layer's
# keyword arguments), still see the documents.
LAYER_POSITIONS = "hf_accel_position_ids"


def _layer_position_hooks(model: torch.nn.Module, attention_modules: list[torch.nn.Module]
                          ) -> list[Callable[[], None]]:
    import inspect

    from transformers.modeling_layers import GradientCheckpointingLayer

    def hand_down(layer, args, kwargs):
        if kwargs.get("position_ids") is not None and LAYER_POSITIONS not in kwargs:
            return args, {**kwargs, LAYER_POSITIONS: kwargs["position_ids"]}
        return None

    inside = {id(m) for m in attention_modules}
    removers = []
    for layer in model.modules():
        if not isinstance(layer, GradientCheckpointingLayer) or not any(id(m) in inside for m in layer.modules()):
            continue
        params = inspect.signature(type(layer).forward).parameters.values()
        if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params):
            removers.append(layer.register_forward_pre_hook(hand_down, with_kwargs=True).remove)
    return removers


def current_forward_batch() -> _ForwardBatch | None:
    """What the patched model's forward now running was given (position_ids, the collator's cu_seq_lens_q and
    max_length_q, whether it got an attention_mask), or None outside one and while torch.compile traces. For layers
    that are not given position_ids themselves (hybrid models' linear-attention layers)."""
    return None if torch.compiler.is_compiling() else _PATCHED_FORWARD.get()
