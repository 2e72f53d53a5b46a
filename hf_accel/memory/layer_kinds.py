"""Decoder layers' call slots, for the memory probe (``memory.plan``): which layers save alike (one kind, and an input
alike), each layer's call wrapped (``calls_wrapped``), and the layers another stands for passing their input through
(``passing_through``), so a probe forward runs two layers of each kind instead of all of them."""
from __future__ import annotations

import contextlib
import itertools
from typing import Sequence

import torch
from torch import nn

from .targets import CALL_SLOT


def kind_ids(layers: Sequence[nn.Module]) -> list[int]:
    """Each layer's kind (``layer_kind``) named by the index of the first layer of that kind."""
    first: dict[tuple, int] = {}
    return [first.setdefault(layer_kind(layer), i) for i, layer in enumerate(layers)]


def layer_kind(layer: nn.Module) -> tuple:
    """What decides the tensors a decoder layer saves, module by module: its class, its plain settings (attention
    type, sliding window, scaling, dropout: every int, float, str, bool or None it holds but its index), its
    parameters' and buffers' shapes, dtypes and trainability, and what hf_accel or a user bound on it (an instance
    forward, a compiled call, hooks). Two layers of one kind differ only in their weights' values and index."""
    kind = []
    for name, module in layer.named_modules():
        plain = tuple(sorted((k, v) for k, v in vars(module).items() if not k.startswith("_") and "idx" not in k
                             and "index" not in k and isinstance(v, (int, float, str, bool, type(None)))))
        tensors = tuple((n, tuple(t.shape), t.dtype, t.requires_grad)
                        for n, t in itertools.chain(module.named_parameters(recurse=False),
                                                    module.named_buffers(recurse=False)))
        bound = tuple(type(module.__dict__.get(slot)).__name__ for slot in ("forward", CALL_SLOT))
        hooks = (len(module._forward_hooks), len(module._forward_pre_hooks), len(module._backward_hooks))
        kind.append((name, type(module), plain, tensors, bound, hooks))
    return tuple(kind)


@contextlib.contextmanager
def passing_through(layers: Sequence[nn.Module], kinds: Sequence[int], stands_for: list[int],
                    on_pass=lambda i: None):
    """Layers of one kind (``kinds``: ``kind_ids``, or every index for none alike) save alike only where their inputs
    are alike too: one whose input needs a gradient saves what one whose input does not leaves out (a frozen layer
    below the first trainable one saves nothing, one above it everything). So each call decides: a layer runs when
    fewer than two of its kind with an input in its state ran before it (``stands_for[i] = i``); else it returns the
    hidden states it is given, in the form its kind returns them (a tensor, or a tuple led by them, as the last layer
    that ran returned), sets ``stands_for[i]`` to the second that ran and calls ``on_pass(i)``. Every layer's
    checkpointing is off; the call slots and flags are restored exactly on exit."""
    last, ran = {}, {}

    def wrap(i: int, layer: nn.Module, call):
        def decide(*args, **kwargs):
            hidden = args[0] if args else kwargs["hidden_states"]
            alike = ran.setdefault((kinds[i], torch.is_grad_enabled() and hidden.requires_grad), [])
            if len(alike) < 2:
                alike.append(i)
                stands_for[i] = i
                out = last["out"] = call(*args, **kwargs)
                return out
            stands_for[i] = alike[1]
            on_pass(i)
            out = last["out"]
            return (hidden, *out[1:]) if isinstance(out, tuple) else hidden
        return decide

    with calls_wrapped(layers, wrap):
        yield


@contextlib.contextmanager
def calls_wrapped(layers: Sequence[nn.Module], wrap):
    """Each layer's call slot replaced by ``wrap(index, layer, call)``, ``call`` being how the layer runs as bound (its
    compiled training call, else ``layer._call_impl``), and its checkpointing flag off; both restored exactly on exit.
    Module hooks would run inside a compiled region: the slot is the one place outside it."""
    missing = object()
    previous = [layer.__dict__.get(CALL_SLOT, missing) for layer in layers]
    flags = [layer.gradient_checkpointing for layer in layers]
    try:
        for i, (layer, call) in enumerate(zip(layers, previous)):
            layer.gradient_checkpointing = False
            layer.__dict__[CALL_SLOT] = wrap(i, layer, layer._call_impl if call is missing else call)
        yield
    finally:
        for layer, call, flag in zip(layers, previous, flags):
            if call is missing:
                layer.__dict__.pop(CALL_SLOT, None)
            else:
                layer.__dict__[CALL_SLOT] = call
            layer.gradient_checkpointing = flag
