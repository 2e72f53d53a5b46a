"""flash-attn-4 (``flash_attn.cute``, Hopper/Blackwell), wrapped as ``torch.library`` custom ops.

flash-attn-4 launches its kernels outside PyTorch's dispatcher as a plain autograd.Function; as custom ops
``hf_accel::fa4_varlen_fwd`` / ``_bwd`` selective checkpoint policies can save its output and torch.compile sees one
opaque node. ALiBi would go through flash-attn-4's ``score_mod``; its backward was reported wrong on sm90 (4.0.0b36),
while a single-slope relative bias measured right on sm90 (tests/gpu/test_kernels_gpu.py). Per-head slopes are not
wired up yet, so ALiBi is not declared.
"""
from __future__ import annotations

import importlib.util
import warnings

import torch

from ..varlen import IdentityMemo
from .backend import Backend, no_cuda_reason
from .base import HALF_DTYPES, AttnOptions, Capabilities
from .sinks import sinks_grad, with_sinks


# flash-attn-4 compiles a separate kernel variant when a batch's longest document fits one tile (<= 128 tokens: its
# "single block" / "max_m_blocks_leq_one" keys). A packed step made only of short documents then stalls training for
# seconds on a JIT compile. `max_seqlen` is an upper bound to flash-attn-4 (it sizes the grid and picks variants, never
# the result), so passing at least this many tokens keeps every step on the variants compiled on the first step.
JIT_STABLE_MIN_SEQLEN = 256


def jit_stable_max_seqlen(n: int) -> int:
    """The `max_seqlen` hint handed to flash-attn-4: the true maximum, floored at JIT_STABLE_MIN_SEQLEN."""
    return max(int(n), JIT_STABLE_MIN_SEQLEN)


# Above this many documents in one call flash-attn-4 switches its varlen scheduler to a batch-lookup variant
# (BIN_BATCH_SEARCH_THRESH), compiled on first use: a packed step of many short documents stalled training for seconds.
# Documents are independent, so a larger call is split into consecutive groups of at most this many documents.
MAX_DOCS_PER_CALL = 256

_groups_memo = IdentityMemo()  # every layer of a step passes the same cu_seqlens: one host read per step


def document_groups(cu_q: torch.Tensor, cu_k: torch.Tensor, total_q: int, total_k: int):
    """[(first_doc, last_doc + 1, q_start, q_end, k_start, k_end)] in groups of at most MAX_DOCS_PER_CALL documents.

    cu_q, cu_k: (num_docs + 1,) int32 on the device. Memoised on the tensors' identity: every layer of a step passes
    the same cu_seqlens (built once per step by hf_accel.attention.varlen), so only the first layer reads them back.
    """
    hit = _groups_memo.get((cu_q, cu_k))
    if hit is not None:
        return hit
    docs = cu_q.shape[0] - 1
    cuts = list(range(0, docs, MAX_DOCS_PER_CALL)) + [docs]
    q_at = cu_q[cuts].tolist()  # host sync: only for steps of more than MAX_DOCS_PER_CALL documents, once per step
    k_at = list(q_at) if cu_k is cu_q else cu_k[cuts].tolist()
    q_at[-1], k_at[-1] = total_q, total_k  # rows after the last document (if any) stay with the last group
    out = [(a, b, q_at[i], q_at[i + 1], k_at[i], k_at[i + 1]) for i, (a, b) in enumerate(zip(cuts, cuts[1:]))]
    _groups_memo.put((cu_q, cu_k), out)
    return out


def _window(left: int, right: int):
    return (None if left < 0 else left), (None if right < 0 else right)


# flash-attn-4 4.0.0b36's CuTe DSL warns once per new kernel variant that its `aux_data` argument "cannot be converted
# to a JitArgument" (a 600-character UserWarning per compile, several per process): its own note on
# how it passes an internal argument, nothing a user can act on. That message only is ignored, from the first call.
AUX_DATA_NOTE = r"Argument aux_data \(position \d+\) cannot be converted to a JitArgument"
_quieted = False


def quiet_aux_data_note() -> None:
    """Ignore flash-attn-4's aux_data JitArgument UserWarning in this process (that message only; once)."""
    global _quieted
    if not _quieted:
        warnings.filterwarnings("ignore", message=AUX_DATA_NOTE, category=UserWarning)
        _quieted = True


@torch.library.custom_op("hf_accel::fa4_varlen_fwd", mutates_args=())
def fa4_varlen_fwd(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_q: torch.Tensor, cu_k: torch.Tensor,
    max_q: int, max_k: int, scale: float, causal: bool, window_left: int, window_right: int, softcap: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    from flash_attn.cute.interface import _flash_attn_fwd

    quiet_aux_data_note()
    left, right = _window(window_left, window_right)
    out, lse, *_ = _flash_attn_fwd(
        q, k, v, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=max_q, max_seqlen_k=max_k,
        softmax_scale=scale, causal=causal, window_size_left=left, window_size_right=right,
        softcap=softcap or None, return_lse=True,
    )
    return out, lse


@fa4_varlen_fwd.register_fake
def _(q, k, v, cu_q, cu_k, max_q, max_k, scale, causal, window_left, window_right, softcap):
    out = q.new_empty(q.shape[0], q.shape[1], v.shape[2])
    lse = q.new_empty(q.shape[1], q.shape[0], dtype=torch.float32)  # (H, T), as flash_attn.cute lays it out
    return out, lse


@torch.library.custom_op("hf_accel::fa4_varlen_bwd", mutates_args=())
def fa4_varlen_bwd(
    dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, lse: torch.Tensor,
    cu_q: torch.Tensor, cu_k: torch.Tensor, max_q: int, max_k: int, scale: float, causal: bool,
    window_left: int, window_right: int, softcap: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    from flash_attn.cute.interface import _flash_attn_bwd

    left, right = _window(window_left, window_right)
    dq, dk, dv = _flash_attn_bwd(
        q, k, v, out, dout.contiguous(), lse, scale, causal, softcap,
        window_size_left=left, window_size_right=right,
        cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=max_q, max_seqlen_k=max_k,
    )[:3]
    return dq, dk, dv


@fa4_varlen_bwd.register_fake
def _(dout, q, k, v, out, lse, cu_q, cu_k, max_q, max_k, scale, causal, window_left, window_right, softcap):
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


def _setup_context(ctx, inputs, output):
    q, k, v, cu_q, cu_k, max_q, max_k, scale, causal, window_left, window_right, softcap = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse, cu_q, cu_k)
    ctx.args = (max_q, max_k, scale, causal, window_left, window_right, softcap)


def _backward(ctx, dout, dlse):
    q, k, v, out, lse, cu_q, cu_k = ctx.saved_tensors
    dq, dk, dv = fa4_varlen_bwd(dout, q, k, v, out, lse, cu_q, cu_k, *ctx.args)
    return dq, dk, dv, None, None, None, None, None, None, None, None, None


fa4_varlen_fwd.register_autograd(_backward, setup_context=_setup_context)


@torch.library.custom_op("hf_accel::fa4_varlen_sinks_fwd", mutates_args=())
def fa4_varlen_sinks_fwd(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, sinks: torch.Tensor, cu_q: torch.Tensor, cu_k: torch.Tensor,
    max_q: int, max_k: int, scale: float, causal: bool, window_left: int, window_right: int, softcap: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """flash-attn-4 with attention sinks (``kernels.sinks``): its output and log-sum-exp corrected for the sinks."""
    out, lse = fa4_varlen_fwd(q, k, v, cu_q, cu_k, max_q, max_k, scale, causal, window_left, window_right, softcap)
    return with_sinks(out, lse, sinks)


@fa4_varlen_sinks_fwd.register_fake
def _(q, k, v, sinks, cu_q, cu_k, max_q, max_k, scale, causal, window_left, window_right, softcap):
    out = q.new_empty(q.shape[0], q.shape[1], v.shape[2])
    return out, q.new_empty(q.shape[1], q.shape[0], dtype=torch.float32)


def _setup_sinks(ctx, inputs, output):
    q, k, v, sinks, cu_q, cu_k, max_q, max_k, scale, causal, window_left, window_right, softcap = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, sinks, out, lse, cu_q, cu_k)
    ctx.args = (max_q, max_k, scale, causal, window_left, window_right, softcap)


def _backward_sinks(ctx, dout, dlse):
    q, k, v, sinks, out, lse, cu_q, cu_k = ctx.saved_tensors
    dq, dk, dv = fa4_varlen_bwd(dout, q, k, v, out, lse, cu_q, cu_k, *ctx.args)  # the sink softmax's (kernels.sinks)
    return dq, dk, dv, sinks_grad(dout, out, lse, sinks), None, None, None, None, None, None, None, None, None


fa4_varlen_sinks_fwd.register_autograd(_backward_sinks, setup_context=_setup_sinks)


class FA4Backend(Backend):
    name = "fa4"
    capabilities = Capabilities(
        devices=frozenset({"cuda"}),
        dtypes=HALF_DTYPES,
        min_capability=(9, 0),
        max_head_dim=256,
        head_dim_multiple=8,
        window=True,
        softcap=True,
        alibi=False,  # score_mod ALiBi not wired up (per-head slopes need aux tensors; see the module docstring)
        alibi_backward=False,
        sinks=True,  # by the log-sum-exp correction (kernels.sinks)
        notes=("flash-attn-4 4.0.0b36; no dropout; no ALiBi yet",),
    )

    def unavailable_reason(self) -> str | None:
        if importlib.util.find_spec("flash_attn") is None or importlib.util.find_spec("flash_attn.cute") is None:
            return "flash-attn-4 not installed (pip install 'hf_accel[flash]')"
        return no_cuda_reason()

    def varlen(self, q_thd, k_thd, v_thd, cu_q, cu_k, max_q, max_k, opts: AttnOptions) -> torch.Tensor:
        if cu_q.shape[0] - 1 <= MAX_DOCS_PER_CALL:
            return self._varlen(q_thd, k_thd, v_thd, cu_q, cu_k, max_q, max_k, opts)
        outs = [
            self._varlen(q_thd[q0:q1], k_thd[k0:k1], v_thd[k0:k1], cu_q[a : b + 1] - q0, cu_k[a : b + 1] - k0,
                         max_q, max_k, opts)
            for a, b, q0, q1, k0, k1 in document_groups(cu_q, cu_k, q_thd.shape[0], k_thd.shape[0])
        ]
        return torch.cat(outs)

    def _varlen(self, q_thd, k_thd, v_thd, cu_q, cu_k, max_q, max_k, opts: AttnOptions) -> torch.Tensor:
        left, right = opts.window
        args = (cu_q, cu_k, jit_stable_max_seqlen(max_q), jit_stable_max_seqlen(max_k), float(opts.scale),
                bool(opts.causal), -1 if left is None else int(left), -1 if right is None else int(right),
                float(opts.softcap))
        if opts.sinks is not None:
            return fa4_varlen_sinks_fwd(q_thd, k_thd, v_thd, opts.sinks, *args)[0]
        return fa4_varlen_fwd(q_thd, k_thd, v_thd, *args)[0]
