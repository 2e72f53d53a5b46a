"""Kernel libraries' code bound into a model, and the stock computation each piece stands for.

liger-kernel (TRL's / transformers' ``use_liger_kernel=True``, ``apply_liger_kernel_to_*``) and transformers' hub
kernels (``use_kernels=True``) give a model module forwards and module-level functions that launch Triton / CUDA
kernels outside torch's dispatcher. Two places of hf_accel must not run them:

- dynamo's traces of the compiled decoder layers (it fails to trace liger's kernels: ``fused.ops`` registers each
  stand-in below with dynamo, ``fused.foreign_forwards`` decides per module);
- the facts probe's forward on fake tensors (``facts.probe``): a fake tensor's data pointer is null, and a Triton
  kernel launched on it is an illegal memory access that poisons the process's CUDA context (run 39:
  ``hf_accel.SFTTrainer`` with ``use_liger_kernel=True``, liger's RoPE bound into ``modeling_llama`` by an earlier
  run).

Both run the stock computation instead: ``stand_in(fn)`` is the plain torch function (same arguments) computing what
``fn`` computes, for the pieces registered here.
"""
from __future__ import annotations

import contextlib
import dis
import inspect
import sys
import warnings
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

# Packages whose module forwards launch kernels outside the dispatcher: top-level package -> the name users know.
FOREIGN_PACKAGES: dict[str, str] = {"liger_kernel": "liger-kernel", "kernels": "hub kernels"}


def function(fn: Any) -> Any:
    """The plain function of a bound method (itself otherwise)."""
    return getattr(fn, "__func__", fn)


def origin(fn: Any) -> str | None:
    """The foreign library a callable or class comes from ("liger-kernel", "hub kernels"), by the module it declares
    (``functools.wraps`` wrappers declare the wrapped function's: kernels' routing wrapper around a transformers
    forward is transformers'); None for anything else."""
    module = getattr(function(fn), "__module__", None) or ""
    return FOREIGN_PACKAGES.get(module.split(".")[0])


def forward_of(module: Any) -> Any:
    """The forward a module's call runs: the one bound on the instance, else its class's."""
    return module.__dict__.get("forward") or type(module).forward


def serving(module: Any) -> str | None:
    """The kernel library serving ``module``: its forward's (bound on it, or its class's), or its class's own."""
    return origin(forward_of(module)) or origin(type(module))


def global_callees(fn: Any) -> list[tuple[str, Any]]:
    """The module-level names ``fn``'s code reads and what they hold now (``apply_rotary_pos_emb`` in a transformers
    attention forward is liger's after ``apply_liger_kernel_to_llama(rope=True)``)."""
    try:
        fn = inspect.unwrap(function(fn))
    except ValueError:
        fn = function(fn)
    code, module_globals = getattr(fn, "__code__", None), getattr(fn, "__globals__", None)
    if code is None or module_globals is None:
        return []
    names = {ins.argval for ins in dis.get_instructions(code) if ins.opname in ("LOAD_GLOBAL", "LOAD_NAME")}
    return [(name, module_globals[name]) for name in sorted(names) if name in module_globals]


# id(original function) -> (original, stock): the original kept alive so its id stays its own
_STAND_INS: dict[int, tuple[Callable, Callable]] = {}


def register_stand_in(original: Callable, stock: Callable) -> None:
    """``stock`` (same arguments) computes what ``original`` computes, in plain torch."""
    _STAND_INS[id(function(original))] = (function(original), stock)


def stand_in(fn: Any) -> Callable | None:
    """The registered stock stand-in of ``fn`` (liger's are registered once liger is imported); None if none."""
    _register_liger()
    entry = _STAND_INS.get(id(function(fn)))
    return entry[1] if entry is not None else None


def stand_ins() -> list[tuple[Callable, Callable]]:
    """Every registered (original, stock) pair."""
    _register_liger()
    return list(_STAND_INS.values())


# liger-kernel warns on import about optional backends a CUDA training run does not use (cuTile, Ascend NPUs).
_OPTIONAL_BACKENDS = r"(?is).*(cuda\.tile|cutile|ascend|torch_npu|\bnpu\b)"
_liger_registered = False


@contextlib.contextmanager
def quiet_liger_import():
    """Import liger-kernel without its warnings about optional cuTile / Ascend backends (those only)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=_OPTIONAL_BACKENDS)
        yield


# ---- the stock computations (same arguments as what they stand for) ------------------------------------------
def stock_rms_norm(self, hidden_states):
    """liger's RMSNorm forward (bound on a stock norm, or a norm of liger's class)."""
    own = type(self).forward
    if not (origin(own) or origin(type(self))):  # liger's forward bound on a stock norm: its own forward, same math
        return own(self, hidden_states)
    dtype = hidden_states.dtype
    x = hidden_states.float()
    x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
    if getattr(self, "weight", None) is None:  # a scale-free norm (Gemma 4's value norm)
        return x.to(dtype)
    if getattr(self, "casting_mode", "llama") in ("gemma", "none"):  # (x * (offset + w)) in fp32, then cast
        return (x * (self.weight.float() + getattr(self, "offset", 0.0))).to(dtype)
    return (getattr(self, "offset", 0.0) + self.weight) * x.to(dtype)


def stock_swiglu(self, x):
    return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


def stock_fused_swiglu(self, x):
    """liger's Phi-3 MLP: gate and up from one fused projection."""
    gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
    return self.down_proj(F.silu(gate) * up)


def stock_geglu(self, x):
    return self.down_proj(F.gelu(self.gate_proj(x), approximate="tanh") * self.up_proj(x))


def stock_layer_norm(self, hidden_states):
    eps = getattr(self, "variance_epsilon", None) or getattr(self, "eps", 1e-5)
    return F.layer_norm(hidden_states, (hidden_states.shape[-1],), self.weight, self.bias, eps)


def stock_rotary(q, k, cos, sin, position_ids=None, unsqueeze_dim=1, rotary_dim=None):
    """liger's ``liger_rotary_pos_emb``: the leading ``cos.shape[-1]`` entries of each head rotated as
    ``rotate_half`` rotates them (Llama; partial rotary, Phi-4-mini, passes the rest through), or, given a
    ``rotary_dim`` twice cos's width, its two halves against half-width cos / sin (gpt-oss's form)."""
    cos, sin = cos.unsqueeze(unsqueeze_dim), sin.unsqueeze(unsqueeze_dim)
    half_width = rotary_dim is not None and rotary_dim == 2 * cos.shape[-1]
    width = rotary_dim if half_width else cos.shape[-1]

    def rotate(x):
        x_rot, x_pass = x[..., :width], x[..., width:]
        first, second = x_rot[..., : width // 2], x_rot[..., width // 2:]
        if half_width:
            rotated = torch.cat((first * cos - second * sin, second * cos + first * sin), dim=-1)
        else:
            rotated = x_rot * cos + torch.cat((-second, first), dim=-1) * sin
        return torch.cat((rotated, x_pass), dim=-1) if x_pass.shape[-1] else rotated

    return rotate(q), rotate(k)


def stock_rotary_gpt_oss(q, k, cos, sin):
    """liger's ``liger_rotary_pos_emb_gpt_oss``: gpt-oss's whole head against half-width cos / sin."""
    return stock_rotary(q, k, cos, sin, rotary_dim=q.shape[-1])


def _register_liger() -> None:
    """Liger's norm, SwiGLU, GEGLU, LayerNorm and RoPE functions with their stock computations (once; only when liger
    has been imported, i.e. may be bound to a model)."""
    global _liger_registered
    if _liger_registered or "liger_kernel" not in sys.modules:
        return
    _liger_registered = True
    with quiet_liger_import():
        from liger_kernel.transformers import geglu, rms_norm, rope, swiglu
        from liger_kernel.transformers.layer_norm import LigerLayerNorm

    pairs = [(rms_norm.LigerRMSNorm.forward, stock_rms_norm), (swiglu.LigerSwiGLUMLP.forward, stock_swiglu),
             (geglu.LigerGEGLUMLP.forward, stock_geglu), (LigerLayerNorm.forward, stock_layer_norm),
             (rope.liger_rotary_pos_emb, stock_rotary)]
    # what liger 0.8.5 adds: classes it binds into modeling modules (``apply_liger_kernel_to_*()``), by name; its
    # fused experts (LigerExperts) have none: a compiled layer runs them between its graphs, the probe fails
    optional = [(rope, "liger_rotary_pos_emb_gpt_oss", stock_rotary_gpt_oss),
                (rms_norm, "LigerRMSNormForGemma4", stock_rms_norm),
                (swiglu, "LigerPhi3SwiGLUMLP", stock_fused_swiglu),
                (swiglu, "LigerQwen3MoeSwiGLUMLP", stock_swiglu)]
    for module, name, stock in optional:
        original = getattr(module, name, None)
        if original is not None:
            pairs.append((getattr(original, "forward", original), stock))
    for original, stock in pairs:
        register_stand_in(original, stock)
