"""Plain-torch attention: every feature, any device, fp32 math. The test oracle and the CPU fallback of last resort."""
from __future__ import annotations

import torch

from .backend import Backend, allowed_bias, repeat_kv_heads
from .base import ALL_FLOAT_DTYPES, AttnOptions, Capabilities


class ReferenceBackend(Backend):
    name = "reference"
    capabilities = Capabilities(
        devices=frozenset({"cpu", "cuda", "mps", "xpu"}),
        dtypes=ALL_FLOAT_DTYPES,
        max_head_dim=1 << 16,
        window=True,
        softcap=True,
        dropout=True,
        alibi=True,
        alibi_backward=True,
        sinks=True,
        notes=("one document at a time in fp32; slow, exact",),
    )

    def varlen(self, q_thd, k_thd, v_thd, cu_q, cu_k, max_q, max_k, opts: AttnOptions) -> torch.Tensor:
        num_heads = q_thd.shape[1]
        k_thd, v_thd = repeat_kv_heads(k_thd, num_heads), repeat_kv_heads(v_thd, num_heads)
        outs = []
        bounds_q, bounds_k = cu_q.tolist(), cu_k.tolist()  # host sync: acceptable for the reference
        for (q0, q1), (k0, k1) in zip(zip(bounds_q, bounds_q[1:]), zip(bounds_k, bounds_k[1:])):
            outs.append(self._one_document(q_thd[q0:q1], k_thd[k0:k1], v_thd[k0:k1], opts))
        return torch.cat(outs, dim=0) if outs else q_thd.new_zeros(q_thd.shape)

    @staticmethod
    def _one_document(q_shd, k_shd, v_shd, opts: AttnOptions) -> torch.Tensor:
        dtype = q_shd.dtype
        math_dtype = torch.promote_types(dtype, torch.float32)  # at least fp32 math; fp64 stays fp64
        q, k, v = (x.transpose(0, 1).to(math_dtype) for x in (q_shd, k_shd, v_shd))  # (H, S, D)
        scores = (q @ k.transpose(-1, -2)) * opts.scale
        if opts.softcap:
            scores = torch.tanh(scores / opts.softcap) * opts.softcap
        # Queries are the last q-len keys of the document (equal lengths in training; the tail after a KV cache).
        k_pos = torch.arange(k.shape[1], device=q.device)
        q_pos = k_pos[k.shape[1] - q.shape[1]:]
        allowed, bias = allowed_bias(q_pos, k_pos, opts)
        if bias is not None:
            scores = scores + bias
        scores = scores.masked_fill(~allowed, float("-inf"))
        if opts.sinks is not None:  # one more logit per head in every row's softmax, with no value (gpt-oss)
            sinks = opts.sinks.to(math_dtype).view(-1, 1, 1).expand(scores.shape[0], scores.shape[1], 1)
            probs = torch.softmax(torch.cat([scores, sinks], dim=-1), dim=-1)[..., :-1]
        else:
            probs = torch.softmax(scores, dim=-1).nan_to_num(0.0)  # fully masked rows attend to nothing
        if opts.dropout_p > 0:
            probs = torch.nn.functional.dropout(probs, p=opts.dropout_p)
        return (probs @ v).transpose(0, 1).to(dtype)
