"""Checkpointing under a memory budget: measure what each decoder layer keeps, then plan per-layer choices.

- `probe_layer_activations(model, batch)`: one forward on a real batch, counting the bytes autograd saves per
  decoder layer (`saved_tensors_hooks`) and what op-level / full checkpointing would keep instead.
- `live_activation_bytes(model, batch)`: every storage a forward leaves alive (the reference for policies' claims).
- `plan_checkpointing(layers, fixed_bytes=, budget_bytes=)`: a pure function choosing the least recompute that fits.
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Sequence

import torch
from torch import nn
from torch.multiprocessing.reductions import StorageWeakRef  # loaded by `import torch` already

from .spec import parse_bytes  # noqa: F401 (plan.parse_bytes, as before)

_GIB = 1024**3

# Recompute cost of one decoder layer, in units of that layer's forward. Op-level recomputes only element-wise ops
# (norms, rotary, activation function): no FLOPs to speak of, memory-bound, roughly a tenth of a layer's forward.
RECOMPUTE_COST = {"none": 0.0, "op": 0.1, "full": 1.0, "offload": 1.1}
# "offload" (full checkpointing with the saved input in host memory, memory.offload) keeps nothing on the device; its
# copies overlap compute, so it costs a little more than "full" only so that plans prefer "full" wherever that fits.
# plan_checkpointing considers it only when asked (modes=...); MemoryBudget asks on CUDA (its `offload`).
DEVICE_MODES = ("none", "op", "full")
# With compiled layers (patch(compile=...)), an op-level layer also runs eagerly: its selective-checkpoint policy must
# see each op, so it leaves the compiled path, and then costs about half a layer forward rather than a tenth
# (the calibration run: benchmarks/other-measurements.md, "a 24 GiB budget").
RECOMPUTE_COST_COMPILED = {**RECOMPUTE_COST, "op": 0.5}


def format_bytes(n: float) -> str:
    return f"{n / _GIB:.2f} GiB" if abs(n) >= _GIB / 10 else f"{n / 1024**2:.1f} MiB"


# ----------------------------------------------------------------------------------------------- the planner
@dataclass(frozen=True)
class LayerActivation:
    """Bytes one decoder layer keeps from forward to backward under each choice (measured or estimated)."""

    none_bytes: int
    op_bytes: int
    full_bytes: int
    # What the layer saves when it runs eagerly, where that differs from none_bytes (measured through compiled
    # layers): an op-level layer leaves the compiled path, so its backward rebuilds the eager set. None: none_bytes.
    eager_none_bytes: int | None = None

    def retained(self, choice: str) -> int:
        return {"none": self.none_bytes, "op": self.op_bytes, "full": self.full_bytes, "offload": 0}[choice]

    def rebuilt(self, choice: str) -> int:
        """Bytes the layer's backward rebuilds on top of what it retained (a recompute brings back the rest)."""
        whole = self.eager_none_bytes if choice == "op" and self.eager_none_bytes is not None else self.none_bytes
        return max(whole - self.retained(choice), 0)


@dataclass(frozen=True)
class CheckpointPlan:
    """Per-layer choices with their predicted peak; `fits` is False when even full checkpointing is over budget."""

    choices: tuple[str, ...]
    predicted_peak_bytes: int
    budget_bytes: int
    fixed_bytes: int
    recompute_cost: float
    fits: bool
    host_bytes: int = 0  # offloaded layers' saved inputs, held in (pinned) host memory between forward and backward
    freed_grad_bytes: int | None = None  # gradients freed before each forward (not in fixed_bytes); None: in it

    def table(self) -> str:
        full = [i for i, c in enumerate(self.choices) if c == "full"]
        op = [i for i, c in enumerate(self.choices) if c == "op"]
        return "\n".join([
            "| item | value |", "|---|---|",
            f"| full checkpointing | {len(full)} layers {full} |",
            f"| op-level checkpointing | {len(op)} layers {op} |",
            f"| no checkpointing | {self.choices.count('none')} layers |",
            *([f"| offloaded checkpointing | {self.choices.count('offload')} layers, "
               f"{format_bytes(self.host_bytes)} of host memory |"] if "offload" in self.choices else []),
            f"| recompute (layer forwards) | {self.recompute_cost:.1f} |",
            *([f"| fixed (params, grads, optimizer) | {format_bytes(self.fixed_bytes)} |"]
              if self.freed_grad_bytes is None else
              [f"| fixed (params, optimizer) | {format_bytes(self.fixed_bytes)} |",
               f"| gradients (freed before each forward) | {format_bytes(self.freed_grad_bytes)} |"]),
            f"| predicted peak | {format_bytes(self.predicted_peak_bytes)} |",
            f"| budget | {format_bytes(self.budget_bytes)}{'' if self.fits else ' (does NOT fit)'} |",
        ])


@dataclass(frozen=True)
class GradientBytes:
    """Gradient bytes per decoder layer (in the order of the probed layers) and outside them (embeddings, head,
    final norm), for a training loop that frees gradients before each forward (see ``plan_peak_bytes``)."""

    per_layer: tuple[int, ...]
    other: int

    @property
    def total(self) -> int:
        return sum(self.per_layer) + self.other


def plan_peak_bytes(layers: Sequence[LayerActivation], choices: Sequence[str], fixed_bytes: int,
                    extra_bytes: int = 0, grads: GradientBytes | None = None) -> int:
    """Peak = fixed + every layer's retained activations + the largest one recomputed layer rebuilds in backward.

    grads: the loop frees gradients before each forward (one micro-batch per optimizer step, ``zero_grad(
    set_to_none=True)``), and ``fixed_bytes`` holds no gradients. Gradients then never meet the whole forward's
    activations: backward makes them top layer first while it frees that layer's activations. The peak is the larger
    of the forward's end (with the head's and embeddings' gradients, which the loss may make early) and each layer's
    backward (the activations of the layers below, this layer's retained and rebuilt bytes, the gradients of this layer
    and those above). Never above the figure without ``grads``, which counts every gradient on top of everything."""
    retained = [layer.retained(c) for layer, c in zip(layers, choices)]
    rebuilt = [layer.rebuilt(c) for layer, c in zip(layers, choices)]
    forward_end = extra_bytes + sum(retained) + max(rebuilt, default=0)
    if grads is None:
        return fixed_bytes + forward_end
    if len(grads.per_layer) != len(retained):
        raise ValueError(f"{len(grads.per_layer)} layers of gradient bytes for {len(retained)} probed layers")
    below = list(itertools.accumulate(retained, initial=0))  # activations of the layers under layer j
    above = list(itertools.accumulate(reversed(grads.per_layer), initial=0))[::-1]  # gradients of layers j and up
    backward = max((below[j] + retained[j] + rebuilt[j] + above[j] for j in range(len(retained))), default=0)
    return fixed_bytes + grads.other + max(forward_end, backward)


def plan_cost(choices: Sequence[str], costs: dict[str, float] = RECOMPUTE_COST) -> float:
    return sum(costs[c] for c in choices)


def plan_checkpointing(layers: Sequence[LayerActivation], *, fixed_bytes: int, budget_bytes: int,
                       extra_bytes: int = 0, modes: Sequence[str] = DEVICE_MODES,
                       costs: dict[str, float] = RECOMPUTE_COST, grads: GradientBytes | None = None) -> CheckpointPlan:
    """The least-recompute per-layer choice whose predicted peak fits `budget_bytes` (pure function, exact).

    For each cap on the bytes one recomputed layer rebuilds, a knapsack over layers (cost in tenths of a layer
    forward) finds the least retained memory per total cost; the cheapest fitting plan wins, ties to the lower
    peak. When nothing fits, the plan with the lowest peak is returned with fits=False. `modes`: the choices to
    consider (add "offload" to let layers keep their input in host memory). `costs`: recompute per choice, in layer
    forwards (RECOMPUTE_COST_COMPILED where the layers are compiled). `grads`: gradients freed before each forward
    (see plan_peak_bytes; `fixed_bytes` then holds none). Each candidate's peak is then exact, but the candidates are
    still the least-retained plans per cost, so the cheapest fitting plan is exact only while the forward's end is
    the peak (a full fine-tune's usual case: the gradients of one layer are far below its activations).
    """
    units = {c: round(costs[c] * 10) for c in modes}
    caps = sorted({layer.rebuilt(c) for layer in layers for c in units})
    best_fit, best_any = None, None
    for cap in caps or [0]:
        table: dict[int, tuple[int, tuple[str, ...]]] = {0: (0, ())}  # total cost -> (least retained, choices)
        for layer in layers:
            grown: dict[int, tuple[int, tuple[str, ...]]] = {}
            for cost, (retained, choices) in table.items():
                for c, unit in units.items():
                    if layer.rebuilt(c) > cap:
                        continue
                    entry = (retained + layer.retained(c), choices + (c,))
                    if cost + unit not in grown or entry[0] < grown[cost + unit][0]:
                        grown[cost + unit] = entry
            table = grown
        for cost, (_, choices) in table.items():
            peak = plan_peak_bytes(layers, choices, fixed_bytes, extra_bytes, grads)
            if peak <= budget_bytes and (best_fit is None or (cost, peak) < best_fit[:2]):
                best_fit = (cost, peak, choices)
            if best_any is None or (peak, cost) < best_any[:2]:
                best_any = (peak, cost, choices)
    choices = best_fit[2] if best_fit else best_any[2]
    peak = plan_peak_bytes(layers, choices, fixed_bytes, extra_bytes, grads)
    host = sum(layer.full_bytes for layer, c in zip(layers, choices) if c == "offload")
    return CheckpointPlan(tuple(choices), peak, budget_bytes, fixed_bytes, plan_cost(choices, costs),
                          best_fit is not None, host, None if grads is None else grads.total)


# ----------------------------------------------------------------------------------------------- measurement
def _storage_key(t: torch.Tensor) -> tuple[int, int]:
    storage = t.untyped_storage()
    return storage.data_ptr(), storage.nbytes()


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
                          save_ops: frozenset | None = None, compiled: bool = False) -> Probe:
    """``probe_layer_activations`` plus the loss tail's peak (see ``Probe``), from the same forward, run eagerly
    (``torch.compiler.set_stance("force_eager")``).

    compiled: the decoder layers are bound to compiled training calls (patch(compile=...)). A second forward then
    runs them as bound and counts what their compiled graphs save (inductor's partitioner keeps less than the eager
    ops: eager-probed plans for compiled layers over-predicted GPU peaks by several GiB). That becomes each
    layer's no-checkpointing (and recompute) bytes; op-level layers, which run eagerly, keep the eager figures."""
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_leaves

    from .targets import decoder_layers, default_save_ops

    layers = list(layers if layers is not None else decoder_layers(model))
    save_ops = save_ops if save_ops is not None else default_save_ops()
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    counter = _SavedBytes(len(layers), params)
    op_out = [0] * len(layers)
    inputs = [0] * len(layers)

    left = [0]  # decoder layers the forward has left
    tail: dict[int, tuple[StorageWeakRef, int]] = {}  # storages allocated after the last layer
    tail_peak = [0]

    class SaveableOutputs(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            tensors = [t for t in tree_leaves(out) if isinstance(t, torch.Tensor)]
            if counter.layer is not None and func.overloadpacket in save_ops:
                op_out[counter.layer] += sum(_storage_key(t)[1] for t in tensors)
            if counter.layer is None and left[0] == len(layers):
                for t in tensors:
                    ptr, nbytes = _storage_key(t)
                    known = tail.get(ptr)
                    if ptr not in params and (known is None or known[0].expired()):
                        tail[ptr] = (StorageWeakRef(t.untyped_storage()), nbytes)
                live = sum(n for ref, n in tail.values() if not ref.expired())
                tail_peak[0] = max(tail_peak[0], live)
            return out

    def enter(index):
        def hook(module, args, kwargs):
            hidden = args[0] if args else kwargs.get("hidden_states")
            inputs[index] = hidden.untyped_storage().nbytes()
            counter.layer = index
        return hook

    def leave(module, args, output):
        counter.layer = None
        left[0] += 1

    flags = [layer.gradient_checkpointing for layer in layers]
    handles = []
    try:
        for i, layer in enumerate(layers):
            layer.gradient_checkpointing = False
            handles.append(layer.register_forward_pre_hook(enter(i), with_kwargs=True))
            handles.append(layer.register_forward_hook(leave))
        with torch.enable_grad(), counter.hooks(), SaveableOutputs(), torch.compiler.set_stance("force_eager"):
            out = model(**batch)
        del out
    finally:
        for handle in handles:
            handle.remove()
        for layer, flag in zip(layers, flags):
            layer.gradient_checkpointing = flag
    saved = counter.saved
    if not compiled:
        return Probe([LayerActivation(s, i + o, i) for s, o, i in zip(saved, op_out, inputs)], tail_peak[0])
    bound = _bound_saved_bytes(model, batch, layers, params)
    return Probe([LayerActivation(b, i + o, i, eager_none_bytes=s)
                  for b, s, o, i in zip(bound, saved, op_out, inputs)], tail_peak[0])


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


def _bound_saved_bytes(model: nn.Module, batch: dict, layers: Sequence[nn.Module], params: set[int]) -> list[int]:
    """Per decoder layer, the bytes autograd saves when the layers run as bound (compiled ones through their graphs).

    Each layer's call slot is wrapped for the forward so saved tensors are attributed to the layer running (module
    hooks would run inside the compiled region); every slot is restored exactly afterwards.
    """
    from .targets import CALL_SLOT

    counter = _SavedBytes(len(layers), params)
    missing = object()
    previous = [layer.__dict__.get(CALL_SLOT, missing) for layer in layers]

    def attributed(index: int, layer: nn.Module, call):
        def run(*args, **kwargs):
            counter.layer = index
            try:
                return (call or layer._call_impl)(*args, **kwargs)
            finally:
                counter.layer = None
        return run

    flags = [layer.gradient_checkpointing for layer in layers]
    try:
        for i, (layer, call) in enumerate(zip(layers, previous)):
            layer.gradient_checkpointing = False
            layer.__dict__[CALL_SLOT] = attributed(i, layer, None if call is missing else call)
        with torch.enable_grad(), counter.hooks():
            out = model(**batch)
        del out
    finally:
        for layer, call, flag in zip(layers, previous, flags):
            if call is missing:
                layer.__dict__.pop(CALL_SLOT, None)
            else:
                layer.__dict__[CALL_SLOT] = call
            layer.gradient_checkpointing = flag
    return counter.saved


def live_activation_bytes(model: nn.Module, batch: dict) -> int:
    """Bytes of every storage created during `model(**batch)` and still alive after it, the output excluded.

    Sees through checkpointing (inputs a checkpoint keeps, op-level caches), which saved-tensor hooks cannot: inside
    a checkpoint torch's own hooks replace ours. The reference the policies' memory claims are tested against.
    """
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_leaves

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
