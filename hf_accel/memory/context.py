"""What a checkpoint policy is told about the run it is applied for: ``policy.apply(model, context)``.

A ``RunContext`` holds the facts of the training loop that a plan depends on and the model cannot tell: how many tokens
a micro-batch holds, how the training state is sharded, whether gradients are freed before each forward, whether the
decoder layers run compiled, and the dtype training forwards autocast to. ``run_context`` assembles it from what a
loop knows (hf_accel's Trainers and the benchmark both call it); ``patch()`` adds whether it compiled the layers, and
builds a default one when it is given none. Policies take what they need (a memory budget: all of it) and ignore the
rest.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import TYPE_CHECKING, ContextManager

import torch

if TYPE_CHECKING:
    from .state import Sharding


@dataclass(frozen=True)
class RunContext:
    """The training run a policy is applied for (every field optional: None means unknown).

    batch_tokens: the most tokens one micro-batch holds (a budget probes a row of this size).
    sharding: how this process holds the training state (``state.Sharding``: FSDP2, ZeRO-3), None unsharded.
    grads_freed: the loop frees gradients before each forward (one micro-batch per optimizer step, zero_grad with
        set_to_none), so they never meet a forward's activations; None / False: they are counted on top.
    compiled: the decoder layers run compiled (``patch(compile=...)``).
    autocast: the dtype training forwards autocast to (accelerate's mixed precision), None without autocast: a
        budget's probe forward runs under the same autocast, so it meets the kernels and saves the tensors training
        will (fp32 master weights under bf16 autocast save bf16 activations and may take another attention kernel).
    """

    batch_tokens: int | None = None
    sharding: Sharding | None = None
    grads_freed: bool | None = None
    compiled: bool = False
    autocast: torch.dtype | None = None

    def autocast_context(self, device: torch.device) -> ContextManager:
        """The autocast training forwards run under on ``device`` (a no-op context without autocast: then whatever
        autocast the caller has entered stays in effect)."""
        if self.autocast is None:
            return contextlib.nullcontext()
        return torch.autocast(device.type, dtype=self.autocast)


def run_context(*, batch_tokens: int | None = None, accumulation_steps: int = 1, engine_keeps_grads: bool = False,
                sharding: Sharding | None = None, autocast: torch.dtype | None = None,
                compiled: bool = False) -> RunContext:
    """The ``RunContext`` of a training loop from the facts it knows.

    Gradients are freed before each forward when one micro-batch makes an optimizer step and the loop zeroes them
    with ``set_to_none`` (torch's optimizers and transformers' Trainer do by default), unless the engine keeps its
    own gradient buffers (DeepSpeed: ``engine_keeps_grads``). ``autocast``: see ``autocast_dtype``.
    """
    grads_freed = accumulation_steps == 1 and not engine_keeps_grads
    return RunContext(batch_tokens=batch_tokens or None, sharding=sharding, grads_freed=grads_freed,
                      compiled=compiled, autocast=autocast)


def autocast_dtype(device_type: str, autocast: ContextManager | None = None) -> torch.dtype | None:
    """The dtype forwards autocast to on ``device_type`` inside ``autocast`` (the training loop's own autocast
    context, e.g. accelerate's ``Accelerator.autocast()``, so nothing re-derives its rules), or in the current
    context when None; None when autocast is off there."""
    if not torch.amp.is_autocast_available(device_type):  # "meta" (weights arriving later), ...
        return None
    with autocast if autocast is not None else contextlib.nullcontext():
        return torch.get_autocast_dtype(device_type) if torch.is_autocast_enabled(device_type) else None
