"""The flash-attn 2 (``flash_attn``) and 3 (``flash_attn_interface``) packages, used when importable.

Neither ships a wheel for the GPU image we test on (flash-attn 2 builds from source for about an hour), so these thin
adapters follow the packages' documented ``flash_attn_varlen_func`` signatures and are selected only when installed.
"""
from __future__ import annotations

import importlib
import importlib.util

import torch

from .backend import Backend, flash_window, no_cuda_reason
from .base import HALF_DTYPES, AttnOptions, Capabilities


class FlashAttn2Backend(Backend):
    name = "fa2"
    capabilities = Capabilities(
        devices=frozenset({"cuda"}),
        dtypes=HALF_DTYPES,
        min_capability=(8, 0),
        max_head_dim=256,
        head_dim_multiple=8,
        window=True,
        softcap=True,
        dropout=True,
        alibi=True,
        alibi_backward=True,
        notes=("flash-attn 2.x package; sdist only, compiles for ~1 h",),
    )

    def unavailable_reason(self) -> str | None:
        try:
            module = importlib.import_module("flash_attn")
        except Exception:  # an absent or half-installed package must not break selection
            return "flash-attn 2 not installed"
        if not str(getattr(module, "__version__", "")).startswith("2.") or not hasattr(
            module, "flash_attn_varlen_func"
        ):
            return "installed flash_attn is not a 2.x release"
        return no_cuda_reason()

    def varlen(self, q_thd, k_thd, v_thd, cu_q, cu_k, max_q, max_k, opts: AttnOptions) -> torch.Tensor:
        from flash_attn import flash_attn_varlen_func

        return flash_attn_varlen_func(
            q_thd, k_thd, v_thd, cu_q, cu_k, max_q, max_k,
            dropout_p=opts.dropout_p, softmax_scale=opts.scale, causal=opts.causal,
            window_size=flash_window(opts), softcap=opts.softcap,
            alibi_slopes=None if opts.alibi_slopes is None else opts.alibi_slopes.to(torch.float32).contiguous(),
        )


class FlashAttn3Backend(Backend):
    name = "fa3"
    capabilities = Capabilities(
        devices=frozenset({"cuda"}),
        dtypes=HALF_DTYPES,
        min_capability=(9, 0),
        max_capability=(9, 0),
        max_head_dim=256,
        head_dim_multiple=8,
        window=True,
        softcap=True,
        notes=("flash-attn 3 (hopper/ build, module flash_attn_interface)",),
    )

    def unavailable_reason(self) -> str | None:
        if importlib.util.find_spec("flash_attn_interface") is None:
            return "flash-attn 3 not installed"
        return no_cuda_reason()

    def varlen(self, q_thd, k_thd, v_thd, cu_q, cu_k, max_q, max_k, opts: AttnOptions) -> torch.Tensor:
        from flash_attn_interface import flash_attn_varlen_func

        out = flash_attn_varlen_func(
            q_thd, k_thd, v_thd, cu_q, cu_k, max_q, max_k,
            softmax_scale=opts.scale, causal=opts.causal, window_size=flash_window(opts), softcap=opts.softcap,
        )
        return out[0] if isinstance(out, tuple) else out  # some releases return (out, lse)
