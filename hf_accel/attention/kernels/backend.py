"""The interface every attention backend implements."""
from __future__ import annotations

import torch

from .base import AttnOptions, Capabilities


class Backend:
    """One attention implementation. Subclasses set ``name`` and ``capabilities`` and implement ``varlen``.

    ``varlen`` takes packed tensors ``q_thd (T, Hq, D)``, ``k_thd``/``v_thd (T, Hkv, D)``, ``cu_q``/``cu_k``
    ``(num_docs + 1,) int32`` and host-int ``max_q``/``max_k``; it returns ``out_thd (T, Hq, D)``.
    """

    name: str = "?"
    capabilities: Capabilities

    def unavailable_reason(self) -> str | None:
        """None when the backend can run in this process, else why not (missing package, ...)."""
        return None

    def varlen(
        self,
        q_thd: torch.Tensor,
        k_thd: torch.Tensor,
        v_thd: torch.Tensor,
        cu_q: torch.Tensor,
        cu_k: torch.Tensor,
        max_q: int,
        max_k: int,
        opts: AttnOptions,
    ) -> torch.Tensor:
        raise NotImplementedError

    def __repr__(self) -> str:
        return f"<attention backend {self.name}>"


def no_cuda_reason() -> str | None:
    """Why a CUDA-only backend cannot run in this process, or None."""
    return None if torch.cuda.is_available() else "no CUDA device"


def aten_cuda_op_reason(op: str) -> str | None:
    """Why a backend calling torch's own CUDA kernel ``aten::<op>`` cannot run in this process, or None."""
    reason = no_cuda_reason()
    if reason:
        return reason
    return None if hasattr(torch.ops.aten, op) else f"this torch build has no aten::{op}"


def flash_window(opts: AttnOptions) -> tuple[int, int]:
    """(left, right) in the flash-attention convention: -1 is unbounded; causal means right = 0."""
    left, right = opts.window
    return (-1 if left is None else left, (0 if opts.causal else -1) if right is None else right)


def document_ids(cu: torch.Tensor, total: int) -> torch.Tensor:
    """(total,) index of the document each packed token belongs to, from cumulative lengths (no host sync)."""
    tokens = torch.arange(total, device=cu.device)
    return torch.searchsorted(cu[1:].to(torch.long), tokens, right=True)


def repeat_kv_heads(x_thd: torch.Tensor, num_heads_q: int) -> torch.Tensor:
    """(T, Hkv, D) -> (T, Hq, D) for kernels without native grouped-query support."""
    groups = num_heads_q // x_thd.shape[1]
    return x_thd if groups == 1 else x_thd.repeat_interleave(groups, dim=1)


def allowed_bias(q_pos: torch.Tensor, k_pos: torch.Tensor, opts: AttnOptions) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Boolean visibility (..., Q, K) from causality and window, and the ALiBi bias (..., H, Q, K) or None.

    q_pos (..., Q) and k_pos (K,) are positions local to one document. Shared by the mask-building backends.
    """
    rel = k_pos - q_pos[..., :, None]  # (..., Q, K): key position minus query position
    allowed = torch.ones_like(rel, dtype=torch.bool)
    if opts.causal:
        allowed &= rel <= 0
    left, right = opts.window
    if left is not None:
        allowed &= rel >= -left
    if right is not None:
        allowed &= rel <= right
    bias = None
    if opts.alibi_slopes is not None:
        slopes = opts.alibi_slopes.to(device=rel.device, dtype=torch.float32)[:, None, None]
        dist = rel.to(torch.float32) if opts.causal else -rel.abs().to(torch.float32)
        bias = slopes * dist[..., None, :, :]
    return allowed, bias
