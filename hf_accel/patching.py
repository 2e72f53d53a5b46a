"""patch() / unpatch(): bind hf_accel's attention seam to one model instance, and undo it exactly.

Nothing is rebound on classes: each family module in ``hf_accel.patches`` touches only this model's attention modules
(and, for registry families, this model's attention implementation name), and hands back undo actions. Every fact
about the family (head shapes, what its layers ask of a kernel, what liger can fuse, the MLP width, the final logit
soft-cap) comes from its ``Family`` object and is handed to the stage that needs it.
"""
from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from ._compat import check_transformers_version
from .errors import ConfigurationError, UnsupportedModel
from .attention.kernels import DeviceInfo
from .kernel_choice import choose, fp32_calls_note
from .patches import family_of

logger = logging.getLogger("hf_accel")

STATE_ATTR = "_hf_accel_state"


@dataclass
class PatchReport:
    """What patch() did: which modules, which backend serves training calls, what was passed over and why."""

    model_type: str
    backend_requested: str
    backend: str
    selection: str
    patched_modules: list[str]
    touches: str
    lora_targets: tuple[str, ...]
    checkpointing: str | None = None
    fused_ops: bool = False
    fused_ce: bool = False
    compiled_layers: int = 0
    mlp_chunks: str = "off"  # what mlp_chunks resolved to, one line
    speedups: list[str] = field(default_factory=list)  # one line per fused_ce / fused_ops / compile: chosen, and why
    replaced_attn_implementation: str | None = None  # the model's attn_implementation ("eager", "sdpa"): it keeps it
    attentions: str | None = None  # what runs a call asking for attention probabilities (output_attentions=True)
    notes: list[str] = field(default_factory=list)

    def __str__(self) -> str:
        lines = [
            f"hf_accel: patched {len(self.patched_modules)} attention modules of a {self.model_type} model "
            f"({self.touches})",
            f"  backend: {self.selection}",
            f"  LoRA targets for this family: {', '.join(self.lora_targets)}",
        ]
        if self.replaced_attn_implementation:
            lines.append(f"  attn_implementation stays {self.replaced_attn_implementation!r} (what transformers reports "
                         "and set_attn_implementation changes); hf_accel's kernel serves training and prefill calls, "
                         "the reported implementation decode steps, KV-cache prefills from a padding mask and "
                         "compiled evaluation")
        if self.attentions:
            lines.append(f"  output_attentions=True runs {self.attentions}")
        if self.checkpointing:
            lines.append(f"  checkpointing: {self.checkpointing}")
        if self.fused_ops:
            lines.append("  fused ops: liger-kernel norms / SwiGLU bound to this instance")
        if self.fused_ce:
            lines.append("  fused cross-entropy: training loss from hidden states, no full logits")
        lines.append(f"  mlp_chunks: {self.mlp_chunks}")
        if self.compiled_layers:
            lines.append(f"  compiled: {self.compiled_layers} decoder layers' training forwards (torch.compile, "
                         "attention left to the kernel above)")
        lines += [f"  {line}" for line in self.speedups]
        lines += [f"  note: {n}" for n in self.notes]
        return "\n".join(lines)


@dataclass
class _PatchState:
    report: PatchReport
    undo: list[Callable[[], None]]
    compile_options: dict | None = None
    mlp_chunking: object = None  # memory.mlp_chunks.MlpChunking or None


def _compile_options(compile: bool | dict) -> dict | None:
    """patch()'s ``compile`` argument as torch.compile options (None: no compilation)."""
    if compile is False or compile is None:
        return None
    if compile is True:
        return {}
    if isinstance(compile, dict):
        return dict(compile)
    raise ConfigurationError(
        f"compile must be True, False or a dict of torch.compile options (e.g. {{'mode': 'max-autotune'}}); "
        f"got {compile!r}."
    )


AUTO = "auto"


@dataclass(frozen=True)
class Speedup:
    """One of patch()'s optional speed-ups as resolved for this model: on or off, and the reason (one line)."""

    name: str
    on: bool
    why: str

    def line(self) -> str:
        return f"{self.name}: {'on' if self.on else 'off'} ({self.why})"


def _quantized(model: torch.nn.Module) -> str | None:
    """Why compiled layers stand down on this model's quantized weights (any but bitsandbytes 4-bit), or None."""
    from .fused.quantized import compile_stand_down

    return compile_stand_down(model)


def resolve_speedups(model: torch.nn.Module, device: DeviceInfo, *, fused_ce="auto", fused_ops="auto",
                     compile="auto", liger_installed: bool | None = None) -> dict[str, Speedup]:
    """Resolve patch()'s ``fused_ce`` / ``fused_ops`` / ``compile`` for ``model`` on ``device``.

    "auto" is the fastest setting that keeps the computation equivalent: on CUDA the fused loss, liger's fused ops
    (when installed) and compiled decoder layers (unless the model's weights are quantized other than by bitsandbytes
    4-bit, see ``_quantized``); on every other device
    all three off (unchanged behaviour). True / False / a dict of compile options are taken as given.
    ``liger_installed`` overrides the installation check (tests fake a device).
    """
    for name, value in (("fused_ce", fused_ce), ("fused_ops", fused_ops)):
        if not isinstance(value, bool) and value != AUTO:
            raise ConfigurationError(f"{name} must be True, False or 'auto'; got {value!r}.")
    on_cuda = device.type == "cuda"
    out = {}
    if fused_ce != AUTO:
        out["fused_ce"] = Speedup("fused_ce", fused_ce, "requested" if fused_ce else "fused_ce=False")
    elif not on_cuda:
        out["fused_ce"] = Speedup("fused_ce", False, f"auto: on CUDA only; this model is on {device.type}")
    elif model.get_output_embeddings() is None:
        out["fused_ce"] = Speedup("fused_ce", False, "auto: the model has no LM head")
    else:
        out["fused_ce"] = Speedup("fused_ce", True, "auto: training forwards with labels take the loss from hidden "
                                                    "states in chunks, no full logits (logits=None there)")
    if fused_ops != AUTO:
        out["fused_ops"] = Speedup("fused_ops", fused_ops, "requested" if fused_ops else "fused_ops=False")
    else:
        if liger_installed is None:
            import importlib.util

            liger_installed = importlib.util.find_spec("liger_kernel") is not None
        why = ("liger-kernel's Triton kernels run on CUDA only; this model is on " + device.type) if not on_cuda \
            else None if liger_installed else "liger-kernel is not installed (pip install 'hf_accel[liger]')"
        out["fused_ops"] = Speedup("fused_ops", why is None,
                                   "auto: liger-kernel's fused norms / gated MLPs" if why is None else f"auto: {why}")
    if compile != AUTO:
        on = compile is not False and compile is not None
        out["compile"] = Speedup("compile", on, "requested" if on else "compile=False")
    else:
        quantized = _quantized(model)
        why = (f"on CUDA only; this model is on {device.type}" if not on_cuda
               else "torch.compile is not supported in this Python / torch" if not torch._dynamo.is_dynamo_supported()
               else quantized)
        # The compile is paid once (seconds) and halves the element-wise time of every later step, so it is paid back
        # early in a fine-tune (BENCHMARKS.md, "where the step time goes").
        out["compile"] = Speedup("compile", why is None, "auto: decoder layers' training forwards through inductor "
                                 "(~20 s once for 1B shapes)" if why is None else f"auto: {why}")
    return out


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
    backend: str = "auto",
    checkpointing=None,
    fused_ops: bool | str = AUTO,
    fused_ce: bool | str = AUTO,
    compile: bool | dict | str = AUTO,
    mlp_chunks: int | bool | str = AUTO,
    context=None,
) -> PatchReport:
    """Route this model's attention through hf_accel's varlen seam and the kernel chosen for ``backend``.

    Works on a plain transformers model or a PEFT model, before or after ``get_peft_model``. Idempotent: patching a
    patched model with the same settings returns the existing report; other settings re-patch. ``checkpointing``
    takes a policy or spec string ("full", "every_2", "op", "budget:20GiB", ...; see hf_accel.memory.checkpointing).
    ``fused_ops``, ``fused_ce`` and ``compile`` default to "auto": on CUDA all three where they apply (liger installed;
    weights not quantized, or bitsandbytes 4-bit), elsewhere off; ``PatchReport.speedups`` says what was chosen and why, and an explicit
    False turns each off (see ``resolve_speedups``).
    ``fused_ops=True`` also binds liger-kernel's fused norms / SwiGLU to this instance (CUDA, liger installed).
    ``fused_ce=True`` makes training forwards with labels return the loss from a chunked linear cross-entropy
    (hf_accel.fused.cross_entropy, "inline" method), never materialising the full logits (``logits`` is then None); eval and
    generate are unchanged.
    ``compile=True`` (or a dict of ``torch.compile`` options) compiles each decoder layer's training forward with
    inductor, attention excluded (see hf_accel.fused.compiling); it takes over the layers' norms / MLP from ``fused_ops``.
    ``mlp_chunks`` runs each decoder layer's MLP over chunks of tokens, each chunk checkpointed, so backward rebuilds
    one chunk's intermediate at a time (hf_accel.memory.mlp_chunks): "auto" (default) for training calls whose
    intermediates would exceed 16 GiB (Llama-3-8B bf16: ~200k tokens), ~1 GiB of intermediates per chunk; an int =
    the chunk size in tokens (calls with more tokens are chunked); False or 0 = off. Same math per token; results differ by rounding and summation order only.
    """
    check_transformers_version()
    model_hf = base_model(model)
    config = getattr(model_hf, "config", None)
    if config is None:
        raise UnsupportedModel(f"expected a transformers PreTrainedModel (or PEFT model), got {type(model).__name__}.")
    family = family_of(config)
    from .kernel_choice import training_request

    request = training_request(model_hf, family, None)
    speedups = resolve_speedups(model_hf, request.device, fused_ce=fused_ce, fused_ops=fused_ops, compile=compile)
    fused_ce, fused_ops = speedups["fused_ce"].on, speedups["fused_ops"].on
    compile_options = _compile_options(compile if compile != AUTO else speedups["compile"].on)
    from .memory import mlp_chunks as mlp_chunking

    chunking = mlp_chunking.resolve(mlp_chunks, family.mlp_width(config), request.dtype.itemsize)
    state: _PatchState | None = model_hf.__dict__.get(STATE_ATTR)
    if state is not None:
        same = (
            state.report.backend_requested == backend
            and state.report.checkpointing == _describe(checkpointing)
            and state.report.fused_ops == fused_ops
            and state.report.fused_ce == fused_ce
            and state.compile_options == compile_options
            and state.mlp_chunking == chunking
        )
        if same:
            return state.report
        unpatch(model)

    choice = choose(model_hf, family, backend)  # raises BackendUnavailable naming what is missing
    fp32_note = fp32_calls_note(model_hf, choice.request, backend)
    previous_attn = config._attn_implementation
    names, undo = family.apply(model_hf, backend)
    _tag_layer_backends(model_hf, names, choice.layer_backends, backend)
    try:
        report = _finish_patch(model, model_hf, family, choice, names, undo, backend, fused_ops,
                               compiled=compile_options is not None)
        report.replaced_attn_implementation, report.attentions = previous_attn, family.attentions
        if compile_options is not None:
            from .fused import compiling

            layers, compile_undo = compiling.apply(model_hf, compile_options)
            undo += compile_undo
            report.compiled_layers = len(layers)
        if chunking is not None:
            chunked, chunk_undo = mlp_chunking.apply(model_hf, chunking)
            undo += chunk_undo
            report.mlp_chunks = f"{chunking.describe()} ({len(chunked)} MLPs)"
            if compile_options is not None:
                report.mlp_chunks += "; inside compiled layers a chunked MLP runs eagerly (one graph break)"
        else:
            report.mlp_chunks = f"off (mlp_chunks={mlp_chunks!r})"
        if fused_ce:
            from .fused.cross_entropy import bind_fused_loss

            undo.append(bind_fused_loss(model_hf, softcap=family.final_logit_softcap(config)))
            report.fused_ce = True
        report.speedups = [s.line() for s in speedups.values()]
        if fp32_note:
            report.notes.append(fp32_note)
        if checkpointing is not None:
            # last: a memory budget's probe forward must see the loss and layers training will run
            from .memory.checkpointing import policy_from_spec

            policy = policy_from_spec(checkpointing)
            policy.apply(model, _run_context(context, model_hf, compiled=compile_options is not None))
            undo.append(lambda: policy.remove(model))
            report.checkpointing = _describe(checkpointing)
    except Exception:  # leave the model exactly as it was
        for action in reversed(undo):
            action()
        raise
    model_hf.__dict__[STATE_ATTR] = _PatchState(report, undo, compile_options, chunking)
    logger.info("%s", report)
    return report


def _tag_layer_backends(model_hf, names: list[str], layer_backends: list[str], backend: str) -> None:
    """Attention modules of layers the requested backend cannot serve select per call ("auto"); the family's undo
    removes the attribute."""
    from .attention.hf_attention import BACKEND_ATTR

    for name in names:
        module = model_hf.get_submodule(name)
        index = getattr(module, "layer_idx", None)
        if index is not None and index < len(layer_backends) and layer_backends[index] != backend:
            setattr(module, BACKEND_ATTR, layer_backends[index])


def _finish_patch(model, model_hf, family, choice, names, undo, backend, fused_ops, compiled: bool) -> PatchReport:
    """Everything after the attention seam; appends its undo actions to ``undo``."""
    notes = list(family.notes) + choice.notes
    if fused_ops:
        from .fused import ops as fused

        # liger serves eager training calls only; traced layers, evaluation and generation run the stock forwards
        fused_names, fused_undo = fused.apply(model_hf, family.fusable(model_hf))
        undo += fused_undo
        if compiled:
            notes.append(f"fused_ops with compile: liger's kernels are bound to {len(fused_names)} modules and serve "
                         "their eager training calls (the final norm, op-level checkpointed layers); inductor fuses "
                         "the compiled layers' own")
    undo.append(model_hf.register_forward_pre_hook(_no_cache_in_training, with_kwargs=True).remove)
    from .attention.hf_attention import forward_batch_hooks

    undo += forward_batch_hooks(model_hf)
    from .fused import lora_casts

    undo += lora_casts.apply(model_hf, notes)  # notes a quantized base's LoRA layers it leaves to PEFT
    report = PatchReport(
        model_type=model_hf.config.model_type, backend_requested=backend, backend=choice.selection.backend.name,
        selection=choice.selection.explain(), patched_modules=names, touches=family.touches,
        lora_targets=family.lora_targets, fused_ops=fused_ops, notes=notes,
    )
    return report


def _run_context(context, model_hf, compiled: bool):
    """The run a checkpoint policy is applied for: the caller's (a Trainer's), else what patch() can see (the autocast
    in effect now), with whether the decoder layers run compiled."""
    from dataclasses import replace

    from .memory.context import RunContext, autocast_dtype

    if context is None:
        param = next((p for p in model_hf.parameters()), None)
        context = RunContext(autocast=autocast_dtype(param.device.type if param is not None else "cpu"))
    return replace(context, compiled=compiled)


def _describe(checkpointing) -> str | None:
    if checkpointing is None:
        return None
    describe = getattr(checkpointing, "describe", None)
    return describe() if callable(describe) else str(checkpointing)


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
    state = base_model(model).__dict__.get(STATE_ATTR)
    return None if state is None else state.report

