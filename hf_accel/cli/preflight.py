"""``hf-accel sft``'s checks that need transformers or torch, run after the arguments parse and before anything
loads: what a ``--model`` folder holds (a model type this transformers knows, a tokenizer), hub ids answered in
seconds (``hub``), and an attention backend that can train on this machine. Each refusal is one ``UsageError`` line
naming the flag to change.
"""
from __future__ import annotations

import argparse
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..errors import UsageError

# the files a saved tokenizer leaves (transformers' fast and slow tokenizers, sentencepiece, tiktoken)
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json", "vocab.txt",
                   "spiece.model", "tokenizer.tiktoken")


@dataclass
class Sources:
    """from_pretrained's keywords for the model and for its tokenizer (``local_files_only`` when offline-cached)."""
    model: dict[str, Any] = field(default_factory=dict)
    tokenizer: dict[str, Any] = field(default_factory=dict)


def preflight(args: argparse.Namespace) -> Sources:
    sources = Sources()
    if args.model:
        folder = Path(args.model).expanduser()
        if folder.is_dir():
            check_model_type(args.model, folder)
            if args.tokenizer is None:
                check_tokenizer_files(args.model, folder)
        sources.model = _hub_model(args.model, "--model", "model")
        sources.tokenizer = sources.model if args.tokenizer is None else \
            _hub_model(args.tokenizer, "--tokenizer", "tokenizer")
    if args.dataset:
        from .hub import check_dataset_id

        check_dataset_id(args.dataset)
    check_backend_trains_here(args.backend)
    config = _model_config(args, sources) if args.model else None
    if getattr(args, "lora_experts", False):
        check_lora_experts(args, config)
    check_text_model(args, config)
    return sources


def _model_config(args: argparse.Namespace, sources: Sources) -> Any:
    """--model's config, read once for the checks from it; None where it cannot be read (loading will say why)."""
    from transformers import AutoConfig

    try:
        return AutoConfig.from_pretrained(args.model, **sources.model)
    except (OSError, ValueError):
        return None


def check_text_model(args: argparse.Namespace, config: Any) -> None:
    """A multimodal --model (Gemma 3 4B-27B, Gemma 4) trains with --text-model, and --text-model only with one: said
    from its ``config``, before the weights load."""
    from ..multimodal import is_multimodal

    if not args.model:
        if args.text_model:
            raise UsageError("--text-model: the built-in model is a text model; pass --model of a multimodal "
                             "checkpoint (Gemma 3 4B-27B, Gemma 4), or leave --text-model out")
        return
    if config is None:
        return  # loading will say what is wrong with it
    multimodal = is_multimodal(config)
    text = config.get_text_config(decoder=True) if multimodal else None
    if multimodal and not args.text_model:
        raise UsageError(
            f"--model {args.model} is a multimodal checkpoint ({config.model_type}: a vision or audio tower around "
            f"the {text.model_type!r} language model), which hf-accel sft does not train as a whole; pass "
            "--text-model to train its language model and LM head (the same weights; the output is a text-only "
            "checkpoint), or train it with another tool")
    if args.text_model and not multimodal:
        raise UsageError(f"--text-model: --model {args.model} ({config.model_type}) is a text model already; leave "
                         "--text-model out")


def check_lora_experts(args: argparse.Namespace, config: Any) -> None:
    """--lora-experts on a model whose config builds no mixture-of-experts experts modules: refused from the config
    (--model's ``config``, or the --model-shape's, built on the meta device), before the weights load."""
    from ..patches.experts import experts_shapes
    from .shapes import model_shape_config

    if args.model:
        if config is None:
            return  # loading will say what is wrong with it
        what = f"--model {args.model}"
    elif args.model_shape:
        config, what = model_shape_config(args.model_shape), f"--model-shape {args.model_shape}"
    else:
        raise UsageError("--lora-experts: the built-in toy model is a dense Llama (no experts); pass --model or "
                         "--model-shape of a mixture-of-experts model, or leave --lora-experts out")
    if not experts_shapes(config):
        raise UsageError(f"--lora-experts: {what} ({config.model_type}) has no mixture-of-experts experts modules; "
                         "leave --lora-experts out")


def _hub_model(name: str, flag: str, kind: str) -> dict[str, Any]:
    from .hub import model_source

    return model_source(name, flag, kind)


def check_model_type(name: str, folder: Path) -> None:
    """A --model folder's config.json names a model_type this transformers can build."""
    import transformers

    try:
        config = json.loads((folder / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise UsageError(f"--model {name}: its config.json cannot be read ({str(e).splitlines()[0]}); pass a folder "
                         "written by save_pretrained") from None
    kind = config.get("model_type") if isinstance(config, dict) else None
    if not kind:
        raise UsageError(f"--model {name}: its config.json names no model_type; pass a folder written by "
                         "save_pretrained (config.json, weights, tokenizer)")
    try:
        transformers.AutoConfig.for_model(kind)  # transformers' own registry of the types it can build
    except (ValueError, KeyError):
        raise UsageError(f"--model {name}: config.json has model_type {kind!r}, which transformers "
                         f"{transformers.__version__} does not know; upgrade transformers (pip install -U "
                         "transformers), or pass a folder of a model it knows") from None


def check_tokenizer_files(name: str, folder: Path) -> None:
    if not any((folder / f).exists() for f in TOKENIZER_FILES):
        raise UsageError(f"--model {name}: the folder has no tokenizer (none of {', '.join(TOKENIZER_FILES[:4])}, "
                         "...); pass --tokenizer PATH_OR_ID (e.g. the base model's folder or hub id), or save it "
                         "there (tokenizer.save_pretrained)")


def check_backend_trains_here(backend: str) -> None:
    """--backend NAME must be able to run forward and backward on this machine's device (``env.trains_here``)."""
    if backend == "auto":
        return
    from .env import device_type, trains_here

    ok, why = trains_here(backend)
    if not ok:
        from .env import training_backends

        could = training_backends()
        raise UsageError(f"--backend {backend} cannot train on this machine ({device_type()}): {why}; pass "
                         f"--backend auto" + (f" (here: {', '.join(could)})" if could else ""))
