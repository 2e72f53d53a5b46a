"""The checkpointing policies but the budget: which decoder layers (or other modules) recompute their activations in
backward. ``checkpointing`` is their face (``policy_from_spec``, ``MemoryBudget``); ``budget`` builds on this module.

Each policy is a small object with `apply(model)`, `remove(model)` and `describe()`. Decoder layers are
transformers' `GradientCheckpointingLayer`s: we turn on transformers' own checkpointing through the model's enable
method (`activation_checkpointing_enable` in 5.23, `gradient_checkpointing_enable` in 5.17, found by feature
detection) and then set each layer's `gradient_checkpointing` flag and `_gradient_checkpointing_func` as the policy
says. A decoder layer's `forward` is never replaced (that silently disables transformers' checkpointing); only
non-layer modules picked by a `check_fn` (e.g. MLPs) get their instance `forward` wrapped, and `remove` restores it.

`Trainer.train()` re-enables checkpointing from its arguments and overwrites the per-layer flags: call
`reapply_checkpointing(model)` after that (hf_accel's Trainer does it) to restore the policy's choice.
"""
from __future__ import annotations

import functools
import logging
from dataclasses import dataclass, field
from typing import Callable, ClassVar, Iterable, Sequence

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint
from transformers.modeling_layers import GradientCheckpointingLayer

from ..binding import bind_forward
from . import trim
from .context import RunContext
from .offload import ActivationOffloader, offloaded_checkpoint
from .spacing import Spacer
from .targets import (OP_LEVEL_ATTR, _as_packet, _hf_enable_function, _op_level_context_fn, base_model,
                                 decoder_layers, default_save_ops, fsdp_activation_checkpointing_active)
from ..errors import ConfigurationError

logger = logging.getLogger(__name__)

# "none" | "op" | "full" | "offload" (full, saved input kept in host memory) | "spaced" (full, saved input not kept:
# rebuilt in backward from the layer below, memory.spacing)
LayerChoice = str
_STATE_ATTR = "_hf_accel_checkpointing"


@dataclass
class _Applied:
    """What apply() changed on one model, so remove() can restore it exactly."""

    policy: "CheckpointingPolicy"
    flags: list = field(default_factory=list)  # (module, attr, had_own, old value)
    wrapped: list = field(default_factory=list)  # the undo of each forward it bound
    added_input_grad_hooks: bool = False


def _remember(applied: _Applied, module: nn.Module, attr: str) -> None:
    applied.flags.append((module, attr, attr in module.__dict__, module.__dict__.get(attr)))


# ----------------------------------------------------------------------------------------------- policies
@dataclass(kw_only=True)
class CheckpointingPolicy:
    """Base class. `explicit`: the user asked for this policy (a clash with FSDP's checkpointing then raises).
    `trim_recompute`: the recompute of a fully checkpointed layer (non-reentrant) skips its output projections'
    matmuls, which only the discarded output reads (`memory.trim`; the same gradients)."""

    use_reentrant: bool = False
    explicit: bool = True
    trim_recompute: bool = True
    # whether apply() plans from its RunContext (a memory budget does): callers gather the run's facts only then
    needs_run_context: ClassVar[bool] = False

    def __post_init__(self) -> None:
        for flag in ("use_reentrant", "explicit", "trim_recompute"):
            if not isinstance(getattr(self, flag), bool):
                raise ConfigurationError(f"{type(self).__name__}({flag}=...) takes True or False, got "
                                         f"{getattr(self, flag)!r}.")

    def layer_choices(self, layers: Sequence[nn.Module]) -> list[LayerChoice]:
        """Per decoder layer (in forward order): "none", "op" or "full"."""
        return ["none"] * len(layers)

    def module_selector(self) -> Callable[[nn.Module], bool] | None:
        """Non-layer modules to checkpoint by wrapping their forward (None: none)."""
        return None

    def describe(self) -> str:
        return type(self).__name__

    def trims(self) -> bool:
        """Whether layers this policy checkpoints fully get the trimmed recompute (where their projections allow)."""
        return self.trim_recompute and not self.use_reentrant

    def apply(self, model: nn.Module, context: RunContext | None = None) -> None:
        """Checkpoint `model` as this policy says (replaces any policy applied before). `context`: the run it is
        applied for (what a memory budget plans with; the fixed policies need none of it)."""
        if getattr(model, _STATE_ATTR, None) is not None:
            remove_checkpointing(model)
        if not isinstance(self, NoCheckpointing) and fsdp_activation_checkpointing_active(model):
            if self.explicit:
                raise ConfigurationError(
                    f"checkpointing policy {self.describe()} was requested but FSDP's own activation checkpointing "
                    "is on; both at once fail. Turn one off: drop `checkpointing=` or set "
                    "fsdp_activation_checkpointing=false in the accelerate config."
                )
            logger.info("hf_accel: FSDP activation checkpointing is on; leaving %s unapplied", self.describe())
            return
        applied = _Applied(policy=self)
        setattr(model, _STATE_ATTR, applied)
        self._set_layers(model, applied, snapshot=True)
        self._wrap_modules(model, applied)

    def remove(self, model: nn.Module) -> None:
        """Undo apply(): flags, checkpoint functions, wrapped forwards and input-grad hooks as they were."""
        remove_checkpointing(model)

    # -- internals
    def _layer_function(self, choice: LayerChoice, head: bool = False, layer: nn.Module | None = None,
                        trimmed: tuple[str, ...] = ()) -> Callable:
        """The checkpoint function for `choice`; `head`: the layer above is spaced (this one keeps its span's
        input); `trimmed`: the output projections (paths in `layer`) its recompute may skip (`memory.trim`)."""
        if (choice == "spaced" or head) and self.use_reentrant:
            raise ConfigurationError(
                "spaced checkpointing works through non-reentrant checkpointing (it hooks the inputs that checkpoint "
                "saves); got use_reentrant=True. Use 'full' layers instead of 'spaced' ones."
            )
        if choice == "spaced":
            return _spacer_of(self).spaced
        if head:
            return _spacer_of(self).head(offload=choice == "offload")
        if choice == "op":
            if self.use_reentrant:
                raise ConfigurationError(
                    "op-level checkpointing needs non-reentrant checkpointing (torch's selective checkpoint "
                    "contexts); got use_reentrant=True. Use 'full' or 'every_N' with reentrant checkpointing."
                )
            func = functools.partial(checkpoint, use_reentrant=False,
                                     context_fn=_op_level_context_fn(default_save_ops_for(self)))
            setattr(func, OP_LEVEL_ATTR, True)
            return func
        if choice == "offload":
            func = functools.partial(offloaded_checkpoint, _offloader_of(self))
        else:
            func = functools.partial(checkpoint, use_reentrant=self.use_reentrant)
        if trimmed and layer is not None and self.trims():
            return trim.TrimmedCheckpoint(func, layer, trimmed, _bindings_of(self))
        return func

    def _set_layers(self, model: nn.Module, applied: _Applied, snapshot: bool) -> None:
        layers = decoder_layers(model)
        choices = self.layer_choices(layers)
        hf_model = base_model(model)
        if snapshot:
            for module in hf_model.modules():
                if hasattr(module, "gradient_checkpointing"):
                    _remember(applied, module, "gradient_checkpointing")
                    _remember(applied, module, "_gradient_checkpointing_func")
            _remember(applied, hf_model, "_require_grads_hooks")
            _remember(applied, hf_model, "_require_grads_hook")
        if any(c != "none" for c in choices):
            had_hooks = bool(getattr(hf_model, "_require_grads_hooks", None) or
                             getattr(hf_model, "_require_grads_hook", None))
            # transformers' own enable sets up everything around the layers (non-layer flags, input grads for
            # adapters); we then narrow the per-layer flags and functions to the policy's choice.
            _hf_enable_function(hf_model)({"use_reentrant": self.use_reentrant})
            if self.use_reentrant and not getattr(hf_model, "_require_grads_hooks", None):
                hf_model.enable_input_require_grads()  # reentrant: frozen-input layers would get no LoRA grads
            applied.added_input_grad_hooks |= not had_hooks
        trimmed = trim.output_projections(hf_model) if self.trims() else ()
        for i, (layer, choice) in enumerate(zip(layers, choices)):
            layer.gradient_checkpointing = choice != "none"
            if choice != "none":
                head = i + 1 < len(choices) and choices[i + 1] == "spaced"
                layer._gradient_checkpointing_func = self._layer_function(choice, head, layer, trimmed)

    def _wrap_modules(self, model: nn.Module, applied: _Applied) -> None:
        selector = self.module_selector()
        if selector is None:
            return
        for module in base_model(model).modules():
            if isinstance(module, GradientCheckpointingLayer) or not selector(module):
                continue
            applied.wrapped.append(
                bind_forward(module, _checkpointed_forward(module, module.forward, self.use_reentrant)))


def default_save_ops_for(policy: CheckpointingPolicy) -> frozenset:
    ops = getattr(policy, "save_ops", None)
    return default_save_ops() if ops is None else frozenset(_as_packet(op) for op in ops)


def _bindings_of(policy: CheckpointingPolicy) -> trim.Bindings:
    """The trimmed forwards the policy bound (one record per policy, undone when it is removed)."""
    if getattr(policy, "trim_bindings", None) is None:
        policy.trim_bindings = trim.Bindings([])
    return policy.trim_bindings


def _checkpointed_forward(module: nn.Module, forward: Callable, use_reentrant: bool) -> Callable:
    @functools.wraps(forward)
    def checkpointed(*args, **kwargs):
        if not (module.training and torch.is_grad_enabled()):
            return forward(*args, **kwargs)
        # reentrant checkpoint takes no kwargs, so bind them; tensors that need grads must be positional then
        return checkpoint(functools.partial(forward, **kwargs), *args, use_reentrant=use_reentrant)

    return checkpointed


def remove_checkpointing(model: nn.Module) -> None:
    """Undo whatever policy was applied to `model` (no-op when none was), and a memory budget's chunking of the MLPs
    (``mlp_chunks.chunk_every_long_call``)."""
    from .mlp_chunks import restore_bound

    restore_bound(model)
    applied: _Applied | None = getattr(model, _STATE_ATTR, None)
    if applied is None:
        return
    hf_model = base_model(model)
    bindings = getattr(applied.policy, "trim_bindings", None)
    if bindings is not None:
        bindings.unbind()
    if applied.added_input_grad_hooks:
        for hook in getattr(hf_model, "_require_grads_hooks", None) or []:
            hook.remove()
    for undo in reversed(applied.wrapped):
        undo()
    for module, attr, had_own, old in reversed(applied.flags):
        if had_own:
            setattr(module, attr, old)
        elif attr in module.__dict__:
            delattr(module, attr)
    # applied to the transformers model and found through a PEFT wrapper added since (its getattr forwards)
    delattr(model if _STATE_ATTR in model.__dict__ else base_model(model), _STATE_ATTR)


def reapply_checkpointing(model: nn.Module) -> None:
    """Re-set the applied policy's per-layer flags; call after `Trainer.train()` re-enabled checkpointing itself."""
    applied: _Applied | None = getattr(model, _STATE_ATTR, None)
    if applied is not None:
        applied.policy._set_layers(model, applied, snapshot=False)


def applied_policy(model: nn.Module) -> CheckpointingPolicy | None:
    """The policy currently applied to `model`, if any."""
    applied = getattr(model, _STATE_ATTR, None)
    return None if applied is None else applied.policy


@dataclass(kw_only=True)
class NoCheckpointing(CheckpointingPolicy):
    """Keep every activation (fastest, most memory)."""

    def describe(self) -> str:
        return "no checkpointing"

    def trims(self) -> bool:
        return False


@dataclass(kw_only=True)
class FullCheckpointing(CheckpointingPolicy):
    """Recompute every decoder layer in backward."""

    def layer_choices(self, layers: Sequence[nn.Module]) -> list[LayerChoice]:
        return ["full"] * len(layers)

    def describe(self) -> str:
        return f"full checkpointing of every decoder layer ({'reentrant' if self.use_reentrant else 'non-reentrant'})"


@dataclass(kw_only=True)
class EveryN(CheckpointingPolicy):
    """Recompute every n-th decoder layer (layers 0, n, 2n, ...), like transformers' every_n_layers."""

    n: int = 2

    def __post_init__(self) -> None:
        super().__post_init__()
        if not isinstance(self.n, int) or self.n < 1:
            raise ConfigurationError(f"EveryN needs an integer n >= 1, got {self.n!r}; e.g. EveryN(n=2).")

    def layer_choices(self, layers: Sequence[nn.Module]) -> list[LayerChoice]:
        return ["full" if i % self.n == 0 else "none" for i in range(len(layers))]

    def describe(self) -> str:
        return f"full checkpointing of every {self.n}-th decoder layer"


@dataclass(kw_only=True)
class SelectiveModules(CheckpointingPolicy):
    """Checkpoint exactly the modules `check_fn(module)` is True for (decoder layers by flag, others by wrapping)."""

    check_fn: Callable[[nn.Module], bool]

    def layer_choices(self, layers: Sequence[nn.Module]) -> list[LayerChoice]:
        return ["full" if self.check_fn(layer) else "none" for layer in layers]

    def module_selector(self) -> Callable[[nn.Module], bool]:
        return self.check_fn

    def describe(self) -> str:
        return f"checkpoint modules where {getattr(self.check_fn, '__name__', repr(self.check_fn))}(module) is True"


@dataclass(kw_only=True)
class OpLevel(CheckpointingPolicy):
    """Inside every decoder layer keep the outputs of matmuls / attention kernels, recompute element-wise ops."""

    save_ops: Iterable | None = None  # None: default_save_ops() at apply time

    def layer_choices(self, layers: Sequence[nn.Module]) -> list[LayerChoice]:
        return ["op"] * len(layers)

    def describe(self) -> str:
        return "op-level selective checkpointing (save matmul and attention outputs, recompute element-wise ops)"

    def trims(self) -> bool:
        return False


@dataclass(kw_only=True)
class PerLayer(CheckpointingPolicy):
    """An explicit choice per decoder layer, e.g. what MemoryBudget's planner picked."""

    choices: Sequence[LayerChoice]

    def layer_choices(self, layers: Sequence[nn.Module]) -> list[LayerChoice]:
        from .planner import CHECKPOINTED, valid_choices

        num_layers = len(layers)
        if len(self.choices) != num_layers or set(self.choices) - {"none", "op", "full", "offload", "spaced"}:
            raise ConfigurationError(
                f"PerLayer needs one of 'none'/'op'/'full'/'offload'/'spaced' per decoder layer ({num_layers} "
                f"layers), got {list(self.choices)}."
            )
        if not valid_choices(self.choices):
            raise ConfigurationError(
                f"PerLayer: a 'spaced' layer rebuilds its input from the layer below, which must be checkpointed "
                f"({'/'.join(CHECKPOINTED)}); got {list(self.choices)}. Make the layer under each first 'spaced' "
                "one 'full' or 'offload'."
            )
        return list(self.choices)

    def trims(self) -> bool:
        return super().trims() and any(c in ("full", "offload") for c in self.choices)

    def describe(self) -> str:
        counts = {c: list(self.choices).count(c) for c in ("full", "op", "none", "offload", "spaced")}
        offload = f", {counts['offload']} offloaded" if counts["offload"] else ""
        spaced = f", {counts['spaced']} spaced" if counts["spaced"] else ""
        return f"per layer: {counts['full']} full, {counts['op']} op-level, {counts['none']} none{offload}{spaced}"


@dataclass(kw_only=True)
class OffloadedCheckpointing(CheckpointingPolicy):
    """Recompute every decoder layer, and keep each layer's saved input in host memory until its recompute.

    Full checkpointing keeps one hidden-state tensor per layer on the device (at 128k tokens of Llama-3-8B, 1 GiB
    each); this policy copies it to pinned host memory on a side stream during forward and brings it back ahead of the
    recompute (`memory.offload`). Gradients are identical to "full". `self.offloader.stats` counts what moved.
    """

    min_bytes: int = 0  # saved inputs smaller than this stay on the device
    prefetch: bool = True
    host_limit: int | None = None  # bytes of host copies alive at once; past it a layer's input stays on the device
    offloader: ActivationOffloader = field(default=None, init=False, repr=False)

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.use_reentrant:
            raise ConfigurationError(
                "offloaded checkpointing works through non-reentrant checkpointing (it hooks the inputs that "
                "checkpoint saves); got use_reentrant=True. Use checkpointing='offload' with use_reentrant=False."
            )
        self.offloader = ActivationOffloader(min_bytes=self.min_bytes, prefetch=self.prefetch,
                                             host_limit=self.host_limit)

    def layer_choices(self, layers: Sequence[nn.Module]) -> list[LayerChoice]:
        return ["offload"] * len(layers)

    def describe(self) -> str:
        text = "full checkpointing of every decoder layer, saved inputs offloaded to host memory"
        if self.host_limit is not None:
            text += f" (up to {self.host_limit / (1 << 30):.1f} GiB of them; past it they stay on the device)"
        return text


def _offloader_of(policy: CheckpointingPolicy) -> ActivationOffloader:
    """The policy's offloader (a PerLayer plan with "offload" choices gets one on first use)."""
    if getattr(policy, "offloader", None) is None:
        policy.offloader = ActivationOffloader()
    return policy.offloader


def _spacer_of(policy: CheckpointingPolicy) -> Spacer:
    """The policy's spaced-checkpoint functions (a plan with "spaced" choices gets them on first use), sharing its
    offloader, so a span head's offloaded input is prefetched like any other."""
    if getattr(policy, "spacer", None) is None:
        policy.spacer = Spacer(offloader=_offloader_of(policy))
    return policy.spacer
