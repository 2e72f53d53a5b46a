"""Benchmark configurations whose packages are kept apart from the main environment (issue 20): Unsloth and
bitsandbytes (QLoRA). Unsloth pins older transformers / trl / datasets than the other configurations use, and
bitsandbytes is large: both are packed apart (`pack-wheels.sh NAME ...` installs a pack into <site_root>/site-NAME on
the GPU machine) and only the child process of a configuration that names the pack in `sites` puts it first on its
PYTHONPATH. Here: those folders, the child's environment, whether a kept-apart package is installed, the models such
runs load from files (NF4 QLoRA base, Unsloth's FastLanguageModel) and Unsloth's runner. configs.py registers them."""
from __future__ import annotations

import contextlib
import importlib.machinery
import os
import sys
from typing import Any, Callable, Iterator

import torch
from torch import nn

from .options import BenchConfig, Options
from .train import RunSettings, Timing, build_model, expert_target_parameters, run_trl
from .workloads import BenchData, Workload

APART_PACKAGES: dict[str, str] = {"unsloth": "unsloth", "bitsandbytes": "bitsandbytes",  # requirement -> module
                                  "torchao": "torchao"}
UNSLOTH_SITES = ("unsloth", "bnb")  # pack names: unsloth + unsloth_zoo + their pins; bitsandbytes (4-bit)
BNB_SITES = ("bnb",)
TORCHAO_SITES = ("torchao",)  # torchao alone (precision="fp8"), the same wheel as in Unsloth's pack
# Unsloth must run offline: no statistics download, no hub or internet probes (unsloth/models/_utils.py reads these).
UNSLOTH_ENV = {"UNSLOTH_DISABLE_STATISTICS": "1", "UNSLOTH_OFFLINE": "1", "HF_HUB_OFFLINE": "1",
               "TRANSFORMERS_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "HF_HUB_DISABLE_TELEMETRY": "1"}


def site_dirs(names: tuple[str, ...] | list[str], root: str) -> list[str]:
    """The folders of packs `names`: NAME -> <root>/site-NAME (pack-wheels' install folder); a name with a path
    separator is taken as the folder itself."""
    return [name if os.sep in name else os.path.join(root, f"site-{name}") for name in names]


def child_sites(config: BenchConfig, options: Options) -> list[str]:
    """The folders `config`'s child puts first on PYTHONPATH, in order: its own packs, then --extra-site ones."""
    names = list(dict.fromkeys((*config.sites, *options.extra_sites)))
    return site_dirs(names, options.site_root)


def child_env(config: BenchConfig, options: Options, base: dict[str, str] | None = None) -> dict[str, str]:
    """The child's environment: `base` (os.environ) with child_sites ahead of its PYTHONPATH."""
    env = dict(os.environ if base is None else base)
    sites = child_sites(config, options)
    if sites:
        env["PYTHONPATH"] = os.pathsep.join([*sites, *([env["PYTHONPATH"]] if env.get("PYTHONPATH") else [])])
    return env


def missing_apart(need: str, sites: list[str]) -> str | None:
    """Whether a package kept apart is importable from `sites` or this process's path (None), else why not."""
    module = APART_PACKAGES[need]
    importlib.invalidate_caches()  # a pack installed since the last look (finders cache folder listings)
    try:
        found = importlib.machinery.PathFinder.find_spec(module, [*sites, *sys.path]) is not None
    except (ImportError, ValueError):
        found = False
    if found:
        return None
    where = ", ".join(sites) if sites else "no pack folder"
    return f"{module} not installed (looked in {where} and this Python's path)"


@contextlib.contextmanager
def saved_random_model(settings: RunSettings) -> Iterator[str]:
    """A folder holding the workload's random-init model (settings.dtype) and the offline tokenizer, written with
    save_pretrained: Unsloth and bitsandbytes' 4-bit quantizer load from files, not from a config. In RAM (/dev/shm)
    where the weights fit, else the temp folder; removed afterwards."""
    import shutil
    import tempfile

    from .train import offline_tokenizer

    model = build_model(settings, "sdpa")
    size = sum(t.numel() * t.element_size() for t in model.state_dict().values())
    ram = "/dev/shm"  # containers often mount a small one: use it only when the weights fit with room to spare
    ram_fits = os.path.isdir(ram) and os.access(ram, os.W_OK) and shutil.disk_usage(ram).free > 1.2 * size
    with tempfile.TemporaryDirectory(dir=ram if ram_fits else None, prefix="bench-model-") as folder:
        model.save_pretrained(folder)
        offline_tokenizer().save_pretrained(folder)
        del model
        if settings.device.startswith("cuda"):
            torch.cuda.empty_cache()
        yield folder


def nf4_config():
    """issue 20's QLoRA base: 4-bit NF4 weights, bf16 compute."""
    from transformers import BitsAndBytesConfig

    return BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=torch.bfloat16)


def qlora_base(settings: RunSettings, attn_implementation: str, kbit_preparation: bool = False,
               keep_bf16: bool = False) -> nn.Module:
    """The workload's model in NF4 (bf16 compute; norms, embeddings and LM head in bf16 as loaded), checkpointing as
    the workload says (non-reentrant), no LoRA yet: the base of TRL's QLoRA path and of hf_accel's recommended recipe
    (docs/qlora.md). The NF4 model is the random bf16 one saved and reloaded (the file route, as users load), or for
    workloads too large for that (`qlora_build="device"`: 70B) built in NF4 on the device one weight at a time
    (quantized_base.build_4bit_model).

    kbit_preparation: PEFT's QLoRA recipe on top (prepare_model_for_kbit_training: norms, embeddings and the LM head
    in fp32, so the residual stream is fp32 under autocast; its checkpointing). keep_bf16 (with it): those weights back
    in bf16 after the recipe, as `hf-accel sft --keep-base-dtype` does."""
    from peft import prepare_model_for_kbit_training
    from transformers import AutoModelForCausalLM

    from .quantized_base import build_4bit_model
    from .workloads import build_config

    if not settings.workload.lora:
        raise ValueError(f"QLoRA trains LoRA adapters on a frozen 4-bit base; workload {settings.workload.name!r} "
                         "has no LoRA. Run it on llama-8b-qlora (--preset llama-8b-qlora).")
    if keep_bf16 and not kbit_preparation:
        raise ValueError("keep_bf16 casts back what prepare_model_for_kbit_training made fp32: pass "
                         "kbit_preparation=True too (without it the base is bf16 already)")
    if settings.workload.qlora_build == "device":
        model = build_4bit_model(build_config(settings.workload, settings.tiny), nf4_config(), settings.device,
                                 attn_implementation=attn_implementation, seed=settings.seed)
    else:
        with saved_random_model(settings) as folder:
            model = AutoModelForCausalLM.from_pretrained(folder, quantization_config=nf4_config(),
                                                         dtype=torch.bfloat16, attn_implementation=attn_implementation,
                                                         device_map={"": settings.device})
    model.config.use_cache = False
    if not kbit_preparation:
        model.requires_grad_(False)  # the base is frozen (get_peft_model freezes it too)
        if settings.workload.checkpointing:
            enable = getattr(model, "activation_checkpointing_enable", None) or model.gradient_checkpointing_enable
            enable({"use_reentrant": False})
        return model
    model = prepare_model_for_kbit_training(model, use_gradient_checkpointing=settings.workload.checkpointing,
                                            gradient_checkpointing_kwargs={"use_reentrant": False})
    if keep_bf16:
        from hf_accel.cli.quantized import unquantized_weights_to  # what hf-accel sft --keep-base-dtype does

        unquantized_weights_to(model, torch.bfloat16)
    return model


def unsloth_runner(load_in_4bit: bool, compiled: bool = True) -> Callable[..., nn.Module]:
    """Unsloth as its notebooks use it: FastLanguageModel from a local folder (bf16, or NF4 for QLoRA), its LoRA on
    the workload's targets (r=16, alpha=32) with its offloaded checkpointing ("unsloth") where the workload
    checkpoints, full fine-tuning (`full_finetuning=True`) where the workload has no LoRA, then TRL's SFTTrainer as
    Unsloth patches it, packing=True (padding-free), on the same data and token budget as trl-fa4-packed.
    `compiled=False` sets Unsloth's own switch UNSLOTH_COMPILE_DISABLE=1 (its generated torch.compile'd modules off),
    for a base whose compiled layers fail on the installed torch (Gemma 2 on the GPU image's torch 2.11)."""

    def run(settings: RunSettings, data: BenchData, options: Options, timing: Timing) -> nn.Module:
        import tempfile

        os.environ.update(UNSLOTH_ENV)
        if not compiled:
            os.environ["UNSLOTH_COMPILE_DISABLE"] = "1"
        # Unsloth writes its generated modules to ./unsloth_compiled_cache by default: keep them out of the checkout
        os.environ.setdefault("UNSLOTH_COMPILE_LOCATION", os.path.join(tempfile.gettempdir(), "unsloth_compiled_cache"))
        from unsloth import FastLanguageModel  # first: Unsloth patches transformers, peft and trl on import

        workload = settings.workload
        checkpointing = "unsloth" if workload.checkpointing else False
        with saved_random_model(settings) as folder:
            model, tokenizer = FastLanguageModel.from_pretrained(
                model_name=folder, max_seq_length=data.spec.max_len, dtype=torch.bfloat16, load_in_4bit=load_in_4bit,
                full_finetuning=not workload.lora, use_gradient_checkpointing=checkpointing, fix_tokenizer=False,
                use_exact_model_name=True, random_state=settings.seed,
            )
        if workload.lora:
            model = FastLanguageModel.get_peft_model(
                model, r=16, lora_alpha=32, lora_dropout=0.0, bias="none", target_modules=list(workload.lora_targets),
                use_gradient_checkpointing=checkpointing, random_state=settings.seed,
                **unsloth_expert_targets(model, workload),
            )
        timing.notes.append(f"unsloth: load_in_4bit={load_in_4bit}, full_finetuning={not workload.lora}, "
                            f"{'' if compiled else 'UNSLOTH_COMPILE_DISABLE=1, '}"
                            f"use_gradient_checkpointing={checkpointing!r}; {unsloth_attention()}")
        # Unsloth's checkpointing is already on the model; TRL's would put HF's own back over it
        run_trl(model, data, settings, timing, liger=False, sft_overrides={"gradient_checkpointing": False},
                processing_class=tokenizer)
        return model

    return run


def unsloth_expert_targets(model: nn.Module, workload: Workload) -> dict[str, Any]:
    """Unsloth's MoE LoRA ("Split LoRA", its faster-MoE docs) takes the experts' 3-D projections as PEFT does:
    ``get_peft_model(target_parameters=[...])``, the names every row adapts (``expert_target_parameters``); nothing
    for a dense workload, whose call stays as Unsloth's notebooks write it."""
    names = expert_target_parameters(workload, model)
    return {"target_parameters": names} if names else {}


def unsloth_attention() -> str:
    """Which attention kernel Unsloth picks for packed (varlen) training calls, and what it found installed."""
    try:
        from unsloth.utils import attention_dispatch as dispatch

        return (f"attention for packed batches: {dispatch.select_attention_backend(use_varlen=True)} (flash_attn "
                f"2: {getattr(dispatch, 'HAS_FLASH_ATTENTION', '?')}, xformers: "
                f"{getattr(dispatch, 'HAS_XFORMERS', '?')} {getattr(dispatch, 'xformers_version', '')})")
    except Exception as exc:  # an Unsloth internals change must not fail the row
        return f"attention backend not read ({type(exc).__name__}: {exc})"
