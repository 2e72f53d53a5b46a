"""Which attention kernel serves each decoder layer of a model patch() is about to patch, and why.

A family's layers may ask different things of a kernel (Gemma's sliding-window and global layers, both soft-capped;
Mistral's window; Falcon-RW's ALiBi): each distinct ``LayerAttention`` becomes one ``AttentionRequest`` and the
registry picks for it. A backend named explicitly (``patch(model, backend="sdpa")``) serves every layer it can; a
layer it cannot serve only for its window / softcap / ALiBi goes to the fastest backend that can ("auto"), and the
report says so, rather than the whole patch failing or the layer silently losing its soft-cap.
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace

import torch

from .attention.kernels import AttentionRequest, DeviceInfo, Selection, select
from .errors import BackendUnavailable
from .family import Family, LayerAttention


def attention_dtype(param_dtype: torch.dtype, device: DeviceInfo) -> torch.dtype:
    """The dtype training calls' attention receives: the autocast dtype when autocast is on now; on CUDA, bf16 for
    fp32 weights (fp32 master weights train under autocast or FSDP2 mixed precision: kbit preparation, FSDP2);
    else the weights' dtype. The seam still selects per call from what it gets (see ``varlen_attention``)."""
    if torch.is_autocast_enabled(device.type):
        return torch.get_autocast_dtype(device.type)
    if device.type == "cuda" and param_dtype == torch.float32:
        return torch.bfloat16
    return param_dtype


def training_request(model, family: Family, device: DeviceInfo | None,
                     layer: LayerAttention | None = None) -> AttentionRequest:
    """What a training call of one of ``model``'s layers (default: its first) asks of a kernel."""
    if layer is None:
        layer = next(iter(family.layer_attentions(model.config).values()), LayerAttention())
    heads_q, heads_kv, head_dim = layer.heads or family.head_shape(model.config)
    param = next((p for p in model.parameters() if p.is_floating_point()), None)
    where = param.device if param is not None else torch.device("cpu")
    if where.type == "meta":  # init_empty_weights / FSDP's cpu_ram_efficient_loading: weights arrive later
        where = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    dev = device or DeviceInfo.of(where)
    return AttentionRequest(
        device=dev, dtype=attention_dtype(param.dtype if param is not None else torch.float32, dev),
        head_dim=head_dim, num_heads_q=heads_q, num_heads_kv=heads_kv,
        dropout=family.training_dropout(model.config) > 0, window=layer.window is not None,
        softcap=layer.softcap is not None, alibi=layer.alibi, sinks=layer.sinks,
    )


@dataclass
class KernelChoice:
    """The backend of the first layer (the report's headline), the name each layer's calls select with, notes."""

    selection: Selection
    layer_backends: dict[int, str]  # decoder layer index -> the backend name its calls select with
    request: AttentionRequest  # the first layer's
    notes: list[str] = field(default_factory=list)


def _pick(request: AttentionRequest, backend: str) -> tuple[Selection, str]:
    """(selection, the name calls select with): ``backend`` where it serves the request, else "auto" where
    ``backend`` fails only for the layer's own features (window, softcap, ALiBi, sinks, its own head_dim)."""
    try:
        return select(request, backend), backend
    except BackendUnavailable:
        plain = replace(request, window=False, softcap=False, alibi=False, sinks=False)
        if backend == "auto" or plain == request:
            raise
        select(plain, backend)  # a backend that cannot serve the layer for any other reason: that error
        return select(request, "auto"), "auto"


def _request(first: AttentionRequest, kind: LayerAttention) -> AttentionRequest:
    heads_q, heads_kv, head_dim = kind.heads or (first.num_heads_q, first.num_heads_kv, first.head_dim)
    return replace(first, window=kind.window is not None, softcap=kind.softcap is not None, alibi=kind.alibi,
                   sinks=kind.sinks, num_heads_q=heads_q, num_heads_kv=heads_kv, head_dim=head_dim)


def choose(model, family: Family, backend: str) -> KernelChoice:
    """Each attention layer's backend (by what its calls ask), and the report's lines when layers differ."""
    layers = family.layer_attentions(model.config)
    first = training_request(model, family, None, next(iter(layers.values()), None))
    kinds = [kind for kind in dict.fromkeys(layers.values()) if not kind.stock]
    picks = {kind: _pick(_request(first, kind), backend) for kind in kinds}
    first_kind = next((kind for kind in layers.values() if not kind.stock), None)
    choice = KernelChoice(picks[first_kind][0] if first_kind is not None else select(first, backend),
                          {i: picks[kind][1] for i, kind in layers.items() if not kind.stock}, first)
    if len(dict.fromkeys(layers.values())) > 1 or any(name != backend for _, name in picks.values()):
        for kind in dict.fromkeys(layers.values()):
            indices = [i for i, layer in layers.items() if layer == kind]
            where = f"layer {indices[0]}" if len(indices) == 1 else f"{len(indices)} layers"
            if kind.stock:
                choice.notes.append(f"{where}: transformers' own attention ({kind.stock})")
                continue
            selection, name = picks[kind]
            line = f"{where} ({kind.describe()}): {selection.backend.name}"
            if name != backend:
                line += (f" (backend {backend!r} cannot do {kind.describe()}; these layers take the fastest "
                         "backend that can)")
            choice.notes.append(line)
    return choice


def fp32_calls_note(model, request: AttentionRequest, backend: str) -> str | None:
    """With fp32 weights on CUDA the report names the backend for half-precision calls; say what fp32 calls get."""
    param = next((p for p in model.parameters() if p.is_floating_point()), None)
    if param is None or param.dtype != torch.float32 or request.dtype == torch.float32:
        return None
    try:
        fp32 = select(replace(request, dtype=torch.float32), backend).backend.name
    except BackendUnavailable:
        fp32 = "none (they raise BackendUnavailable)"
    return (f"fp32 weights: attention is chosen per call from the dtype it receives; the backend above serves "
            f"{request.dtype} calls (autocast, FSDP2 mixed precision), plain fp32 calls get {fp32}")
