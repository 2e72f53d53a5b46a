"""A model's facts read off one forward of a copy built from its config on fake tensors (torch's FakeTensorMode: every
shape and dtype, no memory, no weight read, no kernel run), with a stand-in attention registered under a name of our
own that records each call and saves what a flash kernel saves (q, k, v, out and the fp32 log-sum-exp).

From that forward (``probe_config``):
- each attention call's asks (``hf_accel.attention.calls.read_call``, the same reading the seam makes in training)
  and shapes, per decoder layer;
- per decoder layer, per token, the bytes autograd saves (no checkpointing), what op-level checkpointing keeps (the
  layer's input and the outputs of matmuls and attention) and what full checkpointing keeps (its input), and of the
  first, the share made inside the layer's ``mlp`` (what a chunked MLP holds for one chunk only); each figure is the
  difference of two forwards of different lengths, so what does not grow with the tokens drops out;
- the projections whose output nothing but the layer's output reads, through residual adds (``memory.trim`` may skip
  their matmuls in a checkpointed layer's recompute): found by following the data from each ``nn.Linear`` through
  the ops of the layer.
"""
from __future__ import annotations

import contextlib
import copy
import functools
import inspect
import types
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from .. import foreign
from ..attention.calls import CallAsks, read_call
from .dataflow import Op, output_projections, plain_head

PROBE_NAME = "hf_accel_probe"  # never containing "flash": transformers would take it for its own flash path
TOKENS = (8, 16)  # the two probe lengths


@dataclass(frozen=True)
class ProbedCall:
    """One attention call of the probe forward."""

    module: str  # the attention module's path in the model
    layer: int | None  # the decoder layer it runs in (index among the GradientCheckpointingLayers)
    heads: tuple[int, int, int]  # (query heads, key/value heads, head_dim)
    asks: CallAsks
    # the call got a mask the model built itself, or keys beyond the sequence: the probe's mask function hands out
    # none (one full-length causal document), so any mask at the call was made inside the model (Doge's dynamic bias
    # over query and key positions), and without a cache a key longer than the query was appended there (DeepSeek
    # V4's compressed slots)
    own_mask: bool = False


@dataclass(frozen=True)
class LayerSaves:
    """Bytes per token one decoder layer keeps for backward (see the module docstring)."""

    none: float
    op: float
    full: float
    mlp: float


@dataclass(frozen=True)
class Probed:
    calls: tuple[ProbedCall, ...]
    layers: tuple[LayerSaves, ...]
    output_projections: tuple[str, ...]  # paths inside a decoder layer, e.g. "mlp.down_proj"
    attention_classes: tuple[type, ...]
    layer_linears: tuple[str, ...] = field(default_factory=tuple)  # last names of the layers' nn.Linear modules
    mlp_width: int | None = None  # the widest linear inside the layers' ``mlp``; None where it holds experts
    plain_head: bool = True  # the logits are the LM head's output (a final soft-cap aside): the fused loss serves
    # the sliding window of each mask the model built (None: causal, or not a window this reads): ``mask_window``
    mask_windows: tuple[int | None, ...] = ()
    # every attention call passed ``sliding_window`` (None included): the calls say which layer keeps which window
    calls_say_window: bool = False


# ---------------------------------------------------------------------------------------------- the stand-in kernel
@torch.library.custom_op("hf_accel::probe_attention", mutates_args=())
def _probe_attention_op(q_bshd: torch.Tensor, k_bshd: torch.Tensor, v_bshd: torch.Tensor
                        ) -> tuple[torch.Tensor, torch.Tensor]:
    batch, seq, heads, _ = q_bshd.shape
    return (q_bshd.new_empty(batch, seq, heads, v_bshd.shape[-1]),
            q_bshd.new_empty(batch, heads, seq, dtype=torch.float32))


@_probe_attention_op.register_fake
def _(q_bshd, k_bshd, v_bshd):
    batch, seq, heads, _ = q_bshd.shape
    return (q_bshd.new_empty(batch, seq, heads, v_bshd.shape[-1]),
            q_bshd.new_empty(batch, heads, seq, dtype=torch.float32))


def _setup(ctx, inputs, output):
    ctx.save_for_backward(*inputs, *output)  # what a flash kernel keeps: q, k, v, out, log-sum-exp


def _backward(ctx, grad_out, grad_lse):
    q, k, v = ctx.saved_tensors[:3]
    return torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)


_probe_attention_op.register_autograd(_backward, setup_context=_setup)


class _Recorder:
    def __init__(self) -> None:
        self.calls: list[tuple[nn.Module, tuple[int, int, int], CallAsks, bool]] = []
        self.mask_functions: list[Callable | None] = []  # what each mask the model built was asked to keep
        self.windows_said: list[bool] = []  # whether each call passed ``sliding_window`` (None included)


_RECORDER: list[_Recorder] = []


def _probe_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """transformers' attention interface: record the call, return a flash kernel's output shape."""
    if _RECORDER:
        asks = read_call(module, query.shape[-1], scaling, dropout, kwargs)
        _RECORDER[-1].calls.append((module, (query.shape[1], key.shape[1], query.shape[-1]), asks,
                                    attention_mask is not None or key.shape[-2] != query.shape[-2]))
        _RECORDER[-1].windows_said.append("sliding_window" in kwargs)
    q_bshd, k_bshd, v_bshd = (t.transpose(1, 2).contiguous() for t in (query, key, value))
    out, _ = _probe_attention_op(q_bshd, k_bshd, v_bshd)
    return out, None


def _probe_mask(*args, **kwargs):
    if _RECORDER:
        _RECORDER[-1].mask_functions.append(kwargs.get("mask_function"))
    return None  # causal, no padding: the probe forward has one full-length document


def mask_window(mask_function: Callable | None) -> int | None:
    """The sliding window a transformers mask function keeps: the first query position that no longer sees key 0
    (``sliding_window_causal_mask_function(w)`` -> w); None for a causal mask. A part that reads the probe's fake
    tensors (the packed-sequence lookups transformers wraps around the mask: ``and_masks`` of
    ``remap_positions_for_packed_sequence`` and ``packed_sequence_mask_function``) is read through the functions it
    wraps; the narrowest window found counts. An ``or_masks`` combination widens what is seen: not read."""
    if mask_function is None:
        return None
    windows = [w for w in _windows(mask_function, depth=0) if w is not None]
    return min(windows) if windows else None


def _windows(mask_function: Callable, depth: int) -> list[int | None]:
    if depth > 4 or getattr(mask_function, "__qualname__", "").startswith("or_masks."):
        return []
    window = _part_window(mask_function)
    if window is not _UNREAD:
        return [window]
    wrapped = []
    for cell in getattr(mask_function, "__closure__", None) or ():
        value = cell.cell_contents
        wrapped += [v for v in (value if isinstance(value, tuple) else (value,)) if inspect.isfunction(v)]
    return [w for fn in wrapped for w in _windows(fn, depth + 1)]


_UNREAD = object()


def _part_window(mask_function: Callable) -> Any:
    """The window of a mask function evaluated with plain indices, None for causal; _UNREAD where it cannot be."""
    from torch._subclasses.fake_tensor import FakeTensor

    def sees_first_key(q: int) -> bool:
        zero = torch.tensor(0)
        seen = mask_function(zero, zero, torch.tensor(q), zero)
        if isinstance(seen, FakeTensor):
            raise TypeError("reads the probe's fake tensors")
        return bool(seen)

    try:
        if not sees_first_key(0) or sees_first_key(2**30):
            return None
        seen, unseen = 0, 2**30
        while unseen - seen > 1:
            middle = (seen + unseen) // 2
            seen, unseen = (middle, unseen) if sees_first_key(middle) else (seen, middle)
        return unseen
    except Exception:  # noqa: BLE001 - a function of another shape, or one reading the fake tensors
        return _UNREAD


@functools.lru_cache(maxsize=1)
def register() -> None:
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(PROBE_NAME, _probe_attention)
    AttentionMaskInterface.register(PROBE_NAME, _probe_mask)


# ---------------------------------------------------------------------------------------------- the fake model
def uses_attention_interface(module: nn.Module) -> bool:
    """Whether the module's own forward looks its attention function up in transformers' registry."""
    forward = getattr(type(module), "forward", None)
    code = getattr(_unwrap(forward), "__code__", None)
    return code is not None and "ALL_ATTENTION_FUNCTIONS" in code.co_names


def _unwrap(fn):
    import inspect

    try:
        return inspect.unwrap(fn)
    except ValueError:
        return fn


def fake_model(model_cls: type, config, dtype: torch.dtype):
    """(model, mode): ``model_cls`` built from a copy of ``config`` under a FakeTensorMode, in train mode, with the
    probe attention selected."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    register()
    config = copy.deepcopy(config)
    config.use_cache = False
    _static_rope(config)
    can_set = getattr(model_cls, "_can_set_experts_implementation", None)
    if callable(can_set) and can_set() and getattr(config, "_experts_implementation", None) != "grouped_mm":
        # stock's eager experts loop finds the experts each token routes to by nonzero(), a shape fake tensors cannot
        # know: the copy routes through transformers' grouped path, which hf_accel's experts patch runs too
        config._experts_implementation = "grouped_mm"
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    with mode, _quiet(), _no_init(), _no_zero3_init():
        model = model_cls._from_config(config, dtype=dtype).train()
    for module in model.modules():
        sub = getattr(module, "config", None)
        if sub is not None and hasattr(sub, "_attn_implementation_internal"):
            sub._attn_implementation_internal = PROBE_NAME
    return model, mode


def _static_rope(config) -> None:
    """Dynamic RoPE scaling reads the longest position of each forward back to the host to decide its frequencies (a
    value fake tensors do not have); the copy takes the default RoPE, whose tensors have the same shapes."""
    params = getattr(config, "rope_parameters", None)
    if not isinstance(params, dict):
        return
    for entry in [params, *(v for v in params.values() if isinstance(v, dict))]:
        if entry.get("rope_type") == "dynamic":
            entry["rope_type"] = "default"


def _no_init():
    """Weights left as allocated (fake tensors have no values to initialise; some initialisers read them back)."""
    try:
        from transformers.initialization import no_init_weights
    except ImportError:
        return contextlib.nullcontext()
    return no_init_weights()


def _no_zero3_init():
    """The copy built as one process builds it. Under DeepSpeed ZeRO-3 (transformers' ``HfDeepSpeedConfig`` alive),
    ``_from_config`` wraps construction in ``deepspeed.zero.Init``, which broadcasts each new parameter over the
    process group and partitions it into a 1-D placeholder: collectives on fake tensors, and weights the probe's
    forward cannot use (F.embedding: "'weight' must be 2-D"), so every ZeRO-3 run lost its facts. transformers' own
    guard against a nested ``zero.Init`` says one is already running."""
    from transformers import modeling_utils

    return getattr(modeling_utils, "set_zero3_state", contextlib.nullcontext)()


@contextlib.contextmanager
def _quiet() -> Iterator[None]:
    from transformers.utils import logging

    level = logging.get_verbosity()
    logging.set_verbosity_error()
    try:
        yield
    finally:
        logging.set_verbosity(level)


# ---------------------------------------------------------------------------------------------- kernel libraries
class ForeignKernel(RuntimeError):
    """Kernel library code in the model that the probe cannot run on fake tensors and has no stock stand-in for."""


def _stock(fn, what: str):
    stock = foreign.stand_in(fn)
    if stock is None:
        raise ForeignKernel(f"{what} is {foreign.origin(fn)}'s kernel, which cannot run on the probe's fake tensors "
                            "and has no stock stand-in in hf_accel.foreign")
    return stock


@contextlib.contextmanager
def _stock_for_foreign_kernels(model: nn.Module) -> Iterator[None]:
    """Kernel libraries' code in the copy runs its stock stand-in while the probe runs: a module's forward (liger's
    class, bound by ``apply_liger_kernel_to_*()`` before the model was built) and the module-level names the forwards
    read (liger's RoPE in ``modeling_llama``, bound by an earlier ``use_liger_kernel=True`` run). A Triton kernel
    launched on a fake tensor reads its null data pointer: an illegal memory access that poisons the process's CUDA
    context (run 39). Code without a stand-in fails the probe instead (the seam still serves the model)."""
    swapped: list[tuple[dict, str, object]] = []
    try:
        forwards = {}
        for module in model.modules():
            forward = foreign.forward_of(module)
            if foreign.serving(module):
                stock = _stock(forward, f"{type(module).__name__}'s forward")
                module.__dict__["forward"] = types.MethodType(stock, module)  # the copy is the probe's own
            else:
                forwards[id(foreign.function(forward))] = forward
        for forward in forwards.values():
            for name, value in foreign.global_callees(forward):
                if foreign.origin(value) and not isinstance(value, type):
                    module_globals = inspect.unwrap(foreign.function(forward)).__globals__
                    stock = _stock(value, f"{name} (read by {foreign.function(forward).__qualname__})")
                    swapped.append((module_globals, name, value))
                    module_globals[name] = stock
        yield
    finally:
        for module_globals, name, value in reversed(swapped):
            module_globals[name] = value


# ---------------------------------------------------------------------------------------------- one probe forward
def _key(t: torch.Tensor) -> int:
    return StorageWeakRef(t.untyped_storage()).cdata


def _nbytes(t: torch.Tensor) -> int:
    return t.untyped_storage().nbytes()


class _Tally(TorchDispatchMode):
    """Per decoder layer: saved bytes, op-level bytes, inputs, MLP share, and the ops run (for the data flow)."""

    supports_higher_order_operators = True

    def __init__(self, layers: int, params: set[int], save_ops: frozenset):
        super().__init__()
        self.layer: int | None = None
        self.in_mlp = False
        self.params, self.save_ops = params, save_ops
        self.saved, self.op, self.inputs, self.mlp = ([0] * layers for _ in range(4))
        self.seen: set[int] = set()
        self.made_in_mlp: set[int] = set()
        self.ops: list[list[Op]] = [[] for _ in range(layers)]
        self.linear_out: list[dict[int, str]] = [{} for _ in range(layers)]
        self.layer_out: list[int | None] = [None] * layers
        self.held: list[list[torch.Tensor]] = []
        self.outside: list[Op] = []  # the ops outside decoder layers (embeddings, final norm, LM head, after it)
        self.head_out: int | None = None

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        outputs = [t for t in tree_leaves(out) if isinstance(t, torch.Tensor)]
        self.held.append(outputs)  # every storage of the forward stays alive: its identity is never reused
        if self.layer is None:
            inputs = [_key(t) for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
            packet = getattr(func, "overloadpacket", func)
            self.outside.append(Op(packet, inputs, [_key(t) for t in outputs], args, kwargs, outputs))
            return out
        packet = getattr(func, "overloadpacket", func)
        if packet in self.save_ops:
            self.op[self.layer] += sum(_nbytes(t) for t in outputs)
        inputs = [_key(t) for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        keys = [_key(t) for t in outputs]
        if self.in_mlp:  # storages made here (a view's is its input's)
            self.made_in_mlp.update(k for k in keys if k not in inputs)
        self.ops[self.layer].append(Op(packet, inputs, keys, args, kwargs, outputs))
        return out

    def pack(self, t: torch.Tensor):
        self.held.append([t])
        key = _key(t)
        if self.layer is not None and key not in self.params and key not in self.seen:
            self.seen.add(key)
            self.saved[self.layer] += _nbytes(t)
            if self.in_mlp and key in self.made_in_mlp:
                self.mlp[self.layer] += _nbytes(t)
        return None

    @staticmethod
    def unpack(_):
        raise RuntimeError("the facts probe runs a forward only")


def _hooks(model: nn.Module, layers: list[nn.Module], tally: _Tally) -> list:
    handles = []
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if isinstance(head, nn.Module):
        handles.append(head.register_forward_hook(
            lambda m, a, out: setattr(tally, "head_out", _key(out)) if isinstance(out, torch.Tensor) else None))
    for index, layer in enumerate(layers):
        def enter(module, args, kwargs, index=index):
            hidden = args[0] if args else kwargs.get("hidden_states")
            tally.layer = index
            tally.inputs[index] = _nbytes(hidden)

        def leave(module, args, output, index=index):
            first = output[0] if isinstance(output, (tuple, list)) else output
            tally.layer_out[index] = _key(first)
            tally.layer = None

        handles.append(layer.register_forward_pre_hook(enter, with_kwargs=True))
        handles.append(layer.register_forward_hook(leave))
        mlp = getattr(layer, "mlp", None)
        if isinstance(mlp, nn.Module):
            handles.append(mlp.register_forward_pre_hook(lambda *a: setattr(tally, "in_mlp", True)))
            handles.append(mlp.register_forward_hook(lambda *a: setattr(tally, "in_mlp", False)))
        for name, sub in layer.named_modules():
            if isinstance(sub, nn.Linear):
                def record(module, args, output, index=index, name=name):
                    if isinstance(output, torch.Tensor):  # a router subclassing nn.Linear may return a tuple
                        tally.linear_out[index][_key(output)] = name
                handles.append(sub.register_forward_hook(record))
    return handles


@contextlib.contextmanager
def _grouped_experts_on_fake_tensors() -> Iterator[None]:
    """transformers' grouped-GEMM experts through its own fallback op while the probe runs: torch's meta kernel of
    ``_grouped_mm`` takes bf16 only, where the CPU and CUDA kernels take fp32 too (what the experts save is the same
    two matmuls' inputs)."""
    try:
        from transformers.integrations import moe
    except ImportError:
        yield
        return
    can_use = getattr(moe, "_can_use_grouped_mm", None)
    if can_use is None:
        yield
        return
    moe._can_use_grouped_mm = lambda input, weight, offs: weight.dtype == torch.bfloat16 and can_use(input, weight, offs)
    try:
        yield
    finally:
        moe._can_use_grouped_mm = can_use


def _forward(model: nn.Module, mode, layers: list[nn.Module], tokens: int, save_ops: frozenset
             ) -> tuple[_Tally, _Recorder]:
    params = {_key(t) for t in [*model.parameters(), *model.buffers()]}
    tally = _Tally(len(layers), params, save_ops | {torch.ops.hf_accel.probe_attention})
    recorder = _Recorder()
    handles = _hooks(model, layers, tally)
    _RECORDER.append(recorder)
    try:
        with mode, torch.enable_grad(), _grouped_experts_on_fake_tensors(), tally, \
                torch.autograd.graph.saved_tensors_hooks(tally.pack, tally.unpack):
            ids = torch.zeros(1, tokens, dtype=torch.long)
            model(input_ids=ids, use_cache=False)
    finally:
        _RECORDER.pop()
        for handle in handles:
            handle.remove()
    return tally, recorder


# ---------------------------------------------------------------------------------------------- the probe
def _is_linear(module: nn.Module) -> bool:
    """A plain linear map: an nn.Linear (or transformers' Conv1D, GPT-2's linears stored transposed) running its class's
    own forward, what PEFT's LoRA adapts. A subclass with a forward of its own (Llama 4's router, returning scores and
    logits) is left out: LoRA's wrapper would take its output for a tensor."""
    from transformers.pytorch_utils import Conv1D

    for base in (nn.Linear, Conv1D):
        if isinstance(module, base):
            return type(module).forward is base.forward
    return False


def lora_targets(model: nn.Module) -> tuple[str, ...]:
    """The last names of the model's plain linear maps but its LM head, in order: what PEFT's
    ``target_modules="all-linear"`` adapts, less any linear subclass with a forward of its own."""
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    return tuple(dict.fromkeys(name.rsplit(".", 1)[-1] for name, m in model.named_modules()
                               if _is_linear(m) and m is not head))


def decoder_layers(model: nn.Module) -> list[nn.Module]:
    from transformers.modeling_layers import GradientCheckpointingLayer

    return [m for m in model.modules() if isinstance(m, GradientCheckpointingLayer)]


def probe_config(model_cls: type, config, dtype: torch.dtype = torch.bfloat16,
                 prepare_copy: Callable[[nn.Module], None] | None = None) -> Probed:
    """The facts of ``model_cls`` built from ``config`` with weights (and activations) in ``dtype``; ``prepare_copy``
    runs on the fake-tensor copy first (what patch() does to it beyond the attention seam)."""
    from ..memory.targets import default_save_ops

    model, mode = fake_model(model_cls, config, dtype)
    if prepare_copy is not None:
        with mode:
            prepare_copy(model)
    layers = decoder_layers(model)
    names = {id(m): n for n, m in model.named_modules()}
    index_of = {id(layer): i for i, layer in enumerate(layers)}
    layer_of = {}
    for layer in layers:
        for sub in layer.modules():
            layer_of[id(sub)] = index_of[id(layer)]
    save_ops = default_save_ops()
    with _stock_for_foreign_kernels(model):  # around both forwards: modules bound once, globals restored after
        (short, _), (long, recorder) = (_forward(model, mode, layers, t, save_ops) for t in TOKENS)
    span = TOKENS[1] - TOKENS[0]

    def per_token(a: list[int], b: list[int]) -> list[float]:
        return [(y - x) / span for x, y in zip(a, b)]

    saves = tuple(LayerSaves(*figures) for figures in zip(
        per_token(short.saved, long.saved),
        per_token([i + o for i, o in zip(short.inputs, short.op)], [i + o for i, o in zip(long.inputs, long.op)]),
        per_token(short.inputs, long.inputs),
        per_token(short.mlp, long.mlp)))
    calls = tuple(ProbedCall(names.get(id(module), ""), layer_of.get(id(module)), heads, asks, own_mask)
                  for module, heads, asks, own_mask in recorder.calls)
    projections = output_projections(long.ops, long.linear_out, long.layer_out)
    classes = tuple(dict.fromkeys(type(m) for m in model.modules() if uses_attention_interface(m)))
    linears = lora_targets(model)
    softcap = bool(getattr(config, "final_logit_softcapping", None))
    return Probed(calls, saves, projections, classes, linears, _mlp_width(layers),
                  plain_head(long.outside, long.head_out, softcap),
                  tuple(mask_window(fn) for fn in recorder.mask_functions),
                  bool(recorder.windows_said) and all(recorder.windows_said))


def _mlp_width(layers: list[nn.Module]) -> int | None:
    """The widest linear inside a decoder layer's ``mlp`` (the intermediate a chunked MLP holds), None where an MLP
    holds experts (3-D weights) or there is none."""
    widths = []
    for layer in layers:
        mlp = getattr(layer, "mlp", None)
        if not isinstance(mlp, nn.Module) or any(p.ndim > 2 for p in mlp.parameters()):
            return None
        widths += [m.out_features if isinstance(m, nn.Linear) else m.nf for m in mlp.modules() if _is_linear(m)]
    return max(widths) if widths else None
