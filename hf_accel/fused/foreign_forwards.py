"""Forwards other libraries bound to a model's modules, and what hf_accel's compiled decoder layers do with them.

liger-kernel (TRL's / transformers' ``use_liger_kernel=True``, ``apply_liger_kernel_to_*``,
``_apply_liger_kernel_to_instance``) and transformers' hub kernels (``use_kernels=True``, ``kernels.kernelize``) give
modules forwards that launch their own Triton / CUDA kernels, mostly through a custom ``torch.autograd.Function``.
Dynamo may not trace those: liger's ``LigerRMSNormFunction`` failed inside a compiled layer with an AssertionError in
``overwrite_tensor_vt_proxy`` (issue 69). transformers applies liger when ``train()`` starts, i.e. after
``patch()``, so the layers look at their modules at each compiled call (a cheap check of each module's ``forward``
slot) and decide per module, before dynamo traces it:

- **own forward traced** (``TRACE_OWN``): a foreign forward bound on a module whose class is the model's own (what
  liger's ``_patch_*_module`` and ``kernelize`` do): dynamo traces the class's forward, the computation liger and
  the hub kernel reproduce (and what ``kernels`` itself runs under torch.compile for a layer that declares no
  compile support), and inductor fuses it with the rest of the layer; eager calls (evaluation, generation, layers
  outside the compiled path) keep running the bound kernel.
- **traced as bound** (``TRACED``): a hub kernel layer that declares ``can_torch_compile``, or a liger forward for
  which a stock stand-in is registered with dynamo (``hf_accel.fused.ops.keep_liger_out_of_compiled_graphs``).
- **opaque** (``OPAQUE``): anything else foreign (a module of liger's own classes without a stand-in, a forward that
  calls a foreign function through a module-level name): the module's call runs eagerly under
  ``torch.compiler.disable``, a graph break on each side, its kernels as bound.

Whatever the static decisions miss, a dynamo failure while tracing a layer is not the user's error: the modules of
the layers whose forwards call a custom ``autograd.Function`` (or a foreign function) become opaque and the call is
traced once more; if that fails too, the model's compiled layers run eagerly from then on. Each decision is logged
once and kept for the model's PatchReport (`compile_notes`; hf_accel.SFTTrainer adds them to its notes). A failure
while compiling the *backward*, which happens inside ``loss.backward()``, is outside this net.
"""
from __future__ import annotations

import logging
import sys
import types
import weakref
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ..binding import bind_forward
from ..foreign import function, global_callees, origin

logger = logging.getLogger("hf_accel")

# Attributes hf_accel keeps on a module whose forward it wrapped.
_PREVIOUS = "_hf_accel_foreign_forward"  # the forward slot's content before the wrapper (None: the class's)
_KERNEL_REPO = "_kernel_repo"  # what ``kernels`` sets on a module it bound a hub layer's forward to
NOTES_ATTR = "_hf_accel_compile_notes"  # on the patched model: the lines `compile_notes` returns

TRACE_OWN = "own forward traced"
TRACED = "traced as bound"
OPAQUE = "opaque"


@dataclass(frozen=True)
class Finding:
    """What a compiled layer does with one module's foreign forward: ``decision`` (TRACE_OWN, TRACED, OPAQUE),
    ``source`` (the library: "liger-kernel", "hub kernels", "a custom autograd.Function") and ``why``."""

    decision: str
    source: str
    why: str


def _is_hf_accel(fn: Any) -> bool:
    return (getattr(function(fn), "__module__", None) or "").split(".")[0] == "hf_accel"


def _substituted(fn: Any) -> bool:
    """Whether dynamo traces a registered stand-in wherever it meets ``fn`` (``torch.compiler.substitute_in_graph``)."""
    try:
        from torch._dynamo.trace_rules import is_polyfilled_callable
    except ImportError:  # pragma: no cover - private API moved
        return False
    return bool(is_polyfilled_callable(function(fn)))


def _hub_layer_compiles(forward: Any) -> bool:
    """A hub kernel layer's ``can_torch_compile`` (``kernels``' flag: the layer supports torch.compile), read from the
    class its forward belongs to."""
    fn = function(forward)
    owner: Any = sys.modules.get(getattr(fn, "__module__", "") or "")
    for part in (getattr(fn, "__qualname__", "") or "").split(".")[:-1]:
        owner = getattr(owner, part, None)
    return bool(getattr(owner, "can_torch_compile", False))


def _custom_function(value: Any) -> bool:
    return (isinstance(value, type) and issubclass(value, torch.autograd.Function)
            and not (getattr(value, "__module__", "") or "").startswith("torch"))


def calls_foreign_code(forward: Any) -> bool:
    """Whether a forward reads, by a module-level name, a custom ``torch.autograd.Function`` or a foreign function:
    the code dynamo most often fails to trace (kernels launched outside the dispatcher)."""
    return any(_custom_function(value) or origin(value) for _, value in global_callees(forward))


def classify(module: nn.Module) -> Finding | None:
    """What a compiled layer should do with ``module``'s forward; None where it is the model's own (or hf_accel's)."""
    bound = module.__dict__.get("forward")
    if bound is not None and _is_hf_accel(bound):
        return None
    own = type(module).forward
    forward = own if bound is None else bound
    repo = module.__dict__.get(_KERNEL_REPO)
    own_is_foreign = origin(own) or origin(type(module))  # a module of the library's own class
    source = ((f"hub kernels ({repo})" if repo is not None and bound is not None else None) or origin(forward)
              or (own_is_foreign if bound is None else None))
    if source is not None:
        if repo is not None and bound is not None and _hub_layer_compiles(bound):
            return Finding(TRACED, source, "the hub layer declares can_torch_compile")
        if bound is not None and not own_is_foreign:
            return Finding(TRACE_OWN, source, f"bound on a {type(module).__name__}, whose own forward computes "
                                              "the same")
        if _substituted(forward):
            return Finding(TRACED, source, "dynamo traces hf_accel's stock stand-in for it")
        return Finding(OPAQUE, source, f"a {type(module).__name__} of the library's own class, no stock stand-in")
    # the model's own forward, calling a foreign function by a module-level name (liger's rotary in modeling_llama)
    callees = [(name, origin(value), _substituted(value)) for name, value in global_callees(forward)
               if origin(value)]
    for name, callee, substituted in sorted(callees, key=lambda c: c[2]):  # any without a stand-in decides
        if not substituted:
            return Finding(OPAQUE, callee, f"its forward calls {callee}'s {name}")
        return Finding(TRACED, callee, f"its forward calls {callee}'s {name}, for which dynamo traces hf_accel's "
                                       "stock stand-in")
    return None


def _run_eagerly(self: nn.Module, *args, **kwargs):
    previous = self.__dict__.get(_PREVIOUS)
    return previous(*args, **kwargs) if previous is not None else type(self).forward(self, *args, **kwargs)


_run_eagerly_disabled = torch.compiler.disable(_run_eagerly)


def _own_when_traced(self: nn.Module, *args, **kwargs):
    if torch.compiler.is_compiling():  # constant while dynamo traces: the class's forward goes into the graph
        return type(self).forward(self, *args, **kwargs)
    return self.__dict__[_PREVIOUS](*args, **kwargs)


_WRAPPERS = {TRACE_OWN: _own_when_traced, OPAQUE: _run_eagerly_disabled}


def _wrap(module: nn.Module, decision: str) -> Callable[[], None]:
    """Bind the wrapper of ``decision`` as ``module``'s forward; return the action that restores the slot (unless
    someone bound another forward since)."""
    module.__dict__[_PREVIOUS] = module.__dict__.get("forward")
    unbind = bind_forward(module, types.MethodType(_WRAPPERS[decision], module), keep_later=True)

    def undo() -> None:
        unbind()
        module.__dict__.pop(_PREVIOUS, None)

    return undo


def is_compile_failure(exc: BaseException) -> bool:
    """Whether ``exc`` came from dynamo / inductor compiling a frame (not from the model's own code): a dynamo
    exception, or any exception raised while ``convert_frame`` was compiling (dynamo re-raises its internal
    AssertionErrors unwrapped)."""
    from torch._dynamo.exc import TorchDynamoException

    if isinstance(exc, TorchDynamoException):
        return True
    tb = exc.__traceback__
    while tb is not None:
        if tb.tb_frame.f_code.co_filename.endswith(("_dynamo/convert_frame.py", "_dynamo/symbolic_convert.py")):
            return True
        tb = tb.tb_next
    return False


class ForeignForwards:
    """One model's decisions about foreign forwards in its compiled layers (shared by all of them: they share
    graphs, and a failure in one is a failure in all)."""

    def __init__(self, model: nn.Module, layers: list[nn.Module]) -> None:
        self._model = weakref.ref(model)
        self._layers = [weakref.ref(layer) for layer in layers]
        # id(module) -> (module, its forward slot when last checked); a plain dict: checked at every compiled call
        self._seen: dict[int, tuple[nn.Module, Any]] = {}
        self._walked: dict[int, list[nn.Module]] = {}  # id(layer) -> its modules at the last full walk
        self._undo: list[Callable[[], None]] = []
        self.lines: list[str] = []  # what was noted, in order
        model.__dict__[NOTES_ATTR] = self.lines
        self.findings: list[tuple[str, Finding]] = []  # (module class name, finding)
        self.eager_reason: str | None = None

    # ---- before tracing -----------------------------------------------------------------------------------------
    def refresh(self, layer: nn.Module | None = None) -> None:
        """Decide for the modules whose forward slot changed since the last check (first check: all). ``layer``
        given (a compiled call): its modules as last walked are checked, a cheap read of each one's forward slot, and
        any change sends every compiled layer through the full walk (a library binds all of them at once; a layer's
        modules replaced after its first call, e.g. PEFT injecting adapters late, are walked at the next failure to
        trace, see `failed`). None: the full walk."""
        if layer is not None:
            modules = self._walked.get(id(layer))
            if modules is not None and not any(self._changed_module(m) for m in modules):
                return
        new: list[tuple[str, Finding]] = []
        for each in filter(None, (ref() for ref in self._layers)):
            modules = self._walked[id(each)] = list(each.modules())
            for module in modules:
                if not self._changed_module(module):
                    continue
                finding = classify(module)
                if finding is not None and finding.decision != TRACED:
                    self._undo.append(_wrap(module, finding.decision))
                if finding is not None:
                    new.append((type(module).__name__, finding))
                self._seen[id(module)] = (module, module.__dict__.get("forward"))
        self.findings += new
        self._note_findings(new)

    def _changed_module(self, module: nn.Module) -> bool:
        seen = self._seen.get(id(module))
        return seen is None or seen[0] is not module or seen[1] is not module.__dict__.get("forward")

    def _note_findings(self, new: list[tuple[str, Finding]]) -> None:
        groups = Counter((f.decision, f.source, f.why, name) for name, f in new)
        for (decision, source, why, name), count in groups.items():
            effect = {TRACE_OWN: "dynamo traces the module's own forward, eager calls run the bound kernel",
                      TRACED: "dynamo traces it as bound",
                      OPAQUE: "it runs eagerly between the compiled graphs (a graph break on each side)"}[decision]
            self.note(f"compile: {source} forward on {count} {name} module(s) of the compiled layers ({why}): "
                      f"{effect}")

    # ---- after a failed trace -----------------------------------------------------------------------------------
    def opaque_callers(self, layer: nn.Module) -> list[nn.Module]:
        """Make opaque the modules of ``layer`` (not opaque already) whose forward calls a custom
        ``autograd.Function`` or a foreign function; returns them."""
        made = []
        for module in layer.modules():
            slot = module.__dict__.get("forward")
            if getattr(slot, "__func__", None) is _run_eagerly_disabled:
                continue
            forward = slot if slot is not None and not _is_hf_accel(slot) else type(module).forward
            if getattr(slot, "__func__", None) is _own_when_traced:
                forward = type(module).forward  # what dynamo traced there
            if calls_foreign_code(forward) or origin(forward):
                self._undo.append(_wrap(module, OPAQUE))
                self._seen[id(module)] = (module, module.__dict__.get("forward"))
                made.append(module)
        return made

    def failed(self, exc: BaseException, retried: bool) -> bool:
        """A compiled layer's call failed in dynamo with ``exc``: True to trace once more (the callers of custom
        autograd.Functions or foreign kernels made opaque in every compiled layer: they share graphs, and would fail
        alike), False where the model's compiled layers now run eagerly."""
        text = str(exc).strip()
        first_line = f"{type(exc).__name__}: {text.splitlines()[0] if text else ''}"
        decided = len(self.findings)
        self.refresh()  # forwards bound where the cheap check does not look (modules replaced since the last walk)
        if len(self.findings) > decided and not retried:
            return True
        made = []
        if not retried:
            for layer in filter(None, (ref() for ref in self._layers)):
                made += self.opaque_callers(layer)
        if made:
            names = Counter(type(m).__name__ for m in made)
            self.note(f"compile: dynamo failed to trace a decoder layer ({first_line[:200]}); the modules whose "
                      f"forward calls a custom autograd.Function or a foreign kernel now run eagerly between the "
                      f"compiled graphs ({', '.join(f'{n} x{c}' for n, c in names.items())})", warn=True)
            return True
        self.eager_reason = first_line[:200]
        self.note(f"compile: dynamo failed to trace a decoder layer ({self.eager_reason}); the compiled layers run "
                  "eagerly from now on (patch(compile=False) says so from the start)", warn=True)
        return False

    # ---- reporting and undo -------------------------------------------------------------------------------------
    def note(self, line: str, warn: bool = False) -> None:
        """Log ``line`` once and keep it for the model's PatchReport (`compile_notes`)."""
        if line in self.lines:
            return
        self.lines.append(line)
        (logger.warning if warn else logger.info)("hf_accel: %s", line)

    def undo(self) -> None:
        for action in reversed(self._undo):
            action()
        self._undo.clear()
        self._seen.clear()
        self._walked.clear()
        model = self._model()
        if model is not None and model.__dict__.get(NOTES_ATTR) is self.lines:
            del model.__dict__[NOTES_ATTR]


def compile_notes(model: nn.Module) -> list[str]:
    """What the compiled layers of ``model`` decided about foreign forwards so far (the lines also logged), for its
    PatchReport notes."""
    return list(model.__dict__.get(NOTES_ATTR, ()))
