"""Regional compilation: each decoder layer's training forward through ``torch.compile``, bound to this instance.

``patch(model, compile=True)`` compiles every decoder layer (transformers' ``GradientCheckpointingLayer``s) with
inductor, so the element-wise work around the matmuls (RoPE, residual adds, norms, the gated MLP's activation) runs
as a few fused kernels in forward and backward. Attention stays hf_accel's kernel: the attention
function is excluded from compilation (one graph break per layer), so packing metadata and the kernel choice work as
before. Where torch has dynamo's nested graph breaks (``NESTED_GRAPH_BREAKS`` below) the layers trace under them by
default: one graph before the attention and one after.

Only training calls take the compiled path (module in train mode, grad enabled, no KV cache, and no op-level
checkpointing on that layer, whose selective-checkpoint policy must see each op). Evaluation and generation run the
layer's own eager forward, exactly what the unpatched model computes. The layers compile with ``dynamic=True`` (a
symbolic token dimension from the first step, in the pieces after the attention break too), so steps of different
token counts share the compiled graphs: on CPU no step after the first compiles anything. (Compiled static first,
those pieces compiled again at the first new length.) On CUDA inductor may also guard the first graphs on a token
range from its fusion heuristics (``2560 <= tokens <= 4095`` after a 3,072-token first step), so the first length
outside it compiles them once more, and no later length does (tests/gpu/RESULTS.md). A user's options dict may set
``dynamic`` itself. All layers share one set of graphs.

Compilation leaves many long-lived Python objects (graphs, guards, generated code) that every later full garbage
collection scans, so they grow into stalls of a step or more (docs/guide/speedups-and-backends.md). After a training
call that compiled new graphs, garbage is collected once and, while compiled layers are bound, the collector makes no
automatic full (oldest-generation) collections; young generations are still collected, and an explicit
``gc.collect()`` still frees everything. (An earlier ``gc.freeze`` kept every object alive at that moment forever,
a deleted model included: patched models hold reference cycles, which only the collector frees.) ``unpatch`` of the
last compiled model restores the collector's threshold.

The binding is the layer's ``_compiled_call_impl`` slot (what ``nn.Module.compile`` sets), so ``unpatch`` restores
the slot exactly. Where transformers checkpoints a layer matters: up to 5.22 its checkpointing wraps ``__call__``, so
the checkpoint runs outside the slot and calls the compiled layer (forward and recompute). From 5.23 it wraps the
class's ``forward``, i.e. inside the slot: dynamo would have to trace ``torch.utils.checkpoint`` around a body with a
graph break (the attention), cannot, and ran the whole layer eagerly, with no error. There a checkpointed training
call runs the layer's own call eagerly up to the checkpoint and hands the checkpoint a compiled body (the unwrapped
forward), so the forward and the backward's recompute both run compiled, with the layer's hooks still outside.
"""
from __future__ import annotations

import contextlib
import functools
import gc
from collections.abc import Callable
from types import MethodType
from typing import Any

import torch
from torch import nn

from ..binding import bind_forward
from .._compat import cache_kwarg
from ..memory.targets import CALL_SLOT as SLOT, OP_LEVEL_ATTR, decoder_layers
from ..errors import BackendUnavailable
from .foreign_forwards import ForeignForwards, is_compile_failure


def _mark_dynamic(value: Any, seq_len: int) -> None:
    """Mark the token dimension of every tensor argument dynamic (dim 1 of (B, S, ...) tensors, dim 0 of 1-D ones:
    positions, cu_seqlens), so a new step length or document count reuses the compiled graph."""
    if isinstance(value, (tuple, list)):
        for item in value:
            _mark_dynamic(item, seq_len)
    elif isinstance(value, dict):
        for item in value.values():
            _mark_dynamic(item, seq_len)
    elif isinstance(value, torch.Tensor):
        if value.ndim >= 2 and value.shape[1] == seq_len:
            torch._dynamo.maybe_mark_dynamic(value, 1)
        elif value.ndim == 1:
            torch._dynamo.maybe_mark_dynamic(value, 0)


def graphs_compiled() -> int:
    """How many graphs dynamo has captured in this process (0 where the counter is unavailable)."""
    try:
        return int(torch._dynamo.utils.counters["stats"]["unique_graphs"])
    except (AttributeError, KeyError, TypeError):
        return 0


_NO_AUTO_FULL = 1 << 30  # an oldest-generation threshold no training run reaches
_bound: set[int] = set()  # ids of the TrainingCompiled calls bound now
_saved_threshold: list[int] = []  # the collector's oldest-generation threshold before the first binding


def quiet_full_collections() -> None:
    """Collect garbage once, then keep the collector from automatic full collections (see the module docstring)."""
    gc.collect()
    if _bound:
        thresholds = gc.get_threshold()
        if not _saved_threshold:
            _saved_threshold.append(thresholds[2])
        gc.set_threshold(thresholds[0], thresholds[1], _NO_AUTO_FULL)


def _release(key: int) -> None:
    _bound.discard(key)
    if not _bound and _saved_threshold:
        thresholds = gc.get_threshold()
        gc.set_threshold(thresholds[0], thresholds[1], _saved_threshold.pop())


_CHECKPOINT_FUNC = "_gradient_checkpointing_func"


def checkpointed_body(layer: nn.Module) -> Callable | None:
    """The forward that transformers' checkpointing wrapper runs inside the checkpoint, where that wrapper is the
    class's ``forward`` (transformers >= 5.23), unwrapped; None where checkpointing wraps ``__call__`` (5.17-5.22)."""
    forward, body = type(layer).forward, None
    while getattr(getattr(forward, "__code__", None), "co_name", None) == "forward_with_checkpointing":
        forward = body = forward.__wrapped__  # an FSDP2 subclass wraps it once more; only the outermost checkpoints
    return body


# hf_accel's own key in a compile dict, not a torch.compile option: trace the layers with dynamo's nested graph breaks
# (torch._dynamo.config.nested_graph_breaks). The attention seam's break then ends the layer's graph and tracing
# resumes after it, where without it dynamo compiles the layer, its attention module and transformers' attention
# function as separate frames (~6 graphs a layer, and the gradients of q/k/v coming back into them as eager copies).
# On by default where torch has the option (measured faster on every workload tried, the same memory and loss: Llama-1B
# +0.6% / +1.6%, GPT-NeoX-1.4B +4.2%, Llama-3-8B LoRA +1.5%; GPU equivalence cases for Llama, GPT-NeoX, Falcon, the
# checkpointed LoRA layers and QLoRA; BENCHMARKS.md, tests/gpu/RESULTS.md runs 35-37). ``False`` traces as before.
# The default holds from the first torch they were tested on (2.11 on the GPU, 2.13 on CPU); torch 2.10 has the
# option, earlier in its development, and takes it only when asked.
NESTED_GRAPH_BREAKS = "nested_graph_breaks"
NESTED_BY_DEFAULT_FROM = (2, 11)


def nested_graph_breaks_available() -> bool:
    return hasattr(torch._dynamo.config, NESTED_GRAPH_BREAKS)


def _nested_by_default() -> bool:
    from packaging.version import Version

    release = Version(str(torch.__version__)).release[:2]  # a local tag ("+cu130") is not part of the release
    return nested_graph_breaks_available() and release >= NESTED_BY_DEFAULT_FROM


def traces_nested(options: dict[str, Any] | None) -> bool:
    """Whether layers compiled with ``options`` (a compile dict, or None) trace under nested graph breaks."""
    requested = (options or {}).get(NESTED_GRAPH_BREAKS)
    return _nested_by_default() if requested is None else bool(requested)


def dynamo_settings(options: dict[str, Any]) -> dict[str, Any]:
    """Take hf_accel's dynamo keys out of a compile dict (in place); the dynamo config to trace the layers under.
    Nested graph breaks: the default on torch >= 2.11 unless the dict says False; where torch lacks them, True is
    refused."""
    nested = traces_nested(options)  # one answer for the tracing and for the report's note
    options.pop(NESTED_GRAPH_BREAKS, None)
    if not nested:
        return {}
    if not nested_graph_breaks_available():
        raise BackendUnavailable(
            f"compile={{'{NESTED_GRAPH_BREAKS}': True}} needs dynamo's option of that name, which torch "
            f"{torch.__version__} does not have. Leave the key out (the layers then compile without it)."
        )
    return {NESTED_GRAPH_BREAKS: True}


def _kernels_routing(module: nn.Module) -> bool:
    """Whether ``module``'s class forward is the ``kernels`` package's routing wrapper (``use_kernelized_func``, which
    transformers >= 5.2x puts on its attention classes and which sets a ContextVar in a try/finally around the class's
    own forward, kept as ``__wrapped__``)."""
    wrapper = type(module).forward
    module_name = getattr(wrapper, "__globals__", {}).get("__name__", "")
    return (hasattr(wrapper, "__wrapped__") and isinstance(module.__dict__.get("_kernel_funcs"), dict)
            and module_name.startswith("kernels."))


def _own_forward_unless_kernelized(self: nn.Module, *args, **kwargs):
    wrapper = type(self).forward
    if any("forward" in func.__dict__ for func in self._kernel_funcs.values()):  # kernelize() replaced one
        return wrapper(self, *args, **kwargs)
    return wrapper.__wrapped__(self, *args, **kwargs)


def _trace_through_idle_kernels_routing(layer: nn.Module) -> list[Callable[[], None]]:
    """Under nested graph breaks, dynamo cannot resume inside the routing wrapper's try/finally, so a wrapped attention
    module ran as frames of its own: 4 graphs a layer instead of 2 (transformers 5.25 with `kernels` 0.19; 5.17
    wraps where `kernels` is installed). Until ``kernels.kernelize`` picks a kernel for one of the module's
    functions the wrapper routes each call to that function itself, so the class's own forward computes the same;
    this binds, per instance, a forward that takes it then and the wrapper otherwise (checked on every call; a bound
    method, so a deep copy binds its copy). Returns the undo actions."""
    undo = []
    for module in layer.modules():
        if not _kernels_routing(module) or "forward" in module.__dict__:
            continue
        undo.append(bind_forward(module, MethodType(_own_forward_unless_kernelized, module)))
    return undo


class TrainingCompiled:
    """A decoder layer's call: compiled for training calls, the layer's own eager call for everything else."""

    def __init__(self, layer: nn.Module, options: dict[str, Any], dynamo_config: dict[str, Any] | None = None,
                 foreign: ForeignForwards | None = None):
        self.layer = layer
        self.dynamo_config = dynamo_config or {}
        self.foreign = foreign if foreign is not None else ForeignForwards(layer, [layer])
        self.compiled = torch.compile(layer._call_impl, **options)
        body = checkpointed_body(layer)
        self.compiled_body = None
        if body is not None:
            def run_body(*args, **kwargs):
                return body(layer, *args, **kwargs)

            self.compiled_body = torch.compile(run_body, **options)

    def takes_compiled_path(self, kwargs: dict[str, Any]) -> bool:
        layer = self.layer
        if not (layer.training and torch.is_grad_enabled()) or self.foreign.eager_reason is not None:
            return False
        if cache_kwarg(kwargs) is not None or kwargs.get("layer_past") is not None:  # a KV cache (Falcon's layer_past)
            return False
        if kwargs.get("use_cache"):
            return False
        func = getattr(layer, _CHECKPOINT_FUNC, None)
        op_level = bool(getattr(layer, "gradient_checkpointing", False) and getattr(func, OP_LEVEL_ATTR, False))
        return not op_level

    def __call__(self, *args, **kwargs):
        if not self.takes_compiled_path(kwargs):
            return self.layer._call_impl(*args, **kwargs)
        hidden = args[0] if args else kwargs.get("hidden_states")
        if isinstance(hidden, torch.Tensor) and hidden.ndim >= 2:
            _mark_dynamic(args, hidden.shape[1])
            _mark_dynamic(kwargs, hidden.shape[1])
        from .ops import keep_liger_out_of_compiled_graphs

        keep_liger_out_of_compiled_graphs()  # before tracing: liger bound by transformers / TRL stays eager-only
        self.foreign.refresh(self.layer)  # forwards bound since the last call (transformers binds liger in train())
        before = graphs_compiled()
        retried = False
        while True:
            try:
                out = self._compiled_call(args, kwargs)
                break
            except Exception as exc:
                # a failure to trace is hf_accel's to absorb (see foreign_forwards), never the model's own error
                if not is_compile_failure(exc):
                    raise
                if not self.foreign.failed(exc, retried):
                    out = self.layer._call_impl(*args, **kwargs)
                    break
                retried = True
        if graphs_compiled() != before:
            quiet_full_collections()
        return out

    def _compiled_call(self, args: tuple, kwargs: dict[str, Any]):
        tracing = torch._dynamo.config.patch(**self.dynamo_config) if self.dynamo_config else contextlib.nullcontext()
        with tracing:
            if self.compiled_body is not None and getattr(self.layer, "gradient_checkpointing", False):
                return self._checkpointed(args, kwargs)
            return self.compiled(*args, **kwargs)

    def _checkpointed(self, args: tuple, kwargs: dict[str, Any]):
        """The layer's own call (its hooks, transformers' checkpointing wrapper) with the checkpoint's body compiled
        (see the module docstring): the layer's checkpoint function is wrapped for this call only."""
        layer, body = self.layer, self.compiled_body
        had_own = _CHECKPOINT_FUNC in layer.__dict__
        checkpoint = getattr(layer, _CHECKPOINT_FUNC)

        def checkpoint_compiled_body(forward, *checkpoint_args, **checkpoint_kwargs):
            # forward: functools.partial(<the class's forward>, layer, **kwargs), as transformers' wrapper builds it
            compiled = functools.partial(body, *forward.args[1:], **forward.keywords)
            return checkpoint(compiled, *checkpoint_args, **checkpoint_kwargs)

        layer.__dict__[_CHECKPOINT_FUNC] = checkpoint_compiled_body
        try:
            return layer._call_impl(*args, **kwargs)
        finally:
            if had_own:
                layer.__dict__[_CHECKPOINT_FUNC] = checkpoint
            else:
                layer.__dict__.pop(_CHECKPOINT_FUNC, None)

    def __deepcopy__(self, memo):
        # A copied model (a reference model, EMA) gets the eager call; compile it again with patch() if wanted.
        return None

    def __getstate__(self):
        raise TypeError("a compiled hf_accel layer cannot be pickled; unpatch(model) first or save its state_dict")


def apply(model: nn.Module, options: dict[str, Any] | None = None) -> tuple[list[str], list[Callable[[], None]]]:
    """Compile each decoder layer's training forward; return the layer names and the undo actions."""
    if not torch._dynamo.is_dynamo_supported():
        import sys

        raise BackendUnavailable(
            f"compile=True needs torch.compile, which torch {torch.__version__} does not support on Python "
            f"{sys.version.split()[0]} here. Pass compile=False (hf_accel's other speed-ups do not need it)."
        )
    # dynamic=True: every graph piece is compiled with a symbolic token dimension from the first step. With the
    # default (static first, dynamic after a change) the pieces after the attention break, whose token count is a
    # Python int in the resumed frame, compiled again at the first new length (and on CUDA at the second, see above).
    options = {"fullgraph": False, "dynamic": True, **(options or {})}
    dynamo_config = dynamo_settings(options)
    names = {id(m): n for n, m in model.named_modules()}
    bound, undo = [], []
    from .ops import keep_liger_out_of_compiled_graphs

    keep_liger_out_of_compiled_graphs()  # (where liger is imported) so that its stand-ins count as traceable below
    layers = decoder_layers(model)
    foreign = ForeignForwards(model, layers)  # liger / hub kernel forwards: decided before each trace
    for layer in layers:
        had_own = SLOT in layer.__dict__
        previous = layer.__dict__.get(SLOT)
        call = TrainingCompiled(layer, options, dynamo_config, foreign)
        layer.__dict__[SLOT] = call
        _bound.add(id(call))

        def restore(layer=layer, had_own=had_own, previous=previous, key=id(call)) -> None:
            _release(key)
            if had_own:
                layer.__dict__[SLOT] = previous
            else:
                layer.__dict__.pop(SLOT, None)

        undo.append(restore)
        if dynamo_config.get(NESTED_GRAPH_BREAKS):
            undo += _trace_through_idle_kernels_routing(layer)
        bound.append(names.get(id(layer), type(layer).__name__))
    foreign.refresh()  # forwards bound before patch() (a user's apply_liger_kernel_to_*): decided now
    undo.append(foreign.undo)
    return bound, undo


def compiled_layers(model: nn.Module) -> list[nn.Module]:
    """The decoder layers currently bound to a compiled training call."""
    return [layer for layer in decoder_layers(model) if isinstance(layer.__dict__.get(SLOT), TrainingCompiled)]
