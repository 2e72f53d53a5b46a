"""Checkpointing under a memory budget: measure what each decoder layer keeps, then plan per-layer choices.

- `probe_layer_activations(model, batch)`: one forward on a real batch, counting the bytes autograd saves per
  decoder layer (`saved_tensors_hooks`) and what op-level / full checkpointing would keep instead; layers of one
  kind save alike, so it runs two of each kind and passes the hidden states through the rest.
- `layer_backward_bytes(model, batch, layer)`: what one layer's backward makes on top of its saved tensors (the
  gradients of its intermediates), which every plan adds to each layer's backward.
- `live_activation_bytes(model, batch)`: every storage a forward leaves alive (the reference for policies' claims).
- The planner itself (`plan_checkpointing`, `plan_peak_bytes`, `longest_feasible_tokens`), pure functions of
  per-layer sizes, lives in `planner` and is re-exported here.
"""
from __future__ import annotations

import contextlib
import itertools
from dataclasses import dataclass, fields
from typing import Sequence

import torch
from torch import nn
from torch.multiprocessing.reductions import StorageWeakRef  # loaded by `import torch` already
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from .layer_kinds import calls_wrapped, kind_ids, passing_through
from .planner import (CHECKPOINTED, DEVICE_MODES, RECOMPUTE_COST, RECOMPUTE_COST_COMPILED,  # noqa: F401 (re-exported)
                      CheckpointPlan, GradientBytes, LayerActivation, format_bytes, layer_peaks,
                      longest_feasible_tokens, parse_bytes, peak_terms, plan_checkpointing, plan_cost,
                      plan_peak_bytes)


# ----------------------------------------------------------------------------------------------- measurement
def _storage_key(t: torch.Tensor) -> tuple[int, int]:
    storage = t.untyped_storage()
    return storage.data_ptr(), storage.nbytes()


def _own_storage(t: torch.Tensor) -> tuple[int, int] | None:
    """``_storage_key``, or None for a wrapper subclass with no storage of its own (torchao's float8 tensors): its
    inner tensors are counted where they are made."""
    try:
        return _storage_key(t)
    except RuntimeError:
        return None


@dataclass(frozen=True)
class Probe:
    """What one probe forward measured: per decoder layer bytes, and the peak of what the forward allocates after
    the last layer (final norm, LM head and loss: the full logits of the stock loss, or a fused loss's chunk and
    gradient buffers) that is alive at once."""

    layers: list[LayerActivation]
    tail_peak_bytes: int


def probe_layer_activations(model: nn.Module, batch: dict, layers: Sequence[nn.Module] | None = None,
                            save_ops: frozenset | None = None) -> list[LayerActivation]:
    """One forward (train mode, no checkpointing) on `batch`; per decoder layer the bytes it would keep.

    none: storages autograd saves inside the layer (`saved_tensors_hooks`, each storage counted once, parameters
    excluded); op: the layer's input plus the outputs of the ops op-level checkpointing saves; full: its input.
    """
    return probe_training_memory(model, batch, layers, save_ops).layers


def probe_training_memory(model: nn.Module, batch: dict, layers: Sequence[nn.Module] | None = None,
                          save_ops: frozenset | None = None, compiled: bool = False, backward: bool = True,
                          every_layer: bool = False) -> Probe:
    """``probe_layer_activations`` plus the loss tail's peak (see ``Probe``), from the same forward, run eagerly
    (``torch.compiler.set_stance("force_eager")``).

    compiled: the decoder layers are bound to compiled training calls (patch(compile=...)). A second forward then
    runs them as bound and counts what their compiled graphs save (inductor's partitioner keeps less than the eager
    ops: eager-probed plans for compiled layers over-predicted GPU peaks by several GiB). That becomes each
    layer's no-checkpointing (and recompute) bytes; op-level layers, which run eagerly, keep the eager figures.

    backward: also measure what one layer's backward makes on top of its saved tensors (``layer_backward_bytes``);
    False counts the gradients of each layer's input and output only (twice its input: a lower bound of that; for a
    sharded model, whose layer backward alone would start its collectives).

    Layers alike in every respect, their inputs included (``layer_kinds.passing_through``), save alike: the forwards
    run the first two of each kind and pass the hidden states through the others, whose figures are the second
    one's (the first may also hold what the model hands every layer, such as rotary tables). At long context that is
    most of the probe's time (Llama-3-8B at 344k tokens: two forwards of ~60 s each on an H200). ``every_layer``:
    run them all."""
    from .targets import decoder_layers, default_save_ops

    layers = list(layers if layers is not None else decoder_layers(model))
    kinds = list(range(len(layers))) if every_layer else kind_ids(layers)
    stands_for = list(range(len(layers)))  # filled in by the forward (passing_through)
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    counter = _SavedBytes(len(layers), params)
    tally = _ForwardTally(counter, save_ops if save_ops is not None else default_save_ops(), params)
    handles = []
    try:
        for i, layer in enumerate(layers):
            handles.append(layer.register_forward_pre_hook(tally.entering(i), with_kwargs=True))
            handles.append(layer.register_forward_hook(tally.leave))
        with passing_through(layers, kinds, stands_for, lambda i: tally.leave()), torch.enable_grad(), \
                counter.hooks(), tally, torch.compiler.set_stance("force_eager"):
            out = model(**batch)
        del out
    finally:
        for handle in handles:
            handle.remove()

    def each(figures: list[int]) -> list[int]:
        return [figures[j] for j in stands_for]

    op_out, inputs, tail_peak = each(tally.op_out), each(tally.inputs), tally.tail_peak
    saved = each(counter.saved)
    measured = layer_backward_bytes(model, batch, layers[0], compiled) if layers and backward else None
    backwards = [2 * i if measured is None else measured for i in inputs]
    if not compiled:
        return Probe([LayerActivation(s, i + o, i, backward_bytes=w)
                      for s, o, i, w in zip(saved, op_out, inputs, backwards)], tail_peak)
    bound = each(_bound_saved_bytes(model, batch, layers, params, kinds))
    return Probe([LayerActivation(b, i + o, i, eager_none_bytes=s, backward_bytes=w)
                  for b, s, o, i, w in zip(bound, saved, op_out, inputs, backwards)], tail_peak)


class _Measured(Exception):
    """Ends the model forward once the measured layer has been called (nothing after it is needed)."""


def layer_backward_bytes(model: nn.Module, batch: dict, layer: nn.Module, compiled: bool = False) -> int:
    """What one decoder layer's backward allocates on top of the tensors its forward saved: the gradients of its
    intermediates (an MLP's two intermediate-sized ones, attention's), of its input, and the incoming gradient of its
    output. Measured on ``layer`` with ``batch``'s input to it (the model's forward up to that layer, then one forward
    and backward of the layer alone, as bound: compiled layers through their graphs); every decoder layer of a
    model has the same shapes, so one stands for all.

    On CUDA the allocator's high-water mark over the backward (net of what the backward frees); elsewhere the
    storages the backward creates, counted at each op (``_LiveBytes``). Gradients of the layer's own parameters are
    left out (they are the training state's): the eager backward is asked for the input's gradient only, and a
    compiled one, which makes every gradient in one graph, has its layer's trainable bytes subtracted.
    """
    measured: list[int] = []

    def measuring(index: int, layer: nn.Module, call):
        def measure(*args, **kwargs):
            hidden = args[0] if args else kwargs["hidden_states"]
            x = hidden.detach().requires_grad_(True)
            args, kwargs = ((x, *args[1:]), kwargs) if args else (args, {**kwargs, "hidden_states": x})
            on_cuda = x.device.type == "cuda"
            kept: dict[int, tuple[StorageWeakRef, int]] = {}  # what the forward saved (off CUDA: to credit its frees)

            def pack(t):
                key = _own_storage(t)
                if key is not None:
                    kept.setdefault(key[0], (StorageWeakRef(t.untyped_storage()), key[1]))
                return t

            saving = (contextlib.nullcontext() if on_cuda
                      else torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t))
            with _uncached_autocast(x.device.type), saving:
                out = call(*args, **kwargs)  # as bound: a compiled layer through its graph
            y = out[0] if isinstance(out, (tuple, list)) else out
            grad = torch.ones_like(y)
            if on_cuda:
                torch.cuda.synchronize(y.device)
                before = torch.cuda.memory_allocated(y.device)
                torch.cuda.reset_peak_memory_stats(y.device)
                torch.autograd.backward(y, grad, inputs=[x])
                torch.cuda.synchronize(y.device)
                made = torch.cuda.max_memory_allocated(y.device) - before
            else:
                with _LiveBytes(credit=kept) as live:
                    torch.autograd.backward(y, grad, inputs=[x])
                made = live.peak
            if compiled:
                made -= sum(p.numel() * p.element_size() for p in layer.parameters() if p.requires_grad)
            measured.append(max(made, 0) + grad.untyped_storage().nbytes())
            raise _Measured
        return measure

    try:
        with calls_wrapped([layer], measuring), torch.enable_grad():
            model(**batch)
    except _Measured:
        pass
    return measured[0] if measured else 0


def _uncached_autocast(device_type: str):
    """Off CUDA, the autocast in effect (if any) without its cast cache, so that the storages counted do not depend on
    what an earlier forward cached. On CUDA the allocator measures net of what is cached, and the compiled layers'
    guards would see another autocast state (a recompile): left as it is."""
    if device_type == "cuda" or not torch.is_autocast_enabled(device_type):
        return contextlib.nullcontext()
    return torch.autocast(device_type, dtype=torch.get_autocast_dtype(device_type), cache_enabled=False)


class _LiveBytes:
    """The most bytes of storages created inside it alive at once, checked at each op (a dispatch mode), less what
    of ``credit`` (storages alive on entry: ptr -> (weak reference, bytes)) has been freed by then."""

    def __init__(self, credit: dict[int, tuple[StorageWeakRef, int]] | None = None):
        self.credit = dict(credit or {})

    def __enter__(self):
        refs: dict[int, tuple[StorageWeakRef, int]] = {}
        outer = self
        self.peak = 0

        class Track(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                out = func(*args, **(kwargs or {}))
                for t in tree_leaves(out):
                    key = _own_storage(t) if isinstance(t, torch.Tensor) else None
                    if key is not None and (key[0] not in refs or refs[key[0]][0].expired()):
                        refs[key[0]] = (StorageWeakRef(t.untyped_storage()), key[1])
                credit = outer.credit
                freed = sum(n for ref, n in credit.values() if ref.expired())
                # a storage at a credited address is that credited storage while it lives, a new one after its free
                made = sum(n for ptr, (ref, n) in refs.items()
                           if not ref.expired() and (ptr not in credit or credit[ptr][0].expired()))
                outer.peak = max(outer.peak, made - freed)
                return out

        self._mode = Track()
        self._mode.__enter__()
        return self

    def __exit__(self, *exc):
        return self._mode.__exit__(*exc)


class _ForwardTally(TorchDispatchMode):
    """What the probe's forward counts besides autograd's saved tensors (``_SavedBytes``): per decoder layer its
    input's bytes and the outputs of the ops op-level checkpointing saves (``save_ops``); after the last layer, the
    peak of the storages the loss tail allocates and still holds (``tail_peak``). Layers report in through the hooks
    ``entering(i)`` (a forward pre-hook) and ``leave`` (a forward hook)."""

    # Higher-order operators (FlexAttention's flex_attention, the flex backend's kernel) pass through here too and
    # run as themselves, their outputs counted like an op's; without this the mode refused them.
    supports_higher_order_operators = True

    def __init__(self, counter: "_SavedBytes", save_ops: frozenset, params: set[int]):
        super().__init__()
        self.counter, self.save_ops, self.params = counter, save_ops, params
        layers = len(counter.saved)
        self.op_out, self.inputs = [0] * layers, [0] * layers
        self.left = 0  # decoder layers the forward has left
        self.tail: dict[int, tuple[StorageWeakRef, int]] = {}  # storages allocated after the last layer
        self.tail_peak = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        tensors = [t for t in tree_leaves(out) if isinstance(t, torch.Tensor)]
        layer = self.counter.layer
        if layer is not None and getattr(func, "overloadpacket", func) in self.save_ops:
            self.op_out[layer] += sum(_storage_key(t)[1] for t in tensors)
        if layer is None and self.left == len(self.inputs):
            for t in tensors:
                ptr, nbytes = _storage_key(t)
                known = self.tail.get(ptr)
                if ptr not in self.params and (known is None or known[0].expired()):
                    self.tail[ptr] = (StorageWeakRef(t.untyped_storage()), nbytes)
            self.tail_peak = max(self.tail_peak, sum(n for ref, n in self.tail.values() if not ref.expired()))
        return out

    def entering(self, index: int):
        def hook(module, args, kwargs):
            hidden = args[0] if args else kwargs.get("hidden_states")
            self.inputs[index] = hidden.untyped_storage().nbytes()
            self.counter.layer = index
        return hook

    def leave(self, *_):
        self.counter.layer = None
        self.left += 1


class _SavedBytes:
    """Saved-tensor hooks that count the bytes autograd saves per decoder layer (`layer`: the one running, or None)
    and keep nothing: each storage counted once (an address freed and reused counts again), parameters excluded."""

    def __init__(self, layers: int, params: set[int]):
        self.saved = [0] * layers
        self.layer: int | None = None
        self._params = params
        self._seen: dict[int, StorageWeakRef] = {}

    def pack(self, t: torch.Tensor) -> None:
        ptr, nbytes = _storage_key(t)
        known = self._seen.get(ptr)
        if self.layer is not None and ptr not in self._params and (known is None or known.expired()):
            self._seen[ptr] = StorageWeakRef(t.untyped_storage())
            self.saved[self.layer] += nbytes
        # Only the size is kept: no backward runs on a probe, so autograd need not hold the tensor, and the probe's
        # peak stays at about one layer's transient memory (a 16k-token Llama-8B forward keeping everything would
        # not fit on one GPU). Handing back `t` itself also tied saved outputs to their own grad_fn in a cycle
        # Python's collector cannot break, so the whole probe graph stayed allocated for the rest of training.
        return None

    @staticmethod
    def unpack(_):
        raise RuntimeError("the memory probe runs a forward only; its graph cannot be back-propagated")

    def hooks(self):
        return torch.autograd.graph.saved_tensors_hooks(self.pack, self.unpack)


def _bound_saved_bytes(model: nn.Module, batch: dict, layers: Sequence[nn.Module], params: set[int],
                       kinds: Sequence[int]) -> list[int]:
    """Per decoder layer, the bytes autograd saves when the layers run as bound (compiled ones through their graphs);
    the layers another stands for pass their input through (``layer_kinds.passing_through``: 0 here).

    Each layer's call slot is wrapped for the forward (``layer_kinds.calls_wrapped``) so saved tensors are attributed to the
    layer running.
    """
    counter = _SavedBytes(len(layers), params)

    def attributed(index: int, layer: nn.Module, call):
        def run(*args, **kwargs):
            counter.layer = index
            try:
                return call(*args, **kwargs)
            finally:
                counter.layer = None
        return run

    with calls_wrapped(layers, attributed), passing_through(layers, kinds, list(range(len(layers)))), \
            torch.enable_grad(), counter.hooks():
        out = model(**batch)
    del out
    return counter.saved


def live_activation_bytes(model: nn.Module, batch: dict) -> int:
    """Bytes of every storage created during `model(**batch)` and still alive after it, the output excluded.

    Sees through checkpointing (inputs a checkpoint keeps, op-level caches), which saved-tensor hooks cannot: inside
    a checkpoint torch's own hooks replace ours. The reference the policies' memory claims are tested against.
    """
    before = {p.untyped_storage().data_ptr() for p in itertools.chain(model.parameters(), model.buffers())}
    refs: dict[int, tuple[StorageWeakRef, int]] = {}

    class Track(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            for t in tree_leaves(out):
                if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() not in before:
                    ref = StorageWeakRef(t.untyped_storage())
                    refs.setdefault(ref.cdata, (ref, t.untyped_storage().nbytes()))
            return out

    with torch.enable_grad(), Track():
        out = model(**batch)
    total = sum(n for ref, n in refs.values() if not ref.expired())
    return total - sum(t.untyped_storage().nbytes() for t in out.values() if isinstance(t, torch.Tensor))


def affine_between(a: tuple, b: tuple):
    """The sizes of two probes (tokens, plan.Probe) as affine functions of the tokens: each layer's figures and the
    loss tail through both points (at least 0; nothing at 0 tokens)."""
    (ta, pa), (tb, pb) = a, b

    def at(t: int, fa: int | None, fb: int | None) -> int | None:
        if fa is None or fb is None:
            return None
        return 0 if t == 0 else max(fb + (fa - fb) * (t - tb) // (ta - tb), 0)

    def layers_at(t: int) -> list:
        return [LayerActivation(**{f.name: at(t, getattr(la, f.name), getattr(lb, f.name))
                                   for f in fields(LayerActivation)})
                for la, lb in zip(pa.layers, pb.layers)]

    return layers_at, lambda t: at(t, pa.tail_peak_bytes, pb.tail_peak_bytes)
