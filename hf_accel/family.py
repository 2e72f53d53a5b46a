"""What hf_accel knows about a model family, as one typed object: ``Family``.

For a model whose attention goes through transformers' ``AttentionInterface`` the object is found from the model
itself (``hf_accel.facts``: its attention calls, what its layers save, which modules liger may fuse); a module in
``patches/`` types one only where a model needs more than the generic seam (Falcon's own attention). Everything that
depends on a family asks this object (the memory estimate, fused ops, MLP chunking, the Trainers, the attention
request of ``patch()``); nothing reads ``config.model_type`` to decide.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal

from torch import nn

Undo = Callable[[], None]
ApplyFn = Callable[[nn.Module, str], tuple[list[str], list[Undo]]]
# Where a family's attention is replaced: transformers' AttentionInterface under hf_accel's own name (this model's
# forwards only), or each attention instance's forward (families outside the registry)
Seam = Literal["attention_interface", "instance_forward"]
# What liger-kernel can fuse, per module (hf_accel.fused.ops binds each kind): Llama-style RMSNorm (x.to(dtype) * w),
# Gemma's RMSNorm ((x * (1 + w)).to(dtype): liger's offset=1, casting_mode "gemma"), an RMSNorm weighting in fp32
# ((x * w).to(dtype): offset 0, casting_mode "gemma"), a SiLU-gated MLP (SwiGLU), a tanh-GELU-gated MLP (GEGLU) and
# an affine nn.LayerNorm. hf_accel.facts finds each module's kind from what it computes.
FusableKind = Literal["rms_norm", "rms_norm_gemma", "rms_norm_fp32", "swiglu", "geglu", "layer_norm"]


@dataclass(frozen=True)
class LayerAttention:
    """What one decoder layer's attention asks of a kernel beyond causal softmax attention. ``heads``: (query heads,
    key/value heads, head_dim) where the layer's differ from the model's first layer (Gemma 4's global layers), else
    None; ``stock``: why every call of the layer runs transformers' own attention (it passes something no hf_accel
    kernel expresses), else None."""

    window: int | None = None  # tokens a query sees, itself included (transformers' sliding_window); None: all
    softcap: float | None = None  # scores become softcap * tanh(scores / softcap) before the softmax
    alibi: bool = False  # a per-head linear position bias (the kernel gets the slopes)
    sinks: bool = False  # a learned per-head logit in every softmax's denominator (gpt-oss's s_aux)
    chunk: int | None = None  # a query sees keys of its own chunk of this many positions only (Llama 4)
    heads: tuple[int, int, int] | None = None
    stock: str | None = None

    def describe(self) -> str:
        parts = [f"sliding window {self.window}" if self.window else "",
                 f"softcap {self.softcap:g}" if self.softcap else "", "ALiBi" if self.alibi else "",
                 "attention sinks" if self.sinks else "", f"chunks of {self.chunk}" if self.chunk else "",
                 f"head_dim {self.heads[2]}" if self.heads else "", f"stock ({self.stock})" if self.stock else ""]
        return ", ".join(p for p in parts if p) or "causal"


@dataclass(frozen=True)
class LayerBytes:
    """Bytes per token one decoder layer keeps for backward: no checkpointing, op-level (matmul and attention outputs
    kept, the rest recomputed), full (its input only). Flash-style attention (no seq x seq tensor). ``mlp``: the
    part of ``none`` that is the MLP's intermediates (the tensors inside the MLP, not its input), which a chunked MLP
    (``memory.mlp_chunks``) holds for one chunk only."""

    none: int
    op: int
    full: int
    mlp: int


def _no_extras(config: Any, layer_idx: int) -> LayerAttention:
    return LayerAttention()


def _no_softcap(config: Any) -> float | None:
    return None


def _no_output_projections(config: Any) -> tuple[str, ...]:
    return ()


def config_dropout(config: Any) -> float:
    """Attention dropout in training: transformers passes config.attention_dropout to the kernel."""
    return float(getattr(config, "attention_dropout", 0.0) or 0.0)


@dataclass(frozen=True)
class Family:
    """Every fact hf_accel needs about one model family. Functions take the transformers config (or model)."""

    name: str
    model_types: tuple[str, ...]  # transformers config.model_type strings this family serves
    seam: Seam
    touches: str  # one line: which modules, which seam (the PatchReport shows it)
    attentions: str  # what serves a call that asks for attention probabilities (output_attentions=True)
    lora_targets: tuple[str, ...]  # projection module names PEFT's LoRA targets
    apply: ApplyFn  # (model, backend) -> (patched module names, undo actions)
    head_shape: Callable[[Any], tuple[int, int, int]]  # config -> (query heads, kv heads, head_dim)
    # config -> the MLP's hidden width (memory.mlp_chunks sizes chunks by it); None: no MLP to chunk (experts)
    mlp_width: Callable[[Any], int | None]
    layer_bytes: Callable[[Any, int], LayerBytes]  # (config, activation bytes per element) -> per token, one layer
    fusable: Callable[[nn.Module], list[tuple[str, nn.Module, FusableKind]]]  # model -> what liger can fuse
    training_dropout: Callable[[Any], float] = config_dropout
    layer_attention: Callable[[Any, int], LayerAttention] = _no_extras  # (config, layer index) -> its needs
    final_logit_softcap: Callable[[Any], float | None] = _no_softcap  # config -> cap on the LM head's logits
    # stock transformers keeps packed documents apart by restarting position_ids (its eager / sdpa / flash paths)
    stock_packing: bool = True
    # the attn_implementation to build the unpatched reference with (transformers refuses SDPA for Gemma 2)
    reference_attention: str = "sdpa"
    # config -> paths (inside a decoder layer) of the projections whose output nothing but the layer's output reads
    # (residual adds, dropout): a checkpointed layer's recompute may skip their matmuls (hf_accel.memory.trim).
    # Never list one whose output a norm, a product or the next projection reads (Gemma's post-MLP norm).
    output_projections: Callable[[Any], tuple[str, ...]] = _no_output_projections
    notes: tuple[str, ...] = field(default_factory=tuple)  # what the PatchReport adds for every model of the family
    # config -> {decoder layer index: its LayerAttention} for the layers that have attention (a hybrid model's
    # linear-attention layers have none); None: every layer, from layer_attention
    attention_layers: Callable[[Any], dict[int, LayerAttention]] | None = None

    def layer_attentions(self, config: Any) -> dict[int, LayerAttention]:
        """{decoder layer index: LayerAttention} of each layer with attention, in order."""
        if self.attention_layers is not None:
            return self.attention_layers(config)
        return {i: self.layer_attention(config, i) for i in range(config.num_hidden_layers)}


def fusable_by_class(kinds: Callable[[nn.Module], FusableKind | None]
                     ) -> Callable[[nn.Module], list[tuple[str, nn.Module, FusableKind]]]:
    """A ``Family.fusable`` from ``kinds(module)``: the kind liger can fuse this module as, or None."""

    def fusable(model: nn.Module) -> list[tuple[str, nn.Module, FusableKind]]:
        found = []
        for name, module in model.named_modules():
            kind = kinds(module)
            if kind is not None:
                found.append((name, module, kind))
        return found

    return fusable


def affine_layer_norm(module: nn.Module) -> FusableKind | None:
    return "layer_norm" if isinstance(module, nn.LayerNorm) and module.elementwise_affine else None


SILU = ("silu", "swish")
GELU_TANH = ("gelu_pytorch_tanh",)  # liger's GEGLU computes the tanh approximation only


def sliding_layers(config: Any, layer_idx: int) -> int | None:
    """The window of layer ``layer_idx`` where ``config.layer_types`` marks it "sliding_attention", else None."""
    layer_types = getattr(config, "layer_types", None)
    if layer_types is None or layer_types[layer_idx] != "sliding_attention":
        return None
    return config.sliding_window
