"""Trimmed recompute: a checkpointed decoder layer's recompute skips the matmuls only its discarded output reads.

Non-reentrant checkpointing runs a layer's forward a second time in backward for one purpose, to make again what
autograd saved inside it; the output of that second run is thrown away. A layer's last projection (Llama's
``mlp.down_proj``; with a parallel residual also the attention's output projection) feeds nothing but that output,
through residual adds, so backward needs its weight (for the input's gradient) and its input (for the weight's
gradient, where it trains) but never its output, and the recompute's matmul is wasted: on Llama-3-8B shapes a
quarter of the recomputed matmul FLOPs (a 14336 x 4096 projection of a layer's 53248 x 4096). The family says which
projections qualify (``Family.output_projections``); a projection whose output a norm or a product reads (Gemma's
post-MLP norm, DoRA's magnitude) does not.

How: a policy's checkpoint function for a trimmed layer (``TrimmedCheckpoint``, built by ``policies``) hands its
non-reentrant checkpoint a ``context_fn`` whose recompute context marks this thread as recomputing, after checking
the layer's projections at that call (``prepare``): each base layer (``nn.Linear``, trained or frozen; a frozen
bitsandbytes ``Linear4bit``) gets an instance forward that computes through a custom op,
``hf_accel::linear_unless_recomputing`` or ``hf_accel::gemm_4bit_unless_recomputing``, which calls the kernel the
stock forward calls (``F.linear``; bitsandbytes' ``gemm_4bit``) and, while the thread is recomputing, returns
``FILL`` in the output's shape instead. Being an opaque op, torch.compile keeps one graph for the forward and the
recompute and the choice is made at run time; it is marked unsafe for CUDA graphs (a replay would not look at the
flag). Its backward is the stock one: the input's gradient through the (dequantized) weight, and a trained weight's
and bias's gradients from the saved input with the matmuls autograd's ``mm`` backward makes.

No skip happens wherever it could change a result: no grad mode, a bitsandbytes layer with a bias or an
orientation other than [out, in], a LoRA adapter with a variant (DoRA reads the base output), reentrant
checkpointing (its recompute's output is used), a forward hook that could see the fill, and layers not checkpointed
by a trimmed function (op-level, spaced, a spaced span's head); a bound forward computes there as the stock one
does. Gradients are those of full checkpointing, bit for bit: the same kernels on the same values, and the skipped
outputs reach nothing backward reads (the tests fill them with NaN). ``mlp_chunks`` trims its chunks' recomputes the
same way.
"""
from __future__ import annotations

import contextlib
import threading
import types
import weakref
from dataclasses import dataclass
from typing import Callable, Optional

import torch
import torch.nn.functional as F
from torch import nn

from ..binding import bind_forward

FILL = 0.0  # what a skipped matmul's output holds (tests set NaN: nothing may read it)
_TAGS = (torch.Tag.cudagraph_unsafe,) if hasattr(torch.Tag, "cudagraph_unsafe") else ()
_state = threading.local()  # recomputes run on the autograd engine's threads: the flag is per thread


@dataclass
class TrimStats:
    """Calls of the trimmed projections' ops, process-wide: ``skipped`` in a trimmed recompute, ``computed``
    otherwise."""

    skipped: int = 0
    computed: int = 0


STATS = TrimStats()


def recomputing() -> bool:
    """Whether this thread is inside a trimmed checkpoint's recompute."""
    return getattr(_state, "depth", 0) > 0


class _Recompute:
    """This thread is inside a trimmed recompute while entered. Entered again at each recompute of one checkpoint
    (torch calls ``context_fn`` once per checkpoint call and enters its recompute context at every recompute: a
    second backward through the graph, retain_graph or a second-order gradient): so a class, not a generator."""

    def __enter__(self) -> None:
        _state.depth = getattr(_state, "depth", 0) + 1

    def __exit__(self, *exc) -> None:
        _state.depth -= 1


def context_fn() -> tuple[contextlib.AbstractContextManager, contextlib.AbstractContextManager]:
    """A non-reentrant checkpoint's ``context_fn``: the forward as it is, the recompute with trimmed projections."""
    return contextlib.nullcontext(), _Recompute()


# ----------------------------------------------------------------------------------------------- the ops
@torch.library.custom_op("hf_accel::linear_unless_recomputing", mutates_args=(), tags=_TAGS)
def linear_unless_recomputing(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` (x, weight, bias in one dtype), or FILL in its shape inside a trimmed recompute."""
    if recomputing():
        STATS.skipped += 1
        return x.new_full((*x.shape[:-1], weight.shape[0]), FILL)
    STATS.computed += 1
    return F.linear(x, weight, bias)


@linear_unless_recomputing.register_fake
def _(x, weight, bias):
    return x.new_empty((*x.shape[:-1], weight.shape[0]))


def _linear_setup(ctx, inputs, output) -> None:
    x, weight, bias = inputs
    # the input's gradient needs the weight; a trained weight's gradient needs the input too (never the output)
    ctx.save_for_backward(weight, x if weight.requires_grad else None)


def _linear_backward(ctx, grad):
    """F.linear's gradients as autograd's matmul / mm backward makes them for a [..., in] input and an [out, in]
    weight: the input's ``grad @ W``, the weight's ``grad^T @ x`` over the flattened tokens, the bias's token sum."""
    weight, x = ctx.saved_tensors
    grad_x = grad.matmul(weight) if ctx.needs_input_grad[0] else None
    flat = grad.reshape(-1, grad.shape[-1])
    grad_w = flat.t().mm(x.reshape(-1, x.shape[-1])) if ctx.needs_input_grad[1] else None
    grad_b = flat.sum(0) if ctx.needs_input_grad[2] else None
    return grad_x, grad_w, grad_b


linear_unless_recomputing.register_autograd(_linear_backward, setup_context=_linear_setup)

_GEMM_4BIT: list = []  # the bitsandbytes op, defined on first use (hf_accel never imports bitsandbytes itself)


def _gemm_4bit_op():
    """``hf_accel::gemm_4bit_unless_recomputing``: bitsandbytes' ``gemm_4bit`` (its arguments, plus the dtype the weight
    dequantizes to in backward, as bitsandbytes' ``MatMul4Bit`` does), or FILL inside a trimmed recompute."""
    if _GEMM_4BIT:
        return _GEMM_4BIT[0]

    @torch.library.custom_op("hf_accel::gemm_4bit_unless_recomputing", mutates_args=(), tags=_TAGS)
    def gemm_4bit(A: torch.Tensor, B: torch.Tensor, shapeB: list[int], absmax: torch.Tensor, blocksize: int,
                  quant_type: str, dequant_dtype: torch.dtype, absmax_8bit: Optional[torch.Tensor],
                  absmax_code: Optional[torch.Tensor], absmax_offset: Optional[torch.Tensor]) -> torch.Tensor:
        if recomputing():
            STATS.skipped += 1
            return A.new_full((*A.shape[:-1], shapeB[0]), FILL)
        STATS.computed += 1
        return torch.ops.bitsandbytes.gemm_4bit.default(A, B, shapeB, absmax, blocksize, quant_type,
                                                        absmax_8bit=absmax_8bit, absmax_code=absmax_code,
                                                        absmax_offset=absmax_offset)

    @gemm_4bit.register_fake
    def _(A, B, shapeB, absmax, blocksize, quant_type, dequant_dtype, absmax_8bit, absmax_code, absmax_offset):
        return A.new_empty((*A.shape[:-1], shapeB[0]))

    def setup(ctx, inputs, output):
        A, B, shapeB, absmax, blocksize, quant_type, dequant_dtype, absmax_8bit, absmax_code, absmax_offset = inputs
        ctx.meta = (list(shapeB), blocksize, quant_type, dequant_dtype)
        ctx.save_for_backward(B, absmax, absmax_8bit, absmax_code, absmax_offset)

    def backward(ctx, grad):
        # bitsandbytes' MatMul4Bit.backward: grad @ dequantize_4bit(B) in the gradient's dtype, the nested statistics
        # dequantized as bitsandbytes.functional.dequantize_4bit does
        B, absmax, absmax_8bit, absmax_code, absmax_offset = ctx.saved_tensors
        shape_b, blocksize, quant_type, dequant_dtype = ctx.meta
        if absmax_8bit is not None:
            absmax = torch.ops.bitsandbytes.dequantize_blockwise.default(absmax_8bit, absmax, absmax_code, 256,
                                                                         torch.float32) + absmax_offset
        weight = torch.ops.bitsandbytes.dequantize_4bit.default(B, absmax, blocksize, quant_type, shape_b,
                                                                dequant_dtype)
        grad_a = torch.matmul(grad, weight.to(grad.dtype)) if ctx.needs_input_grad[0] else None
        return (grad_a,) + (None,) * 9

    gemm_4bit.register_autograd(backward, setup_context=setup)
    _GEMM_4BIT.append(gemm_4bit)
    return gemm_4bit


# ----------------------------------------------------------------------------------------------- the forwards
def _linear_forward(self: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    """nn.Linear's forward (``F.linear``) through ``linear_unless_recomputing``, casting as autocast would."""
    weight, bias = self.weight, self.bias
    if not torch.is_grad_enabled() or torch._C._are_functorch_transforms_active():  # (vmap / grad: a custom op
        return type(self).forward(self, x)  # without setup_context is refused there)
    device = x.device.type
    if torch.is_autocast_enabled(device):
        dtype = torch.get_autocast_dtype(device)
        x, weight = x.to(dtype), weight.to(dtype)
        bias = None if bias is None else bias.to(dtype)
    return torch.ops.hf_accel.linear_unless_recomputing(x, weight, bias)


def _linear_4bit_forward(self: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """bitsandbytes ``Linear4bit.forward`` (0.50) for a frozen layer without bias, its matmul through
    ``gemm_4bit_unless_recomputing``; the stock forward for everything else."""
    stock = type(self).forward
    state = getattr(self.weight, "quant_state", None)
    if not (torch.is_grad_enabled() and not torch._C._are_functorch_transforms_active() and self.bias is None
            and not self.weight.requires_grad and state is not None
            and len(state.shape) == 2 and not getattr(state, "packing_format_for_cpu", False)
            and x.shape[-1] == state.shape[1] and x.numel() > 0
            and (not state.nested or state.state2.blocksize == 256)):
        return stock(self, x)
    from bitsandbytes.nn.modules import fix_4bit_weight_quant_state_from_module

    fix_4bit_weight_quant_state_from_module(self)
    state = self.weight.quant_state
    if not self.compute_type_is_set:
        self.set_compute_type(x)
        self.compute_type_is_set = True
    input_dtype = x.dtype
    if self.compute_dtype is not None:
        x = x.to(self.compute_dtype)
    packed = self.weight.view(-1, 1)  # bitsandbytes' canonical [(N*K+1)//2, 1]
    if state.nested:
        absmax, nested = state.state2.absmax, (state.absmax, state.state2.code, state.offset)
    else:
        absmax, nested = state.absmax, (None, None, None)
    out = torch.ops.hf_accel.gemm_4bit_unless_recomputing(x, packed, list(state.shape), absmax, state.blocksize,
                                                          state.quant_type, state.dtype, *nested)
    return out.to(input_dtype)


# linears whose forward is F.linear's product: nn.Linear, and Falcon's (x @ W.T, the same matmul) without a bias
_BIASED_OK = {("torch.nn.modules.linear", "Linear"): True,
              ("transformers.models.falcon.modeling_falcon", "FalconLinear"): False}


def _trimmed_forward(module: nn.Module):
    """The trimmed forward for ``module``'s class, or None where there is none."""
    cls = type(module)
    biased_ok = _BIASED_OK.get((cls.__module__, cls.__name__))
    if biased_ok is not None and (biased_ok or getattr(module, "bias", None) is None):
        return _linear_forward
    linear_4bit = next((c for c in cls.__mro__ if (c.__module__, c.__name__) == ("bitsandbytes.nn.modules",
                                                                                   "Linear4bit")), None)
    if linear_4bit is not None and cls.forward is linear_4bit.forward:
        _gemm_4bit_op()
        return _linear_4bit_forward
    return None


# ----------------------------------------------------------------------------------------------- binding
def _base_of(module: nn.Module) -> nn.Module | None:
    """The layer whose matmul a trim may skip: ``module`` itself, or the base layer under PEFT's LoRA when every
    adapter is plain LoRA (a variant such as DoRA reads the base output); None where it may not."""
    lora_a = getattr(module, "lora_A", None)
    if lora_a is None:
        return module
    if getattr(module, "lora_variant", None) or getattr(module, "lora_magnitude_vector", None):
        return None
    get_base = getattr(module, "get_base_layer", None)
    return get_base() if callable(get_base) else None


@dataclass
class Bindings:
    """The trimmed forwards one policy bound (the undo of each), undone by ``unbind``."""

    bound: list

    def unbind(self) -> None:
        for undo in reversed(self.bound):
            undo()
        self.bound.clear()


def bind(layer: nn.Module, paths: tuple[str, ...], bindings: Bindings) -> dict[str, nn.Module] | None:
    """Bind the trimmed forward to the base layer of each projection at ``paths`` that has none yet (recorded in
    ``bindings``); each path's base layer where every one has it now, None where not (a path missing, a LoRA variant,
    a kind with no trimmed forward, a forward of someone else's: accelerate's device hooks, a user's wrapper, left
    alone)."""
    bases: dict[str, nn.Module] | None = {} if paths else None
    for path in paths:
        try:
            base = _base_of(layer.get_submodule(path))
        except AttributeError:
            bases = None
            continue
        forward = None if base is None else _trimmed_forward(base)
        current = None if base is None else base.__dict__.get("forward")
        if forward is None or (current is not None and getattr(current, "__func__", None) is not forward):
            bases = None
            continue
        if current is None:
            bindings.bound.append(bind_forward(base, types.MethodType(forward, base)))
        if bases is not None:
            bases[path] = base
    return bases


def prepare(layer: nn.Module, paths: tuple[str, ...], bindings: Bindings) -> bool:
    """Whether ``layer``'s recompute may be trimmed now: every projection at ``paths`` has a base layer of a kind
    with a trimmed forward (bound here on first sight: ``bind``) and no forward hook could see the fill. Checked at
    each checkpoint call, so LoRA added after ``patch()`` is seen.

    Binding comes before the hook checks, and so at the first call that could trim whatever the hooks: the bound
    forward saves other tensors than the stock one (bitsandbytes' keeps its weight on the context, unseen), so a
    checkpoint whose forward ran the stock forward and whose recompute found it bound (a later call bound it: a
    hook present in forward only, or a chunked MLP's recompute inside its layer's) fails torch's check of the
    recomputed tensors."""
    bases = bind(layer, paths, bindings)
    if bases is None or _transforms_outputs(torch.nn.modules.module._global_forward_hooks.values()):
        return False
    for path, base in bases.items():
        on_the_way = [layer, *(layer.get_submodule(".".join(path.split(".")[:i + 1]))
                               for i in range(path.count(".") + 1)), base]
        if any(_transforms_outputs(m._forward_hooks.values()) for m in on_the_way):
            return False  # a forward hook there would see (and may save) the recompute's fill
    return True


def _transforms_outputs(hooks) -> bool:
    """Whether any of these forward hooks may read or change a module's output: all but the sharding engines' own
    (FSDP2's and DeepSpeed ZeRO-3's move parameters around a module's call and leave its output as it is)."""
    for hook in hooks:
        owner = getattr(getattr(hook, "func", hook), "__module__", None) or ""
        if not owner.startswith(("torch.distributed.", "deepspeed.")):
            return True
    return False


class TrimmedCheckpoint:
    """A layer's checkpoint function (``func``: torch's non-reentrant checkpoint, or the offloaded one) whose recompute
    skips the layer's output projections (``paths``) where ``prepare`` finds them at this call."""

    def __init__(self, func: Callable, layer: nn.Module, paths: tuple[str, ...], bindings: Bindings):
        self.func, self.layer, self.paths, self.bindings = func, weakref.ref(layer), paths, bindings

    def __call__(self, function: Callable, *args, **kwargs):
        layer = self.layer()
        if layer is not None and "context_fn" not in kwargs and prepare(layer, self.paths, self.bindings):
            kwargs["context_fn"] = context_fn
        return self.func(function, *args, **kwargs)


def output_projections(hf_model: nn.Module) -> tuple[str, ...]:
    """The family's output projections (paths inside a decoder layer; ``Family.output_projections``), () for a model
    of no supported family."""
    from ..errors import UnsupportedModel
    from ..patches import family_of

    try:
        return tuple(family_of(hf_model).output_projections(hf_model.config))
    except UnsupportedModel:
        return ()
