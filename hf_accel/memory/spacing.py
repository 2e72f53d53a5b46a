"""Spaced checkpointing: a checkpointed decoder layer that keeps no input of its own.

Full checkpointing keeps each layer's input until backward (at 512k tokens of Llama-3-8B, 4 GiB a layer). A
checkpoint spanning layers s..s+k-1 would keep only layer s's input, but transformers checkpoints each layer on its
own (``GradientCheckpointingLayer`` hands each call to ``_gradient_checkpointing_func``), so a span is expressed
through the same saved-tensor hooks as offloading (``memory.offload``): the *head* s runs as a full or offloaded
checkpoint that also records how it ran (its checkpointed function, RNG and autocast state); each *spaced* layer above
it records the same and runs its own non-reentrant checkpoint under hooks that save, in place of its input, a
recipe: "re-run the span from its head's input". In backward, the first spaced layer to be recomputed (the top one)
re-runs layers s..j-1 once, the way their forward ran (under a non-reentrant checkpoint, grad enabled, so every
branch that depends on it, such as ``mlp_chunks``, is taken again; the output detached), keeps the rebuilt inputs of
the spaced layers below it until their own recomputes take them, and every layer's backward is then full
checkpointing's, on the same input values: gradients are identical to full checkpointing (bit for bit where the
kernels are deterministic). The cost is one more forward of each layer below a spaced one, the memory one layer's
recompute plus the span's rebuilt inputs (``planner.layer_peaks``).

A spaced layer whose input is not its span's last output (another module ran in between) keeps its input, as full
checkpointing does (``SpacingStats.kept``).
"""
from __future__ import annotations

import weakref
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
from torch.utils.checkpoint import checkpoint, get_device_states, set_device_states

from .offload import ActivationOffloader


@dataclass
class SpacingStats:
    spans: int = 0  # spans started (heads run with grad)
    spaced: int = 0  # spaced layers whose input was not kept
    kept: int = 0  # spaced layers that kept their input (it was not the span's last output)
    rebuilt: int = 0  # inputs handed back rebuilt
    replays: int = 0  # layer forwards re-run to rebuild them


class _Replay:
    """One layer's checkpointed call as the forward ran it: the function, the other positional arguments, whether
    its input required grad, the RNG states and the autocast settings."""

    def __init__(self, function: Callable, args: tuple) -> None:
        hidden = args[0]
        self.function, self.rest, self.requires_grad = function, args[1:], hidden.requires_grad
        self.device_type = hidden.device.type if hidden.device.type != "cpu" else "cuda"
        self.cpu_rng = torch.get_rng_state()
        self.devices, self.device_rng = get_device_states(*args)
        self.autocast = [(kind, dict(enabled=torch.is_autocast_enabled(kind), dtype=torch.get_autocast_dtype(kind),
                                     cache_enabled=torch.is_autocast_cache_enabled()))
                         for kind in dict.fromkeys((hidden.device.type, "cpu"))
                         if torch.amp.is_autocast_available(kind)]

    def run(self, hidden: torch.Tensor) -> torch.Tensor:
        """The layer's output for `hidden`, computed as its forward did, without a graph."""
        import contextlib

        with contextlib.ExitStack() as stack:
            stack.enter_context(torch.random.fork_rng(devices=self.devices, device_type=self.device_type))
            torch.set_rng_state(self.cpu_rng)
            if self.devices:
                set_device_states(self.devices, self.device_rng, device_type=self.device_type)
            for kind, settings in self.autocast:
                stack.enter_context(torch.autocast(kind, **settings))
            stack.enter_context(torch.enable_grad())
            inputs = hidden.detach().requires_grad_(self.requires_grad)
            out = checkpoint(self.function, inputs, *self.rest, use_reentrant=False)
        return (out[0] if isinstance(out, tuple) else out).detach()


class _Span:
    """A head layer and the spaced layers above it: how each ran, the head's kept input, the rebuilt inputs."""

    def __init__(self, spacer: "Spacer", head_input: Any) -> None:
        self.spacer, self.head_input = spacer, head_input  # a device tensor, or the offloader's entry
        self.replays: list[_Replay] = []
        self.last_output: weakref.ref | None = None  # the newest layer's output: the next spaced layer's input
        self.rebuilt: dict[int, torch.Tensor] = {}  # layer position in the span -> its rebuilt input, waiting

    def add(self, replay: _Replay, out: Any) -> None:
        self.replays.append(replay)
        hidden = out[0] if isinstance(out, tuple) else out
        self.last_output = weakref.ref(hidden) if isinstance(hidden, torch.Tensor) else None

    def feeds(self, hidden: Any) -> bool:
        return self.last_output is not None and self.last_output() is hidden

    def input(self, position: int) -> torch.Tensor:
        """The input of the span's layer at `position` (>= 1), rebuilt from the head's input on first need together
        with those of the layers between (kept for their own recomputes, which come next in backward)."""
        stats = self.spacer.stats
        stats.rebuilt += 1
        if position in self.rebuilt:
            return self.rebuilt.pop(position)
        hidden = self.spacer.offloader.peek(self.head_input)
        for step in range(position):
            hidden = self.replays[step].run(hidden)
            stats.replays += 1
            if step + 1 < position:
                self.rebuilt[step + 1] = hidden
        return hidden


class _HeadInput:
    """What autograd keeps for a span head's input: the tensor (or its offloaded entry), and the span, so the span
    lives until the head's own backward, the last of its span."""

    __slots__ = ("kept", "span")

    def __init__(self, kept: Any, span: _Span) -> None:
        self.kept, self.span = kept, span


class _Rebuild:
    """What autograd keeps for a spaced layer's input: where to rebuild it from."""

    __slots__ = ("span", "position")

    def __init__(self, span: _Span, position: int) -> None:
        self.span, self.position = span, position


@dataclass
class Spacer:
    """The checkpoint functions of span heads and spaced layers for one model (``PerLayer`` plans with "spaced")."""

    offloader: ActivationOffloader = field(default_factory=ActivationOffloader)
    stats: SpacingStats = field(default_factory=SpacingStats)
    _current: Any = field(default=None, repr=False)  # weakref to the span the newest head opened

    def head(self, offload: bool) -> Callable:
        """The checkpoint function of a layer that keeps its input (on the device, or offloaded) for a span."""
        def run(function: Callable, *args, **kwargs):
            if not torch.is_grad_enabled() or not args or not isinstance(args[0], torch.Tensor):
                return self._plain(function, args, kwargs, offload)
            # the hooks live as long as what they saved: they hold the input's signature, never the input
            hidden, span = _signature(args[0]), None

            def pack(t: torch.Tensor) -> Any:
                nonlocal span
                kept = self.offloader.pack(t) if offload else t
                if span is None and _signature(t) == hidden:
                    span = _Span(self, kept)
                    return _HeadInput(kept, span)
                return kept

            def unpack(saved: Any) -> torch.Tensor:
                kept = saved.kept if isinstance(saved, _HeadInput) else saved
                return self.offloader.unpack(kept)

            replay = _Replay(function, args)
            with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
                out = checkpoint(function, *args, use_reentrant=False, **kwargs)
            if span is not None:
                self.stats.spans += 1
                span.add(replay, out)
            self._current = None if span is None else weakref.ref(span)
            return out

        return run

    def spaced(self, function: Callable, *args, **kwargs):
        """The checkpoint function of a spaced layer: its input is rebuilt from its span's head in backward."""
        span = self._current() if self._current is not None else None
        if not torch.is_grad_enabled() or span is None or not args or not span.feeds(args[0]):
            if torch.is_grad_enabled():
                self.stats.kept += 1
                self._current = None
            return self._plain(function, args, kwargs, offload=False)
        hidden, position = _signature(args[0]), len(span.replays)

        def pack(t: torch.Tensor) -> Any:  # (holds the input's signature: the input itself must be free to go)
            return _Rebuild(span, position) if _signature(t) == hidden else t

        def unpack(saved: Any) -> torch.Tensor:
            return saved.span.input(saved.position) if isinstance(saved, _Rebuild) else saved

        replay = _Replay(function, args)
        with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
            out = checkpoint(function, *args, use_reentrant=False, **kwargs)
        self.stats.spaced += 1
        span.add(replay, out)
        return out

    def _plain(self, function: Callable, args: tuple, kwargs: dict, offload: bool):
        if not torch.is_grad_enabled():
            return function(*args, **kwargs)
        if offload:
            with self.offloader.hooks():
                return checkpoint(function, *args, use_reentrant=False, **kwargs)
        return checkpoint(function, *args, use_reentrant=False, **kwargs)


def _signature(t: torch.Tensor) -> tuple:
    """What tells a saved tensor to be the layer's input: the same memory, viewed the same way."""
    return t.data_ptr(), tuple(t.shape), t.stride(), t.dtype, t.device
