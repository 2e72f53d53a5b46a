"""``patch(model, precision="fp8")``: the decoder layers' linear layers train through torchao's float8 training
(``torchao.float8.convert_to_float8_training``, rowwise scaling: each row of the input, weight and output gradient
gets its own scale; the matmuls run in float8 e4m3 with bf16 / fp32 outputs and master weights untouched).

This changes what the model computes (float8 rounding of every matmul operand), so it is never a default and never
chosen by "auto": the caller asks for it, and the report says so. The LM head, the embeddings, norms and attention
stay in the model's own precision (as torchtitan and torchao's recipes keep the output layer in high precision), as
does every linear whose dimensions are not multiples of 16 (float8 matmuls need them). The token dimension, an
inner dimension of the weight gradient's matmul, is padded with zeros to a multiple of 16 (torchao's
``pad_inner_dim``), so packed batches of any length train.

Full fine-tuning only: a PEFT model's frozen base and small adapters, and quantized bases, are refused with the
reason. The swap keeps each original ``nn.Linear`` (the new module shares its weight and bias Parameters), so
``unpatch`` puts the very same modules back.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch
from torch import nn

from ..errors import BackendUnavailable, ConfigurationError
from ..memory.targets import decoder_layers

PRECISIONS = (None, "fp8")
RECIPE = "rowwise"
_ALIGN = 16  # torch._scaled_mm: both dimensions of each operand a multiple of 16


def check_precision(value: object) -> None:
    if value not in PRECISIONS:
        raise ConfigurationError(f"precision must be None (the weights' own precision) or 'fp8' (torchao float8 "
                                 f"training, an explicit opt-in that changes the computation); got {value!r}.")


def _float8_api():
    try:
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training
    except ImportError as error:
        raise BackendUnavailable(
            "precision='fp8' trains through torchao's float8 training, and torchao is not installed: "
            "pip install 'hf_accel[fp8]' (or pip install torchao)."
        ) from error
    return Float8LinearConfig, convert_to_float8_training


def refusal(model: nn.Module, model_hf: nn.Module) -> str | None:
    """Why this model cannot take precision='fp8' (one line), or None."""
    from .quantized import compile_stand_down

    if model is not model_hf or any(type(m).__module__.split(".")[0] == "peft" for m in model_hf.modules()):
        return ("precision='fp8' is for full fine-tuning: a PEFT model's base weights are frozen and its adapters "
                "too small for float8 matmuls to pay; train LoRA in bf16 (the default)")
    if getattr(model_hf, "is_quantized", False) or compile_stand_down(model_hf) is not None:
        return "precision='fp8' needs unquantized weights (a quantized base already has its own matmul precision)"
    param = next(model_hf.parameters(), None)
    if param is not None and param.device.type == "cuda":
        major, minor = torch.cuda.get_device_capability(param.device)
        if (major, minor) < (8, 9):
            return (f"precision='fp8' needs float8 tensor cores (compute capability 8.9+: Ada, Hopper, Blackwell); "
                    f"this GPU has {major}.{minor}")
    return None


def _eligible(module: nn.Module) -> bool:
    return type(module) is nn.Linear and module.in_features % _ALIGN == 0 and module.out_features % _ALIGN == 0


def apply(model_hf: nn.Module) -> tuple[list[str], list[Callable[[], None]]]:
    """Swap the decoder layers' eligible ``nn.Linear`` for torchao's ``Float8Linear`` (``patch()`` has checked
    ``refusal``); returns the swapped names and the undo action that puts the original modules back."""
    config_cls, convert = _float8_api()
    # the weight gradient's inner dimension is the batch's token count, which packing makes any number (and the
    # compiled layers a symbol): torchao pads that dimension with zeros to the multiple of 16 that float8 matmuls
    # need, which leaves each product as it was
    config = dataclasses.replace(config_cls.from_recipe_name(RECIPE), pad_inner_dim=True)
    names = {id(m): n for n, m in model_hf.named_modules()}
    originals: list[tuple[nn.Module, str, nn.Module]] = []
    for layer in decoder_layers(model_hf):
        for parent in list(layer.modules()):
            for child_name, child in list(parent.named_children()):
                if _eligible(child):
                    originals.append((parent, child_name, child))
                    setattr(parent, child_name, convert(child, config=config))  # a Linear root comes back swapped

    def undo() -> None:
        for parent, child_name, child in originals:
            setattr(parent, child_name, child)

    swapped = [f"{names.get(id(parent), '')}.{child_name}".lstrip(".") for parent, child_name, _ in originals]
    return swapped, [undo]


def describe(swapped: list[str]) -> str:
    return (f"fp8 ({len(swapped)} decoder linears through torchao float8 training, {RECIPE} scaling): changes the "
            "computation (float8 rounding of each matmul's operands; not equivalent to the weights' own precision); "
            "the LM head, embeddings, norms and attention keep the model's precision")
