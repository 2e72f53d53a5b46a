"""How a patched model's forwards reach hf_accel's attention while its config keeps saying what the user chose.

transformers' attention layers and mask builders look their functions up by ``config._attn_implementation``. A patch
that renamed it for good broke what users and transformers' own tests rely on: ``config.output_attentions = True``
on an eager model raised, ``set_attn_implementation`` and the sdpa dispatch checks read a foreign name. So the model's
config keeps reporting the user's implementation ("sdpa", "eager", ...), and:

- each patched attention module reads a *routed view* of that config (``routed_config``: the same attributes, the
  same ``__dict__``, but ``_attn_implementation`` reads hf_accel's name), so its forward reaches hf_accel's function
  in every call, a checkpoint's recompute in backward and compiled layers included;
- a pre-hook on the model's body (every entry point passes through it) switches the config itself to hf_accel's name
  for the duration of each forward, so the mask is built by hf_accel's mask function, and sets a ``Route`` saying
  which implementation serves the calls the seam leaves to transformers (the reported one): decoding steps behind a
  KV cache, a caller's 4D mask, evaluation traced by ``torch.compile``, and, outside training, every call of a forward
  given a padding mask that fills a KV cache (a ``generate`` prefill) or hides a slot: masked query slots then get
  the stock values (the varlen layout drops them), and generate reads a right-padded row's last one, so right-padded
  generation is the unpatched model's with a dynamic, a static or no cache;
- a forward asking for attention probabilities runs transformers' eager attention, mask included.

Inside ``torch.compile`` the body's hook does not switch (dynamo cannot trace the context variable): a traced
forward builds the reported implementation's mask, and the seam leaves every call it cannot read to that
implementation. ``set_attn_implementation`` after patching is honoured: the stock calls then use the new name.
"""
from __future__ import annotations

import copy
import functools
import inspect
import sys
from collections.abc import Callable
from contextvars import ContextVar
from dataclasses import dataclass

import torch
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from .._compat import cache_kwarg

# Our own name: never containing "flash" (transformers treats such names as its own flash path and fetches kernels).
ATTN_NAME = "hf_accel"
PROBABILITIES = "eager"  # what serves a forward asking for attention probabilities (always available)


@dataclass(frozen=True)
class Route:
    """What the current forward of a patched model asks of its attention calls."""

    stock_name: str  # the implementation the model reports: it serves every call the seam does not
    stock_forward: bool = False  # every call of this forward runs stock (``leaves_forward_to_stock``)
    probabilities: bool = False  # this forward returns attention probabilities: eager serves it
    padding_mask: torch.Tensor | None = None  # the 2D mask the body was given (every layer's mask is this tensor)


_ROUTE: ContextVar[Route | None] = ContextVar("hf_accel_route", default=None)
_INTERNAL = "_attn_implementation_internal"  # where PretrainedConfig keeps the name its property reports


def _route() -> Route | None:
    return None if torch.compiler.is_compiling() else _ROUTE.get()


def _routed_name(self) -> str:
    route = _route()
    return PROBABILITIES if route is not None and route.probabilities else ATTN_NAME


def _set_name(self, value) -> None:
    self.__dict__[_INTERNAL] = value


def _reduce(self):
    return routed_config, (type(self).real_config, type(self).patched_name, type(self).eager)


def routed_config(config, patched_name: str, eager: Callable | None):
    """A view of ``config`` sharing its attributes (its ``__dict__``: what either changes the other sees) whose
    ``_attn_implementation`` reads hf_accel's name (eager while a forward asks for probabilities). ``patched_name``:
    what the model reported when patched; ``eager``: the family's ``eager_attention_forward``. Copies of the view
    (deepcopy, pickle) are views of the copied config."""
    cls = type(f"Routed{type(config).__name__}", (type(config),), {
        "_attn_implementation": property(_routed_name, _set_name),
        "real_config": config, "patched_name": patched_name, "eager": eager, "__reduce__": _reduce,
        "__deepcopy__": lambda self, memo: routed_config(copy.deepcopy(config, memo), patched_name, eager),
    })
    view = object.__new__(cls)
    view.__dict__ = config.__dict__
    return view


def stock_name(module: torch.nn.Module) -> str:
    """The implementation serving ``module``'s calls that the seam leaves to transformers: the current forward's
    route, else what the config reports now (the name at patch time while it is pinned to hf_accel's)."""
    route = _route()
    if route is not None:
        return route.stock_name
    config = module.config
    name = config.__dict__.get(_INTERNAL)
    if name is None or name == ATTN_NAME:
        name = getattr(type(config), "patched_name", None)
    return "sdpa" if name is None or name == ATTN_NAME else name


def stock_attention(module: torch.nn.Module) -> Callable:
    """The attention function transformers would call for ``module`` under the reported implementation (eager: the
    family's own ``eager_attention_forward``, soft-capping included where the family has it)."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    eager = getattr(type(module.config), "eager", None) or sdpa_attention_forward
    return ALL_ATTENTION_FUNCTIONS.get_interface(stock_name(module), eager)


def stock_mask() -> Callable:
    """The mask function of the reported implementation (SDPA's where it has none of its own)."""
    route = _route()
    return ALL_MASK_ATTENTION_FUNCTIONS.get(route.stock_name if route else "sdpa", sdpa_mask)


def forward_padding_mask() -> torch.Tensor | None:
    """The 2D padding mask the current forward's body was given, or None."""
    route = _route()
    return None if route is None else route.padding_mask


def runs_stock_forward() -> bool:
    """Whether the current forward leaves every attention call to the reported implementation."""
    route = _route()
    return route is not None and route.stock_forward


def route_attention_modules(model: torch.nn.Module, modules: list[torch.nn.Module]) -> list[Callable[[], None]]:
    """Give each of ``modules`` (the model's attention modules) the routed view of the model's config; undo actions.
    The family's eager function is looked up in the modules' own modeling file."""
    config = model.config
    eager = getattr(sys.modules.get(type(modules[0]).__module__), "eager_attention_forward", None) if modules else None
    view = routed_config(config, config._attn_implementation, eager)
    undo = []
    for module in modules:
        own = module.__dict__.get("config")
        module.config = view
        undo.append(lambda m=module, own=own: setattr(m, "config", own))
    return undo


def wants_attentions(config, kwargs) -> bool:
    """Whether a model forward called with ``kwargs`` returns attention probabilities."""
    wanted = kwargs.get("output_attentions")
    return bool(getattr(config, "output_attentions", False) if wanted is None else wanted)


def leaves_forward_to_stock(module: torch.nn.Module, mask, cache, use_cache) -> bool:
    """Whether a forward outside training, given ``mask`` (its attention_mask), leaves every attention call to the
    reported implementation: a 2D padding mask with a KV cache filled (``cache`` given, or ``use_cache`` making one;
    decided without reading tensor data), or a 2D mask hiding a slot (one host read of the mask). Stock attention
    gives a masked query slot values of its own where the varlen layout drops it, and generate reads a right-padded
    row's last slot."""
    if module.training and torch.is_grad_enabled():
        return False  # training calls keep the seam (a cache there is dead weight, and patch() defaults it off)
    if getattr(mask, "ndim", None) != 2:
        return False
    use_cache = getattr(module.config, "use_cache", False) if use_cache is None else use_cache
    return cache is not None or bool(use_cache) or not bool(mask.all())


@functools.lru_cache(maxsize=None)
def _default_logits_to_keep(body_cls: type):
    """The default of the body's own ``logits_to_keep`` parameter (Gemma 4's text model: 0), None where it has none."""
    parameter = inspect.signature(body_cls.forward).parameters.get("logits_to_keep")
    return None if parameter is None or parameter.default is inspect.Parameter.empty else parameter.default


def routing_hooks(body: torch.nn.Module, patched_name: str) -> list[Callable[[], None]]:
    """Pre- and post-hooks on the model's body that switch its config to hf_accel's name (or to eager, for a call
    asking for probabilities) for each forward and back; returns their removers. ``patched_name``: the name the
    model reported when patched (the stock implementation while the config is pinned to hf_accel's own name).
    The hooks read the config from the module they run on, so a deep copy of the patched model switches its own."""
    from .hf_attention import suspend_forward_record

    calls = []  # one entry per call in flight (calls nest): None or (config, reported name, undo actions)

    def before(module, args, kwargs):
        if torch.compiler.is_compiling():
            calls.append(None)
            return
        config = module.config
        reported = config._attn_implementation
        stock = reported if reported != ATTN_NAME else (patched_name if patched_name != ATTN_NAME else "sdpa")
        probabilities = wants_attentions(config, kwargs)
        mask = kwargs["attention_mask"] if "attention_mask" in kwargs else (args[1] if len(args) > 1 else None)
        cache = cache_kwarg(kwargs)
        token = _ROUTE.set(Route(stock, leaves_forward_to_stock(module, mask, cache, kwargs.get("use_cache")),
                                 probabilities, mask if getattr(mask, "ndim", None) == 2 else None))
        undo = [lambda: _ROUTE.reset(token)]
        if probabilities:  # eager's mask finds packed documents itself, as stock does
            undo.append(suspend_forward_record())
        config._attn_implementation_internal = PROBABILITIES if probabilities else ATTN_NAME  # both always exist
        calls.append((config, reported, undo))
        keep = kwargs.get("logits_to_keep", _default_logits_to_keep(type(module)))
        if isinstance(keep, int) and not isinstance(keep, bool):
            # A body that slices its queries to the kept positions before some layers (Gemma 4's KV-shared layers,
            # an inference shortcut for integer logits_to_keep) would slice the masks as 4D (B, 1, Q, K) tensors,
            # which the seam's 2D padding mask is not: the same positions as a slice, which such a body computes in
            # full (the same values; the CausalLM slices its logits with its own argument).
            return args, {**kwargs, "logits_to_keep": slice(-keep, None) if keep else slice(None)}
        return None

    def after(module, args, kwargs, output):
        entry = calls.pop() if calls else None
        if entry is not None:
            config, reported, undo = entry
            config._attn_implementation_internal = reported
            for action in undo:
                action()

    return [
        body.register_forward_pre_hook(before, with_kwargs=True).remove,
        body.register_forward_hook(after, with_kwargs=True, always_call=True).remove,
    ]


def pin_name(model: torch.nn.Module) -> Callable[[], None]:
    """Make the config report hf_accel's name between forwards too, for wrappers that intercept the attention
    function registered under the config's name (DeepSpeed's Ulysses sequence parallelism); returns the undo."""
    previous = model.config._attn_implementation
    model.set_attn_implementation(ATTN_NAME)
    return lambda: model.set_attn_implementation(previous)
