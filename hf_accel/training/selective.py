"""Selective checkpoints (``AccelArguments(save="trainable")``): only the parameters that train, plus a fingerprint
of the frozen part, so a resume can refuse a different base model instead of silently training on it.

The fingerprint lists every frozen tensor of the state dict (parameters and persistent buffers) with its shape,
dtype and a hash of a fixed sample of its values (``SAMPLE`` evenly spaced elements): cheap on any size of model,
and a different base (other weights, other dtype, a missing or extra layer) differs in it. The optimizer state
needs nothing special: transformers' optimizer only holds the trainable parameters.
"""
from __future__ import annotations

import hashlib
import json
import os
from typing import Any

import torch

from ..errors import CheckpointError

TRAINABLE_FILE = "trainable.safetensors"
FINGERPRINT_FILE = "frozen_fingerprint.json"
SAMPLE = 256  # elements hashed per frozen tensor


def trainable_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """``name -> tensor`` of the parameters that train (tied parameters once, under their first name)."""
    return {name: p.detach() for name, p in model.named_parameters() if p.requires_grad}


def sample_indices(numel: int, count: int = SAMPLE) -> torch.Tensor:
    """``count`` evenly spaced indices into ``numel`` elements, first and last included, in exact integer arithmetic:
    the same on every device and in range for any size (a float32 linspace rounds past the end above ~2**24
    elements, e.g. a Llama-3 embedding's 525M)."""
    count = min(numel, count)
    if count <= 1:
        return torch.zeros(count, dtype=torch.long)
    return torch.arange(count, dtype=torch.long) * (numel - 1) // (count - 1)


def _sample_hash(t: torch.Tensor) -> str | None:
    if t.device.type == "meta" or t.numel() == 0:
        return None
    flat = t.detach().reshape(-1)
    idx = sample_indices(flat.numel()).to(flat.device)
    picked = flat[idx].to("cpu").contiguous()
    return hashlib.sha256(picked.view(torch.uint8).numpy().tobytes()).hexdigest()[:16]


def frozen_fingerprint(model: torch.nn.Module) -> dict[str, dict[str, Any]]:
    """``name -> {shape, dtype, sample}`` for every state-dict entry that does not train."""
    trainable = {id(p) for p in model.parameters() if p.requires_grad}
    return {
        name: {"shape": list(t.shape), "dtype": str(t.dtype), "sample": _sample_hash(t)}
        for name, t in model.state_dict(keep_vars=True).items() if id(t) not in trainable
    }


def fingerprint_differences(saved: dict[str, dict], now: dict[str, dict]) -> list[str]:
    out = [f"{n}: in the checkpoint's base, not in this model" for n in sorted(set(saved) - set(now))]
    out += [f"{n}: in this model, not in the checkpoint's base" for n in sorted(set(now) - set(saved))]
    for name in sorted(set(saved) & set(now)):
        a, b = saved[name], now[name]
        for key in ("shape", "dtype", "sample"):
            if a.get(key) != b.get(key):
                what = "values" if key == "sample" else key
                out.append(f"{name}: {what} differ (checkpoint {a.get(key)}, now {b.get(key)})")
                break
    return out


def save_trainable(folder: str, tensors: dict[str, torch.Tensor], fingerprint: dict[str, dict]) -> None:
    """Write ``tensors`` (the trainable parameters) and the frozen part's fingerprint into ``folder``."""
    from .shards import write_safetensors

    os.makedirs(folder, exist_ok=True)
    write_safetensors(os.path.join(folder, TRAINABLE_FILE), tensors, metadata={"format": "pt", "hf_accel": "trainable"})
    with open(os.path.join(folder, FINGERPRINT_FILE), "w", encoding="utf-8") as f:
        json.dump(fingerprint, f, indent=0, sort_keys=True)


def is_selective(folder: str) -> bool:
    return os.path.isfile(os.path.join(folder, TRAINABLE_FILE))


def load_trainable(model: torch.nn.Module, folder: str) -> None:
    """Check that ``model``'s frozen part is the checkpoint's base, then load its trainable parameters; raises
    ``CheckpointError`` (and loads nothing) on any difference."""
    from safetensors.torch import load_file

    with open(os.path.join(folder, FINGERPRINT_FILE), encoding="utf-8") as f:
        saved = json.load(f)
    diff = fingerprint_differences(saved, frozen_fingerprint(model))
    if diff:
        shown = "; ".join(diff[:5]) + (f"; ... ({len(diff)} differences)" if len(diff) > 5 else "")
        raise CheckpointError(
            f"{folder} holds only the trainable parameters of another base model ({shown}). Load the base model the "
            "run started from (same weights and dtype), or start a new run."
        )
    tensors = load_file(os.path.join(folder, TRAINABLE_FILE), device="cpu")
    params = dict(trainable_state(model))
    if set(tensors) != set(params) or any(tensors[n].shape != params[n].shape for n in params):
        missing, extra = sorted(set(params) - set(tensors)), sorted(set(tensors) - set(params))
        raise CheckpointError(
            f"{folder}: its trainable parameters do not match this model's (missing {missing[:5]}, extra "
            f"{extra[:5]}, or other shapes). Train the same parameters as the run that saved it (same LoRA "
            "config, same frozen modules)."
        )
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name in tensors:
                p.copy_(tensors[name])
