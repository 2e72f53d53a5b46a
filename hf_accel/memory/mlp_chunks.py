"""The MLP in token chunks, each under its own checkpoint, for calls long enough that its intermediate is the peak.

At long context a decoder layer's MLP intermediate is the largest tensor of the step: Llama-3-8B at 262,144 tokens
has gate, up and their product at 262144 x 14336 bf16 = 7.5 GB each, alive together in forward and again in the
layer's checkpoint recompute and backward. The MLP is per token, so ``patch(model, mlp_chunks=...)`` replaces each
decoder layer's MLP *instance* ``forward`` with one that splits the tokens into chunks and runs each chunk through
``torch.utils.checkpoint.checkpoint(forward, chunk, use_reentrant=False)``: forward keeps only the chunk inputs
(views of the MLP's input), and backward rebuilds one chunk's intermediate at a time. The cost is one more MLP
forward per chunked call (its recompute). The math is the same per token, equal up to rounding: a matmul over fewer
rows may round differently (BLAS picks kernels by shape), and weight gradients are the same sums in another order.
Dropout inside the MLP (PEFT's ``lora_dropout`` on its projections) draws its masks chunk by chunk: the same
distribution, but not the masks one draw over every token gives, so not the unpatched model's step for a seed; the
first such call says so in a warning (``lora_dropout=0`` or ``mlp_chunks=False`` keep the unpatched masks).

A memory budget (``memory.budget``) that no plan meets with auto's threshold may lower it to one chunk for its run
(``chunk_every_long_call``; ``restore_bound`` puts it back): the bound forward reads its chunking at each call.

Only *training* calls over the threshold are chunked (module in train mode, grad enabled, more tokens than
``min_tokens``); evaluation, no-grad and shorter calls run the forward that was bound before, unchanged. That forward
is whatever was there at bind time (the class's, liger's fused SwiGLU bound by ``fused_ops``), and the projections
are still called as modules, so PEFT LoRA adapters inside the MLP train as before. Chunk checkpoints nest inside
the decoder layer's own (full, offloaded, op-level). A chunk's recompute skips the MLP's output projection (the
family's ``output_projections`` inside ``mlp``, e.g. ``down_proj``), whose output it throws away (``memory.trim``).

Inside a compiled decoder layer (``hf_accel.fused.compiling``) the chunk loop is kept out of the graph
(``torch._dynamo.disable``): a chunked call breaks the layer's graph around its MLP, which then runs eagerly; calls
under the threshold trace the MLP as before (dynamo guards on the token count, so crossing it recompiles once).

Liger-kernel 0.8.5 ships ``LigerTiledMLPFunction`` (after DeepSpeed ALST's ``TiledMLP``); it is not used here: its
backward runs a nested ``torch.autograd.backward`` per shard that accumulates parameter gradients straight into
``.grad`` instead of returning them (so ``torch.autograd.grad`` and gradient hooks see none), and it needs
liger/Triton where the CPU tests run. Nested non-reentrant checkpoints give the same memory with autograd's own
bookkeeping.
"""
from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from ..binding import bind_forward
from ..errors import ConfigurationError
from . import trim
from .targets import decoder_mlps

logger = logging.getLogger(__name__)

AUTO = "auto"
AUTO_MIN_TOKENS = 32768  # "auto" never chunks a training call of this many tokens or fewer
# ... and chunks only calls whose unchunked intermediates would take more than this: chunking costs one more MLP
# forward per layer in backward, paid only where the intermediates are the peak (Llama-3-8B bf16: calls over ~200k
# tokens; Llama-3.2-1B: over ~350k; a 16k-token packed batch never)
AUTO_TRIGGER_BYTES = 16 << 30
AUTO_CHUNK_BYTES = 1 << 30  # "auto" sizes a chunk so its intermediate tensors take about this much
AUTO_MIN_CHUNK = 4096  # ... but never fewer tokens per chunk than this (matmuls stay large)
_INTERMEDIATES = 3  # tensors of (tokens, intermediate_size) alive together: gate, up and their product (SwiGLU)
_ALIGN = 1024  # auto chunk sizes are multiples of this many tokens


def intermediates_bytes(tokens: int, intermediate_size: int, element_size: int) -> int:
    """What an MLP call over `tokens` holds at once in intermediates (gate, up and their product)."""
    return tokens * intermediate_size * element_size * _INTERMEDIATES


def auto_min_tokens(intermediate_size: int, element_size: int) -> int:
    """The token count above which "auto" chunks: AUTO_TRIGGER_BYTES of unchunked intermediates (at least
    AUTO_MIN_TOKENS)."""
    return max(AUTO_MIN_TOKENS, AUTO_TRIGGER_BYTES // intermediates_bytes(1, intermediate_size, element_size))


def auto_chunk_tokens(intermediate_size: int, element_size: int) -> int:
    """Tokens per chunk whose MLP intermediates take about AUTO_CHUNK_BYTES (at least AUTO_MIN_CHUNK).

    Llama-3-8B in bf16: 2**30 // (14336 * 2 * 3) = 12483, rounded down to 12288 tokens (one chunk's three
    intermediates: 1.0 GiB, against 22 GiB for 262,144 tokens unchunked)."""
    tokens = AUTO_CHUNK_BYTES // intermediates_bytes(1, intermediate_size, element_size)
    return max(AUTO_MIN_CHUNK, tokens // _ALIGN * _ALIGN)


@dataclass(frozen=True)
class MlpChunking:
    """Training calls with more than ``min_tokens`` tokens run the MLP in chunks of ``chunk_tokens`` tokens."""

    chunk_tokens: int
    min_tokens: int
    auto: bool = False

    def chunk_for(self, hidden_states: torch.Tensor, training: bool) -> int:
        """This call's chunk size, or 0: run the forward unchanged. Reads only the (host-side) shape."""
        if not (training and torch.is_grad_enabled()) or hidden_states.ndim < 2:
            return 0
        return self.chunk_at(hidden_states.numel() // hidden_states.shape[-1])

    def chunk_at(self, tokens: int) -> int:
        """The chunk size of a training call over `tokens` tokens, or 0: it runs unchunked."""
        return self.chunk_tokens if tokens > self.longest_unchunked else 0

    @property
    def longest_unchunked(self) -> int:
        """The most tokens a training call may have and still run unchunked."""
        return max(self.min_tokens, self.chunk_tokens)

    def leaves_unchunked(self, tokens: int) -> bool:
        """"auto" runs a call of `tokens` unchunked (under its threshold, for speed) though it is longer than one
        chunk: what a memory budget may chunk before refusing (``every_long_call``)."""
        return self.auto and not self.chunk_at(tokens) and tokens > self.chunk_tokens

    def every_long_call(self) -> MlpChunking:
        """These chunks for every training call over one chunk, not only those over the threshold."""
        return MlpChunking(self.chunk_tokens, self.chunk_tokens, auto=self.auto)

    def describe(self) -> str:
        if self.auto:
            return (f"auto: training calls over {self.min_tokens} tokens run each decoder layer's MLP in chunks of "
                    f"{self.chunk_tokens} tokens (~1 GiB of intermediates each), each chunk checkpointed; shorter "
                    "calls unchanged")
        return (f"training calls over {self.min_tokens} tokens run each decoder layer's MLP in chunks of "
                f"{self.chunk_tokens} tokens, each chunk checkpointed")


def _off(setting) -> bool:
    return setting is None or setting is False or (isinstance(setting, int) and not isinstance(setting, bool)
                                                    and setting == 0)


def _chunk_size(setting) -> bool:
    return isinstance(setting, int) and not isinstance(setting, bool) and setting > 0


def check_setting(setting) -> None:
    """Refuse what patch()'s ``mlp_chunks`` cannot be: "auto", a chunk size in tokens (int > 0), or False / 0 / None."""
    if not (_off(setting) or setting == AUTO or _chunk_size(setting)):
        raise ConfigurationError(
            f"mlp_chunks must be 'auto', a chunk size in tokens (a positive int, e.g. 8192) or False; got {setting!r}."
        )


def resolve(setting, intermediate_size: int | None, element_size: int) -> MlpChunking | None:
    """patch()'s ``mlp_chunks``: "auto", a chunk size in tokens (int > 0), or False / 0 / None (off).
    ``intermediate_size``: the MLP's width (its family's ``mlp_width``, handed in by patch()); None for a model whose
    decoder layers have no dense ``mlp`` to chunk (experts): "auto" is off then, a chunk size refused."""
    check_setting(setting)
    if _off(setting):
        return None
    if intermediate_size is None:
        if setting == AUTO:
            return None
        raise ConfigurationError(
            f"mlp_chunks={setting!r} runs each decoder layer's dense MLP in chunks of tokens, and this model's layers "
            "have none (their MLP holds experts, or is not named mlp). Pass mlp_chunks=False.")
    if setting == AUTO:
        return MlpChunking(auto_chunk_tokens(intermediate_size, element_size),
                           auto_min_tokens(intermediate_size, element_size), auto=True)
    return MlpChunking(setting, setting)


@torch._dynamo.disable  # a chunked call runs eagerly even inside a compiled decoder layer (see the module docstring)
def run_in_chunks(forward: Callable[[torch.Tensor], torch.Tensor], hidden_states: torch.Tensor,
                  chunk_tokens: int, trimmed: bool = False) -> torch.Tensor:
    """``forward(hidden_states)`` for a per-token ``forward``, over chunks of ``chunk_tokens`` tokens, each chunk
    under its own non-reentrant checkpoint (``trimmed``: with the trimmed recompute, ``memory.trim``).
    hidden_states: (..., H); the leading dimensions are the tokens."""
    hidden_th = hidden_states.reshape(-1, hidden_states.shape[-1])
    context = {"context_fn": trim.context_fn} if trimmed else {}
    outs_th = [checkpoint(forward, chunk_th, use_reentrant=False, **context)
               for chunk_th in hidden_th.split(chunk_tokens, dim=0)]
    out_th = torch.cat(outs_th, dim=0)
    return out_th.view(*hidden_states.shape[:-1], out_th.shape[-1])


_CHUNKING = "__hf_accel_mlp_chunks__"  # on a chunked forward: the chunking its calls follow now
_BOUND = "__hf_accel_mlp_chunks_bound__"  # ... and the one patch() bound (a memory budget may chunk more: below)


def _active_dropout(module: nn.Module) -> str:
    """The dropout modules inside ``module`` that drop now (training, p > 0), named; '' for none."""
    return ", ".join(name for name, m in module.named_modules()
                     if isinstance(m, nn.Dropout) and m.training and m.p > 0)


@torch._dynamo.disable  # (inside a compiled layer: the trim's binding and its checks run as written, each call)
def _run_chunked(module: nn.Module, forward: Callable, hidden_states: torch.Tensor, chunk: int,
                 trimmed: tuple[str, ...], bindings: trim.Bindings, said: set) -> torch.Tensor:
    """A chunked call: the dropout warning (once per model: `said` is its MLPs'), then the chunks."""
    dropping = "dropout" not in said and _active_dropout(module)
    if dropping:
        said.add("dropout")
        logger.warning(
            "hf_accel: %s runs in chunks of %d tokens with dropout inside it (%s): its masks are drawn chunk by "
            "chunk (the same distribution, not the masks of one draw over every token). For the unpatched "
            "model's masks: lora_dropout=0, or patch(model, mlp_chunks=False).", type(module).__name__, chunk,
            dropping)
    return run_in_chunks(forward, hidden_states, chunk, trimmed=trim.prepare(module, trimmed, bindings))


def _chunked_forward(module: nn.Module, forward: Callable, chunking: MlpChunking, trimmed: tuple[str, ...],
                     bindings: trim.Bindings, said: set) -> Callable:
    @functools.wraps(forward)
    def chunked(*args, **kwargs):
        if len(args) != 1 or kwargs or not isinstance(args[0], torch.Tensor):
            return forward(*args, **kwargs)
        chunk = getattr(chunked, _CHUNKING).chunk_for(args[0], module.training)
        if not chunk:
            return forward(args[0])
        return _run_chunked(module, forward, args[0], chunk, trimmed, bindings, said)

    setattr(chunked, _CHUNKING, chunking)
    setattr(chunked, _BOUND, chunking)
    return chunked


def apply(model: nn.Module, chunking: MlpChunking, output_projections: tuple[str, ...] = ()) -> tuple[
        list[str], list[Callable[[], None]]]:
    """Bind the chunked forward to each decoder layer's MLP; the MLP names and the undo actions.
    ``output_projections``: the family's (paths in a decoder layer); those inside its ``mlp`` a chunk's recompute
    skips (``memory.trim``)."""
    trimmed = tuple(path.removeprefix("mlp.") for path in output_projections if path.startswith("mlp."))
    bindings, said = trim.Bindings([]), set()
    names, undo = [], [bindings.unbind]
    for name, mlp in decoder_mlps(model):
        undo.append(bind_forward(mlp, _chunked_forward(mlp, mlp.forward, chunking, trimmed, bindings, said)))
        names.append(name)
    return names, undo


def chunking_of(module: nn.Module) -> MlpChunking | None:
    """The chunking this MLP instance's calls follow, if any."""
    return getattr(module.__dict__.get("forward"), _CHUNKING, None)


def chunk_every_long_call(model: nn.Module) -> MlpChunking | None:
    """A memory budget's step before refusing: every decoder MLP bound with mlp_chunks="auto" chunks each training
    call over one chunk, not only those over auto's threshold (a layer's backward then rebuilds one chunk's
    intermediates at any length). The chunking now in force, or None where no MLP has an auto chunking (nothing
    changed). ``restore_bound`` undoes it."""
    now = None
    for _, mlp in decoder_mlps(model):
        forward = mlp.__dict__.get("forward")
        bound = getattr(forward, _BOUND, None)
        if bound is not None and bound.auto:
            now = bound.every_long_call()
            setattr(forward, _CHUNKING, now)
    return now


def restore_bound(model: nn.Module) -> None:
    """Each decoder MLP's calls follow the chunking patch() bound again (undoes ``chunk_every_long_call``)."""
    for _, mlp in decoder_mlps(model):
        forward = mlp.__dict__.get("forward")
        if hasattr(forward, _BOUND):
            setattr(forward, _CHUNKING, getattr(forward, _BOUND))
