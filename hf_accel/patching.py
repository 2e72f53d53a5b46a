"""patch() / unpatch(): bind hf_accel's attention seam to one model instance, and undo it exactly.

Nothing is rebound on classes: each family module in ``hf_accel.patches`` touches only this model's attention modules
(and, for registry families, this model's attention implementation name), and hands back undo actions. Every fact
about the family (head shapes, what its layers ask of a kernel, what liger can fuse, the MLP width, the final logit
soft-cap) comes from its ``Family`` object and is handed to the stage that needs it.

patch() is a short pipeline: its settings become one validated ``PatchOptions`` (``patch_options``); ``_decide``
resolves them for this model (speed-ups on or off and why, compile options, MLP chunking); ``choose`` picks each
layer's kernel; ``_apply`` binds each stage in order, collecting undo actions; ``_report`` builds the PatchReport
from the decisions and what was applied.
"""
from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from ._compat import check_transformers_version
from .attention.kernels.base import DeviceInfo
from .errors import ConfigurationError, UnsupportedModel
from .kernel_choice import KernelChoice, choose, fp32_calls_note
from .memory.context import RunContext
from .patch_options import AUTO, PatchOptions, Speedup, resolve_speedups  # noqa: F401 (re-exported)
from .report import PatchReport
from .patches import Family, family_of

logger = logging.getLogger("hf_accel")

STATE_ATTR = "_hf_accel_state"


@dataclass(frozen=True)
class _Decisions:
    """What patch() decided for this model before touching it: the options, its family, each speed-up on or off
    (and why), the torch.compile options and the MLP chunking."""

    options: PatchOptions
    family: Family
    speedups: dict[str, Speedup]
    compile_options: dict | None
    chunking: object  # memory.mlp_chunks.MlpChunking or None
    device: DeviceInfo  # where training calls run
    output_projections: tuple[str, ...]  # the family's, for this config: what a trimmed recompute skips

    def on(self, name: str) -> bool:
        return self.speedups[name].on

    def same_settings(self, other: _Decisions) -> bool:
        """Whether patching with ``other`` would do what these decisions did (patch() then keeps the patch)."""
        return (self.options.backend == other.options.backend
                and self.options.describe_checkpointing() == other.options.describe_checkpointing()
                and self.on("fused_ops") == other.on("fused_ops") and self.on("fused_ce") == other.on("fused_ce")
                and self.compile_options == other.compile_options and self.chunking == other.chunking
                and self.options.precision == other.options.precision)


@dataclass
class _Applied:
    """What patch() changed on the model, for the report, recorded as each stage is bound."""

    attention_modules: list[str] = field(default_factory=list)
    previous_attn: str | None = None
    compiled_layers: int = 0
    chunked_mlps: int = 0
    fp8_linears: list[str] = field(default_factory=list)
    checkpointing: str | None = None  # the defaults' choice for the model's own checkpointing, where they made one
    notes: list[str] = field(default_factory=list)
    packing: str | None = None  # PatchReport.packing


@dataclass
class _PatchState:
    report: PatchReport
    undo: list[Callable[[], None]]
    decisions: _Decisions


def base_model(model: torch.nn.Module) -> torch.nn.Module:
    """The transformers model under PEFT (or any wrapper exposing get_base_model)."""
    get_base = getattr(model, "get_base_model", None)
    return get_base() if callable(get_base) else model


def _no_cache_in_training(module, args, kwargs):
    """A KV cache is dead weight in training (and stock HF then ignores packing); default it off there."""
    if module.training and kwargs.get("use_cache") is None:
        kwargs["use_cache"] = False
    return args, kwargs


def patch(
    model: torch.nn.Module,
    backend: str = AUTO,
    checkpointing=None,
    fused_ops: bool | str = AUTO,
    fused_ce: bool | str = AUTO,
    compile: bool | dict | str = AUTO,
    mlp_chunks: int | bool | str = AUTO,
    *,
    precision: str | None = None,
    options: PatchOptions | None = None,
    context: RunContext | None = None,
) -> PatchReport:
    """Route this model's attention through hf_accel's varlen seam and the kernel chosen for ``backend``.

    Works on a plain transformers model or a PEFT model, before or after ``get_peft_model``. Idempotent: patching a
    patched model with the same settings returns the existing report; other settings re-patch. The settings come
    as keyword arguments or as one ``options=PatchOptions(...)`` (hf_accel.patch_options; the Trainers pass that).
    ``checkpointing`` takes a policy or spec string ("full", "every_2", "op", "budget:20GiB", ...; see
    hf_accel.memory.checkpointing), applied last with ``context``, the run it is for (``memory.context.RunContext``;
    default: the autocast in effect now).
    ``fused_ops``, ``fused_ce`` and ``compile`` default to "auto": on CUDA all three where they apply (liger installed;
    weights not quantized, or bitsandbytes 4-bit), elsewhere off; ``PatchReport.speedups`` says what was chosen and
    why, and an explicit False turns each off (see ``resolve_speedups``).
    ``fused_ops=True`` also binds liger-kernel's fused norms / SwiGLU to this instance (CUDA, liger installed).
    ``fused_ce=True`` makes training forwards with labels return the loss from a chunked linear cross-entropy
    (hf_accel.fused.cross_entropy, "inline" method), never materialising the full logits (``logits`` is then None);
    eval and generate are unchanged.
    ``compile=True`` (or a dict of ``torch.compile`` options) compiles each decoder layer's training forward with
    inductor, attention excluded (see hf_accel.fused.compiling); it takes over the layers' norms / MLP from
    ``fused_ops``.
    ``mlp_chunks`` runs each decoder layer's MLP over chunks of tokens, each chunk checkpointed, so backward rebuilds
    one chunk's intermediate at a time (hf_accel.memory.mlp_chunks): "auto" (default) for training calls whose
    intermediates would exceed 16 GiB (Llama-3-8B bf16: ~200k tokens), ~1 GiB of intermediates per chunk; an int =
    the chunk size in tokens (calls with more tokens are chunked); False or 0 = off. Same math per token; results
    differ by rounding and summation order only.
    ``precision="fp8"`` (full fine-tuning, torchao installed, CUDA compute capability 8.9+ or CPU) trains the decoder
    layers' linears through torchao's float8 training (hf_accel.fused.fp8): faster matmuls, a different computation;
    an explicit opt-in only. Default None: the weights' own precision.
    """
    options = PatchOptions.from_arguments(options, backend=backend, checkpointing=checkpointing, fused_ops=fused_ops,
                                          fused_ce=fused_ce, compile=compile, mlp_chunks=mlp_chunks,
                                          precision=precision)
    check_transformers_version()
    model_hf = _transformers_model(model)
    decisions = _decide(model_hf, options)
    if options.precision == "fp8":  # before anything changes: a refusal leaves the model as it was
        from .fused import fp8

        why = fp8.refusal(model, model_hf)
        if why is not None:
            raise ConfigurationError(why)
    state: _PatchState | None = model_hf.__dict__.get(STATE_ATTR)
    if state is not None:
        if state.decisions.same_settings(decisions):
            return state.report
        unpatch(model)
    choice = choose(model_hf, decisions.family, options.backend)  # raises BackendUnavailable naming what is missing
    undo: list[Callable[[], None]] = []
    try:
        applied = _apply(model, model_hf, decisions, choice, context, undo)
    except Exception:  # leave the model exactly as it was
        for action in reversed(undo):
            action()
        raise
    report = _report(model_hf, decisions, choice, applied)
    model_hf.__dict__[STATE_ATTR] = _PatchState(report, undo, decisions)
    logger.info("%s", report)
    return report


def _transformers_model(model: torch.nn.Module) -> torch.nn.Module:
    model_hf = base_model(model)
    if getattr(model_hf, "config", None) is None:
        raise UnsupportedModel(f"expected a transformers PreTrainedModel (or PEFT model), got {type(model).__name__}.")
    return model_hf


def _decide(model_hf: torch.nn.Module, options: PatchOptions) -> _Decisions:
    """Everything patch() decides from the options, the model and its device, before it changes anything."""
    from .kernel_choice import training_request
    from .memory import mlp_chunks as mlp_chunking

    family = family_of(model_hf)
    request = training_request(model_hf, family, None)
    speedups = resolve_speedups(model_hf, request.device, fused_ce=options.fused_ce, fused_ops=options.fused_ops,
                                compile=options.compile, compile_stand_down=options.compile_stand_down)
    head = family.head_differs(model_hf.config)
    if head is not None and speedups["fused_ce"].on:
        if options.fused_ce is True:
            raise ConfigurationError(f"fused_ce=True: {head}. Pass fused_ce=False (or 'auto').")
        speedups["fused_ce"] = Speedup("fused_ce", False, head)
    chunking = mlp_chunking.resolve(options.mlp_chunks, family.mlp_width(model_hf.config), request.dtype.itemsize)
    return _Decisions(options, family, speedups, options.compile_options(speedups["compile"].on), chunking,
                      request.device, tuple(family.output_projections(model_hf.config)))


def _apply(model, model_hf, decisions: _Decisions, choice: KernelChoice, context: RunContext | None,
           undo: list[Callable[[], None]]) -> _Applied:
    """Bind every stage the decisions ask for, in order, appending each one's undo actions to ``undo``."""
    family, backend, compiled = decisions.family, decisions.options.backend, decisions.compile_options is not None
    applied = _Applied(previous_attn=model_hf.config._attn_implementation, notes=list(family.notes) + choice.notes)
    if applied.previous_attn == "sdpa" and any(a.softcap for a in family.layer_attentions(model_hf.config).values()):
        applied.notes.append("the unpatched model runs transformers' SDPA attention, which cannot soft-cap and drops "
                             "the attention soft-cap (transformers 5.17 allowed it; later versions refuse SDPA here): "
                             "patched training applies the cap, as eager attention does; build with eager to compare")
    names, seam_undo = family.apply(model_hf, backend)
    undo += seam_undo
    applied.attention_modules = names
    undo += _bind_experts(model, applied.notes)
    undo += _bind_linear_attention(model_hf, applied.notes)
    applied.packing = _packing_reason(model_hf, family)
    _tag_layer_backends(model_hf, names, choice.layer_backends, backend)
    if decisions.options.precision == "fp8":  # first: fused ops and compiled layers then call the float8 linears
        from .fused import fp8

        applied.fp8_linears, fp8_undo = fp8.apply(model_hf)
        undo += fp8_undo
    if decisions.on("fused_ops"):
        undo += _bind_fused_ops(model_hf, family, compiled, applied.notes)
    undo.append(model_hf.register_forward_pre_hook(_no_cache_in_training, with_kwargs=True).remove)
    from .attention.hf_attention import forward_batch_hooks
    from .fused import lora_casts

    undo += forward_batch_hooks(model_hf)
    undo += lora_casts.apply(model_hf, applied.notes)  # notes a quantized base's LoRA layers it leaves to PEFT
    undo += _keep_cpu_4bit_trainable(model_hf, applied.notes)
    if compiled:
        from .fused import compiling

        layers, compile_undo = compiling.apply(model_hf, decisions.compile_options)
        undo += compile_undo
        applied.compiled_layers = len(layers)
        if compiling.traces_nested(decisions.compile_options):
            applied.notes.append("compile: the layers traced with dynamo's nested graph breaks, one graph before the "
                                 "attention and one after (compile={'nested_graph_breaks': False} traces without)")
    if decisions.chunking is not None:
        from .memory import mlp_chunks as mlp_chunking

        chunked, chunk_undo = mlp_chunking.apply(model_hf, decisions.chunking, decisions.output_projections)
        undo += chunk_undo
        applied.chunked_mlps = len(chunked)
    if decisions.on("fused_ce"):
        from .fused.cross_entropy import bind_fused_loss

        undo.append(bind_fused_loss(model_hf, softcap=family.final_logit_softcap(model_hf.config)))
    fp32_note = fp32_calls_note(model_hf, choice.request, backend)
    applied.notes += [fp32_note] if fp32_note else []
    policy = decisions.options.policy
    if decisions.options.checkpointing is None:
        default = checkpoint_default(model, decisions.device)
        policy, applied.checkpointing = default.policy, default.describe() if default.policy is not None else None
    if policy is not None:  # last: a memory budget's probe forward must see the loss and layers training will run
        policy.apply(model, _run_context(context, model_hf, compiled))
        undo.append(lambda: policy.remove(model))
    return applied


def checkpoint_default(model: torch.nn.Module, device: DeviceInfo | None = None):
    """What the defaults do with the model's own checkpointing (``memory.defaults``): its ``policy`` (None: keep it)
    and why. patch() applies it; hf_accel's Trainers again once ``train()`` has turned the model's checkpointing on."""
    from .fused.quantized import four_bit_base
    from .kernel_choice import training_request
    from .memory.defaults import checkpoint_default as default_for

    model_hf = _transformers_model(model)
    family = family_of(model_hf)
    device = device or training_request(model_hf, family, None).device
    return default_for(model, device, base_4bit=four_bit_base(model_hf),
                       output_projections=tuple(family.output_projections(model_hf.config)))


def _bind_experts(model, notes: list[str]) -> list[Callable[[], None]]:
    """Mixture-of-experts layers through a grouped GEMM, LoRA on the experts kept low-rank (hf_accel.patches.experts);
    a model without experts is left as it is."""
    from .patches import experts

    bound = experts.kernel_library_forwards(model)  # before apply binds over them
    names, undo = experts.apply(model)
    if names:
        notes.append(f"experts: {len(names)} mixture-of-experts modules run their tokens sorted by expert through a "
                     "grouped GEMM (LoRA on the experts as low-rank products; the router and its load-balancing "
                     "logits stay transformers' own)")
    for library, count in sorted(Counter(bound.values()).items()):
        notes.append(f"experts: {library}'s experts forward, bound on {count} modules, gives way to the grouped path "
                     "(its fused experts take full weights only: no LoRA reaches them, and on PEFT's wrapper they "
                     "fail); evaluation runs the model's own experts")
    return undo


def _bind_linear_attention(model_hf, notes: list[str]) -> list[Callable[[], None]]:
    """A hybrid model's recurrent layers (Gated DeltaNet, Mamba-2, short convs: hf_accel.patches.linear_attention)
    restart their conv and state at every packed document; a model without them is left as it is."""
    from .patches import linear_attention

    names, undo = linear_attention.apply(model_hf)
    if names:
        notes.append(f"linear attention: {len(names)} recurrent layers restart their conv and state at every packed "
                     "document (fla-core's varlen kernels where installed on CUDA, else each document on its own)")
        refusal = linear_attention.fla_backward_refusal()
        if refusal is not None:  # said before training starts, not at its first backward
            logger.warning("hf_accel: linear attention: %s", refusal)
            notes.append(f"linear attention: {refusal}")
    return undo


def _packing_reason(model_hf, family) -> str | None:
    """Why the patched model would not compute each packed document as it computes it alone, None where it would:
    it computes its own positions (``takes_position_ids``), or decoder layers mix tokens where neither the seam (no
    attention call of theirs went through it) nor ``patches.linear_attention`` reaches (MiniMax's lightning
    attention layers)."""
    from .attention.hf_attention import takes_position_ids
    from .memory.targets import decoder_layers
    from .patches import linear_attention

    if not takes_position_ids(model_hf):
        return f"{type(model_hf).__name__} computes its own positions (its forward takes no position_ids)"
    layers = decoder_layers(model_hf)
    covered = set(family.layer_attentions(model_hf.config))
    covered |= {layers.index(layer) for _, _, layer in linear_attention.linear_attention_modules(model_hf)
                if layer in layers}
    outside = [i for i in range(len(layers)) if i not in covered and _mixes_tokens(model_hf.config, i)]
    if not outside:
        return None
    kinds = sorted({type(layers[i]).__name__ for i in outside})
    return (f"decoder layers {', '.join(map(str, outside))} ({', '.join(kinds)}) make no attention call through "
            "transformers' AttentionInterface and hf_accel has no patch for how they mix tokens")


def _mixes_tokens(config, index: int) -> bool:
    """Whether decoder layer ``index`` may mix tokens: its ``layer_types`` entry is one transformers builds a mask
    for (attention, linear attention, convs; not an MLP or MoE layer of a hybrid pattern), or the config has none."""
    from transformers import masking_utils

    get_text = getattr(config, "get_text_config", None)
    types = getattr(get_text(decoder=True) if callable(get_text) else config, "layer_types", None)
    masked = getattr(masking_utils, "LAYER_PATTERN_TO_MASK_FUNCTION_MAPPING", None)
    if not types or masked is None or not 0 <= index < len(types):
        return True
    return types[index] in masked


def _keep_cpu_4bit_trainable(model_hf, notes: list[str]) -> list[Callable[[], None]]:
    from .fused.quantized import keep_cpu_4bit_trainable

    count, undo = keep_cpu_4bit_trainable(model_hf)
    if count:
        notes.append(f"bitsandbytes' CPU inference repacking off on {count} 4-bit layers: training after an "
                     "evaluation would run its repacked kernel, which has no backward (wrong gradients)")
    return undo


def _bind_fused_ops(model_hf, family: Family, compiled: bool, notes: list[str]) -> list[Callable[[], None]]:
    """liger's fused norms / gated MLPs on this instance; they serve eager training calls only (traced layers,
    evaluation and generation run the stock forwards)."""
    from .fused import ops as fused

    fused_names, fused_undo = fused.apply(model_hf, family.fusable(model_hf))
    if compiled:
        notes.append(f"fused_ops with compile: liger's kernels are bound to {len(fused_names)} modules and serve "
                     "their eager training calls (the final norm, op-level checkpointed layers); inductor fuses "
                     "the compiled layers' own")
    return fused_undo


def _report(model_hf, decisions: _Decisions, choice: KernelChoice, applied: _Applied) -> PatchReport:
    """The PatchReport of what was decided and applied."""
    options, family = decisions.options, decisions.family
    if decisions.chunking is not None:
        mlp_chunks = f"{decisions.chunking.describe()} ({applied.chunked_mlps} MLPs)"
        if decisions.compile_options is not None:
            mlp_chunks += "; inside compiled layers a chunked MLP runs eagerly (one graph break)"
    else:
        mlp_chunks = f"off (mlp_chunks={options.mlp_chunks!r})"
    return PatchReport(
        model_type=model_hf.config.model_type, backend_requested=options.backend,
        backend=choice.selection.backend.name, selection=choice.selection.explain(),
        patched_modules=applied.attention_modules, touches=family.touches, lora_targets=family.lora_targets,
        checkpointing=options.describe_checkpointing(decisions.output_projections) or applied.checkpointing,
        fused_ops=decisions.on("fused_ops"),
        fused_ce=decisions.on("fused_ce"), compiled_layers=applied.compiled_layers, mlp_chunks=mlp_chunks,
        precision=_precision_line(applied),
        speedups=[s.line() for s in decisions.speedups.values()],
        replaced_attn_implementation=applied.previous_attn, attentions=family.attentions, notes=applied.notes,
        packing=applied.packing,
    )


def _precision_line(applied: _Applied) -> str | None:
    if not applied.fp8_linears:
        return None
    from .fused import fp8

    return fp8.describe(applied.fp8_linears)


def _tag_layer_backends(model_hf, names: list[str], layer_backends: dict[int, str], backend: str) -> None:
    """Attention modules of layers the requested backend cannot serve select per call ("auto"); the family's undo
    removes the attribute."""
    from .attention.hf_attention import BACKEND_ATTR

    for name in names:
        module = model_hf.get_submodule(name)
        index = getattr(module, "layer_idx", None)
        if layer_backends.get(index, backend) != backend:
            setattr(module, BACKEND_ATTR, layer_backends[index])


def _run_context(context: RunContext | None, model_hf, compiled: bool) -> RunContext:
    """The run a checkpoint policy is applied for: the caller's (a Trainer's), else what patch() can see (the autocast
    in effect now), with whether the decoder layers run compiled."""
    from dataclasses import replace

    from .memory.context import autocast_dtype

    if context is None:
        param = next((p for p in model_hf.parameters()), None)
        context = RunContext(autocast=autocast_dtype(param.device.type if param is not None else "cpu"))
    return replace(context, compiled=compiled)


def unpatch(model: torch.nn.Module) -> None:
    """Undo patch() exactly (a no-op on an unpatched model)."""
    model_hf = base_model(model)
    state: _PatchState | None = model_hf.__dict__.pop(STATE_ATTR, None)
    if state is None:
        return
    for action in reversed(state.undo):
        action()


def pin_attention_name(model: torch.nn.Module) -> str:
    """Make a patched model's config report hf_accel's attention name between forwards too (by default it reports the
    user's implementation and switches for each forward only), for wrappers that intercept the attention function
    registered under the config's name (DeepSpeed's Ulysses sequence parallelism). unpatch() restores it. Returns
    the name."""
    from .attention.routing import ATTN_NAME, pin_name

    model_hf = base_model(model)
    state: _PatchState | None = model_hf.__dict__.get(STATE_ATTR)
    if state is None:
        raise ConfigurationError("pin_attention_name needs a model patched by hf_accel.patch().")
    if model_hf.config._attn_implementation != ATTN_NAME:
        state.undo.append(pin_name(model_hf))
    return ATTN_NAME


def patch_report(model: torch.nn.Module) -> PatchReport | None:
    """The PatchReport of a patched model (None if unpatched), with what its compiled layers decided since about
    forwards liger or hub kernels bound to its modules (fused.foreign_forwards)."""
    model_hf = base_model(model)
    state = model_hf.__dict__.get(STATE_ATTR)
    if state is None:
        return None
    from .fused.foreign_forwards import compile_notes

    state.report.notes += [n for n in compile_notes(model_hf) if n not in state.report.notes]
    return state.report

