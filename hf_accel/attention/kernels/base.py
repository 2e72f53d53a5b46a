"""What a backend declares (Capabilities), what a call needs (AttentionRequest), and the options every kernel takes.

Selection is generic: a backend serves a request when ``Capabilities.missing(request)`` is empty.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

HALF_DTYPES = frozenset({torch.float16, torch.bfloat16})
ALL_FLOAT_DTYPES = frozenset({torch.float16, torch.bfloat16, torch.float32, torch.float64})


@dataclass(frozen=True)
class DeviceInfo:
    """The device a call runs on; tests fake it to check selection without a GPU."""

    type: str  # "cpu" | "cuda" | ...
    capability: tuple[int, int] | None = None  # CUDA compute capability, e.g. (9, 0) for Hopper

    @staticmethod
    def of(device: torch.device) -> "DeviceInfo":
        if device.type == "cuda":
            return DeviceInfo("cuda", torch.cuda.get_device_capability(device))
        return DeviceInfo(device.type)


@dataclass(frozen=True)
class AttnOptions:
    """Per-call attention options. Window: tokens to the left/right a query may see; None = unbounded."""

    scale: float
    causal: bool = True
    window: tuple[int | None, int | None] = (None, None)
    softcap: float = 0.0
    dropout_p: float = 0.0
    alibi_slopes: torch.Tensor | None = None  # (H_q,) fp32; bias slope * (k_pos - q_pos) added to scaled scores
    sinks: torch.Tensor | None = None  # (H_q,) learned logits joining each softmax's denominator (no value)

    @property
    def has_window(self) -> bool:
        left, right = self.window
        return left is not None or (right is not None and not (self.causal and right == 0))


@dataclass(frozen=True)
class AttentionRequest:
    """Everything about a call that decides which backend may serve it."""

    device: DeviceInfo
    dtype: torch.dtype
    head_dim: int
    num_heads_q: int
    num_heads_kv: int
    causal: bool = True
    window: bool = False
    softcap: bool = False
    dropout: bool = False
    alibi: bool = False
    sinks: bool = False
    needs_grad: bool = True

    @staticmethod
    def build(q_thd: torch.Tensor, k_thd: torch.Tensor, opts: AttnOptions, device: DeviceInfo | None = None):
        return AttentionRequest(
            device=device or DeviceInfo.of(q_thd.device),
            dtype=q_thd.dtype,
            head_dim=q_thd.shape[-1],
            num_heads_q=q_thd.shape[-2],
            num_heads_kv=k_thd.shape[-2],
            causal=opts.causal,
            window=opts.has_window,
            softcap=opts.softcap != 0.0,
            dropout=opts.dropout_p > 0.0,
            alibi=opts.alibi_slopes is not None,
            sinks=opts.sinks is not None,
            needs_grad=torch.is_grad_enabled() and (q_thd.requires_grad or k_thd.requires_grad),
        )


@dataclass(frozen=True)
class Capabilities:
    """What a backend can do, as data. ``missing`` names each unmet need of a request."""

    devices: frozenset[str]
    dtypes: frozenset[torch.dtype]
    min_capability: tuple[int, int] | None = None  # CUDA only
    max_capability: tuple[int, int] | None = None
    max_head_dim: int = 256
    head_dim_multiple: int = 1
    gqa: bool = True
    non_causal: bool = True
    window: bool = False
    softcap: bool = False
    dropout: bool = False
    alibi: bool = False
    alibi_backward: bool = False
    sinks: bool = False
    backward_devices: frozenset[str] | None = None  # where gradients work; None = every device in ``devices``
    notes: tuple[str, ...] = field(default_factory=tuple)

    def missing(self, req: AttentionRequest) -> list[str]:
        out = []
        if req.device.type not in self.devices:
            out.append(f"device {req.device.type} (runs on {', '.join(sorted(self.devices))})")
        elif req.device.type == "cuda" and req.device.capability is not None:
            cap = req.device.capability
            if self.min_capability and cap < self.min_capability:
                out.append(f"GPU sm{cap[0]}{cap[1]} (needs sm{self.min_capability[0]}{self.min_capability[1]}+)")
            if self.max_capability and cap > self.max_capability:
                out.append(f"GPU sm{cap[0]}{cap[1]} (supports up to sm{self.max_capability[0]}{self.max_capability[1]})")
        if req.needs_grad and self.backward_devices is not None and req.device.type not in self.backward_devices:
            out.append(f"backward on {req.device.type}")
        if req.dtype not in self.dtypes:
            out.append(f"dtype {req.dtype} (supports {', '.join(sorted(str(d) for d in self.dtypes))})")
        if req.head_dim > self.max_head_dim or req.head_dim % self.head_dim_multiple:
            out.append(
                f"head_dim={req.head_dim} (supported: multiples of {self.head_dim_multiple} up to {self.max_head_dim})"
            )
        if req.num_heads_q != req.num_heads_kv and not self.gqa:
            out.append("grouped-query attention")
        if req.num_heads_q % req.num_heads_kv:
            out.append(f"{req.num_heads_q} query heads not divisible by {req.num_heads_kv} kv heads")
        wanted = {
            "non-causal attention": (not req.causal, self.non_causal),
            "sliding window": (req.window, self.window),
            "softcap": (req.softcap, self.softcap),
            "dropout": (req.dropout, self.dropout),
            "ALiBi": (req.alibi, self.alibi),
            "ALiBi backward": (req.alibi and req.needs_grad, self.alibi_backward),
            "attention sinks": (req.sinks, self.sinks),
        }
        out += [name for name, (needed, offered) in wanted.items() if needed and not offered]
        return out
