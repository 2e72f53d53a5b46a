"""Planning checkpointing under a memory budget: pure functions of per-layer sizes (no model, no torch).

Each decoder layer gets one choice; what it keeps from forward to backward, on the device and in host memory:

- "none": everything autograd saves; "op": matmul / attention outputs plus its input (op-level checkpointing);
- "full": its input (on the device); "offload": its input, in pinned host memory (``memory.offload``);
- "spaced": nothing: its input is rebuilt in backward by re-running the layers below it from the nearest layer that
  kept one ("full" or "offload"), as a checkpoint spanning those layers would (``memory.spacing``). A span of k
  layers keeps one input instead of k, at one more layer forward per spaced layer.

`plan_checkpointing` finds the least recompute whose predicted device peak fits the device budget and whose host
copies fit the host budget (exact, on the peak model of `plan_peak_bytes`); `longest_feasible_tokens` how long a
document the budgets could hold, with every size scaled linearly in tokens (activations are, with flash-style
attention).
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Callable, Sequence

from .spec import parse_bytes  # noqa: F401 (re-exported: the spec parser, torch-free)

_GIB = 1024**3

# Recompute cost of one decoder layer, in units of that layer's forward. Op-level recomputes only element-wise ops
# (norms, rotary, activation function): no FLOPs to speak of, memory-bound, roughly a tenth of a layer's forward.
# "offload" (full checkpointing with the saved input in host memory) keeps nothing on the device; its copies overlap
# compute, so it costs a little more than "full" only so that plans prefer "full" wherever that fits. "spaced" runs
# the layer below once more (to rebuild its input) besides its own recompute: plans space layers only where the
# inputs fit neither the device nor the host.
RECOMPUTE_COST = {"none": 0.0, "op": 0.1, "full": 1.0, "offload": 1.1, "spaced": 2.0}
DEVICE_MODES = ("none", "op", "full")
CHECKPOINTED = ("full", "offload", "spaced")  # what a "spaced" layer may follow (its span starts at a kept input)
# With compiled layers (patch(compile=...)), an op-level layer also runs eagerly: its selective-checkpoint policy must
# see each op, so it leaves the compiled path, and then costs about half a layer forward rather than a tenth
# (the calibration run: benchmarks/other-measurements.md, "a 24 GiB budget").
RECOMPUTE_COST_COMPILED = {**RECOMPUTE_COST, "op": 0.5}


def format_bytes(n: float) -> str:
    return f"{n / _GIB:.2f} GiB" if abs(n) >= _GIB / 10 else f"{n / 1024**2:.1f} MiB"


@dataclass(frozen=True)
class LayerActivation:
    """Bytes one decoder layer keeps from forward to backward under each choice (measured or estimated)."""

    none_bytes: int
    op_bytes: int
    full_bytes: int
    # What the layer saves when it runs eagerly, where that differs from none_bytes (measured through compiled
    # layers): an op-level layer leaves the compiled path, so its backward rebuilds the eager set. None: none_bytes.
    eager_none_bytes: int | None = None
    # What the layer's backward allocates on top of its saved tensors while it runs (the gradients of its
    # intermediates, e.g. an MLP's two intermediate-sized ones, and of its input and output), whatever the choice
    backward_bytes: int = 0

    def retained(self, choice: str) -> int:
        """Device bytes kept from forward to backward."""
        return {"none": self.none_bytes, "op": self.op_bytes, "full": self.full_bytes, "offload": 0,
                "spaced": 0}[choice]

    def rebuilt(self, choice: str) -> int:
        """Bytes the layer's backward rebuilds on top of what it retained (a recompute brings back the rest)."""
        whole = self.eager_none_bytes if choice == "op" and self.eager_none_bytes is not None else self.none_bytes
        return max(whole - self.retained(choice), 0)

    def scaled(self, numerator: int, denominator: int) -> "LayerActivation":
        """These sizes for numerator / denominator times the tokens (activations are linear in tokens)."""
        def scale(n):
            return None if n is None else n * numerator // denominator
        return LayerActivation(scale(self.none_bytes), scale(self.op_bytes), scale(self.full_bytes),
                               scale(self.eager_none_bytes), scale(self.backward_bytes))


@dataclass(frozen=True)
class GradientBytes:
    """Gradient bytes per decoder layer (in the order of the probed layers) and outside them (embeddings, head,
    final norm), for a training loop that frees gradients before each forward (see ``plan_peak_bytes``)."""

    per_layer: tuple[int, ...]
    other: int

    @property
    def total(self) -> int:
        return sum(self.per_layer) + self.other


def valid_choices(choices: Sequence[str]) -> bool:
    """Every "spaced" layer follows a checkpointed one ("full", "offload" or "spaced"): its span has a kept input."""
    return all(c != "spaced" or (i > 0 and choices[i - 1] in CHECKPOINTED) for i, c in enumerate(choices))


def _step(layer: LayerActivation, choice: str, prefetched: int, pending: int | None) -> tuple[int, int, int | None]:
    """One layer of the peak model: (bytes its backward holds on top of every layer's retained bytes, the prefetched
    input for the layers above, the span's pending inputs for the layer above; None: no span open)."""
    held = layer.rebuilt(choice) + layer.backward_bytes + prefetched + (pending if choice == "spaced" else 0)
    if choice == "offload":
        prefetched = layer.full_bytes
    if choice in ("full", "offload"):
        pending = 0
    elif choice == "spaced":
        pending += layer.full_bytes
    else:
        pending = None
    return held, prefetched, pending


def layer_peaks(layers: Sequence[LayerActivation], choices: Sequence[str]) -> list[int]:
    """Per layer, what its backward holds on top of the retained bytes of every layer: what it rebuilds and the
    gradients it makes (``LayerActivation.backward_bytes``); for a spaced layer also the inputs its span rebuilt below
    it and still waiting; and the input of the nearest offloaded layer below, which is on the device from the backward
    of the offloaded layer above it (a prefetch, or a spaced span's rebuild) until its own (counted for every layer
    above it: an upper bound)."""
    if not valid_choices(choices):
        raise ValueError(f"a 'spaced' layer must follow a checkpointed one ({'/'.join(CHECKPOINTED)}): {choices}")
    peaks, prefetched, pending = [], 0, None
    for layer, choice in zip(layers, choices):
        held, prefetched, pending = _step(layer, choice, prefetched, pending)
        peaks.append(held)
    return peaks


def host_bytes(layers: Sequence[LayerActivation], choices: Sequence[str]) -> int:
    """Host memory the offloaded layers' inputs take between forward and backward."""
    return sum(layer.full_bytes for layer, c in zip(layers, choices) if c == "offload")


def plan_peak_bytes(layers: Sequence[LayerActivation], choices: Sequence[str], fixed_bytes: int,
                    extra_bytes: int = 0, grads: GradientBytes | None = None) -> int:
    """Peak = fixed + the larger of the forward's end and the worst layer's backward.

    The forward's end: every layer's retained activations, the top layer's output (the final norm's input; no
    layer's figures hold it) and the loss tail's peak (`extra_bytes`: the full logits of the stock loss, or a fused
    loss's chunk and gradient buffers). Layer j's backward: the retained activations of the layers up to j and what
    j's backward holds on top (``layer_peaks``: what it rebuilds and the gradients it makes, plus spaced spans'
    rebuilt inputs and offloaded inputs fetched back). The loss tail has run its backward and freed its buffers
    before any layer's backward starts (what it hands on, the gradient of the top layer's output, is in that layer's
    backward bytes), so the tail and a layer's backward are not counted together: counting them together
    over-predicted long documents by the largest layer's backward (docs/long-context.md, "How a plan's peak is
    counted"); tests/test_memory.py holds real CPU steps to the prediction from below, closely.

    grads: the loop frees gradients before each forward (one micro-batch per optimizer step, ``zero_grad(
    set_to_none=True)``), and ``fixed_bytes`` holds no gradients. Gradients then never meet the whole forward's
    activations: backward makes them top layer first while it frees that layer's activations. The head's and
    embeddings' gradients (which the loss may make early) count in both phases; each layer's backward adds the
    gradients of that layer and those above. Never above the figure without ``grads``, which counts every gradient
    in ``fixed_bytes``."""
    return peak_terms(layers, choices, fixed_bytes, extra_bytes, grads)["peak"]


def peak_terms(layers: Sequence[LayerActivation], choices: Sequence[str], fixed_bytes: int, extra_bytes: int = 0,
               grads: GradientBytes | None = None) -> dict[str, int]:
    """``plan_peak_bytes``'s terms, to set beside a measured peak: `fixed`, `other_gradients` (the head's and
    embeddings', with ``grads``), `loss_and_head` (extra_bytes), `retained` (every layer's), `top_output`,
    `forward_end` (the sum of the last three), `held` (the most one layer's backward holds on top of what it
    retained), `backward` (the worst layer's backward: the activations up to it, what it holds, the gradients made by
    then) and `peak`."""
    retained = [layer.retained(c) for layer, c in zip(layers, choices)]
    held = layer_peaks(layers, choices)
    if grads is not None and len(grads.per_layer) != len(retained):
        raise ValueError(f"{len(grads.per_layer)} layers of gradient bytes for {len(retained)} probed layers")
    per_layer = grads.per_layer if grads is not None else (0,) * len(retained)
    other = grads.other if grads is not None else 0
    below = list(itertools.accumulate(retained, initial=0))  # activations of the layers under layer j
    above = list(itertools.accumulate(reversed(per_layer), initial=0))[::-1]  # gradients of layers j and up
    top_output = layers[-1].full_bytes if len(layers) else 0
    forward_end = extra_bytes + sum(retained) + top_output
    backward = max((below[j] + retained[j] + held[j] + above[j] for j in range(len(retained))), default=0)
    return {"fixed": fixed_bytes, "other_gradients": other, "loss_and_head": extra_bytes, "retained": sum(retained),
            "top_output": top_output, "forward_end": forward_end, "held": max(held, default=0), "backward": backward,
            "peak": fixed_bytes + other + max(forward_end, backward)}


def plan_cost(choices: Sequence[str], costs: dict[str, float] = RECOMPUTE_COST) -> float:
    return sum(costs[c] for c in choices)


@dataclass(frozen=True)
class CheckpointPlan:
    """Per-layer choices with their predicted peak; `fits` is False when no plan meets the budgets."""

    choices: tuple[str, ...]
    predicted_peak_bytes: int
    budget_bytes: int
    fixed_bytes: int
    recompute_cost: float
    fits: bool
    host_bytes: int = 0  # offloaded layers' saved inputs, held in (pinned) host memory between forward and backward
    freed_grad_bytes: int | None = None  # gradients freed before each forward (not in fixed_bytes); None: in it
    host_budget_bytes: int | None = None  # host memory the plan could use (None: not limited)

    @property
    def spans(self) -> list[int]:
        """Length of each run of layers sharing one kept input (a checkpointed layer and the spaced ones above it)."""
        runs: list[int] = []
        for c in self.choices:
            if c == "spaced":
                runs[-1] += 1
            elif c in ("full", "offload"):
                runs.append(1)
        return runs

    def split(self) -> str:
        """One line: where the checkpointed layers' inputs live, and the spacing."""
        count = self.choices.count
        parts = [f"{count('full')} layer inputs on the device", f"{count('offload')} in host memory"]
        if count("spaced"):
            parts.append(f"{count('spaced')} rebuilt in backward (spacing {max(self.spans)}: a span of up to "
                         f"{max(self.spans)} layers keeps one input)")
        kept = [f"{count(c)} {name}" for c, name in (("none", "not checkpointed"), ("op", "op-level")) if count(c)]
        return ", ".join(parts + kept)

    def table(self) -> str:
        full = [i for i, c in enumerate(self.choices) if c == "full"]
        op = [i for i, c in enumerate(self.choices) if c == "op"]
        spaced = [i for i, c in enumerate(self.choices) if c == "spaced"]
        host_budget = "" if self.host_budget_bytes is None else f" (host budget {format_bytes(self.host_budget_bytes)})"
        return "\n".join([
            "| item | value |", "|---|---|",
            f"| split | {self.split()} |",
            f"| full checkpointing | {len(full)} layers {full} |",
            f"| op-level checkpointing | {len(op)} layers {op} |",
            f"| no checkpointing | {self.choices.count('none')} layers |",
            *([f"| offloaded checkpointing | {self.choices.count('offload')} layers, "
               f"{format_bytes(self.host_bytes)} of host memory{host_budget} |"] if "offload" in self.choices else []),
            *([f"| spaced checkpointing | {len(spaced)} layers {spaced}, spans of {sorted(set(self.spans))} layers |"]
              if spaced else []),
            f"| recompute (layer forwards) | {self.recompute_cost:.1f} |",
            *([f"| fixed (params, grads, optimizer) | {format_bytes(self.fixed_bytes)} |"]
              if self.freed_grad_bytes is None else
              [f"| fixed (params, optimizer) | {format_bytes(self.fixed_bytes)} |",
               f"| gradients (freed before each forward) | {format_bytes(self.freed_grad_bytes)} |"]),
            f"| predicted peak | {format_bytes(self.predicted_peak_bytes)} |",
            f"| budget | {format_bytes(self.budget_bytes)}{'' if self.fits else ' (does NOT fit)'} |",
        ])


# ----------------------------------------------------------------------------------------------- the search
def _best_first(layers: Sequence[LayerActivation], units: dict[str, int], bound: float, host_budget: float,
                by_cost: bool, accept: Callable[[tuple[str, ...], int, float], bool], extra_bytes: int = 0) -> None:
    """Best-first search over per-layer choices, bottom layer first. A partial plan's device bytes are a lower bound
    of ``plan_peak_bytes``'s (less fixed bytes and gradients): the larger of its retained bytes with `extra_bytes`
    (the forward's end) and its worst layer's backward so far (the retained bytes up to that layer and what it
    holds). Partial plans come off a heap by recompute cost (`by_cost`) or by those bytes; both only grow as layers
    are added, so complete plans come off in that order. A partial plan is dropped when its bytes exceed `bound`,
    when its host bytes exceed `host_budget`, or when one popped before it at the same layer and in the same state
    (the prefetched input and the open span: what decides later layers' bytes) kept no more retained, host and
    backward bytes. `accept(choices, cost, priority)` sees each complete plan (and returns True to stop)."""
    import heapq

    counter = itertools.count(1)
    heap = [(0, 0, 0, 0, 0, 0, 0, 0, None, None)]
    # (priority, tiebreak, layer, retained, host, backward, cost, prefetched, pending, path)
    popped: dict[tuple, list[tuple[int, int, int]]] = {}
    while heap:
        priority, _, i, retained, host, backward, cost, prefetched, pending, path = heapq.heappop(heap)
        front = popped.setdefault((i, prefetched, pending), [])
        if any(r <= retained and h <= host and b <= backward for r, h, b in front):
            continue
        # what this one dominates can go: whatever those would drop later (they came off first), it drops too
        front[:] = [(r, h, b) for r, h, b in front if not (retained <= r and host <= h and backward <= b)]
        front.append((retained, host, backward))
        if i == len(layers):
            if accept(_unwind(path), cost, priority):
                return
            continue
        layer = layers[i]
        for choice, unit in units.items():
            if choice == "spaced" and pending is None:
                continue
            layer_held, next_prefetched, next_pending = _step(layer, choice, prefetched, pending)
            r, h = retained + layer.retained(choice), host + (layer.full_bytes if choice == "offload" else 0)
            b = max(backward, r + layer_held)
            device = max(extra_bytes + r, b)
            if device > bound or h > host_budget:
                continue
            heapq.heappush(heap, (cost + unit if by_cost else device, next(counter), i + 1, r, h, b, cost + unit,
                                  next_prefetched, next_pending, (choice, path)))


def _unwind(path) -> tuple[str, ...]:
    out = []
    while path is not None:
        choice, path = path
        out.append(choice)
    return tuple(reversed(out))


def _cheapest_fitting(layers, units, fixed_bytes, budget_bytes, extra_bytes, grads, host_budget):
    """The least-recompute plan whose exact peak fits the budget (ties: the lower peak), or None."""
    base = fixed_bytes + (grads.other if grads is not None else 0)
    best: list = []  # [cost, peak, choices]

    def accept(choices, cost, priority):
        if best and cost > best[0]:
            return True  # every plan left costs more
        peak = plan_peak_bytes(layers, choices, fixed_bytes, extra_bytes, grads)
        if peak <= budget_bytes and (not best or peak < best[1]):
            best[:] = [cost, peak, choices]
        return False

    _best_first(layers, units, budget_bytes - base, host_budget, True, accept, extra_bytes)
    return best[2] if best else None


def _lowest_peak(layers, units, fixed_bytes, extra_bytes, grads, host_budget):
    """The plan with the lowest exact peak whose host bytes fit (ties: the first found)."""
    base = fixed_bytes + (grads.other if grads is not None else 0)
    best: list = []  # [peak, choices]

    def accept(choices, cost, priority):
        if best and base + priority >= best[0]:
            return True  # a lower bound of every plan left is no better
        peak = plan_peak_bytes(layers, choices, fixed_bytes, extra_bytes, grads)
        if not best or peak < best[0]:
            best[:] = [peak, choices]
        return False

    _best_first(layers, units, float("inf"), host_budget, False, accept, extra_bytes)
    return best[1]


def plan_checkpointing(layers: Sequence[LayerActivation], *, fixed_bytes: int, budget_bytes: int,
                       extra_bytes: int = 0, modes: Sequence[str] = DEVICE_MODES,
                       costs: dict[str, float] = RECOMPUTE_COST, grads: GradientBytes | None = None,
                       host_budget_bytes: int | None = None) -> CheckpointPlan:
    """The least-recompute per-layer choice whose predicted peak fits `budget_bytes` and whose offloaded inputs fit
    `host_budget_bytes` (pure function, exact on ``plan_peak_bytes``'s model).

    A dynamic program over layers keeps, per recompute cost, every plan not beaten on device bytes retained, host
    bytes and its worst layer's backward so far; the cheapest fitting plan wins, ties to the lower peak. When
    nothing fits, the plan with the lowest peak within the host budget is returned with fits=False. `modes`: the
    choices to consider (add "offload" to keep layers' inputs in host memory, "spaced" to rebuild them in backward).
    `costs`: recompute per choice, in layer forwards (RECOMPUTE_COST_COMPILED where the layers are compiled). `grads`:
    gradients freed before each forward (see plan_peak_bytes; `fixed_bytes` then holds none); each candidate's peak
    is then exact, but the candidates are kept by their bytes without the gradients, so the cheapest fitting plan is
    exact only while the forward's end is the peak (a full fine-tune's usual case).
    """
    units = {c: round(costs[c] * 10) for c in modes}
    host_budget = float("inf") if host_budget_bytes is None else host_budget_bytes
    choices = _cheapest_fitting(layers, units, fixed_bytes, budget_bytes, extra_bytes, grads, host_budget)
    fits = choices is not None
    if not fits:
        choices = _lowest_peak(layers, units, fixed_bytes, extra_bytes, grads, host_budget)
    peak = plan_peak_bytes(layers, choices, fixed_bytes, extra_bytes, grads)
    return CheckpointPlan(tuple(choices), peak, budget_bytes, fixed_bytes, plan_cost(choices, costs), fits,
                          host_bytes(layers, choices), None if grads is None else grads.total, host_budget_bytes)


def longest_feasible_tokens(layers: Sequence[LayerActivation] | Callable[[int], Sequence[LayerActivation]],
                            tokens: int, *, fixed_bytes: int, budget_bytes: int,
                            extra_bytes: int | Callable[[int], int] = 0, modes: Sequence[str] = DEVICE_MODES,
                            costs: dict[str, float] = RECOMPUTE_COST, grads: GradientBytes | None = None,
                            host_budget_bytes: int | None = None, upper: int | None = None,
                            breaks: Sequence[int] = ()) -> int:
    """The most tokens per micro-batch (at most `upper`, default `tokens`) for which some plan fits, with the layers'
    bytes and `extra_bytes` measured at `tokens` and scaled linearly (the fixed bytes and gradients do not scale).
    Either may instead be a function of the tokens: `layers` (a chunked MLP holds one chunk's intermediates, and
    only past a length), `extra_bytes` (a fused loss's chunk does not shrink with them). 0: not even an empty batch
    fits (the training state alone is over the budget). Binary search: a plan that fits some length fits every
    shorter one, up to the nearest of `breaks` below it (the last lengths before the figures change form: an
    unchunked MLP at 190k tokens may need more than a chunked one at 300k), so the regimes are searched from the
    longest down."""
    upper = tokens if upper is None else upper

    units = {c: round(costs[c] * 10) for c in modes}
    host_budget = float("inf") if host_budget_bytes is None else host_budget_bytes
    extra_at = extra_bytes if callable(extra_bytes) else (lambda t: extra_bytes * t // tokens)
    layers_at = layers if callable(layers) else (lambda t: [layer.scaled(t, tokens) for layer in layers])

    def fits(t: int) -> bool:
        return _cheapest_fitting(layers_at(t), units, fixed_bytes, budget_bytes, extra_at(t), grads,
                                 host_budget) is not None

    ends = sorted({b for b in breaks if 0 < b < upper}) + [upper]
    for start, end in reversed(list(zip([0, *(b + 1 for b in ends[:-1])], ends))):
        if not fits(start):
            continue
        lo, hi = start, end  # fits(lo); the answer is in [lo, hi]
        if fits(hi):
            return hi
        while hi - lo > 1:
            mid = (lo + hi) // 2
            lo, hi = (mid, hi) if fits(mid) else (lo, mid)
        return lo
    return 0

