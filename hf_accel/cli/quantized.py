"""``hf-accel sft``'s quantized bases (QLoRA): what a checkpoint's config says of its stored quantization (read
before torch is imported), ``--load-in-4bit``'s bitsandbytes config, loading a base in 4 bits on
the device it trains on (a model built in memory through a temporary folder, as transformers' quantizer loads from
files), and the preparation of a quantized base for LoRA (hf_accel's recipe, or PEFT's on request), with
bitsandbytes' CPU inference repacking turned off."""
from __future__ import annotations

import argparse
import os
import warnings
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # the command imports torch only once its arguments are checked
    import torch


def stored_quantization(config: dict[str, Any]) -> str | None:
    """How a checkpoint's config says its weights are stored quantized ("bitsandbytes 4-bit", "gptq", ...), or None.
    GGUF files are dequantized on loading (--smollm2): not a stored quantization."""
    quant = config.get("quantization_config") or {}
    method = str(quant.get("quant_method", "")).lower()
    if not method or method == "gguf":
        return None
    if method == "bitsandbytes":
        return "bitsandbytes 4-bit" if quant.get("load_in_4bit") else "bitsandbytes 8-bit"
    return method


def quantized_needs_lora(model: str, stored: str) -> str:
    return (f"--model {model} is stored quantized ({stored}): its weights cannot train, LoRA adapters on them can: "
            "add --lora-r R (e.g. 16)")


def four_bit_config(args: argparse.Namespace, dtype):
    """The BitsAndBytesConfig of --load-in-4bit (computed in the run's dtype), or None."""
    if not args.load_in_4bit:
        return None
    from transformers import BitsAndBytesConfig

    return BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type=args.bnb_4bit_quant_type or "nf4",
                              bnb_4bit_use_double_quant=args.use_bnb_nested_quant, bnb_4bit_compute_dtype=dtype)


def quantized_loading(quantization, device_map: bool = True) -> dict[str, Any]:
    """from_pretrained's keywords for a quantized base: the quantization (None: the checkpoint's own, or none) and
    this process's device (bitsandbytes quantizes a weight where it is placed, and the Trainer does not move a
    quantized model, so it is loaded straight there)."""
    import torch

    keywords: dict[str, Any] = {} if quantization is None else {"quantization_config": quantization}
    if device_map:
        keywords["device_map"] = {"": str(process_device()) if torch.cuda.is_available() else "cpu"}
    return keywords


def process_device():
    """This process's GPU: the launcher's LOCAL_RANK (0 in a single process)."""
    import torch

    return torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))


def reload_quantized(model, quantization, dtype):
    """A model built in memory, in 4 bits: saved to a temporary folder and loaded back through transformers'
    quantizer, as a model from a folder or the hub is."""
    import tempfile

    from transformers import AutoModelForCausalLM

    with tempfile.TemporaryDirectory(prefix="hf-accel-4bit-") as folder:
        model.save_pretrained(folder)
        quantized = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype,
                                                         attn_implementation=model.config._attn_implementation,
                                                         **quantized_loading(quantization))
    quantized.name_or_path = quantized.config._name_or_path = model.name_or_path  # not the temporary folder
    return quantized


def prepare_quantized(model, args: argparse.Namespace):
    """A quantized base ready for LoRA, as hf_accel's QLoRA recipe has it (docs/qlora.md): frozen, its weights that
    are not quantized (norms, embeddings, head) left in the dtype it was loaded in (the run's: bf16 with --bf16), and
    -- unless --checkpointing chooses -- every layer checkpointed (non-reentrant), which patch() takes over with its
    own (trimmed; offloaded on CUDA). That is TRL's QLoRA path too; PEFT's ``prepare_model_for_kbit_training`` makes
    those weights fp32 instead, which is slower and larger (issue 70's measurement) and changes nothing in an fp32 run.
    ``args.peft_kbit_preparation`` (``--peft-kbit-preparation`` where the command offers it) runs PEFT's preparation
    instead; --keep-base-dtype then puts those weights back in bf16 afterwards (``unquantized_weights_to``).
    bitsandbytes' CPU inference repacking is turned off (patched or not): the held-out evaluation before training
    would otherwise leave the weights in a layout that trains with wrong gradients
    (``fused.quantized.keep_cpu_4bit_trainable``)."""
    import torch

    from ..fused.quantized import keep_cpu_4bit_trainable

    keep_cpu_4bit_trainable(model)
    checkpointing = {"use_reentrant": False} if args.checkpointing is None else None
    if not getattr(args, "peft_kbit_preparation", False):
        model.requires_grad_(False)
        if checkpointing is not None:  # 5.23 renamed gradient_checkpointing_enable (5.17); the first positional stays
            enable = getattr(model, "activation_checkpointing_enable", None) or model.gradient_checkpointing_enable
            enable(checkpointing)
        return model
    from peft import prepare_model_for_kbit_training

    with warnings.catch_warnings():  # PEFT calls methods transformers 5.2x renamed: nothing a user can change
        warnings.filterwarnings("ignore", message=".*gradient_checkpointing.* is deprecated", category=FutureWarning)
        model = prepare_model_for_kbit_training(model, use_gradient_checkpointing=checkpointing is not None,
                                                gradient_checkpointing_kwargs={"use_reentrant": False})
    if args.keep_base_dtype:
        unquantized_weights_to(model, torch.bfloat16)
    return model


def unquantized_weights_to(model: torch.nn.Module, dtype: torch.dtype) -> int:
    """Cast a PEFT-prepared quantized base's fp32 weights (those ``prepare_model_for_kbit_training`` upcast: norms,
    embeddings, LM head; the quantized weights are integer storage and stay) to ``dtype``, as hf_accel's recipe, TRL's
    SFTTrainer (neither runs PEFT's preparation) and Unsloth keep them. The residual stream is then ``dtype`` instead of fp32:
    every layer input a checkpoint saves is half the bytes in bf16. Call it before adding adapters (PEFT makes those
    fp32 itself). Returns how many tensors it cast."""
    import torch

    cast = 0
    for param in model.parameters():
        if param.dtype == torch.float32:
            param.data = param.data.to(dtype)
            cast += 1
    return cast
