"""Mixture-of-experts layers through a grouped GEMM, with LoRA on the experts kept low-rank.

Touches: the ``forward`` of each experts module of this model instance, bound on the instance (never the class).
Experts modules are found from the model: instances of a class transformers decorated with
``@use_experts_implementation`` (Qwen3MoeExperts, GptOssExperts, MixtralExperts, Qwen3_5MoeExperts, ...). The
decorator gives every such class one call signature ``(hidden_states (T, H), top_k_index (T, k), top_k_weights (T, k))``
and describes its layout as instance flags (``has_gate``, ``has_bias``, ``is_transposed``, ``has_post_expert_norm``)
plus the class's own ``_apply_gate`` (gpt-oss's clamped, interleaved SwiGLU; a concatenated act(gate) * up
otherwise); the forward here reads those, so no family is typed. The router (its logits, softmax, top-k, the top-k
renormalisation, the ``router_logits`` that transformers records for the load-balancing loss) is a sibling module
that keeps running stock's code: its results are stock's by construction.

The experts run on the (token, expert) rows sorted by expert: one grouped GEMM per projection, ``torch._grouped_mm``
(or ``F.grouped_mm``) on CUDA for bf16 with 16-byte aligned widths, else per-expert matmuls over the sorted rows (the
exact fallback: CPU, fp32, odd widths; one host sync per experts call to read the group sizes).

LoRA on the experts (PEFT's ``LoraConfig(target_parameters=[...])``, ``ParamWrapper``): PEFT's own forward registers
a parametrization on the wrapped 3-D parameter (``_LoraFactorsProxy``: ``W + scaling * lhs @ rhs`` by one ``baddbmm``,
a tensor the size of the whole expert stack each forward) and then calls the experts module, i.e. the forward
bound here, whichever order ``patch()`` and ``get_peft_model`` ran in. That forward reads the raw parameter and the
proxy's factors without evaluating the parametrization and computes ``x @ W + ((x @ A) @ B) * scaling`` per expert
group. Where the parametrization is anything else (several active adapters, fp8 weights: PEFT then materialises the
delta itself before the call, or a parametrization of the user's), the parameter is read as stock reads it.
"""
from __future__ import annotations

import sys
import types
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.nn.utils import parametrize

Undo = Callable[[], None]
Factors = tuple[torch.Tensor, torch.Tensor, float]  # a LoRA delta's (lhs, rhs, scaling): scaling * lhs @ rhs


# ---------------------------------------------------------------------------------------------------- finding experts
def _decorated_forward_code() -> Any:
    """The code object of the forward ``@use_experts_implementation`` installs (decorating a throwaway class)."""
    from transformers.integrations.moe import use_experts_implementation

    probe = use_experts_implementation(type("_ExpertsProbe", (nn.Module,), {"forward": lambda self: None}))
    return probe.forward.__code__


def is_experts_module(module: nn.Module) -> bool:
    """Whether ``module``'s class is one transformers decorated with ``@use_experts_implementation`` (a PEFT
    parametrization subclasses it and keeps its forward)."""
    forward = getattr(type(module), "forward", None)
    return getattr(forward, "__code__", None) is _DECORATED and hasattr(module, "has_gate")


def find_experts(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """Every experts module of ``model`` (through PEFT wrappers too), by name."""
    return [(name, m) for name, m in model.named_modules() if is_experts_module(m)]


def lora_target_parameters(model: nn.Module) -> tuple[str, ...]:
    """The experts' 3-D projection parameters as PEFT's ``target_parameters`` names them (the last two module names
    and the parameter, e.g. ``mlp.experts.gate_up_proj``), read from the model."""
    names = set()
    for path, module in find_experts(model):
        place = ".".join(p for p in path.split(".") if p != "base_layer").split(".")[-2:]
        names.update(".".join([*place, n]) for n in ("gate_up_proj", "up_proj", "down_proj") if n in dict(
            _raw_parameters(module)))
    return tuple(sorted(names))


def kernel_library_forwards(model: nn.Module) -> dict[str, str]:
    """{name: library} of the experts modules, and of PEFT's wrappers in their place, whose forward a kernel library
    bound on the instance (liger's ``LigerExperts`` forward, bound by ``use_liger_kernel`` / ``swiglu=True``: fused
    experts of full weights, which no LoRA reaches and which fail on a ``ParamWrapper``). ``apply`` binds the grouped
    forward over them; read it before."""
    from hf_accel import foreign

    wrapper_cls = _param_wrapper() if "peft" in sys.modules else None  # no PEFT imported: no wrapper in the model
    found = {}
    for name, module in model.named_modules():
        wrapped = wrapper_cls is not None and isinstance(module, wrapper_cls) \
            and is_experts_module(module.get_base_layer())
        library = foreign.origin(module.__dict__.get("forward"))
        if library is not None and (wrapped or is_experts_module(module)):
            found[name] = library
    return found


def _raw_parameters(module: nn.Module):
    """(name, parameter) of ``module`` itself, a parametrized one's original included."""
    yield from module.named_parameters(recurse=False)
    if parametrize.is_parametrized(module):
        for name, chain in module.parametrizations.items():
            yield name, chain.original


def _why_not(module: nn.Module) -> str | None:
    if getattr(module, "_is_expert_parallel", False):
        return "expert-parallel (its rows carry sentinel experts): left to transformers"
    return None


def apply(model: nn.Module) -> tuple[list[str], list[Undo]]:
    """Bind the grouped forward to each experts module of ``model``, and keep PEFT's experts adapters low-rank
    whether ``get_peft_model`` ran before or runs after; returns (patched module names, undo actions).
    Expert-parallel modules are left stock. Applying twice binds nothing new."""
    names, undo = [], []
    parents = {id(child): (parent, attr) for parent in model.modules() for attr, child in parent.named_children()}
    for name, module in find_experts(model):
        if _why_not(module) is not None or _bound_here(module, grouped_experts_forward):
            continue
        undo.append(_bind(module, grouped_experts_forward))
        undo.append(_watch_adapters(module, parents))
        names.append(name)
    return names, undo


def prepare_probe_copy(model: nn.Module) -> None:
    """What ``patch()`` will do to a model, done to the fake-tensor copy ``hf_accel.facts`` probes (its per-layer
    saved bytes are then the grouped path's, which ``patch()`` trains through, not stock's)."""
    apply(model)


def _bound_here(module: nn.Module, fn: Callable) -> bool:
    return getattr(module.__dict__.get("forward"), "__func__", None) is fn


def _bind(module: nn.Module, fn: Callable) -> Undo:
    had, previous = "forward" in module.__dict__, module.__dict__.get("forward")
    module.forward = types.MethodType(fn, module)

    def undo() -> None:
        if had:
            module.forward = previous
        else:
            module.__dict__.pop("forward", None)

    return undo


# --------------------------------------------------------------------------------------- PEFT's experts adapters
def _param_wrapper() -> type | None:
    try:
        from peft.tuners.lora.layer import ParamWrapper
    except ImportError:
        return None
    return ParamWrapper


def _watch_adapters(experts: nn.Module, parents: dict) -> Undo:
    """PEFT puts its ``ParamWrapper`` chain in the experts module's place (before or after this patch): a pre-hook on
    the module holding that place binds the low-rank forward on the chain's outermost wrapper when one is there."""
    wrapper_cls = _param_wrapper()
    if id(experts) not in parents:  # the model is the experts module itself: nothing can take its place
        return lambda: None
    holder, attr = parents[id(experts)]
    while wrapper_cls is not None and isinstance(holder, wrapper_cls):  # patched after get_peft_model
        holder, attr = parents[id(holder)]
    undos: list[Undo] = []

    def bind_outermost(module: nn.Module, args: Any) -> None:
        top = getattr(module, attr, None)
        if top is not experts and wrapper_cls is not None and isinstance(top, wrapper_cls) \
                and top.get_base_layer() is experts and not _bound_here(top, peft_experts_forward):
            undos.append(_bind(top, peft_experts_forward))

    bind_outermost(holder, ())
    handle = holder.register_forward_pre_hook(bind_outermost)

    def undo() -> None:
        handle.remove()
        while undos:
            undos.pop()()

    return undo


def _lora_factors(chain: list[nn.Module]) -> dict[str, Factors] | None:
    """{parameter name: (lhs, rhs, scaling)} for the chain's active adapters, or None where PEFT's own forward must
    run (adapters disabled or merged, several active on one parameter, fp8 weights, a parameter that is not one of
    the 3-D projections)."""
    factors = {}
    for wrapper in chain:
        if wrapper.disable_adapters or wrapper.merged:
            return None
        adapters = [a for a in wrapper.active_adapters if a in wrapper.lora_A]
        param = wrapper.get_param()
        if len(adapters) > 1 or param.element_size() < 2 or param.dim() != 3:
            return None
        if adapters:
            factors[wrapper.parameter_name] = wrapper.get_delta_factors(adapters[0])
    return factors


def peft_experts_forward(self: nn.Module, hidden_states: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
    """Bound on the outermost ``ParamWrapper`` of an experts module: the grouped forward with the adapters' factors,
    skipping PEFT's parametrization (which evaluates W + delta once per forward even when nothing reads it)."""
    chain, base = [], self
    while isinstance(base, type(self)):
        chain.append(base)
        base = base.base_layer
    factors = None if kwargs or not self.training else _lora_factors(chain)
    if factors is None:
        return type(self).forward(self, hidden_states, *args, **kwargs)
    return grouped_experts_forward(base, hidden_states, *args, lora=factors)


# ------------------------------------------------------------------------------------------------- the grouped forward
class _Groups:
    """The (token, expert) rows sorted by expert. ``offs``: (E,) int32 cumulative row counts (grouped GEMM's offsets,
    no host sync); ``counts``: the per-expert row counts as Python ints, read once (the one host sync of a call that
    takes the fallback)."""

    def __init__(self, sorted_ids: torch.Tensor, num_experts: int):
        self.ids = sorted_ids  # (S,) expert of each sorted row
        bounds = torch.arange(num_experts, device=sorted_ids.device, dtype=sorted_ids.dtype)
        self.offs = torch.searchsorted(sorted_ids, bounds, right=True).to(torch.int32)
        self._counts: list[int] | None = None

    @property
    def counts(self) -> list[int]:
        if self._counts is None:
            ends = self.offs.tolist()  # host sync: the fallback slices rows per expert
            self._counts = [e - s for s, e in zip([0] + ends[:-1], ends)]
        return self._counts


def _cuda_grouped_mm_serves(x: torch.Tensor, w: torch.Tensor) -> bool:
    """torch's grouped GEMM serves (S, K) @ (E, K, N) here: CUDA sm80+, bf16, widths a multiple of 16 bytes."""
    if x.device.type != "cuda" or not (hasattr(torch.nn.functional, "grouped_mm") or hasattr(torch, "_grouped_mm")):
        return False
    if x.dtype != torch.bfloat16 or w.dtype != torch.bfloat16:
        return False
    aligned = all((n * x.element_size()) % 16 == 0 for n in (w.shape[-2], w.shape[-1]))
    return aligned and torch.cuda.get_device_capability(x.device) >= (8, 0)


def _group_bounds(offs: torch.Tensor) -> list[tuple[int, int]]:
    ends = offs.tolist()
    return list(zip([0] + ends[:-1], ends))


@torch.library.custom_op("hf_accel::experts_grouped_mm", mutates_args=())
def _grouped_mm_op(x: torch.Tensor, w: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """``torch._grouped_mm``'s contract for any dtype and device, as one op: what the facts probe runs on fake tensors
    (whose group sizes it cannot read), saving for backward what ``torch._grouped_mm`` saves (the rows only where
    the weight trains). Training calls take ``grouped_mm``'s own paths."""
    if x.shape[0] == 0:
        return x.new_zeros(0, w.shape[-1])
    return torch.cat([x[s:e] @ w[i] for i, (s, e) in enumerate(_group_bounds(offs))])


@_grouped_mm_op.register_fake
def _grouped_mm_op_fake(x: torch.Tensor, w: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    return x.new_empty(x.shape[0], w.shape[-1])


def _grouped_mm_op_setup(ctx: Any, inputs: tuple, output: torch.Tensor) -> None:
    x, w, offs = inputs
    ctx.save_for_backward(x if ctx.needs_input_grad[1] else None, w if ctx.needs_input_grad[0] else None, offs)


def _grouped_mm_op_backward(ctx: Any, grad: torch.Tensor) -> tuple:
    x, w, offs = ctx.saved_tensors
    grad_x = _grouped_mm_op(grad, w.transpose(-2, -1).contiguous(), offs) if ctx.needs_input_grad[0] else None
    grad_w = None
    if ctx.needs_input_grad[1]:
        grad_w = grad.new_zeros(offs.shape[0], x.shape[1], grad.shape[1])
        for i, (s, e) in enumerate(_group_bounds(offs)):
            grad_w[i] = x[s:e].transpose(0, 1) @ grad[s:e]
    return grad_x, grad_w, None


_grouped_mm_op.register_autograd(_grouped_mm_op_backward, setup_context=_grouped_mm_op_setup)


def _is_fake(t: torch.Tensor) -> bool:
    from torch._subclasses.fake_tensor import FakeTensor

    return isinstance(t, FakeTensor)


@torch.library.custom_op("hf_accel::dense_copy", mutates_args=())
def _dense_copy(t: torch.Tensor) -> torch.Tensor:
    """A contiguous copy of ``t`` that a compiled graph keeps contiguous (``_gemm_operand``)."""
    return t.clone(memory_format=torch.contiguous_format)


@_dense_copy.register_fake
def _dense_copy_fake(t: torch.Tensor) -> torch.Tensor:
    return torch.empty(t.shape, dtype=t.dtype, device=t.device)


_dense_copy.register_autograd(lambda ctx, grad: grad, setup_context=lambda ctx, inputs, output: None)


def _gemm_operand(w: torch.Tensor) -> torch.Tensor:
    """``w`` (E, K, N) as torch's grouped GEMM takes it: one of its last two dimensions of stride 1. A permuted view
    (PEFT's expert LoRA factor ``lora_B``, stored (out, r * E)) gets a copy through an op of our own: inductor
    (torch 2.11-2.13) lays a ``.contiguous()`` copy out in its input's stride order when only ``_grouped_mm`` reads
    it, and the kernel then refuses it ("Invalid strides/sizes", run 41), where a custom op's output keeps its
    layout."""
    if w.stride(-1) == 1 or w.stride(-2) == 1:
        return w
    return _dense_copy(w)


def grouped_mm(x: torch.Tensor, w: torch.Tensor, groups: _Groups) -> torch.Tensor:
    """Rows of ``x`` (S, K), sorted by expert, times their expert's ``w`` (E, K, N) -> (S, N)."""
    if _is_fake(x):  # the facts probe: shapes only
        return _grouped_mm_op(x, w, groups.offs)
    if x.device.type == "cuda" and torch.is_autocast_enabled("cuda"):
        dtype = torch.get_autocast_dtype("cuda")  # grouped_mm is not autocast-aware; F.linear would cast
        x, w = x.to(dtype), w.to(dtype)
    if _cuda_grouped_mm_serves(x, w):
        fn = getattr(torch.nn.functional, "grouped_mm", None) or torch._grouped_mm
        return fn(x, _gemm_operand(w), offs=groups.offs)
    parts = [xe @ we for xe, we, n in zip(x.split(groups.counts), w.unbind(0), groups.counts) if n]
    return torch.cat(parts) if parts else x.new_zeros(0, w.shape[-1])


def _lora_factors_proxy() -> type | None:
    try:
        from peft.tuners.lora.layer import _LoraFactorsProxy
    except ImportError:
        return None
    return _LoraFactorsProxy


def weight_and_lora(module: nn.Module, name: str) -> tuple[torch.Tensor, Factors | None]:
    """The parameter ``name`` of ``module`` and, where PEFT's single-adapter LoRA parametrization is active on it,
    its factors ``(lhs, rhs, scaling)`` (delta = scaling * lhs @ rhs, in the parameter's layout), unevaluated.
    Anything else is read as stock reads it (the parametrization evaluated)."""
    if parametrize.is_parametrized(module, name):
        chain = module.parametrizations[name]
        proxy = _lora_factors_proxy()
        if len(chain) == 1 and proxy is not None and type(chain[0]) is proxy:
            return chain.original, (chain[0].lhs, chain[0].rhs, chain[0].scaling)
    return getattr(module, name), None


def experts_linear(module: nn.Module, name: str, x: torch.Tensor, groups: _Groups,
                   lora: Factors | None = None) -> torch.Tensor:
    """Projection ``name`` (a 3-D expert parameter, plus ``name + '_bias'`` where the module has biases) of the
    sorted rows ``x`` (S, in) -> (S, out); LoRA on it (``lora`` given, or found on the parameter) as low-rank
    products per expert group."""
    if lora is None:
        weight, lora = weight_and_lora(module, name)
    else:
        weight = getattr(module, name)
    transposed = module.is_transposed  # stored (E, in, out); else (E, out, in) as nn.Linear
    y = grouped_mm(x, weight if transposed else weight.transpose(-2, -1), groups)
    if lora is not None:
        lhs, rhs, scaling = lora
        down, up = (lhs, rhs) if transposed else (rhs.transpose(-2, -1), lhs.transpose(-2, -1))  # (E,in,r), (E,r,out)
        y = y + grouped_mm(grouped_mm(x, down, groups), up, groups) * scaling
    if module.has_bias:  # gathered in fp32 so its backward sums each expert's rows in fp32, as eager's broadcast
        y = y + getattr(module, f"{name}_bias").float()[groups.ids].to(y.dtype)
    return y


def grouped_experts_forward(self: nn.Module, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                            top_k_weights: torch.Tensor, lora: dict[str, Factors] | None = None) -> torch.Tensor:
    """The experts of ``self`` on ``hidden_states`` (T, H), each token through its ``top_k_index`` (T, k) experts,
    summed with ``top_k_weights`` (T, k): what stock's eager loop computes, on rows grouped by expert. ``lora``:
    {parameter name: (lhs, rhs, scaling)} of PEFT's adapters on the 3-D parameters (``peft_experts_forward``).
    Outside training (eval mode: evaluation, generation, compiled decode) the class's own forward runs, with the
    experts implementation the model was given, exactly as unpatched."""
    if not self.training:
        return type(self).forward(self, hidden_states, top_k_index, top_k_weights)
    lora = lora or {}
    num_tokens, hidden = hidden_states.shape
    top_k = top_k_index.shape[-1]
    sorted_ids, perm = torch.sort(top_k_index.reshape(-1), stable=True)  # (S,) with S = T * k
    groups = _Groups(sorted_ids, self.num_experts)
    rows = hidden_states[perm // top_k]  # (S, H)
    up = "gate_up_proj" if self.has_gate else "up_proj"
    h = experts_linear(self, up, rows, groups, lora.get(up))
    h = self._apply_gate(h) if self.has_gate else self.act_fn(h)
    out = experts_linear(self, "down_proj", h, groups, lora.get("down_proj"))  # (S, H)
    if getattr(self, "has_post_expert_norm", False):
        out = self.post_expert_norm(out)
    weighted = out * top_k_weights.reshape(-1)[perm].unsqueeze(-1)
    inverse = torch.empty_like(perm).scatter_(0, perm, torch.arange(perm.numel(), device=perm.device))
    unsorted = weighted[inverse]  # back to (token, k) order (a gather: saves the index only, index_copy the rows)
    return unsorted.view(num_tokens, top_k, hidden).sum(dim=1).to(hidden_states.dtype)


_DECORATED = _decorated_forward_code()


# ------------------------------------------------------------------------------------- what the memory estimate reads
@dataclass(frozen=True)
class ExpertsShape:
    """One experts module's sizes, read from the module (``experts_shapes``), and what the grouped path keeps."""

    path: str  # the module's name in the model
    num_experts: int
    top_k: int  # experts per token (the router's top_k)
    hidden: int  # H: the rows' width in and out
    intermediate: int  # I: down_proj's input width
    up_width: int  # the up projection's output width (2I with a gate)
    has_bias: bool
    gate_bytes: dict[int, int]  # activation bytes -> bytes per row the gate / activation keeps (measured on a probe)

    @property
    def params(self) -> int:
        """Parameters of all experts (weights and biases)."""
        per_expert = (self.hidden + self.has_bias) * self.up_width + (self.intermediate + self.has_bias) * self.hidden
        return self.num_experts * per_expert

    @property
    def active_params(self) -> int:
        """Parameters one token runs through (its top_k experts): what a FLOP count per token uses."""
        return self.params * self.top_k // self.num_experts

    def saved_bytes_per_token(self, act_bytes: int, *, lora_rank: int = 0, trainable: bool = False,
                              routing_bytes: int = 4) -> int:
        """Bytes per token the grouped forward keeps for backward: per (token, expert) row the up projection's input
        (where its weight trains or carries LoRA), the gate's tensors, the down projection's input (same rule), the
        LoRA products (``lora_rank`` per projection), the expert output and routing weight (the router's gradient),
        and the int64 indices of the sort (three, four with trainable biases). ``routing_bytes``: the router's output
        dtype (fp32 for Mixtral; Qwen3-MoE and gpt-oss return the activation dtype: 2 bytes less per row there)."""
        weight_inputs = (self.hidden + self.intermediate) if (trainable or lora_rank) else 0
        elements = weight_inputs + 2 * lora_rank + self.hidden
        gate = self.gate_bytes.get(act_bytes, self.gate_bytes[4] * act_bytes // 4)
        row = elements * act_bytes + gate + routing_bytes + 8 * (3 + (self.has_bias and trainable))
        return self.top_k * row


def _gate_bytes(module: nn.Module, width: int) -> dict[int, int]:
    """Bytes per row ``_apply_gate`` (or ``act_fn``) keeps for backward, its input's storage included, measured on a
    4-row CPU probe in bf16 and fp32 (the module holds no parameter the gate reads)."""
    gate = module._apply_gate if module.has_gate else module.act_fn
    found = {}
    for dtype in (torch.bfloat16, torch.float32):
        kept: dict[int, int] = {}

        def pack(t: torch.Tensor) -> torch.Tensor:
            kept[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            gate(torch.ones(4, width, dtype=dtype, requires_grad=True) * 1.0)
        found[torch.finfo(dtype).bits // 8] = sum(kept.values()) // 4
    return found


def _top_k(experts: nn.Module, holder: nn.Module, config: Any) -> int:
    for module in (holder, *holder.children()):
        if module is not experts and isinstance(getattr(module, "top_k", None), int):
            return module.top_k
    text = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
    return int(text.num_experts_per_tok)


def experts_shapes(model_or_config: Any) -> list[ExpertsShape]:
    """Each experts module's ``ExpertsShape``, in model order. A config is built on the meta device (no memory)."""
    if isinstance(model_or_config, nn.Module):
        model = model_or_config
    else:
        from transformers import AutoModelForCausalLM

        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(model_or_config)
    holders = {id(child): parent for parent in model.modules() for child in parent.children()}
    shapes = []
    gates: dict[tuple, dict[int, int]] = {}  # one probe per gate kind and width: every layer's experts alike
    for name, module in find_experts(model):
        up = getattr(module, "gate_up_proj" if module.has_gate else "up_proj")
        down = getattr(module, "down_proj")
        hidden, intermediate = (down.shape[-1], down.shape[-2]) if module.is_transposed else down.shape[-2:]
        up_width = up.shape[-1] if module.is_transposed else up.shape[-2]
        holder = holders[id(module)]
        while _param_wrapper() is not None and isinstance(holder, _param_wrapper()):
            holder = holders[id(holder)]
        gate_key = (type(module), bool(module.has_gate), up_width)
        if gate_key not in gates:
            gates[gate_key] = _gate_bytes(module, up_width)
        shapes.append(ExpertsShape(name, module.num_experts, _top_k(module, holder, model.config), hidden,
                                   intermediate, up_width, bool(module.has_bias), gates[gate_key]))
    return shapes
