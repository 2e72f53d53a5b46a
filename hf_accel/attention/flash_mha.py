"""FlashMHA: multi-head attention for custom models that runs hf_accel's varlen kernels and stays LoRA-friendly.

It mirrors ``nn.MultiheadAttention``'s call (``forward(query, key, value, key_padding_mask=..., attn_mask=...)``
returning ``(output, None)``) but never materialises attention weights: padded input is unpadded to packed tokens,
packed input (``(T, E)`` + ``cu_seqlens``) goes straight to the kernel. Projections are plain ``nn.Linear`` children
(``q_proj``/``k_proj``/``v_proj``/``out_proj``, or ``Wqkv`` + ``out_proj``) that forward *calls*, so PEFT's LoRA
adapters on them receive their inputs and gradients.

Padding convention: outputs at padded positions are zero (they are never computed), and rotary positions count the
real tokens of each sequence from 0, so left- and right-padded rows give the same result.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from ..errors import ConfigurationError, InvalidBatch
from .kernels import AttnOptions, varlen_attention
from .varlen import VarlenBatch


def alibi_slopes(num_heads: int) -> torch.Tensor:
    """ALiBi head slopes (num_heads,) fp32, as in the paper (and Bloom/MPT): a geometric series, interleaved beyond a
    power of two."""
    def power_of_two(n: int) -> list[float]:
        start = 2.0 ** (-(2.0 ** -(math.log2(n) - 3)))
        return [start ** (i + 1) for i in range(n)]

    closest = 2 ** math.floor(math.log2(num_heads))
    slopes = power_of_two(closest)
    if closest < num_heads:
        slopes += power_of_two(2 * closest)[0::2][: num_heads - closest]
    return torch.tensor(slopes, dtype=torch.float32)


def rotary_cos_sin(positions_t: torch.Tensor, head_dim: int, base: float) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin tables (T, head_dim) fp32 for the rotate-half RoPE convention (Llama, GPT-NeoX)."""
    inv_freq = 1.0 / base ** (torch.arange(0, head_dim, 2, device=positions_t.device, dtype=torch.float32) / head_dim)
    angles_td = positions_t.to(torch.float32)[:, None] * inv_freq[None, :]
    angles_td = torch.cat([angles_td, angles_td], dim=-1)
    return angles_td.cos(), angles_td.sin()


def apply_rotary(x_thd: torch.Tensor, cos_td: torch.Tensor, sin_td: torch.Tensor) -> torch.Tensor:
    """Rotate (T, H, D) by per-token angles; the math runs in fp32 so bf16 inputs lose nothing extra."""
    x = x_thd.to(torch.float32)
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    out = x * cos_td[:, None, :] + rotated * sin_td[:, None, :]
    return out.to(x_thd.dtype)


def positions_in_documents(cu_seqlens: torch.Tensor, total: int) -> torch.Tensor:
    """(T,) long position of every packed token inside its document (restarts at 0); no host sync."""
    tokens = torch.arange(total, device=cu_seqlens.device)
    cu = cu_seqlens.to(torch.long)
    doc = torch.searchsorted(cu[1:], tokens, right=True)
    return tokens - cu[doc]


def padding_layout(
    batch_size: int, seq_len: int, key_padding_mask: torch.Tensor | None, device: torch.device
) -> VarlenBatch:
    """Each row of a (B, S) batch is one sequence made of its real tokens (``key_padding_mask`` True = pad).

    A hole in the middle of a row does not split it (as in ``varlen.from_mask_and_positions``): only the masked keys
    are hidden and every real token of a row attends to the others, as in ``nn.MultiheadAttention``.
    """
    if key_padding_mask is None:
        cu = torch.arange(0, (batch_size + 1) * seq_len, seq_len, dtype=torch.int32, device=device)
        return VarlenBatch(batch_size, seq_len, cu, seq_len, None)
    if key_padding_mask.dtype != torch.bool:
        raise InvalidBatch(
            f"key_padding_mask must be bool (True = padding), got dtype {key_padding_mask.dtype}; "
            "pass `mask.bool()` (or `mask == float('-inf')` for an additive float mask)."
        )
    if tuple(key_padding_mask.shape) != (batch_size, seq_len):
        raise InvalidBatch(
            f"key_padding_mask must have shape (batch, seq) = {(batch_size, seq_len)}, "
            f"got {tuple(key_padding_mask.shape)}."
        )
    real_bs = ~key_padding_mask.to(device)
    lengths_b = real_bs.sum(dim=1)
    cu = F.pad(lengths_b.cumsum(0), (1, 0)).to(torch.int32)
    # The one host sync of a padded call: kernels need the longest sequence as a Python int.
    max_len, total = torch.stack([lengths_b.max(), lengths_b.sum()]).tolist()
    indices = None if total == batch_size * seq_len else real_bs.reshape(-1).nonzero().squeeze(1)
    return VarlenBatch(batch_size, seq_len, cu, int(max_len), indices)


def _is_causal_mask(attn_mask: torch.Tensor, seq_len: int) -> bool | None:
    """True if ``attn_mask`` (S, S) is the causal mask, False if it masks nothing, None if it is anything else."""
    if attn_mask.ndim != 2 or tuple(attn_mask.shape) != (seq_len, seq_len):
        return None
    blocked = attn_mask if attn_mask.dtype == torch.bool else attn_mask == float("-inf")
    if attn_mask.dtype != torch.bool and not bool(((attn_mask == 0) | blocked).all()):
        return None  # a float mask with finite non-zero biases
    upper = torch.ones(seq_len, seq_len, dtype=torch.bool, device=attn_mask.device).triu(1)
    if torch.equal(blocked, upper):
        return True
    return False if not bool(blocked.any()) else None


class FlashMHA(nn.Module):
    """Multi-head attention on hf_accel's varlen kernels; GQA/MQA via ``num_kv_heads``, optional RoPE and ALiBi.

    Args mirror ``nn.MultiheadAttention`` where they overlap. ``causal`` is the default of ``forward(is_causal=None)``;
    ``rotary="rope"`` rotates q/k with base ``rotary_base``; ``alibi=True`` adds the standard per-head slopes;
    ``qkv_fused`` uses one ``Wqkv`` projection laid out ``[q; k; v]`` (as ``in_proj_weight``); ``backend`` is any
    name of ``hf_accel.attention.kernels`` ("auto" picks the fastest that can serve the call, e.g. one with dropout in training).
    """

    def __init__(
        self,
        embed_dim: int,
        num_heads: int,
        num_kv_heads: int | None = None,
        bias: bool = True,
        causal: bool = False,
        dropout: float = 0.0,
        rotary: str | None = None,
        rotary_base: float = 10000.0,
        alibi: bool = False,
        qkv_fused: bool = False,
        batch_first: bool = True,
        backend: str = "auto",
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        num_kv_heads = num_heads if num_kv_heads is None else num_kv_heads
        _check_config(embed_dim, num_heads, num_kv_heads, dropout, rotary)
        self.embed_dim, self.num_heads, self.num_kv_heads = embed_dim, num_heads, num_kv_heads
        self.head_dim = embed_dim // num_heads
        self.causal, self.dropout, self.batch_first, self.backend = causal, dropout, batch_first, backend
        self.rotary, self.rotary_base, self.qkv_fused = rotary, rotary_base, qkv_fused
        kv_dim = num_kv_heads * self.head_dim
        factory = {"device": device, "dtype": dtype}
        if qkv_fused:
            self.Wqkv = nn.Linear(embed_dim, embed_dim + 2 * kv_dim, bias=bias, **factory)
        else:
            self.q_proj = nn.Linear(embed_dim, embed_dim, bias=bias, **factory)
            self.k_proj = nn.Linear(embed_dim, kv_dim, bias=bias, **factory)
            self.v_proj = nn.Linear(embed_dim, kv_dim, bias=bias, **factory)
        self.out_proj = nn.Linear(embed_dim, embed_dim, bias=bias, **factory)
        # Not persistent: the slopes follow from num_heads, so state_dicts hold only the projections.
        slopes = alibi_slopes(num_heads).to(device) if alibi else None
        self.register_buffer("alibi_slopes", slopes, persistent=False)

    @property
    def alibi(self) -> bool:
        return self.alibi_slopes is not None

    def extra_repr(self) -> str:
        return (
            f"embed_dim={self.embed_dim}, num_heads={self.num_heads}, num_kv_heads={self.num_kv_heads}, "
            f"causal={self.causal}, dropout={self.dropout}, rotary={self.rotary}, alibi={self.alibi}, "
            f"qkv_fused={self.qkv_fused}, batch_first={self.batch_first}, backend={self.backend!r}"
        )

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor | None = None,
        value: torch.Tensor | None = None,
        key_padding_mask: torch.Tensor | None = None,
        need_weights: bool = False,
        attn_mask: torch.Tensor | None = None,
        is_causal: bool | None = None,
        cu_seqlens: torch.Tensor | None = None,
        max_seqlen: int | None = None,
    ) -> tuple[torch.Tensor, None]:
        """Self-attention (``key``/``value`` None or ``query`` itself) or, unfused and non-causal, cross-attention.

        Padded: ``query`` (B, S, E) (``(S, B, E)`` if not batch_first), ``key_padding_mask`` (B, S) bool, True = pad.
        Packed: ``query`` (T, E) with ``cu_seqlens`` (num_docs + 1,) int32 and ``max_seqlen`` (a Python int; computed
        with a host sync when omitted). ``attn_mask`` may only be the (S, S) causal mask (or one masking nothing).
        Returns ``(output, None)``: output has ``query``'s shape; attention weights are never materialised.
        """
        if need_weights:
            raise ConfigurationError(
                "FlashMHA never materialises attention weights, so need_weights=True cannot be honoured; pass "
                "need_weights=False (use nn.MultiheadAttention, e.g. FlashMHA.to_torch(), to inspect weights)."
            )
        key = query if key is None else key
        value = key if value is None else value
        cross = key is not query or value is not query
        if cu_seqlens is not None:
            causal = self._resolve_causal(attn_mask, is_causal, seq_len=None)
            return self._forward_packed(query, cross, key_padding_mask, cu_seqlens, max_seqlen, causal), None
        if not self.batch_first:
            query, key, value = (x.transpose(0, 1) for x in (query, key, value))
        if query.ndim != 3 or query.shape[-1] != self.embed_dim:
            raise InvalidBatch(
                f"padded input must be (batch, seq, {self.embed_dim}) (batch_first={self.batch_first}), got "
                f"{tuple(query.shape)}; packed (T, E) input needs cu_seqlens."
            )
        causal = self._resolve_causal(attn_mask, is_causal, seq_len=None if cross else query.shape[1])
        out_bse = self._forward_padded(query, key, value, key_padding_mask, causal, cross)
        return (out_bse if self.batch_first else out_bse.transpose(0, 1)), None

    def _resolve_causal(self, attn_mask: torch.Tensor | None, is_causal: bool | None, seq_len: int | None) -> bool:
        """Causality from ``is_causal`` (default: the module's) and an optional (S, S) mask that must agree with it."""
        causal = self.causal if is_causal is None else bool(is_causal)
        if attn_mask is None:
            return causal
        if seq_len is None:
            raise ConfigurationError(
                "attn_mask is not supported with packed input or cross-attention: documents are already separated "
                "by cu_seqlens / key_padding_mask. Drop attn_mask and pass is_causal=True or False."
            )
        mask_causal = _is_causal_mask(attn_mask, seq_len)
        if mask_causal is None:
            raise ConfigurationError(
                f"FlashMHA cannot honour an attn_mask of shape {tuple(attn_mask.shape)} and dtype {attn_mask.dtype}: "
                f"it accepts only the ({seq_len}, {seq_len}) causal mask (bool True or float -inf above the "
                "diagonal). Use is_causal=True for causal attention, key_padding_mask for padding, cu_seqlens for "
                "packed documents, alibi=True for ALiBi; other masks need nn.MultiheadAttention."
            )
        if is_causal and not mask_causal:
            raise ConfigurationError("is_causal=True contradicts an attn_mask that masks nothing; pass one of them.")
        return mask_causal

    def _check_cross(self, causal: bool) -> None:
        if self.qkv_fused or causal or self.rotary or self.alibi:
            raise ConfigurationError(
                "cross-attention (key/value other than query) is supported only unfused (qkv_fused=False), "
                f"non-causal, without rotary or ALiBi; this module has qkv_fused={self.qkv_fused}, causal={causal}, "
                f"rotary={self.rotary}, alibi={self.alibi}. For self-attention pass key=None, value=None."
            )

    def _forward_padded(self, query, key, value, key_padding_mask, causal: bool, cross: bool) -> torch.Tensor:
        batch, seq_q = query.shape[:2]
        if not cross:
            layout = padding_layout(batch, seq_q, key_padding_mask, query.device)
            x_te = layout.unpad(query)
            return layout.pad(self._attend(x_te, x_te, x_te, layout, layout, causal))
        self._check_cross(causal)
        if key.ndim != 3 or key.shape[0] != batch or key.shape[:2] != value.shape[:2]:
            raise InvalidBatch(
                f"cross-attention needs key and value of shape (batch={batch}, seq_k, E), got key "
                f"{tuple(key.shape)} and value {tuple(value.shape)} (after batch_first={self.batch_first})."
            )
        layout_q = padding_layout(batch, seq_q, None, query.device)
        layout_k = padding_layout(batch, key.shape[1], key_padding_mask, query.device)
        out_te = self._attend(layout_q.unpad(query), layout_k.unpad(key), layout_k.unpad(value), layout_q, layout_k,
                              causal)
        return layout_q.pad(out_te)

    def _forward_packed(self, query, cross: bool, key_padding_mask, cu_seqlens, max_seqlen, causal: bool):
        if cross or key_padding_mask is not None:
            raise ConfigurationError(
                "packed input (cu_seqlens) supports self-attention only, without key_padding_mask: pass key=None, "
                "value=None and no key_padding_mask (padding is already absent from packed tokens)."
            )
        if query.ndim != 2 or query.shape[-1] != self.embed_dim:
            raise InvalidBatch(f"packed input must be (T, {self.embed_dim}) with cu_seqlens, got {tuple(query.shape)}.")
        if cu_seqlens.ndim != 1 or cu_seqlens.numel() < 2 or cu_seqlens.is_floating_point():
            raise InvalidBatch(
                f"cu_seqlens must be a 1D integer tensor (num_docs + 1,), got shape {tuple(cu_seqlens.shape)} "
                f"dtype {cu_seqlens.dtype}."
            )
        cu = cu_seqlens.to(device=query.device, dtype=torch.int32)
        if max_seqlen is None:
            max_seqlen = int((cu[1:] - cu[:-1]).max())  # host sync: pass max_seqlen to avoid it
        layout = VarlenBatch(1, query.shape[0], cu, int(max_seqlen), None)
        return self._attend(query, query, query, layout, layout, causal)

    def _project(self, xq_te, xk_te, xv_te) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Call the projection modules (LoRA adapters see their inputs) and split heads: (T, H, D) each."""
        kv_dim = self.num_kv_heads * self.head_dim
        if self.qkv_fused:
            q_te, k_te, v_te = self.Wqkv(xq_te).split([self.embed_dim, kv_dim, kv_dim], dim=-1)
            q_te, k_te, v_te = q_te.contiguous(), k_te.contiguous(), v_te.contiguous()  # kernels want dense heads
        else:
            q_te, k_te, v_te = self.q_proj(xq_te), self.k_proj(xk_te), self.v_proj(xv_te)
        return (
            q_te.view(q_te.shape[0], self.num_heads, self.head_dim),
            k_te.view(k_te.shape[0], self.num_kv_heads, self.head_dim),
            v_te.view(v_te.shape[0], self.num_kv_heads, self.head_dim),
        )

    def _attend(self, xq_te, xk_te, xv_te, layout_q: VarlenBatch, layout_k: VarlenBatch, causal: bool):
        """Packed tokens (T, E) in, packed (T, E) out: project, rotate, attend, project out."""
        q_thd, k_thd, v_thd = self._project(xq_te, xk_te, xv_te)
        if self.rotary:
            positions_t = positions_in_documents(layout_q.cu_seqlens, q_thd.shape[0])
            cos_td, sin_td = rotary_cos_sin(positions_t, self.head_dim, self.rotary_base)
            q_thd, k_thd = apply_rotary(q_thd, cos_td, sin_td), apply_rotary(k_thd, cos_td, sin_td)
        opts = AttnOptions(
            scale=self.head_dim**-0.5,
            causal=causal,
            dropout_p=self.dropout if self.training else 0.0,
            alibi_slopes=self.alibi_slopes.float() if self.alibi else None,
        )
        out_thd = varlen_attention(
            q_thd, k_thd, v_thd, layout_q.cu_seqlens, layout_k.cu_seqlens, layout_q.max_seqlen, layout_k.max_seqlen,
            opts, backend=self.backend,
        )
        return self.out_proj(out_thd.reshape(out_thd.shape[0], self.embed_dim))

    @classmethod
    def from_torch(cls, mha: nn.MultiheadAttention, **kwargs) -> "FlashMHA":
        """A FlashMHA with ``mha``'s weights, bias, dropout and batch_first (same outputs at real positions).

        ``kwargs`` set FlashMHA-only options (causal, qkv_fused, backend, rotary, alibi, ...); the shape comes from
        ``mha``. The copy is a conversion, done once; forward never reads weights.
        """
        fixed = sorted({"embed_dim", "num_heads", "num_kv_heads", "bias"} & kwargs.keys())
        if fixed:
            raise ConfigurationError(f"from_torch takes {fixed} from the nn.MultiheadAttention; drop them from kwargs.")
        if not mha._qkv_same_embed_dim or mha.bias_k is not None or mha.add_zero_attn:
            raise ConfigurationError(
                "FlashMHA supports kdim == vdim == embed_dim without add_bias_kv / add_zero_attn; got "
                f"kdim={mha.kdim}, vdim={mha.vdim}, embed_dim={mha.embed_dim}, add_bias_kv={mha.bias_k is not None}, "
                f"add_zero_attn={mha.add_zero_attn}. Project keys/values to embed_dim before attention."
            )
        weight = mha.in_proj_weight
        options = {"dropout": mha.dropout, "batch_first": mha.batch_first}
        options.update(device=weight.device, dtype=weight.dtype)
        options.update(kwargs)
        new = cls(mha.embed_dim, mha.num_heads, bias=mha.in_proj_bias is not None, **options)
        with torch.no_grad():
            if new.qkv_fused:
                _copy_linear(new.Wqkv, mha.in_proj_weight, mha.in_proj_bias)
            else:
                biases = (None,) * 3 if mha.in_proj_bias is None else mha.in_proj_bias.chunk(3)
                for proj, w, b in zip((new.q_proj, new.k_proj, new.v_proj), mha.in_proj_weight.chunk(3), biases):
                    _copy_linear(proj, w, b)
            _copy_linear(new.out_proj, mha.out_proj.weight, mha.out_proj.bias)
        return new

    def to_torch(self) -> nn.MultiheadAttention:
        """An ``nn.MultiheadAttention`` with these weights. Causality is not module state there: pass its
        ``attn_mask`` yourself. Needs plain MHA (no GQA, rotary or ALiBi) and plain projections (merge LoRA first)."""
        projections = [self.Wqkv] if self.qkv_fused else [self.q_proj, self.k_proj, self.v_proj]
        if self.num_kv_heads != self.num_heads or self.rotary or self.alibi:
            raise ConfigurationError(
                f"nn.MultiheadAttention cannot express num_kv_heads={self.num_kv_heads} (num_heads={self.num_heads}), "
                f"rotary={self.rotary} or alibi={self.alibi}; only plain multi-head attention converts back."
            )
        if not all(type(p) is nn.Linear for p in projections + [self.out_proj]):
            raise ConfigurationError(
                "to_torch needs plain nn.Linear projections; this module's are wrapped (e.g. by PEFT): call "
                "`merge_and_unload()` on the PEFT model first."
            )
        weight = self.out_proj.weight
        mha = nn.MultiheadAttention(
            self.embed_dim, self.num_heads, dropout=self.dropout, bias=self.out_proj.bias is not None,
            batch_first=self.batch_first, device=weight.device, dtype=weight.dtype,
        )
        with torch.no_grad():
            mha.in_proj_weight.copy_(torch.cat([p.weight for p in projections]))
            if mha.in_proj_bias is not None:
                mha.in_proj_bias.copy_(torch.cat([p.bias for p in projections]))
            _copy_linear(mha.out_proj, self.out_proj.weight, self.out_proj.bias)
        return mha


def _copy_linear(linear: nn.Linear, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
    linear.weight.copy_(weight)
    if bias is not None:
        linear.bias.copy_(bias)


def _check_config(embed_dim: int, num_heads: int, num_kv_heads: int, dropout: float, rotary: str | None) -> None:
    if embed_dim <= 0 or num_heads <= 0 or embed_dim % num_heads:
        raise ConfigurationError(f"embed_dim ({embed_dim}) must be a positive multiple of num_heads ({num_heads}).")
    if num_kv_heads <= 0 or num_heads % num_kv_heads:
        raise ConfigurationError(
            f"num_heads ({num_heads}) must be a multiple of num_kv_heads ({num_kv_heads}); use num_kv_heads=1 for "
            "multi-query, a divisor of num_heads for grouped-query attention."
        )
    if not 0.0 <= dropout < 1.0:
        raise ConfigurationError(f"dropout must be in [0, 1), got {dropout}.")
    if rotary not in (None, "rope"):
        raise ConfigurationError(f"rotary must be None or 'rope', got {rotary!r}.")
    if rotary and (embed_dim // num_heads) % 2:
        raise ConfigurationError(f"rotary needs an even head_dim, got {embed_dim // num_heads}.")
