"""Hybrid models' recurrent layers on packed batches: every document computes what it computes alone.

Qwen3.5 (dense and MoE) and Qwen3-Next interleave full-attention layers (the generic seam's) with Gated DeltaNet
layers: a causal depthwise conv along the sequence, then the gated delta rule, a state carried along it. Other hybrids
carry a conv window and a state the same way in their Mamba, Mamba-2 or short-conv layers. Stock transformers runs a
packed row through them as one sequence: each document starts from the previous one's conv window and state when
documents are marked by ``position_ids`` alone (TRL's padding-free and BFD packing), and 5.25's torch fallbacks refuse
a collator's ``cu_seq_lens_q`` / ``seq_idx`` (docs/hybrid.md).

Touches, on the instance only: each recurrent module's ``forward`` (``linear_attention_modules``), and a forward
pre-hook on its decoder layer handing it the forward's documents (the layer's ``position_ids`` and the model's
collator metadata; the module is given neither) as a keyword argument, which a checkpointed layer's recompute gets
again. LoRA targets: ``in_proj_qkv in_proj_z in_proj_b in_proj_a out_proj`` (Qwen3.5), ``in_proj_qkvz in_proj_ba
out_proj`` (Qwen3-Next), ``in_proj out_proj`` (Mamba-2, LFM2); the forwards call them as modules.

Calls with a cache (``generate``'s prefill and decoding) and batches whose rows hold one document each (stock zeroes
padding and starts every row from a zero state) run the stock forward unchanged. Packed rows are cut in the flattened
(B*S) slots at every row start and every document start of hf_accel's varlen layout (a collator's ``cu_seq_lens_q``,
``position_ids`` restarting, a padding mask's first real token), once per forward; masked slots stay in their segment,
zeroed as stock zeroes them. The first backend that can serve the call runs the segments:
- ``fla``: fla-core's varlen causal conv and chunked gated delta rule over the flattened batch, for CUDA tensors and
  the Gated DeltaNet projection layouts of ``PROJECTION_LAYOUTS``;
- ``per_document``: the stock forward itself over the segments laid out as rows (right-padded to the longest): exact
  by construction, on every device and for every module found here.
"""
from __future__ import annotations

import functools
import inspect
import logging
import types
import weakref
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from hf_accel.attention.hf_attention import current_forward_batch
from hf_accel.attention.varlen import IdentityMemo, VarlenBatch, from_cu_seqlens, from_mask_and_positions
from hf_accel.errors import BackendUnavailable, ConfigurationError

logger = logging.getLogger(__name__)

DOCUMENTS_KWARG = "hf_accel_documents"  # what the decoder layer's pre-hook adds to the module's keyword arguments
BACKENDS = ("fla", "per_document")  # preference order of backend="auto"
FLA_DEVICES = ("cuda",)  # where fla-core's Triton kernels run
FLA_ACTIVATIONS = ("silu", "swish", None)  # the activations fla-core's causal conv applies
_CACHE_NAMES = ("cache", "cache_params")  # transformers 5.17-5.24 name it cache_params
# the documents as collators give them (TRL adds seq_idx): the layout serves them, and 5.25's torch fallbacks refuse
# cu_seq_lens_q and seq_idx
_COLLATOR_KWARGS = ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k", "seq_idx")
_STOCK, _POSITIONAL, _BACKEND = "_hf_accel_stock_forward", "_hf_accel_positional", "_hf_accel_linear_backend"


class Documents(NamedTuple):
    """Where one forward's documents come from, as its decoder layer hands them to a linear-attention module."""

    position_ids: torch.Tensor | None  # (B, S) or (1, S), restarting at each packed document
    cu_seq_lens: torch.Tensor | None  # (num_docs + 1,) int32 over the flattened B*S slots (a collator's)
    max_length: int | None
    mask_given: bool | None  # the model's forward was given an attention_mask (None: not known here)


@dataclass
class Segments:
    """A packed (B, S) batch cut in its flattened B*S slots at every row start and every document start.

    cu_slots: (N + 1,) int64 on the model's device; cu_host: the same on the host, where it was read there.
    """

    cu_slots: torch.Tensor
    cu_host: torch.Tensor | None = None
    _rows: dict = field(default_factory=dict)

    def host(self) -> torch.Tensor:
        if self.cu_host is None:
            self.cu_host = self.cu_slots.cpu()  # host sync: once per forward (memoised), per-document backend only
        return self.cu_host

    def as_rows(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor, int, int]:
        """(grid (N*L,), back (B*S,), N, L): ``grid`` lays the segments out as N rows of L slots, right-padded with
        slot B*S (a zero row the caller appends); ``back`` takes each slot's value from that layout."""
        if device not in self._rows:
            cu = self.host()
            starts, lengths = cu[:-1], cu[1:] - cu[:-1]
            count, width, total = lengths.numel(), int(lengths.max()), int(cu[-1])
            offsets = torch.arange(width)
            grid = torch.where(offsets < lengths[:, None], starts[:, None] + offsets, total)
            segment = torch.repeat_interleave(torch.arange(count), lengths)
            back = segment * width + torch.arange(total) - starts[segment]
            self._rows[device] = (grid.reshape(-1).to(device), back.to(device), count, width)
        return self._rows[device]


# ---- finding the modules ----

def linear_attention_modules(model: nn.Module) -> list[tuple[str, nn.Module, nn.Module]]:
    """(name, module, its decoder layer) of every recurrent token mixer of ``model``: a child, with ``layer_idx`` i,
    of a layer taking ``**kwargs``, where the text config's ``layer_types[i]`` is one of ``recurrent_layer_types()``,
    that holds a depthwise ``nn.Conv1d`` and whose forward takes ``(hidden_states, cache, attention_mask,
    **kwargs)`` (Gated DeltaNet, Mamba-2 mixers, short convs)."""
    config = model.config
    get_text = getattr(config, "get_text_config", None)
    text = get_text(decoder=True) if callable(get_text) else config
    layer_types = list(getattr(text, "layer_types", None) or ())
    recurrent = recurrent_layer_types()
    found = []
    for layer_name, layer in model.named_modules():
        for child_name, child in layer.named_children():
            index = getattr(child, "layer_idx", None)
            if (isinstance(index, int) and 0 <= index < len(layer_types) and layer_types[index] in recurrent
                    and _is_conv_mixer(child) and _takes_var_kwargs(layer.forward)):
                found.append((f"{layer_name}.{child_name}" if layer_name else child_name, child, layer))
    return found


def recurrent_layer_types() -> frozenset[str]:
    """The layer types whose layers transformers gives a recurrent padding mask (``create_recurrent_attention_mask``,
    alone or among a hybrid layer's masks): linear attention, Mamba and short-conv layers."""
    from transformers import masking_utils

    recurrent = getattr(masking_utils, "create_recurrent_attention_mask", None)
    mapping = getattr(masking_utils, "LAYER_PATTERN_TO_MASK_FUNCTION_MAPPING", {})
    found = {name for name, fn in mapping.items()
             if recurrent is not None and (fn is recurrent or (isinstance(fn, dict) and recurrent in fn.values()))}
    return frozenset(found or ("linear_attention", "conv"))


def _takes_var_kwargs(fn: Callable) -> bool:
    return any(p.kind is p.VAR_KEYWORD for p in inspect.signature(fn).parameters.values())


def _is_conv_mixer(module: nn.Module) -> bool:
    depthwise = any(isinstance(c, nn.Conv1d) and c.groups == c.in_channels == c.out_channels
                    for c in module.children())
    forward = module.__dict__.get(_STOCK, module.forward)  # a patched module's own forward
    params = inspect.signature(forward).parameters
    return (depthwise and _takes_var_kwargs(forward) and "attention_mask" in params
            and any(name in params for name in _CACHE_NAMES))


# ---- the documents of a forward ----

def _hand_documents(layer: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict] | None:
    """Decoder-layer pre-hook: in training, add the forward's documents to the keyword arguments the layer passes on
    (from 5.25 on a checkpointed layer's recompute gets these very keyword arguments again). Outside training
    (evaluation, generation) nothing: the modules read the model forward's record themselves, and a compiled decode
    (``torch.compile(fullgraph=True)``) traces through this hook without a break."""
    if not layer.training:
        return None
    return _with_documents(args, kwargs)


@torch.compiler.disable  # reads the forward's record (a context variable)
def _with_documents(args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    kwargs[DOCUMENTS_KWARG] = _documents(kwargs, kwargs.get("position_ids", _MISSING), current_forward_batch())
    return args, kwargs


_MISSING = object()


def _documents(kwargs: dict, position_ids: Any, record) -> Documents:
    """The documents from the call's own arguments, else from ``record`` (the model forward's)."""
    if position_ids is _MISSING:
        position_ids = None if record is None else record.position_ids
    cu, max_length = kwargs.get("cu_seq_lens_q"), kwargs.get("max_length_q")
    if cu is None and record is not None:
        cu, max_length = record.cu_seq_lens, record.max_length
    return Documents(position_ids, cu, max_length, None if record is None else record.padding_mask)


class _LayoutMemo:
    """The last few forwards' segments, keyed by the identity of the tensors that define them (weakly held): every
    layer of a forward, and its checkpoint recomputes in backward, share one computation (one host read)."""

    def __init__(self, size: int = 4) -> None:
        self._entries: deque = deque(maxlen=size)

    def get(self, key: tuple, shape: tuple, mask_given: bool | None):
        for memo, (entry_shape, entry_given) in self._entries:
            hit = memo.get(key)
            if hit is not None and entry_shape == shape and mask_given in (None, entry_given):
                return hit
        return None

    def put(self, key: tuple, shape: tuple, mask_given: bool, value) -> None:
        memo = IdentityMemo()
        memo.put(key, value)
        self._entries.append((memo, (shape, mask_given)))


_layouts = _LayoutMemo()


def layout(documents: Documents, mask_bs: torch.Tensor | None, batch: int, seq: int,
           device: torch.device) -> Segments | None:
    """The segments of a packed batch, or None where every row holds one document (stock computes those)."""
    positions = documents.position_ids
    if positions is not None and positions.ndim not in (1, 2):
        positions = None  # multimodal rope rows (3, B, S): no text positions to read documents from
    if positions is None and documents.cu_seq_lens is None:
        return None
    key, shape = (mask_bs, positions, documents.cu_seq_lens), (batch, seq)
    hit = _layouts.get(key, shape, documents.mask_given)
    if hit is not None:
        return hit[0]
    mask_given = bool(documents.mask_given) or mask_bs is not None
    if not mask_given and documents.cu_seq_lens is not None and documents.max_length is not None:
        meta = from_cu_seqlens(documents.cu_seq_lens, documents.max_length, batch, seq, device)
    else:
        if mask_bs is None and mask_given:  # an all-ones mask (the layer then gets None): positions read as with one
            mask_bs = torch.ones(batch, seq, dtype=torch.bool, device=device if positions is None else positions.device)
        meta = from_mask_and_positions(mask_bs, positions, batch, seq, device)
    value = _segments(meta, batch, seq, device)
    _layouts.put(key, shape, mask_given, (value,))
    return value


def _segments(meta: VarlenBatch, batch: int, seq: int, device: torch.device) -> Segments | None:
    if meta.indices is None:  # every slot real: documents are the segments (no host read here)
        return Segments(meta.cu_seqlens.to(torch.int64)) if meta.num_docs > batch else None
    # Padding: cut at each document's first real slot and at each row start, so the masked slots before a row's
    # first document stay apart from it. The layout's indices come to the host once per forward here.
    indices, cu = meta.indices.cpu(), meta.cu_seqlens.cpu().to(torch.int64)
    if meta.num_docs <= torch.unique(indices // seq).numel():
        return None
    starts = torch.unique(torch.cat([indices[cu[:-1]], torch.arange(batch) * seq]))
    cu_host = torch.cat([starts, torch.tensor([batch * seq])])
    return Segments(cu_host.to(device), cu_host)


# ---- backends ----

class _FlaOps(NamedTuple):
    conv: Callable  # fla causal_conv1d(x (1, T, C), weight (C, W), bias, activation=, cu_seqlens=) -> (y, state)
    rule: Callable  # fla chunk_gated_delta_rule(q, k, v, g, beta, ..., cu_seqlens=) -> (o (1, T, HV, V), state)


@functools.cache
def fla_ops() -> _FlaOps | str:
    """fla-core's varlen kernels, or why they cannot be imported."""
    try:
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule
        from fla.modules.causal_conv1d import causal_conv1d
    except Exception as error:  # ImportError, or Triton missing / failing at import
        return f"fla-core is not importable ({type(error).__name__}: {error}); pip install 'hf_accel[hybrid]'"
    return _FlaOps(causal_conv1d, chunk_gated_delta_rule)


@functools.cache
def fla_backward_refusal() -> str | None:
    """Why fla-core, importable here, refuses the gated delta rule's backward on this machine (its own guard in
    0.6.0: Hopper GPUs with Triton 3.4 to 3.7.0 give wrong results, unless tilelang serves the kernel), or None.
    transformers' stock forward calls the same kernel, so the unpatched model cannot train there either (run 39)."""
    if isinstance(fla_ops(), str):
        return None
    try:
        import importlib.util

        from fla.utils import IS_NVIDIA_HOPPER, TRITON_ABOVE_3_4_0, TRITON_ABOVE_3_7_1
    except ImportError:  # another fla-core: its own guard, if any, speaks for itself
        return None
    if not (IS_NVIDIA_HOPPER and TRITON_ABOVE_3_4_0 and not TRITON_ABOVE_3_7_1) or importlib.util.find_spec("tilelang"):
        return None
    import triton

    return (f"fla-core refuses its gated delta rule's backward on Hopper GPUs with Triton {triton.__version__} (wrong "
            "results below 3.7.1): training fails at the first backward, unpatched too. Install Triton >= 3.7.1 or "
            "tilelang, or uninstall fla-core (transformers' torch path, slower)")


def _qwen3_5_projections(module: nn.Module, h_bsd: torch.Tensor):
    batch, seq, _ = h_bsd.shape
    z = module.in_proj_z(h_bsd).reshape(batch, seq, -1, module.head_v_dim)
    return module.in_proj_qkv(h_bsd), z, module.in_proj_b(h_bsd), module.in_proj_a(h_bsd)


def _qwen3_next_projections(module: nn.Module, h_bsd: torch.Tensor):
    q, k, v, z, b, a = module.fix_query_key_value_ordering(module.in_proj_qkvz(h_bsd), module.in_proj_ba(h_bsd))
    return torch.cat([t.reshape(t.shape[0], t.shape[1], -1) for t in (q, k, v)], dim=-1), z, b, a


# Gated DeltaNet projection layouts the fla backend computes, known by the names the module holds. Each returns
# (mixed_qkv (B, S, 2*key_dim + value_dim), z (B, S, HV, V), b (B, S, HV), a (B, S, HV)), as the stock forward has
# them before its conv.
PROJECTION_LAYOUTS: tuple[tuple[tuple[str, ...], Callable], ...] = (
    (("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a"), _qwen3_5_projections),
    (("in_proj_qkvz", "in_proj_ba", "fix_query_key_value_ordering"), _qwen3_next_projections),
)
_GATED_DELTA_NET = ("conv1d", "A_log", "dt_bias", "norm", "out_proj", "key_dim", "value_dim", "head_k_dim",
                    "head_v_dim", "activation")


def _projections(module: nn.Module) -> Callable | None:
    if not all(hasattr(module, name) for name in _GATED_DELTA_NET):
        return None
    return next((fn for names, fn in PROJECTION_LAYOUTS if all(hasattr(module, n) for n in names)), None)


def _fla_refusal(module: nn.Module, hidden_bsd: torch.Tensor) -> str | None:
    if hidden_bsd.device.type not in FLA_DEVICES:
        return f"tensors on {hidden_bsd.device.type} (its kernels run on {', '.join(FLA_DEVICES)})"
    if _projections(module) is None:
        return f"{type(module).__name__} is not a Gated DeltaNet of a known projection layout"
    if getattr(module, "activation", None) not in FLA_ACTIVATIONS:
        return f"conv activation {module.activation!r} (fla-core applies {FLA_ACTIVATIONS})"
    if getattr(module.conv1d, "_hf_hook", None) is not None:
        return "conv1d is dispatched by accelerate (offloaded weights)"
    ops = fla_ops()
    if isinstance(ops, str):
        return ops
    return fla_backward_refusal() if torch.is_grad_enabled() else None


def _fla_forward(module, stock, hidden_bsd, mask_bs, segments: Segments, kwargs) -> torch.Tensor:
    """The Gated DeltaNet forward of transformers 5.17-5.25 over the flattened batch, its conv and delta rule by
    fla-core's varlen kernels (each segment from a zero conv window and a zero state)."""
    ops = fla_ops()
    if mask_bs is not None:  # stock's apply_mask_to_padding_states
        hidden_bsd = (hidden_bsd * mask_bs[:, :, None]).to(hidden_bsd.dtype)
    batch, seq, _ = hidden_bsd.shape
    tokens = batch * seq
    mixed_qkv, z, b, a = _projections(module)(module, hidden_bsd)
    # Under autocast the projections come out in the autocast dtype while the conv's weight is fp32: the conv runs
    # in the former, as autocast runs stock's F.conv1d
    weight, bias = (None if t is None else t.to(mixed_qkv.dtype) for t in (module.conv1d.weight, module.conv1d.bias))
    x_1tc, _ = ops.conv(mixed_qkv.reshape(1, tokens, -1), weight=weight.squeeze(1), bias=bias,
                        activation=module.activation, cu_seqlens=segments.cu_slots, cu_seqlens_cpu=segments.cu_host)
    q, k, v = torch.split(x_1tc, [module.key_dim, module.key_dim, module.value_dim], dim=-1)
    q, k = q.reshape(1, tokens, -1, module.head_k_dim), k.reshape(1, tokens, -1, module.head_k_dim)
    v = v.reshape(1, tokens, -1, module.head_v_dim)
    beta = b.sigmoid().reshape(1, tokens, -1)
    g = (-module.A_log.float().exp() * F.softplus(a.float() + module.dt_bias)).reshape(1, tokens, -1)
    out, _ = ops.rule(q, k, v, g=g, beta=beta, use_qk_l2norm_in_kernel=True, cu_seqlens=segments.cu_slots,
                      cu_seqlens_cpu=segments.cu_host)
    out = out.to(v.dtype)  # as the stock forward casts the rule's output back (the norm keeps its input's dtype)
    out = module.norm(out.reshape(-1, module.head_v_dim), z.reshape(-1, module.head_v_dim))
    return module.out_proj(out.reshape(batch, seq, -1))


def _per_document(module, stock, hidden_bsd, mask_bs, segments: Segments, kwargs) -> torch.Tensor:
    """The stock forward over the segments laid out as rows: each computes what it computes alone. Every per-token
    argument ((B, S, ...): the hidden states, the mask, any such keyword argument) is laid out the same way."""
    batch, seq = hidden_bsd.shape[:2]
    grid, back, count, width = segments.as_rows(hidden_bsd.device)

    def as_rows(value):
        if not (isinstance(value, torch.Tensor) and value.dim() >= 2 and tuple(value.shape[:2]) == (batch, seq)):
            return value
        flat = value.reshape(batch * seq, *value.shape[2:])
        flat = torch.cat([flat, flat.new_zeros(1, *value.shape[2:])])  # slot B*S: the rows' right padding
        return flat.index_select(0, grid).reshape(count, width, *value.shape[2:])

    kwargs = {name: as_rows(value) for name, value in kwargs.items()}
    y_nld = stock(as_rows(hidden_bsd), attention_mask=as_rows(mask_bs), **kwargs)
    return y_nld.reshape(count * width, -1).index_select(0, back).reshape(batch, seq, -1)


class _Backend(NamedTuple):
    refusal: Callable[[nn.Module, torch.Tensor], str | None]  # why it cannot serve this call, None if it can
    run: Callable[..., torch.Tensor]


_BACKENDS = {"fla": _Backend(_fla_refusal, _fla_forward), "per_document": _Backend(lambda m, h: None, _per_document)}


def choose_backend(module: nn.Module, hidden_bsd: torch.Tensor, wanted: str = "auto") -> str:
    """The first backend (``BACKENDS`` order, or ``wanted`` alone) that can serve this call; BackendUnavailable
    naming each refusal otherwise."""
    refusals = {}
    for name in BACKENDS if wanted == "auto" else (wanted,):
        reason = _BACKENDS[name].refusal(module, hidden_bsd)
        if reason is None:
            if refusals and hidden_bsd.device.type in FLA_DEVICES:
                _warn_slow_once(type(module).__name__, name, tuple(refusals.items()))
            return name
        refusals[name] = reason
    tried = "; ".join(f"{n}: {r}" for n, r in refusals.items())
    raise BackendUnavailable(f"linear-attention backend {wanted!r} cannot serve {type(module).__name__} ({tried}). "
                             "Pass backend='auto' (per_document serves every call), or install what it names.")


@functools.cache
def _warn_slow_once(module_type: str, chosen: str, refusals: tuple) -> None:
    logger.warning("packed %s layers run %s (exact, slower): %s", module_type, chosen,
                   "; ".join(f"{n} refused: {r}" for n, r in refusals))


# ---- the patched forward ----

def _forward(self: nn.Module, hidden_states: torch.Tensor, *args, **kwargs):
    """Each linear-attention module's forward while patched (an instance attribute)."""
    stock = self.__dict__[_STOCK]
    documents = kwargs.pop(DOCUMENTS_KWARG, None)
    names = self.__dict__[_POSITIONAL]
    if len(args) > len(names):
        return stock(hidden_states, *args, **kwargs)  # a call this patch cannot read: as unpatched
    kwargs.update(zip(names, args))
    if any(kwargs.get(name) is not None for name in _CACHE_NAMES):
        return stock(hidden_states, **kwargs)  # generate's prefill and decoding: unchanged
    return _packed_forward(self, stock, hidden_states, documents, kwargs)


@torch.compiler.disable  # compiled layers break here, as at the attention seam: the layout and backends run eagerly
def _packed_forward(module, stock, hidden_bsd, documents: Documents | None, kwargs: dict) -> torch.Tensor:
    mask_bs = kwargs.pop("attention_mask", None)
    documents = _reaching(module, documents, kwargs)
    for name in _COLLATOR_KWARGS + _CACHE_NAMES:  # served by the layout / None
        kwargs.pop(name, None)
    segments = layout(documents, mask_bs, hidden_bsd.shape[0], hidden_bsd.shape[1], hidden_bsd.device)
    if segments is None:
        return stock(hidden_bsd, attention_mask=mask_bs, **kwargs)
    backend = choose_backend(module, hidden_bsd, module.__dict__[_BACKEND])
    return _BACKENDS[backend].run(module, stock, hidden_bsd, mask_bs, segments, kwargs)


# Each module's documents of its last forward with grad, for a checkpoint's recompute they do not reach: a
# layer that does not pass its keyword arguments on (Jamba's), or one whose hooks run again in the recompute, after
# the model's forward and its record ended (transformers < 5.25), without the documents in its own arguments. The
# recompute in backward belongs to the module's last forward in every schedule that runs each micro-batch's backward
# before the next micro-batch's forward (Trainer's, TRL's).
_last: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _reaching(module: nn.Module, documents: Documents | None, kwargs: dict) -> Documents:
    """The documents of this call: handed on by the decoder layer, else the model forward's record; in a recompute
    in backward that neither reached, the module's last forward's."""
    in_backward = torch._C._current_graph_task_id() != -1
    if documents is None or documents.mask_given is None:  # not handed on, or handed on outside the model's forward
        record = current_forward_batch()
        if record is not None:
            documents = _documents(kwargs, _MISSING if documents is None else documents.position_ids, record)
        elif in_backward and module in _last and (documents is None or all(d is None for d in documents[:3])):
            documents = _last[module]
        elif documents is None:
            documents = Documents(None, kwargs.get("cu_seq_lens_q"), kwargs.get("max_length_q"), None)
    if not in_backward and torch.is_grad_enabled():  # a forward a backward may recompute (not an evaluation's)
        _last[module] = documents
    return documents


def _bind(module: nn.Module, layer: nn.Module, backend: str) -> list[Callable[[], None]]:
    previous = module.__dict__.get("forward")  # an instance forward already there (accelerate's hooks)
    stock = module.forward
    params = list(inspect.signature(stock).parameters.values())[1:]
    module.__dict__[_STOCK] = stock
    module.__dict__[_POSITIONAL] = [p.name for p in params if p.kind is p.POSITIONAL_OR_KEYWORD]
    module.__dict__[_BACKEND] = backend
    module.forward = types.MethodType(_forward, module)

    def undo() -> None:
        for attr in (_STOCK, _POSITIONAL, _BACKEND, "forward"):
            module.__dict__.pop(attr, None)
        if previous is not None:
            module.__dict__["forward"] = previous

    return [undo, layer.register_forward_pre_hook(_hand_documents, with_kwargs=True).remove,
            lambda: _last.pop(module, None)]


def apply(model: nn.Module, *, backend: str = "auto") -> tuple[list[str], list[Callable[[], None]]]:
    """Bind the packed-document forward to each linear-attention module of ``model`` (this instance only) and a
    pre-hook to its decoder layer. ``backend``: "auto" (fla-core where it can serve a call, else per document),
    "fla" (raise where it cannot) or "per_document". Returns the patched modules' names and the undo actions that
    restore them exactly (any order). Modules already patched are left as they are."""
    if backend not in ("auto", *BACKENDS):
        raise ConfigurationError(f"linear-attention backend={backend!r}; allowed: 'auto', "
                                 f"{', '.join(repr(b) for b in BACKENDS)}.")
    names, undo = [], []
    for name, module, layer in linear_attention_modules(model):
        if _STOCK in module.__dict__:
            continue
        undo += _bind(module, layer, backend)
        names.append(name)
    return names, undo
