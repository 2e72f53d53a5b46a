"""Per-layer shards (``AccelArguments(layer_shards=True)``): one safetensors file per decoder layer, one for the
embeddings and one for the rest (final norm, LM head), with the standard ``model.safetensors.index.json``, so
``from_pretrained`` loads the folder and ``load_layer_range`` reads only the files of the layers asked for.

Files are written by ``write_safetensors``, which streams each tensor's bytes to disk: no second in-memory copy of
the state (``safetensors.torch.save_file`` first turns every tensor into a ``bytes`` object).
"""
from __future__ import annotations

import json
import os
import re
import struct
from collections import defaultdict
from typing import Any

import torch
from safetensors import safe_open

INDEX_FILE = "model.safetensors.index.json"  # transformers' SAFE_WEIGHTS_INDEX_NAME
EMBEDDINGS_FILE = "model-embeddings.safetensors"
REST_FILE = "model-head.safetensors"
_LAYER = re.compile(r"\.(?:layers|h)\.(\d+)\.")  # Llama / GPT-NeoX "layers.N.", Falcon "h.N."
_EMBEDDING_NAMES = ("embed_tokens", "embed_in", "word_embeddings", "wte")
_DTYPES = {torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16", torch.float64: "F64",
           torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
           torch.bool: "BOOL", torch.float8_e4m3fn: "F8_E4M3", torch.float8_e5m2: "F8_E5M2"}


def layer_file(layer: int) -> str:
    return f"model-layer-{layer:05d}.safetensors"


def shard_of(name: str) -> str:
    m = _LAYER.search(name)
    if m:
        return layer_file(int(m.group(1)))
    return EMBEDDINGS_FILE if any(e in name for e in _EMBEDDING_NAMES) else REST_FILE


def write_safetensors(path: str, tensors: dict[str, torch.Tensor], metadata: dict[str, str] | None = None) -> None:
    """A safetensors file written tensor by tensor from CPU memory (the host holds no copy beyond ``tensors``)."""
    header: dict[str, Any] = {"__metadata__": metadata} if metadata else {}
    offset = 0
    for name, t in tensors.items():
        n = t.numel() * t.element_size()
        header[name] = {"dtype": _DTYPES[t.dtype], "shape": list(t.shape), "data_offsets": [offset, offset + n]}
        offset += n
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # keep the data 8-byte aligned, as safetensors does
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw)))
        f.write(raw)
        for t in tensors.values():
            t = t.detach().to("cpu").contiguous()
            if t.numel():
                f.write(memoryview(t.reshape(-1).view(torch.uint8).numpy()))


def _once(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Tied weights once (safetensors refuses shared storage; from_pretrained re-ties them)."""
    kept, seen = {}, set()
    for name, t in state.items():
        key = (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), t.dtype)
        if key not in seen:
            seen.add(key)
            kept[name] = t
    return kept


def _save_configs(model: torch.nn.Module, folder: str) -> None:
    model.config.save_pretrained(folder)
    if getattr(model, "generation_config", None) is not None:
        model.generation_config.save_pretrained(folder)


def save_single_file(model: torch.nn.Module, folder: str, state_dict: dict[str, torch.Tensor]) -> None:
    """``model.safetensors`` + config, streamed from ``state_dict`` (what ``from_pretrained`` reads)."""
    os.makedirs(folder, exist_ok=True)
    write_safetensors(os.path.join(folder, "model.safetensors"), _once(state_dict), metadata={"format": "pt"})
    _save_configs(model, folder)


def save_layer_shards(model: torch.nn.Module, folder: str, state_dict: dict[str, torch.Tensor] | None = None) -> None:
    """Write ``state_dict`` (default: the model's) as per-layer shards + index + config into ``folder``."""
    kept = _once(state_dict if state_dict is not None else model.state_dict())
    groups: dict[str, dict[str, torch.Tensor]] = defaultdict(dict)
    for name, t in kept.items():
        groups[shard_of(name)][name] = t
    os.makedirs(folder, exist_ok=True)
    for file, tensors in sorted(groups.items()):
        write_safetensors(os.path.join(folder, file), tensors, metadata={"format": "pt"})
    index = {"metadata": {"total_size": sum(t.numel() * t.element_size() for t in kept.values())},
             "weight_map": {name: shard_of(name) for name in kept}}
    with open(os.path.join(folder, INDEX_FILE), "w", encoding="utf-8") as f:
        json.dump(index, f, indent=1, sort_keys=True)
    _save_configs(model, folder)


def load_layer_range(folder: str, first: int, last: int, *, embeddings: bool = False, head: bool = False,
                     device: str = "cpu") -> dict[str, torch.Tensor]:
    """The tensors of decoder layers ``first..last`` (inclusive), optionally with the embeddings and the rest,
    reading only those layers' files."""
    with open(os.path.join(folder, INDEX_FILE), encoding="utf-8") as f:
        weight_map = json.load(f)["weight_map"]
    wanted = {layer_file(i) for i in range(first, last + 1)}
    wanted |= {EMBEDDINGS_FILE} if embeddings else set()
    wanted |= {REST_FILE} if head else set()
    files = sorted(wanted & set(weight_map.values()))
    out: dict[str, torch.Tensor] = {}
    for file in files:
        with safe_open(os.path.join(folder, file), framework="pt", device=device) as f:
            for name in f.keys():
                out[name] = f.get_tensor(name)
    return out
