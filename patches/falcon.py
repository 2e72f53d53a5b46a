"""Falcon family: 7B multi-query, 40B/180B new decoder architecture (grouped KV), RW (ALiBi), plain MHA.

Up to transformers 5.23 Falcon builds its mask without position_ids, so stock packed batches attend across documents;
up to 5.24 its attention takes the ALiBi tensor as an argument and does not use transformers' AttentionInterface (5.25
folds ALiBi into the mask and does). The seam here, for every version, is each ``FalconAttention`` instance's
``forward`` (never the decoder layer's, which would silently disable checkpointing): the fused ``query_key_value`` and
``dense`` projections are still called as modules (LoRA works), K/V go to the kernel as true groups (no broadcast to
every head), documents come from the collator's ``cu_seq_lens_q`` given to the model's forward, else from
position_ids, and ALiBi is passed to the kernel as slopes.

The original forward (transformers' own, eager or SDPA as configured) runs unchanged for every call the seam cannot
or need not serve: decoding steps behind a KV cache, every call with a static cache and, outside training, a forward
given a padding mask that fills a cache or hides a slot (so right-padded generation is the unpatched model's with a
dynamic, a static or no cache: ``routing.leaves_forward_to_stock``), ``output_attentions``, a 4D
mask given by the caller (a pre-hook on ``FalconModel`` notes what mask each forward was given), and evaluation calls
traced by ``torch.compile`` (so a compiled decode step traces with ``fullgraph=True`` as the unpatched model's does).
A 2D mask with holes keeps its meaning: the masked keys are hidden and nothing else changes (see ``varlen``).
"""
from __future__ import annotations

import functools
import inspect
import math
import types
from dataclasses import dataclass

import torch
from transformers.models.falcon.modeling_falcon import (
    FalconAttention,
    FalconModel,
    apply_rotary_pos_emb,
    build_alibi_tensor,
)

from hf_accel._compat import cache_kwarg
from hf_accel.attention.hf_attention import (
    BACKEND_ATTR,
    collator_metadata,
    kernel_layout,
    runs_stock,
    seam_attention,
    suspend_forward_record,
)
from hf_accel.attention.kernels import AttnOptions
from hf_accel.attention.routing import PROBABILITIES, leaves_forward_to_stock

from hf_accel.family import Family, LayerAttention, LayerBytes, affine_layer_norm, fusable_by_class

_ORIGINAL = "_hf_accel_original_forward"
_CALL = "_hf_accel_model_call"


@dataclass
class _ModelCall:
    """What the current FalconModel forward was given, shared by that model's patched attention modules."""

    mask_ndim: int | None = None  # the caller's attention_mask: None (no mask), 2 or 4
    stock_forward: bool = False  # every call of this forward runs the original (routing.leaves_forward_to_stock)


def head_shape(config) -> tuple[int, int, int]:
    heads = config.num_attention_heads
    if config.new_decoder_architecture:
        kv = config.num_kv_heads
    else:
        kv = 1 if config.multi_query else heads
    return heads, kv, config.hidden_size // heads


def training_dropout(config) -> float:
    """Falcon's attention dropout in training: on its ALiBi path always; on its rotary path from transformers 5.25 on
    (its attention-interface forward passes the config's dropout on both), none up to 5.24 (that eager / SDPA rotary
    path applied none)."""
    return float(config.attention_dropout or 0.0) if (config.alibi or not TAKES_ALIBI) else 0.0


def split_qkv(module: FalconAttention, fused_bsx: torch.Tensor):
    """Fused projection (B, S, X) -> q (B, S, Hq, D), k and v (B, S, Hkv, D), per the checkpoint's layout."""
    batch, seq, _ = fused_bsx.shape
    heads, head_dim = module.num_heads, module.head_dim
    if module.new_decoder_architecture:  # per KV group: [q ... q, k, v]
        groups = module.num_kv_heads
        qkv = fused_bsx.view(batch, seq, groups, heads // groups + 2, head_dim)
        return qkv[:, :, :, :-2].reshape(batch, seq, heads, head_dim), qkv[:, :, :, -2], qkv[:, :, :, -1]
    if module.multi_query:  # all q heads, then one k, one v
        qkv = fused_bsx.view(batch, seq, heads + 2, head_dim)
        return qkv[:, :, :heads], qkv[:, :, heads:heads + 1], qkv[:, :, heads + 1:]
    qkv = fused_bsx.view(batch, seq, heads, 3, head_dim)  # plain MHA: interleaved per head
    return qkv[..., 0, :], qkv[..., 1, :], qkv[..., 2, :]


@functools.lru_cache(maxsize=16)
def alibi_slopes(num_heads: int, head_dim: int, device: torch.device) -> torch.Tensor:
    """Per-head slopes exactly as transformers builds them (bf16-rounded), scaled as Falcon scales its bias."""
    ones = torch.ones(1, 2, device=device)
    slopes = build_alibi_tensor(ones, num_heads, torch.float32).reshape(num_heads, 2)[:, 1]
    return slopes / math.sqrt(head_dim)


def _cache_layout(module: FalconAttention, k_bshd: torch.Tensor) -> torch.Tensor:
    """K/V as the stock forward caches them: (B, H_cache, S, D); the new architecture broadcasts to every head."""
    cached_heads = module.num_heads if module.new_decoder_architecture else module.num_kv_heads
    groups = cached_heads // k_bshd.shape[2]
    return k_bshd.repeat_interleave(groups, dim=2).transpose(1, 2) if groups > 1 else k_bshd.transpose(1, 2)


def _dropout_p(module: FalconAttention) -> float:
    """The attention dropout: an nn.Dropout up to transformers 5.24, the config's float from 5.25 on."""
    dropout = module.attention_dropout
    return float(dropout.p if isinstance(dropout, torch.nn.Dropout) else dropout)


@torch.compiler.disable  # compiled layers break here, as at hf_accel_attention (the slopes memo stays eager)
def _attend(self: FalconAttention, q, k, v, attention_mask, position_ids, with_alibi: bool) -> torch.Tensor:
    opts = AttnOptions(
        scale=self.inv_norm_factor,
        causal=True,
        dropout_p=_dropout_p(self) if (self.training and (with_alibi or not TAKES_ALIBI)) else 0.0,
        alibi_slopes=alibi_slopes(self.num_heads, self.head_dim, q.device) if with_alibi else None,
    )
    # Falcon's decoder layers pass no keyword arguments down: the collator's metadata comes from the model's forward.
    # With it, or with no padding mask given to the model, Falcon's 4D mask only restates causality, ALiBi (which goes
    # to the kernel as slopes) and, from transformers 5.24 on, packing by position_ids (which the seam takes from
    # cu_seq_lens or position_ids itself), so it is not read back.
    cu_seq_lens, max_length = collator_metadata(position_ids)
    if cu_seq_lens is not None or self.__dict__[_CALL].mask_ndim is None:
        attention_mask = None
    return seam_attention(self, q, k, v, attention_mask=attention_mask, position_ids=position_ids, opts=opts,
                          cu_seq_lens=cu_seq_lens, max_length=max_length)


def _runs_stock(self: FalconAttention, layer_past, output_attentions: bool) -> bool:
    """Whether this call runs the original forward; decided without reading tensor data (no host sync, and a
    compiled decode step stays one graph)."""
    call = self.__dict__[_CALL]
    if output_attentions or call.mask_ndim == 4 or call.stock_forward or runs_stock(self):
        return True
    if layer_past is None:
        return False
    if getattr(layer_past, "is_compileable", False):  # a static cache: its length is tensor data
        return True
    return layer_past.get_seq_length(self.layer_idx) > 0  # a dynamic cache's length is a Python int


# transformers 5.17-5.24 hand FalconAttention the ALiBi tensor as an argument of its own; 5.25 folds it into the
# attention mask (the model's config says whether the model has ALiBi) and routes the stock call through
# transformers' attention interface.
TAKES_ALIBI = "alibi" in inspect.signature(FalconAttention.forward).parameters


def _seam_forward(self: FalconAttention, hidden_states, attention_mask, position_ids, layer_past, position_embeddings,
                  with_alibi: bool):
    q, k, v = split_qkv(self, self.query_key_value(hidden_states))
    if not with_alibi:
        cos, sin = position_embeddings
        q, k = apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=2)
    if layer_past is not None:  # a prefill that starts a cache: store it the way the stock decode steps read it
        layer_past.update(_cache_layout(self, k), _cache_layout(self, v), self.layer_idx)
    if torch.compiler.is_compiling():  # a compiled layer's training call: lay q/k/v out before the graph break
        q, k, v = (kernel_layout(t) for t in (q, k, v))
    out = _attend(self, q, k, v, attention_mask, position_ids, with_alibi=with_alibi)
    return self.dense(out.reshape(*out.shape[:2], -1)), None


def patched_forward(
    self: FalconAttention, hidden_states, attention_mask, position_ids=None, layer_past=None, use_cache=False,
    output_attentions=False, position_embeddings=None, **kwargs,
):
    """transformers 5.25 on."""
    if _runs_stock(self, layer_past, output_attentions):
        return getattr(self, _ORIGINAL)(
            hidden_states, attention_mask, position_ids=position_ids, layer_past=layer_past, use_cache=use_cache,
            output_attentions=output_attentions, position_embeddings=position_embeddings, **kwargs,
        )
    return _seam_forward(self, hidden_states, attention_mask, position_ids, layer_past, position_embeddings,
                         with_alibi=bool(self.config.alibi))


def patched_forward_taking_alibi(
    self: FalconAttention, hidden_states, alibi, attention_mask, position_ids=None, layer_past=None,
    use_cache=False, output_attentions=False, position_embeddings=None, **kwargs,
):
    """transformers 5.17-5.24."""
    if _runs_stock(self, layer_past, output_attentions):
        return getattr(self, _ORIGINAL)(
            hidden_states, alibi, attention_mask, position_ids=position_ids, layer_past=layer_past,
            use_cache=use_cache, output_attentions=output_attentions, position_embeddings=position_embeddings,
            **kwargs,
        )
    return _seam_forward(self, hidden_states, attention_mask, position_ids, layer_past, position_embeddings,
                         with_alibi=alibi is not None)


def _probabilities_call(falcon: FalconModel):
    """Set up a call returning attention probabilities (every attention call then runs the original forward), and
    return its undo: transformers' mask preparation looks for packed documents itself, as unpatched. From transformers
    5.25 on the original forward reaches transformers' attention interface, whose SDPA returns no probabilities:
    eager attention serves the call, mask included, as for every other family (``routing.routing_hooks``)."""
    resume = suspend_forward_record()
    if TAKES_ALIBI:  # up to 5.24 the original forward computes the probabilities with the configured math
        return resume
    config, reported = falcon.config, falcon.config._attn_implementation
    config._attn_implementation_internal = PROBABILITIES

    def undo():
        config._attn_implementation_internal = reported
        resume()

    return undo


def _call_hooks(falcon: FalconModel) -> list:
    """Note what mask each FalconModel forward is given and whether it runs stock; a call returning attention
    probabilities (all stock) gets transformers' own packed-document search in its mask preparation. The hooks read
    the record from the module they run on (a deep copy of the patched model shares its record with its own attention
    modules only)."""
    resumes = []  # one entry per call in flight (calls nest)

    def before(module, args, kwargs):
        mask = kwargs["attention_mask"] if "attention_mask" in kwargs else (args[2] if len(args) > 2 else None)
        cache = cache_kwarg(kwargs, args[1] if len(args) > 1 else None)
        call = module.__dict__[_CALL]
        call.mask_ndim = None if mask is None else mask.ndim
        call.stock_forward = not torch.compiler.is_compiling() and leaves_forward_to_stock(
            module, mask, cache, kwargs.get("use_cache"))
        wanted = kwargs.get("output_attentions")
        wanted = module.config.output_attentions if wanted is None else wanted
        resumes.append(_probabilities_call(module) if wanted and not torch.compiler.is_compiling() else None)

    def after(module, args, kwargs, output):
        resume = resumes.pop() if resumes else None
        if resume is not None:
            resume()

    return [
        falcon.register_forward_pre_hook(before, with_kwargs=True).remove,
        falcon.register_forward_hook(after, with_kwargs=True, always_call=True).remove,
    ]


def apply(model, backend: str):
    names, undo = [], []
    for prefix, falcon in [(n, m) for n, m in model.named_modules() if isinstance(m, FalconModel)]:
        call = falcon.__dict__[_CALL] = _ModelCall()
        undo += _call_hooks(falcon)
        undo.append(lambda m=falcon: m.__dict__.pop(_CALL, None))
        for name, module in falcon.named_modules():
            if isinstance(module, FalconAttention):
                module.__dict__[_ORIGINAL] = module.forward
                module.__dict__[_CALL] = call
                module.forward = types.MethodType(
                    patched_forward_taking_alibi if TAKES_ALIBI else patched_forward, module)
                setattr(module, BACKEND_ATTR, backend)
                names.append(f"{prefix}.{name}" if prefix else name)
                undo.append(lambda m=module: [m.__dict__.pop(a, None)
                                              for a in ("forward", _ORIGINAL, _CALL, BACKEND_ATTR)])
    return names, undo


def mlp_width(config) -> int:
    """Falcon's MLP width: ffn_hidden_size, 4 x hidden_size by default."""
    return getattr(config, "ffn_hidden_size", None) or 4 * config.hidden_size


def layer_bytes(config, b: int) -> LayerBytes:
    """One or two LayerNorms (the new architecture's two parallel ones, or the sequential layout's), the fused qkv
    (true KV groups), attention output and log-sum-exp, the GELU MLP."""
    h = config.hidden_size
    heads, kv, d = head_shape(config)
    i = mlp_width(config)
    lse = 4 * heads
    n_ln = 2 if (config.new_decoder_architecture and getattr(config, "num_ln_in_parallel_attn", 2) == 2) or \
        not config.parallel_attn else 1
    sequential = 0 if config.parallel_attn or config.new_decoder_architecture else h * b
    mlp = 2 * i * b  # the up projection's output and its GELU
    none = h * b + n_ln * (8 + h * b) + sequential + (2 * heads * d + 2 * kv * d) * b + lse + mlp
    op = h * b + ((heads + 2 * kv) * d + heads * d + h + i + h) * b + lse
    return LayerBytes(none, op, h * b, mlp)


def output_projections(config) -> tuple[str, ...]:
    """The MLP's output projection only joins the residual stream (added to the attention's output first in the
    parallel layouts); with parallel attention the attention's ``dense`` too (sequential: it feeds the second
    LayerNorm)."""
    parallel = config.new_decoder_architecture or config.parallel_attn
    return ("self_attention.dense", "mlp.dense_4h_to_h") if parallel else ("mlp.dense_4h_to_h",)


FAMILY = Family(
    name="falcon",
    model_types=("falcon",),
    seam="instance_forward",
    touches="FalconAttention.forward (instance-bound)",
    attentions=("the attention module's original forward for that call (transformers' own probabilities; eager "
                "attention from transformers 5.25 on, where SDPA returns none)"),
    lora_targets=("query_key_value", "dense", "dense_h_to_4h", "dense_4h_to_h"),
    apply=apply,
    head_shape=head_shape,
    mlp_width=mlp_width,
    layer_bytes=layer_bytes,
    fusable=fusable_by_class(affine_layer_norm),
    training_dropout=training_dropout,
    layer_attention=lambda config, layer_idx: LayerAttention(alibi=bool(config.alibi)),
    stock_packing=False,  # stock Falcon builds its mask without position_ids: packed documents attend to each other
    output_projections=output_projections,
)
