"""A bitsandbytes 4-bit model built on the device one weight at a time, for QLoRA workloads whose bf16 weights fit
neither the machine's disk nor its RAM (Llama-3-70B: ~140 GB), so the file route (save, then `from_pretrained` with a
`BitsAndBytesConfig`) cannot run.

The model is created on the meta device, every linear that transformers' bitsandbytes quantizer would convert (all
but the LM head) is replaced by `bitsandbytes.nn.Linear4bit` as that quantizer builds it, then each weight is made on
the device in bf16 (a random init, or a given source), quantized to `Params4bit` right away and its bf16 copy freed:
at most one matrix exists in bf16 at a time. The model carries what `from_pretrained` leaves on a 4-bit model
(`hf_quantizer`, `is_loaded_in_4bit`, `config.quantization_config`, ...), so PEFT's kbit preparation, `get_peft_model`
and transformers' Trainer treat it as one. tests/test_qlora_build.py checks it against the file route on the same
weights: the same quantized data and states, the same logits.
"""
from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

# (parameter name, shape, the module that owns it) -> the bf16 tensor on the device
WeightSource = Callable[[str, tuple[int, ...], nn.Module], torch.Tensor]


def random_weights(config, device: torch.device | str, seed: int = 0) -> WeightSource:
    """transformers' random init for these models, generated on the device: linear and embedding weights
    normal(0, initializer_range), biases zeros, other weights (norms) ones; one seeded stream in creation order."""
    generator = torch.Generator(device=device).manual_seed(seed)
    std = getattr(config, "initializer_range", 0.02)

    def make(name: str, shape: tuple[int, ...], module: nn.Module) -> torch.Tensor:
        if name.endswith("bias"):
            return torch.zeros(shape, dtype=torch.bfloat16, device=device)
        if isinstance(module, (nn.Linear, nn.Embedding)):
            return torch.empty(shape, dtype=torch.bfloat16, device=device).normal_(0.0, std, generator=generator)
        return torch.ones(shape, dtype=torch.bfloat16, device=device)

    return make


def build_4bit_model(config, quantization_config, device: torch.device | str, *, weights: WeightSource | None = None,
                     attn_implementation: str = "sdpa", seed: int = 0) -> nn.Module:
    """The causal LM of ``config`` with bitsandbytes 4-bit linears (``quantization_config``: a 4-bit
    BitsAndBytesConfig) on ``device``, non-quantized weights in bf16, from ``weights`` (default: ``random_weights``)."""
    from transformers import AutoModelForCausalLM

    if not getattr(quantization_config, "load_in_4bit", False):
        raise ValueError(f"build_4bit_model needs a 4-bit BitsAndBytesConfig (load_in_4bit=True); got {quantization_config!r}")
    device = torch.device(device)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16, attn_implementation=attn_implementation)
    _to_linear4bit(model, quantization_config)
    _materialize(model, weights or random_weights(config, device, seed), device)
    _mark_quantized(model, quantization_config)
    return model


def _skipped(model: nn.Module, quantization_config) -> set[str]:
    """Modules left unquantized: the LM head (what transformers' quantizer keeps) and llm_int8_skip_modules."""
    head = model.get_output_embeddings()
    names = {n for n, m in model.named_modules() if m is head}
    return names | set(quantization_config.llm_int8_skip_modules or ())


def _to_linear4bit(model: nn.Module, quantization_config) -> None:
    """Replace each nn.Linear (but the skipped) by bitsandbytes' Linear4bit, as transformers' bnb quantizer does."""
    import bitsandbytes as bnb

    skipped = _skipped(model, quantization_config)
    for name, module in list(model.named_modules()):
        if type(module) is not nn.Linear or any(name == s or name.endswith("." + s) for s in skipped):
            continue
        with torch.device("meta"):
            new = bnb.nn.Linear4bit(
                module.in_features, module.out_features, module.bias is not None,
                quantization_config.bnb_4bit_compute_dtype,
                compress_statistics=quantization_config.bnb_4bit_use_double_quant,
                quant_type=quantization_config.bnb_4bit_quant_type,
                quant_storage=quantization_config.bnb_4bit_quant_storage,
            )
        new.source_cls = type(module)
        new.requires_grad_(False)
        parent_name, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent_name) if parent_name else model, child, new)


def _materialize(model: nn.Module, weights: WeightSource, device: torch.device) -> None:
    """Every meta parameter made on ``device`` from ``weights`` (Linear4bit weights quantized at once), then the
    rotary embeddings' buffers recomputed there."""
    import bitsandbytes as bnb

    made: dict[int, tuple[nn.Parameter, nn.Parameter]] = {}  # meta -> made: a tied weight is made once, then shared
    for module_name, module in model.named_modules(remove_duplicate=False):
        for pname, param in list(module.named_parameters(recurse=False)):
            if param.device.type != "meta":
                continue
            if id(param) in made:
                setattr(module, pname, made[id(param)][1])
                continue
            name = f"{module_name}.{pname}" if module_name else pname
            value = weights(name, tuple(param.shape), module)
            if isinstance(module, bnb.nn.Linear4bit) and pname == "weight":
                old = module.weight
                module.weight = bnb.nn.Params4bit(
                    value, requires_grad=False, blocksize=old.blocksize, compress_statistics=old.compress_statistics,
                    quant_type=old.quant_type, quant_storage=old.quant_storage, module=module,
                ).to(device)  # quantizes; the bf16 `value` is freed when it goes out of scope
            else:
                setattr(module, pname, nn.Parameter(value.to(param.dtype), requires_grad=param.requires_grad))
            made[id(param)] = (param, getattr(module, pname))  # the meta one kept: its id stays unique
            del value
    for module_name, module in list(model.named_modules()):
        if not any(b.device.type == "meta" for b in module.buffers(recurse=False)):
            continue
        if "RotaryEmbedding" not in type(module).__name__:
            raise ValueError(f"build_4bit_model cannot make buffers of {module_name} ({type(module).__name__}) on the "
                             "device; only rotary embeddings are rebuilt. Use the file route (from_pretrained).")
        with torch.device(device):  # its constructor computes the buffers (5.17 took a `device`, 5.23 does not)
            rebuilt = type(module)(config=module.config).to(device)
        parent_name, _, child = module_name.rpartition(".")
        setattr(model.get_submodule(parent_name) if parent_name else model, child, rebuilt)


def _mark_quantized(model: nn.Module, quantization_config) -> None:
    """What transformers' bnb quantizer leaves on a model it loaded in 4-bit."""
    from transformers.quantizers import AutoHfQuantizer

    model.hf_quantizer = AutoHfQuantizer.from_config(quantization_config, pre_quantized=False)
    model.is_quantized = True
    model.quantization_method = quantization_config.quant_method
    model.is_loaded_in_4bit = True
    model.config.quantization_config = quantization_config
    model.config._is_quantized = True
