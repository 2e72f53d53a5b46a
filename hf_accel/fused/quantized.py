"""Quantized bases (QLoRA): which quantized layers hf_accel's compiled layers are checked on.

bitsandbytes' 4-bit ``Linear4bit`` (NF4 / FP4, plain or nested statistics) is: its forward matmul
(``bitsandbytes::gemm_4bit``) and the backward's dequantize (``bitsandbytes::dequantize_4bit``, with
``dequantize_blockwise`` for nested statistics) are ``torch.library`` custom ops with fake kernels, so dynamo traces
``Linear4bit.forward`` and bitsandbytes' autograd function around them and keeps the two ops opaque in the layer's
graph; inductor compiles what is around them (the input cast to the compute dtype, the cast of the output back, PEFT's
defensive clone and the adapter's add). tests/test_qlora.py checks compiled against eager training steps on such a
base. Every other quantizer's layers (bitsandbytes 8-bit, torchao, GPTQ, AWQ, HQQ, quanto, ...) is not checked, and
``compile="auto"`` stands down on them with that reason. Nothing here imports a quantization library: layers are
recognised by the package and name of their classes.
"""
from __future__ import annotations

from typing import Callable

from torch import nn

from ..errors import ConfigurationError

QUANTIZER_PACKAGES = ("bitsandbytes", "torchao", "auto_gptq", "gptqmodel", "awq", "hqq", "optimum", "quanto")
COMPILE_CHECKED_LAYERS = (("bitsandbytes", "Linear4bit"),)  # (package, class name), subclasses included
COMPILE_CHECKED_QUANTIZERS = ("Bnb4BitHfQuantizer",)  # transformers' quantizer of BitsAndBytesConfig(load_in_4bit=True)
_CHECKED = "compiled layers are checked on bitsandbytes 4-bit (Linear4bit) only"
# torchao's float8 *training* layers (patch(precision="fp8")) keep high-precision weights: not a quantized base
TRAINING_LAYERS = (("torchao", "Float8Linear"),)


def compile_checked(cls: type) -> bool:
    """Whether a quantized layer class is one compiled layers are checked on (or a subclass of one)."""
    return any((c.__module__.split(".")[0], c.__name__) in COMPILE_CHECKED_LAYERS for c in cls.__mro__)


def four_bit_base(model: nn.Module) -> bool:
    """Whether the model's linears include bitsandbytes 4-bit ones (a QLoRA base)."""
    return any(compile_checked(type(module)) for module in model.modules())


def compile_stand_down(model: nn.Module) -> str | None:
    """Why compiled layers should stand down on this model's quantized weights (one line), or None: no quantized
    layers, or bitsandbytes 4-bit ones only."""
    quantizer = getattr(model, "hf_quantizer", None)
    if quantizer is not None and type(quantizer).__name__ not in COMPILE_CHECKED_QUANTIZERS:
        return f"{type(quantizer).__name__} weights: {_CHECKED}"
    if quantizer is None and getattr(model, "is_quantized", False):
        return f"quantized weights: {_CHECKED}"
    for module in model.modules():
        cls = type(module)
        package = cls.__module__.split(".")[0]
        if (package, cls.__name__) in TRAINING_LAYERS:
            continue
        if package in QUANTIZER_PACKAGES and not compile_checked(cls):
            return f"{cls.__name__} layers: {_CHECKED}"
    return None


CPU_PACKING_FLAG = "support_avx512bf16_for_cpu"  # Linear4bit's instance flag (bitsandbytes >= 0.49)


def keep_cpu_4bit_trainable(model: nn.Module) -> tuple[int, list[Callable[[], None]]]:
    """Turn off bitsandbytes' CPU inference repacking on the model's 4-bit layers; (layers changed, undo actions).

    On a CPU with AVX512-BF16, a ``Linear4bit`` that runs in eval mode without gradients (an evaluation, a
    ``generate()``) repacks its weight for a faster CPU kernel and keeps it so. A training step afterwards goes through
    that kernel (``bitsandbytes::gemv_4bit``), which has no backward: the gradients reaching earlier layers are wrong
    (torch only warns that "an autograd kernel was not registered"). With the layer's flag off, evaluation runs the
    unpacked kernels that training runs. A weight already repacked cannot be trained: ConfigurationError."""
    layers = [(name, module) for name, module in model.named_modules() if compile_checked(type(module))]
    for name, module in layers:  # all checked before any is changed
        if getattr(getattr(module.weight, "quant_state", None), "packing_format_for_cpu", False):
            raise ConfigurationError(
                f"{name}: bitsandbytes repacked this 4-bit weight for CPU inference (the model ran in eval mode "
                "before), and training through that layout gives wrong gradients. Load the model again and patch it "
                "(or build the Trainer) before evaluating it.")
    changed = [module for _, module in layers if getattr(module, CPU_PACKING_FLAG, False)]
    for module in changed:
        setattr(module, CPU_PACKING_FLAG, False)

    def undo() -> None:
        for module in changed:
            setattr(module, CPU_PACKING_FLAG, True)

    return len(changed), [undo] if changed else []
