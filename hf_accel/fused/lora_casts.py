"""PEFT LoRA layers under autocast without the fp32 round trip of their input.

PEFT keeps LoRA adapters in fp32 and casts each adapted linear's input to the adapter's dtype
(``LoraLayer._cast_input_dtype``). Under bf16/fp16 autocast that cast is a round trip: the bf16 activation is
copied to fp32, and autocast copies it straight back to bf16 for the adapter's matmul (it computes ``lora_A`` in the
autocast dtype). Both copies are exact, so skipping them changes nothing the layer computes, in forward or backward
(the gradient makes the same exact round trip the other way), but on Llama-8B shapes with LoRA on every linear they
were the largest element-wise cost of the step.

hf_accel skips the cast only where it is provably a round trip: autocast on for the input's device with the input's
own dtype, a bf16/fp16 input, an fp32 adapter, and every adapter of the layer a plain LoRA (no DoRA or other
variant) with no dropout (dropout's random mask is laid out per dtype, so with dropout the cast stays). Everywhere
else PEFT's own method runs. The skip is bound per layer instance (an instance attribute shadowing PEFT's method), on
LoRA layers present at ``patch()`` and on those PEFT adds later (checked at each forward of the patched model);
``unpatch`` removes it.

LoRA layers on bitsandbytes 4-bit bases (QLoRA: ``peft.tuners.lora.bnb.Linear4bit``) get the same skip: their forward
calls ``_cast_input_dtype`` only when CUDA autocast is off (``torch.is_autocast_enabled()`` without a device), then
feeds the cast input to ``lora_A`` alone, so where the check above holds (CPU autocast, say) the cast is the same round
trip. Under CUDA autocast they call it never: the casts a 4-bit LoRA layer makes there are bitsandbytes' (the input to
the compute dtype for the 4-bit matmul, the output back to the input's dtype), autocast's own copy of the input for
``lora_A`` and PEFT's defensive ``clone`` of the base output; none is a round trip the skip may drop without changing
a gradient's rounding (sharing the two input casts would sum the two input gradients in bf16), and compiled layers
fuse them into their neighbours instead. PEFT's other quantized LoRA layers (8-bit, GPTQ, AWQ, ...) are left to PEFT's
own forward, and the patch report says so. They are recognised by class module and name: bitsandbytes is never
imported.
"""
from __future__ import annotations

import sys
import types
from collections.abc import Callable

import torch
from torch import nn

_ATTR = "_cast_input_dtype"
_HALF = (torch.bfloat16, torch.float16)


def _peft_lora_layers():
    """``peft.tuners.lora.layer`` where PEFT is imported, else None. A model holds PEFT's LoRA layers only once PEFT
    is imported; importing it here would cost every patch() PEFT's import and, where bitsandbytes is installed,
    bitsandbytes' (whose first CPU kernel lookup tries the hub and logs an exception with the caller's frames)."""
    if "peft" not in sys.modules:
        return None
    try:
        from peft.tuners.lora import layer
    except ImportError:
        return None
    return layer


def _lora_linear_cls() -> type | None:
    layers = _peft_lora_layers()
    return None if layers is None else layers.Linear


def _lora_layer_cls() -> type | None:
    layers = _peft_lora_layers()
    return None if layers is None else layers.LoraLayer


# PEFT LoRA layers on quantized bases whose forward casts as ``peft.tuners.lora.layer.Linear`` does (module, name):
# peft defines them only when bitsandbytes imports, so they are recognised by name, not by import
_QUANTIZED_BOUND = (("peft.tuners.lora.bnb", "Linear4bit"),)


def _takes_skip(module: nn.Module, linear: type, lora_layer: type | None) -> bool:
    cls = type(module)
    return isinstance(module, linear) or (
        lora_layer is not None and isinstance(module, lora_layer) and (cls.__module__, cls.__name__) in _QUANTIZED_BOUND)


def left_to_peft(model: nn.Module) -> dict[str, int]:
    """LoRA layers the skip is not bound to, by kind ("bnb.Linear8bitLt": count): PEFT LoRA layers on quantized bases
    (classes from ``peft.tuners.lora.<backend>`` other than ``layer``) but bitsandbytes 4-bit ones."""
    lora_layer = _lora_layer_cls()
    if lora_layer is None:
        return {}
    found: dict[str, int] = {}
    for module in model.modules():
        cls = type(module)
        backend = cls.__module__.removeprefix("peft.tuners.lora.")
        if (isinstance(module, lora_layer) and backend != cls.__module__ and backend != "layer"
                and (cls.__module__, cls.__name__) not in _QUANTIZED_BOUND):
            key = f"{backend}.{cls.__name__}"
            found[key] = found.get(key, 0) + 1
    return found


def stand_down_note(model: nn.Module) -> str | None:
    """The patch report's line for LoRA layers left to PEFT, or None when there are none."""
    kinds = left_to_peft(model)
    if not kinds:
        return None
    what = ", ".join(f"{n} {kind}" for kind, n in sorted(kinds.items()))
    return (f"LoRA cast skip: not bound to {what} LoRA layers (quantized base layers the skip is not checked on): "
            "PEFT's own forward and casts run there")


def round_trip_only(layer: nn.Module, x: torch.Tensor, dtype: torch.dtype) -> bool:
    """Whether casting ``x`` to ``dtype`` in ``layer``'s forward is undone exactly by autocast before any use."""
    if dtype != torch.float32 or x.dtype not in _HALF:
        return False
    device = x.device.type
    if not torch.is_autocast_enabled(device) or torch.get_autocast_dtype(device) != x.dtype:
        return False
    variants = getattr(layer, "lora_variant", None)
    if variants is None:  # a PEFT layout this check does not know: keep PEFT's own cast
        return False
    # every adapter of the layer, not only the active ones: a mixed-adapter batch casts for any of them
    for name, lora_a in layer.lora_A.items():
        if name in variants or type(lora_a) is not nn.Linear:
            return False
        if not isinstance(layer.lora_dropout[name], nn.Identity):
            return False
    return True


def _cast_input_dtype(self, x, dtype: torch.dtype):
    if x is not None and round_trip_only(self, x, dtype):
        return x
    return type(self)._cast_input_dtype(self, x, dtype)  # PEFT's own


def bind(model: nn.Module) -> int:
    """Bind the skip to every PEFT LoRA Linear (and bitsandbytes 4-bit LoRA layer) of ``model`` that lacks it;
    returns how many were bound."""
    cls, lora_layer = _lora_linear_cls(), _lora_layer_cls()
    if cls is None:
        return 0
    bound = 0
    for module in model.modules():
        if _takes_skip(module, cls, lora_layer) and _ATTR not in module.__dict__:
            module.__dict__[_ATTR] = types.MethodType(_cast_input_dtype, module)
            bound += 1
    return bound


def unbind(model: nn.Module) -> None:
    for module in model.modules():
        method = module.__dict__.get(_ATTR)
        if isinstance(method, types.MethodType) and method.__func__ is _cast_input_dtype:
            del module.__dict__[_ATTR]


def _adapters_key(model: nn.Module):
    """Changes when PEFT injects adapters: it sets ``peft_config`` on the model it wraps (and adds to that dict)."""
    config = model.__dict__.get("peft_config")
    return None if config is None else (id(config), tuple(config))


def _note(model: nn.Module, notes: list[str] | None) -> None:
    line = stand_down_note(model) if notes is not None else None
    if line is None:
        return
    notes[:] = [n for n in notes if not n.startswith("LoRA cast skip: ")] + [line]  # the latest count only


def apply(model: nn.Module, notes: list[str] | None = None) -> list[Callable[[], None]]:
    """Bind now, re-bind when PEFT adds adapters (checked cheaply at each forward); returns the undo actions.
    ``notes`` (the patch report's) gets a line for LoRA layers left to PEFT, now or when PEFT adds them."""
    bind(model)
    _note(model, notes)
    seen = [_adapters_key(model)]

    def rebind_if_adapters_changed(module, args):
        key = _adapters_key(module)
        if key != seen[0]:
            bind(module)
            _note(module, notes)
            seen[0] = key

    handle = model.register_forward_pre_hook(rebind_if_adapters_changed)
    return [lambda: unbind(model), handle.remove]
