"""A model family's facts found from the model, not typed by hand: ``found_family(model or config)``.

Any causal LM whose attention modules look their function up in transformers' ``AttentionInterface`` gets the
generic seam; what hf_accel needs to know about it comes from a probe forward of a copy built from the config on fake
tensors (``probe``: each attention call's asks and shapes, the bytes each decoder layer saves, the projections only
the residual reads), from PEFT-style naming of its ``nn.Linear`` modules (the LoRA targets: every linear of the
decoder layers, what PEFT's ``target_modules="all-linear"`` picks) and from running its norms and gated MLPs on a
probe input (``fusable``). A family needing more than the seam (Falcon's own attention) is typed in ``patches/``.
"""
from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from ..attention.hf_attention import GENERIC_ATTENTIONS, patch_attention_modules
from ..errors import UnsupportedModel
from ..family import Family, LayerAttention, LayerBytes
from .probe import PROBE_NAME, Probed, probe_config, uses_attention_interface  # noqa: F401 (re-exported)

_DTYPES = {2: torch.bfloat16, 4: torch.float32}


def causal_lm_class(config) -> type:
    """The class transformers' AutoModelForCausalLM builds for ``config``."""
    from transformers import AutoModelForCausalLM

    try:
        return AutoModelForCausalLM._model_mapping[type(config)]
    except (KeyError, ValueError) as e:
        raise UnsupportedModel(
            f"transformers has no causal LM class for model_type {getattr(config, 'model_type', None)!r} "
            f"({type(config).__name__}): hf_accel patches causal language models (and their bodies), not encoders or "
            "vision / audio towers. Train it unpatched.") from e


def _is_causal_lm_class(model_cls: type) -> bool:
    """Whether ``model_cls`` is (a subclass of) a class transformers' AutoModelForCausalLM builds for some config:
    ``Emu3ForCausalLM`` and ``MllamaForCausalLM`` are, though their own configs (the text sub-configs) map to none.
    By class name, from the lazy mapping's names (and the classes registered into it): reading its classes would
    import every model module transformers has (seconds at each patch)."""
    from transformers import AutoModelForCausalLM

    mapping = AutoModelForCausalLM._model_mapping
    names = set(mapping._model_mapping.values()) | {c.__name__ for c in getattr(mapping, "_extra_content", {}).values()}
    return any(cls.__name__ in names for cls in model_cls.__mro__)


def _fingerprint(config) -> str:
    try:
        return config.to_json_string(use_diff=False)
    except (TypeError, ValueError):
        return repr(sorted(config.to_dict().items()))


_PROBES: dict[tuple, Probed] = {}


def probed(model_cls: type, config, dtype: torch.dtype = torch.bfloat16,
           prepare_copy: Callable[[nn.Module], None] | None = None) -> Probed:
    """``probe_config``, memoised per class, config, dtype and preparation (a config changed in place probes
    again)."""
    key = (model_cls, _fingerprint(config), dtype, prepare_copy)
    if key not in _PROBES:
        if len(_PROBES) > 64:
            _PROBES.clear()
        _PROBES[key] = probe_config(model_cls, config, dtype, prepare_copy)
    return _PROBES[key]


def _layer_attention(calls, index: int, first) -> LayerAttention:
    layer_calls = [c for c in calls if c.layer == index]
    if not layer_calls:
        return LayerAttention()
    call = layer_calls[0]
    asks = call.asks
    stock = f"its call passes {', '.join(asks.unknown)}, which no hf_accel kernel reads" if asks.unknown else None
    return LayerAttention(window=asks.window, softcap=asks.softcap, sinks=asks.sinks is not None, chunk=asks.chunk,
                          heads=call.heads if call.heads != first else None, stock=stock)


def _mean(figures: list[float]) -> int:
    """Per-layer bytes for the uniform per-layer figure the estimate uses: the layers past the first (which may also
    hold what the model hands every layer, such as rotary tables), averaged."""
    rest = figures[1:] or figures
    return int(round(sum(rest) / len(rest))) if rest else 0


def _needs_eager(model_cls: type, calls) -> bool:
    """Whether stock SDPA cannot compute what the calls ask (soft-capping, sinks, anything unknown), or the class
    refuses it: the unpatched reference is eager attention then."""
    if not getattr(model_cls, "_supports_sdpa", False):
        return True
    return any(c.asks.softcap or c.asks.sinks is not None or c.asks.unknown for c in calls)


def found_family(model_or_config: Any, prepare_copy: Callable[[nn.Module], None] | None = None) -> Family:
    """The generic Family of a transformers causal LM (or its config). UnsupportedModel where its attention does not
    go through transformers' AttentionInterface. ``prepare_copy``: what patch() does beyond the attention seam (the
    MoE experts' grouped path), done to the fake-tensor copy the facts are read from, so its saved bytes are the
    patched model's."""
    get_base = getattr(model_or_config, "get_base_model", None)
    model = get_base() if callable(get_base) else model_or_config  # under PEFT, the transformers model
    config = getattr(model, "config", model)
    if isinstance(model, nn.Module):
        return _found(type(model), config, model, prepare_copy)
    return _found(causal_lm_class(config), config, prepare_copy=prepare_copy)


def _found(model_cls: type, config, model: nn.Module | None = None,
           prepare_copy: Callable[[nn.Module], None] | None = None) -> Family:
    model_type = config.model_type
    try:
        causal_lm_class(config)  # a causal LM (or its body): not a vision or audio tower, an encoder, ...
    except UnsupportedModel:
        if not _is_causal_lm_class(model_cls):  # a text-only causal LM on a sub-config (Emu3's, Mllama's) is one
            raise
    try:
        facts = probed(model_cls, config, prepare_copy=prepare_copy)
    except Exception as e:  # noqa: BLE001 - a forward fake tensors cannot run: the seam without found facts
        classes = () if model is None else \
            tuple(dict.fromkeys(type(m) for m in model.modules() if uses_attention_interface(m)))
        if model is not None and not classes:  # the probe's failure aside, nothing here reaches the seam
            raise _no_interface(model_cls, model_type) from e
        if not classes:
            raise UnsupportedModel(
                f"hf_accel could not read {model_cls.__name__}'s facts from a probe forward on fake tensors "
                f"({type(e).__name__}: {e}); pass the model itself, or train it unpatched.") from e
        reader = _reads_the_mask_itself(classes, e)
        found = f"its probe forward, given what the seam gives, failed there ({type(e).__name__}: {e})"
        if reader is None:  # the probe failed before any attention ran: read the attention's own code
            reader = _indexes_the_mask(classes)
            found = f"its forward indexes the mask (the probe forward failed earlier: {type(e).__name__}: {e})"
        if reader is not None:
            raise UnsupportedModel(
                f"{model_cls.__name__} (model_type {model_type!r}): its attention ({reader}) reads the attention "
                "mask transformers builds itself before it calls the attention interface (e.g. to overlay a sparse "
                "selection of keys), and under hf_accel's seam the model gets a padding mask or none instead: "
                f"{found}. Train it unpatched.") from e
        return _unprobed(model, config, e)
    if not facts.attention_classes:
        raise _no_interface(model_cls, model_type)
    calls = facts.calls
    if any(c.own_mask for c in calls):
        names = ", ".join(sorted(c.__name__ for c in facts.attention_classes))
        raise UnsupportedModel(
            f"{model_cls.__name__} (model_type {model_type!r}): its attention ({names}) builds a mask "
            "of its own before it calls the attention interface (e.g. a learned bias over query and key positions), "
            "or attends to keys of its own beyond the sequence (e.g. compressed slots), which no varlen kernel takes, "
            "and it would build them from the padding mask hf_accel's seam hands the model instead of transformers' "
            "own. Train it unpatched.")
    window = _mask_window(model_cls, model_type, calls, facts.mask_windows, facts.calls_say_window)
    if window is not None:  # every call takes the window its mask carries
        calls = tuple(dataclasses.replace(c, asks=dataclasses.replace(c.asks, window=window)) for c in calls)
    first = calls[0].heads if calls else (config.num_attention_heads, config.num_attention_heads, 0)
    classes = facts.attention_classes
    layers = {c.layer for c in calls if c.layer is not None}
    attention_of = {index: _layer_attention(calls, index, first) for index in sorted(layers)}
    stock_layers = [i for i, a in attention_of.items() if a.stock]
    notes = tuple(f"layer {i}: transformers' own attention for every call ({attention_of[i].stock})"
                  for i in stock_layers)
    if window is not None:
        notes += (f"sliding window {window}: read from the mask the model builds (its attention calls do not pass "
                  "one); every layer's calls take it",)

    def layer_bytes(config_: Any, b: int) -> LayerBytes:
        saves = probed(model_cls, config_, _DTYPES.get(b, torch.bfloat16), prepare_copy).layers
        return LayerBytes(*(_mean([getattr(s, f) for s in saves]) for f in ("none", "op", "full", "mlp")))

    def apply(model: nn.Module, backend: str):
        return patch_attention_modules(model, classes, backend, mask_window=window)

    return Family(
        name=model_type,
        model_types=(model_type,),
        seam="attention_interface",
        touches=f"{', '.join(c.__name__ for c in classes)} via transformers' AttentionInterface",
        attentions=GENERIC_ATTENTIONS,
        lora_targets=facts.layer_linears,
        apply=apply,
        head_shape=lambda config_: first,
        mlp_width=lambda config_: facts.mlp_width,
        layer_bytes=layer_bytes,
        fusable=_fusable,
        training_dropout=lambda config_: max((c.asks.dropout for c in calls), default=0.0),
        layer_attention=lambda config_, index: attention_of.get(index, LayerAttention()),
        attention_layers=lambda config_: dict(attention_of),
        final_logit_softcap=lambda config_: getattr(config_, "final_logit_softcapping", None) or None,
        reference_attention="eager" if _needs_eager(model_cls, calls) else "sdpa",
        output_projections=lambda config_: facts.output_projections,
        notes=notes,
        packs_apart=stock_keeps_documents_apart,
        head_differs=lambda config_: None if facts.plain_head else (
            "the model's forward does more to the LM head's logits than a final soft-cap (a scale, a bias), which the "
            "fused loss would leave out"),
    )


def _no_interface(model_cls: type, model_type: str) -> UnsupportedModel:
    return UnsupportedModel(
        f"{model_cls.__name__} (model_type {model_type!r}) does not reach attention through transformers' "
        "AttentionInterface (ALL_ATTENTION_FUNCTIONS), the seam hf_accel patches, and hf_accel.patches has no "
        "family of its own for it. Train it unpatched.")


def _mask_window(model_cls: type, model_type: str, calls: tuple, windows: tuple[int | None, ...],
                 calls_say_window: bool) -> int | None:
    """The sliding window a model applies only through the mask it builds (PhiMoE: a sliding-window mask, attention
    calls without ``sliding_window``), where every mask it built carries that one window; None where the calls say
    what they keep (a window, a chunk, or ``sliding_window`` passed by every call, None included: transformers' flash
    path reads the keyword alone, so a mask built and handed to no sliding layer, as Cohere Compass's defaults build
    one, does not count) or no mask keeps a window. Masks of several windows, or sliding beside causal ones, with calls
    that do not say which layer takes which, are refused."""
    if (not any(w is not None for w in windows) or calls_say_window
            or any(c.asks.window or c.asks.chunk for c in calls)):
        return None
    if len(set(windows)) == 1:
        return windows[0]
    raise UnsupportedModel(
        f"{model_cls.__name__} (model_type {model_type!r}) builds masks with sliding windows "
        f"({', '.join('none' if w is None else str(w) for w in dict.fromkeys(windows))}) that its attention calls do "
        "not pass, so which layer keeps which window is known only to the masks, which hf_accel's seam replaces. "
        "Train it unpatched.")


def stock_keeps_documents_apart(model: nn.Module) -> bool:
    """Whether the unpatched ``model``, given two documents packed in one row with position_ids restarting at the
    second, computes each as it computes it alone (transformers' own packing; stock gpt-oss's eager attention lets
    the second attend to the first). One small forward of the model itself, without gradients."""
    get_base = getattr(model, "get_base_model", None)
    model = get_base() if callable(get_base) else model
    param = next(model.parameters())
    ids = (torch.arange(7, device=param.device)[None] * 5 + 3) % model.config.vocab_size
    pos = torch.tensor([[0, 1, 2, 0, 1, 2, 3]], device=param.device)
    training = model.training
    model.eval()
    try:
        with torch.no_grad():
            packed = model(input_ids=ids, position_ids=pos, use_cache=False).logits.float()
            alone = torch.cat([model(input_ids=ids[:, :3], use_cache=False).logits,
                               model(input_ids=ids[:, 3:], use_cache=False).logits], dim=1).float()
    finally:
        model.train(training)
    tolerance = 1e-4 if param.dtype == torch.float32 else 2e-2  # half precision: kernels of other shapes round apart
    return bool((packed - alone).abs().max() <= tolerance * alone.abs().max())


def _fusable(model: nn.Module):
    from .fusable import fusable_modules

    return fusable_modules(model)


def _reads_the_mask_itself(classes: tuple[type, ...], error: Exception) -> str | None:
    """The attention class (of ``classes``, the model's) whose own code the probe forward failed in, before its
    attention-interface call, or None. The probe's mask function gives what the seam gives a full-length document (no
    mask), so an attention module that indexes or overlays transformers' 4-D mask itself (DeepSeek V3.2's and GLM-5's
    sparse-attention indexers) fails there, patched as on the probe. Failures of fake tensors themselves
    (data-dependent values) say nothing of the mask."""
    import inspect

    from torch._subclasses import fake_tensor
    from torch.fx.experimental import symbolic_shapes

    from .probe import _probe_attention

    fake_limits = (fake_tensor.DataDependentOutputException, fake_tensor.DynamicOutputShapeException,
                   fake_tensor.UnsupportedOperatorException, symbolic_shapes.GuardOnDataDependentSymNode)
    if isinstance(error, fake_limits):
        return None
    codes = {inspect.unwrap(cls.forward).__code__: cls.__name__ for cls in classes}
    found, tb = None, error.__traceback__
    while tb is not None:
        code = tb.tb_frame.f_code
        if code in codes:
            found = codes[code]
        elif found is not None and code is _probe_attention.__code__:
            return None  # it failed in (or under) the attention call, not in the module's own code before it
        tb = tb.tb_next
    return found


_MASK_READ = re.compile(r"attention_mask\s*\[|attention_mask\.(?:masked_fill|dtype|dim\(|ndim)|attention_mask\s*[&|]")


def _indexes_the_mask(classes: tuple[type, ...]) -> str | None:
    """The attention class (of ``classes``, the model's) whose forward reads transformers' mask itself (indexes it,
    reads its dtype or rank, or overlays a selection on it), from its source, or None: for a model whose probe forward
    failed before any attention ran (HunYuan V4's). Every attention class of transformers 5.25 that does so is a
    sparse-attention indexer's (DeepSeek V3.2, GLM-5, HunYuan V4, Qwen4-exp, Kolibri, Mistral Large 4, Dots3)."""
    import inspect

    for cls in classes:
        try:
            source = inspect.getsource(inspect.unwrap(cls.forward))
        except (OSError, TypeError):
            continue
        if _MASK_READ.search(source):
            return cls.__name__
    return None


def _unprobed(model: nn.Module, config, error: Exception) -> Family:
    """The generic seam for a model whose probe forward failed: every call still reads its own asks and picks its
    kernel; what only the probe finds is left off (the trimmed recompute, MLP chunks) or refused (the memory
    estimate), and the report says so."""
    from ..errors import ConfigurationError
    from .probe import lora_targets

    attention = [m for m in model.modules() if uses_attention_interface(m)]
    classes = tuple(dict.fromkeys(type(m) for m in attention))
    own = getattr(attention[0], "config", None) or config  # a sub-model's own config (BLT's local encoder)

    def read(name: str) -> Any:
        for source in (own, config):
            try:
                value = getattr(source, name, None)
            except Exception:  # noqa: BLE001 - a per-layer attribute read globally (Dots3's per_layer_config)
                value = None
            if value is not None:
                return value
        return None

    heads = read("num_attention_heads") or getattr(attention[0], "num_heads", None)
    head_dim = getattr(attention[0], "head_dim", None) or (read("hidden_size") or 0) // (heads or 1)
    if not heads or not head_dim:
        raise UnsupportedModel(
            f"{type(model).__name__} (model_type {config.model_type!r}): its probe forward on fake tensors failed "
            f"({type(error).__name__}: {error}) and its attention's heads cannot be read from its config either; "
            "train it unpatched.") from error
    first = (heads, heads // getattr(attention[0], "num_key_value_groups", 1), head_dim)
    targets = lora_targets(model)
    why = f"{type(error).__name__}: {error}"

    def layer_bytes(config_: Any, b: int) -> LayerBytes:
        raise ConfigurationError(f"the memory estimate of {config.model_type} needs its probe forward, which failed "
                                 f"({why}); plan checkpointing by hand ('full', 'every_2', ...).")

    return Family(
        name=config.model_type, model_types=(config.model_type,), seam="attention_interface",
        touches=f"{', '.join(c.__name__ for c in classes)} via transformers' AttentionInterface",
        attentions=GENERIC_ATTENTIONS, lora_targets=targets,
        apply=lambda model_, backend: patch_attention_modules(model_, classes, backend),
        head_shape=lambda config_: first, mlp_width=lambda config_: None, layer_bytes=layer_bytes, fusable=_fusable,
        attention_layers=lambda config_: {},
        notes=(f"the facts probe forward failed ({why}): each attention call picks its kernel from what it asks; no "
               "trimmed recompute, no MLP chunks, no memory estimate",),
    )
