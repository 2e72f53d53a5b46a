"""What patch() is asked (``PatchOptions``, validated once) and how its optional speed-ups resolve for a model
(``resolve_speedups``: on or off, and why, one line each for the report).

``patch(model, compile=False)`` and ``patch(model, options=PatchOptions(compile=False))`` are the same call; the
Trainers build the object from ``AccelArguments`` (``AccelArguments.patch_options``), the command line through them.
"""
from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any

import torch

from .attention.kernels import DeviceInfo
from .errors import ConfigurationError

AUTO = "auto"


@dataclass(frozen=True)
class PatchOptions:
    """patch()'s settings (see ``hf_accel.patch`` for what each does), checked when the object is made.

    backend: an attention backend name or "auto". checkpointing: a policy or spec ("full", "budget:20GiB", ...; parsed
    once into ``policy``), None: the model's checkpointing is left alone. fused_ops / fused_ce: True, False or
    "auto". compile: True, False, a dict of torch.compile options or "auto". mlp_chunks: "auto", a chunk size in
    tokens, or False / 0. compile_stand_down: why the caller turned "auto" compile off for its run (a Trainer under
    DeepSpeed, say; compile is then False): the report's compile line gives this reason. precision: None (the
    weights' own) or "fp8" (torchao float8 training of the decoder linears: an explicit opt-in that changes the
    computation, never chosen by "auto"; hf_accel.fused.fp8).
    """

    backend: str = AUTO
    checkpointing: Any = None
    fused_ops: bool | str = AUTO
    fused_ce: bool | str = AUTO
    compile: bool | dict | str | None = AUTO
    mlp_chunks: int | bool | str | None = AUTO
    compile_stand_down: str | None = None
    precision: str | None = None
    policy: Any = field(default=None, init=False, repr=False, compare=False)  # checkpointing as a policy object

    def __post_init__(self) -> None:
        from .fused.fp8 import check_precision
        from .memory.mlp_chunks import check_setting

        if not isinstance(self.backend, str):
            raise ConfigurationError(f"backend must be a backend name or 'auto' (hf_accel.list_backends()); "
                                     f"got {self.backend!r}.")
        for name in ("fused_ce", "fused_ops"):
            value = getattr(self, name)
            if not isinstance(value, bool) and value != AUTO:
                raise ConfigurationError(f"{name} must be True, False or 'auto'; got {value!r}.")
        if not (isinstance(self.compile, (bool, dict)) or self.compile is None or self.compile == AUTO):
            raise ConfigurationError(
                f"compile must be True, False or a dict of torch.compile options (e.g. {{'mode': 'max-autotune'}}); "
                f"got {self.compile!r}."
            )
        if isinstance(self.compile, dict):
            from .fused.compiling import NESTED_GRAPH_BREAKS  # hf_accel's own key in a compile dict

            nested = self.compile.get(NESTED_GRAPH_BREAKS)
            if nested is not None and not isinstance(nested, bool):
                raise ConfigurationError(
                    f"compile={{'{NESTED_GRAPH_BREAKS}': ...}} must be True or False (or left out: on by default "
                    f"from torch 2.11); got {nested!r}."
                )
        if self.compile_stand_down is not None and self.compile is not False:
            raise ConfigurationError(f"compile_stand_down says why 'auto' compile is off: it needs compile=False; got "
                                     f"compile={self.compile!r}.")
        check_setting(self.mlp_chunks)
        check_precision(self.precision)
        if self.checkpointing is not None:
            from .memory.checkpointing import policy_from_spec

            object.__setattr__(self, "policy", policy_from_spec(self.checkpointing))

    @classmethod
    def from_arguments(cls, options: PatchOptions | None = None, **arguments: Any) -> PatchOptions:
        """``options``, or the object patch()'s keyword arguments describe; both at once only where the keyword
        arguments are the defaults."""
        if options is None:
            return cls(**arguments)
        if not isinstance(options, PatchOptions):
            raise ConfigurationError(f"options must be a PatchOptions; got {type(options).__name__}.")
        defaults = {f.name: f.default for f in fields(cls)}
        given = sorted(name for name, value in arguments.items() if value != defaults[name])
        if given:
            raise ConfigurationError(f"pass patch(model, options=...) or keyword arguments, not both (got options and "
                                     f"{', '.join(given)}); put them into the PatchOptions.")
        return options

    def compile_options(self, on: bool) -> dict | None:
        """torch.compile options for a resolved compile decision ``on`` (None: no compilation)."""
        if not on:
            return None
        return dict(self.compile) if isinstance(self.compile, dict) else {}

    def describe_checkpointing(self, output_projections: tuple[str, ...] = ()) -> str | None:
        """The report's checkpointing line: a policy's own description (after apply, a budget's plan), else the
        spec as given; with the projections its recompute skips (the family's ``output_projections``),
        if the policy trims."""
        if self.checkpointing is None:
            return None
        describe = getattr(self.checkpointing, "describe", None)
        text = describe() if callable(describe) else str(self.checkpointing)
        policy = self.policy
        if policy is not None and policy.trims() and output_projections:
            text += f"; its recompute skips {' and '.join(output_projections)} (memory.trim)"
        return text


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


def _explicit(name: str, value: Any, stand_down: str | None = None) -> Speedup:
    on = value is not False and value is not None
    requested = f"requested: {value!r}" if isinstance(value, dict) else "requested"  # the options in the report
    return Speedup(name, on, requested if on else f"auto: {stand_down}" if stand_down else f"{name}=False")


def resolve_speedups(model: torch.nn.Module, device: DeviceInfo, *, fused_ce="auto", fused_ops="auto",
                     compile="auto", liger_installed: bool | None = None,
                     compile_stand_down: str | None = None) -> dict[str, Speedup]:
    """Resolve patch()'s ``fused_ce`` / ``fused_ops`` / ``compile`` for ``model`` on ``device``.

    "auto" is the fastest setting that keeps the computation equivalent: on CUDA the fused loss, liger's fused ops
    (when installed) and compiled decoder layers (unless the model's weights are quantized other than by bitsandbytes
    4-bit, see ``_quantized``); on every other device all three off (unchanged behaviour). True / False / a dict of
    compile options are taken as given; ``compile_stand_down`` is why a caller turned "auto" compile off.
    ``liger_installed`` overrides the installation check (tests fake a device).
    """
    PatchOptions(fused_ce=fused_ce, fused_ops=fused_ops, compile=compile)  # the same checks, the same messages
    on_cuda = device.type == "cuda"
    out = {}
    wrapped = "forward" in vars(model)  # accelerate's autocast / device hooks, another library's loss: its own forward
    if fused_ce != AUTO:
        if wrapped and fused_ce is not False and fused_ce is not None:
            raise ConfigurationError(
                f"fused_ce={fused_ce!r}: this {type(model).__name__}'s forward is already wrapped on the instance "
                f"({getattr(vars(model)['forward'], '__qualname__', 'a callable')}: e.g. accelerate's autocast or "
                "device hooks from accelerator.prepare / a device_map over several devices), and the fused loss's "
                "training path would bypass that wrapper. Patch before wrapping, or pass fused_ce=False."
            )
        out["fused_ce"] = _explicit("fused_ce", fused_ce)
    elif wrapped:
        out["fused_ce"] = Speedup("fused_ce", False, "auto: the model's forward is already wrapped on the instance "
                                  "(e.g. accelerate's autocast or device hooks): the fused loss would bypass it")
    elif not on_cuda:
        out["fused_ce"] = Speedup("fused_ce", False, f"auto: on CUDA only; this model is on {device.type}")
    elif model.get_output_embeddings() is None:
        out["fused_ce"] = Speedup("fused_ce", False, "auto: the model has no LM head")
    else:
        out["fused_ce"] = Speedup("fused_ce", True, "auto: training forwards with labels take the loss from hidden "
                                                    "states in chunks, no full logits (logits=None there)")
    if fused_ops != AUTO:
        out["fused_ops"] = _explicit("fused_ops", fused_ops)
    else:
        if liger_installed is None:
            import importlib.util

            liger_installed = importlib.util.find_spec("liger_kernel") is not None
        why = ("liger-kernel's Triton kernels run on CUDA only; this model is on " + device.type) if not on_cuda \
            else None if liger_installed else "liger-kernel is not installed (pip install 'hf_accel[liger]')"
        out["fused_ops"] = Speedup("fused_ops", why is None,
                                   "auto: liger-kernel's fused norms / gated MLPs" if why is None else f"auto: {why}")
    if compile != AUTO:
        out["compile"] = _explicit("compile", compile, compile_stand_down)
    else:
        why = (f"on CUDA only; this model is on {device.type}" if not on_cuda
               else "torch.compile is not supported in this Python / torch" if not torch._dynamo.is_dynamo_supported()
               else _quantized(model))
        # The compile is paid once (seconds) and halves the element-wise time of every later step, so it is paid back
        # early in a fine-tune (BENCHMARKS.md, "where the step time goes").
        out["compile"] = Speedup("compile", why is None, "auto: decoder layers' training forwards through inductor "
                                 "(~20 s once for 1B shapes)" if why is None else f"auto: {why}")
    return out
