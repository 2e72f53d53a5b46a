"""Which of a model's modules liger's fused kernels may replace, found by what each module computes.

A norm is a candidate if it has a 1-D ``weight`` and an epsilon; a gated MLP if it calls ``gate_proj``, ``up_proj``
and ``down_proj`` (the names liger's SwiGLU / GEGLU modules call). Each candidate class is run once on a probe input
(a copy of a norm with random weights; an MLP as it is, on two tokens, without gradients) and compared with the
formula liger's kernel computes for each kind; a kind is taken only where the module's output is that formula's,
in fp32 and in bf16 (which tells Llama's casting from Gemma's). A module matching none (Olmo's post-norms,
Qwen3.5's gated norm, an unknown variant) is never bound, nor one a kernel library already serves (liger bound before
``patch()``: it keeps what it was given). On CUDA, ``fused.ops`` checks liger's own kernel against
the module on a probe input again before binding it.
"""
from __future__ import annotations

import copy

import torch
import torch.nn.functional as F
from torch import nn

from .. import foreign
from ..family import FusableKind

_ACTIVATIONS: dict[str, FusableKind] = {"silu": "swiglu", "gelu_tanh": "geglu"}


def norm_eps(module: nn.Module) -> float | None:
    """Llama-style norms name it variance_epsilon, Gemma's and LayerNorm eps."""
    eps = getattr(module, "variance_epsilon", None)
    eps = eps if eps is not None else getattr(module, "eps", None)
    return float(eps) if isinstance(eps, (int, float)) else None


def _rms(x: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.float()
    return xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)


_NORM_FORMULAS = {
    # liger's casting_mode="llama": normalised in fp32, cast back, then times the weight
    "rms_norm": lambda x, w, eps: w * _rms(x, eps).to(x.dtype),
    # casting_mode="gemma" with offset 1: (x_norm * (1 + w)) in fp32, then cast
    "rms_norm_gemma": lambda x, w, eps: (_rms(x, eps) * (1.0 + w.float())).to(x.dtype),
    # casting_mode="gemma" with offset 0: the weight applied in fp32 (Olmo 2's norms)
    "rms_norm_fp32": lambda x, w, eps: (_rms(x, eps) * w.float()).to(x.dtype),
}


def _norm_kind(module: nn.Module) -> FusableKind | None:
    if foreign.serving(module):  # liger bound before patch(): left as bound (its kernel cannot run on the CPU copy)
        return None
    eps = norm_eps(module)
    weight = getattr(module, "weight", None)
    if eps is None or not isinstance(weight, nn.Parameter) or weight.ndim != 1 or weight.numel() < 2:
        return None
    if isinstance(module, nn.LayerNorm):
        return "layer_norm" if module.elementwise_affine else None
    generator = torch.Generator().manual_seed(0)
    dim = weight.numel()
    try:
        probe = copy.deepcopy(module).to("cpu")
        with torch.no_grad():
            probe.weight.copy_(torch.randn(dim, generator=generator))
        x = torch.randn(3, dim, generator=generator) * 3 + 0.5
        outputs = {}
        for dtype in (torch.float32, torch.bfloat16):
            probe.to(dtype)
            with torch.no_grad():
                outputs[dtype] = (probe(x.to(dtype)), x.to(dtype), probe.weight.detach())
    except Exception:  # noqa: BLE001 - a module that cannot run on a probe input (sharded, meta) is not fused
        return None
    for kind, formula in _NORM_FORMULAS.items():
        if all(isinstance(y, torch.Tensor) and y.shape == xd.shape and torch.equal(y, formula(xd, w, eps))
               for y, xd, w in outputs.values()):
            return kind
    return None


def _activation(module: nn.Module) -> str | None:
    act = getattr(module, "act_fn", None)
    if not callable(act):
        return None
    v = torch.linspace(-6, 6, 97)
    try:
        with torch.no_grad():
            y = act(v)
    except Exception:  # noqa: BLE001
        return None
    if torch.allclose(y, F.silu(v), rtol=1e-6, atol=1e-7):
        return "silu"
    if torch.allclose(y, F.gelu(v, approximate="tanh"), rtol=1e-6, atol=1e-7):
        return "gelu_tanh"
    return None


def _mlp_kind(module: nn.Module) -> FusableKind | None:
    if foreign.serving(module):  # liger bound before patch(): left as bound
        return None
    parts = [getattr(module, name, None) for name in ("gate_proj", "up_proj", "down_proj")]
    if not all(isinstance(p, nn.Module) for p in parts):
        return None
    act = _activation(module)
    if act is None:
        return None
    gate, up, down = parts
    param = next(module.parameters(), None)
    in_features = getattr(getattr(gate, "base_layer", gate), "in_features", None)
    if param is None or in_features is None or param.device.type == "meta":
        return None
    dtype = param.dtype if param.is_floating_point() else torch.bfloat16
    x = torch.randn(2, in_features, generator=torch.Generator().manual_seed(0)).to(param.device, dtype)
    fn = F.silu if act == "silu" else (lambda t: F.gelu(t, approximate="tanh"))
    try:
        with torch.no_grad():
            y, ref = module(x), down(fn(gate(x)) * up(x))
    except Exception:  # noqa: BLE001 - sharded (ZeRO-3) or otherwise unrunnable weights: not fused
        return None
    if not isinstance(y, torch.Tensor) or y.shape != ref.shape:
        return None
    return _ACTIVATIONS[act] if torch.allclose(y.float(), ref.float(), rtol=1e-3, atol=1e-5) else None


def module_kind(module: nn.Module) -> FusableKind | None:
    """The kind liger's kernel may replace ``module`` as, or None."""
    return _mlp_kind(module) if hasattr(module, "gate_proj") else _norm_kind(module)


def fusable_modules(model: nn.Module) -> list[tuple[str, nn.Module, FusableKind]]:
    """(name, module, kind) of every module liger may replace: each candidate class probed once (its first
    instance), its other instances taking the verdict."""
    verdicts: dict[type, FusableKind | None] = {}
    found = []
    for name, module in model.named_modules():
        if not (hasattr(module, "gate_proj") or getattr(module, "weight", None) is not None) or \
                isinstance(module, (nn.Linear, nn.Embedding)) or (list(module.children()) and
                                                                   not hasattr(module, "gate_proj")):
            continue
        cls = type(module)
        if cls not in verdicts:
            verdicts[cls] = module_kind(module)
        if verdicts[cls] is not None and (verdicts[cls] in ("swiglu", "geglu") or getattr(module, "weight", None)
                                          is not None):
            found.append((name, module, verdicts[cls]))
    return found
