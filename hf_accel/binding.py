"""A forward bound on one module instance, and the undo that puts the slot back as it was.

Several layers of hf_accel (and liger, PEFT, TRL) bind forwards on the same instances: the fused loss on the model,
MLP chunks and checkpointing on layers, a head swapped for one call. Each undo restores exactly what that binding
found: the instance's own forward where it had one, else none, so the class's forward serves again (never a copy of
the class's forward left behind, which a later class-level patch would not reach).
"""
from __future__ import annotations

from typing import Callable

from torch import nn

_NONE = object()


def bind_forward(module: nn.Module, forward: Callable, keep_later: bool = False) -> Callable[[], None]:
    """Bind ``forward`` (a callable of the call's arguments: a function, or a method bound to ``module``) as
    ``module``'s instance forward; returns its undo. ``keep_later``: the undo leaves the slot alone where another
    forward was bound since (that binding owns it now)."""
    previous = module.__dict__.get("forward", _NONE)
    module.__dict__["forward"] = forward

    def undo() -> None:
        if keep_later and module.__dict__.get("forward") is not forward:
            return
        if previous is _NONE:
            module.__dict__.pop("forward", None)
        else:
            module.__dict__["forward"] = previous

    return undo

