"""Model FLOPs for MFU, trainable-aware, counted on real (non-pad) tokens and real documents only.

Per optimizer step, with T real tokens in documents of lengths n_d, of which T_target have a target (a label that
is not -100 after the causal shift):
    FLOPs = (6 * P_trainable + 4 * P_frozen) * T  -  (6 * H_trainable + 4 * H_frozen) * (T - T_target)
            +  6 * L * d_attn * sum_d n_d^2
- P_*: weights of every matmul (each nn.Linear, so LoRA A/B and a tied lm_head count; embeddings lookups do not;
  a 4-bit Linear4bit counts its in x out weights, not its packed storage). MoE experts count their active weights
  (top_k of E experts a token; their PEFT adapters likewise): MFU on active parameters.
  A weight costs 2 FLOPs/token forward, 2 for the input gradient, and 2 more for its own gradient if trainable.
- H_*: the LM head's share of P_* (its nn.Linear layers, LoRA's included). The head is counted on target tokens
  only: a masked position (a prompt token, a document's first token) needs no logits, so its head work is not model
  work, whatever a configuration spends on it. Without masks (T_target = T) this is the plain formula.
- attention: per layer, causal QK^T and PV cost 2 * 2 * d_attn * n^2 / 2 forward, x3 for forward+backward.
  d_attn = num_attention_heads * head_dim of that layer (query width; GQA does not reduce score FLOPs; Gemma 4's
  global layers have heads twice as wide as its sliding ones). A sliding-window layer counts the pairs its window
  lets through, a chunked layer (Llama 4) those within its chunks (``attended``); a layer without attention
  (Qwen3.5's Gated DeltaNet, Mamba-2) counts its projections only (its recurrence is not counted).
Recomputation by gradient checkpointing is not counted (MFU, not hardware FLOPs utilisation); padding is not
counted either, so padded configurations are charged only for useful work.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Mapping

import torch
from torch import nn

# bf16 dense tensor-core peak (no sparsity), from NVIDIA's H100/H200 SXM data sheets.
PEAK_BF16_FLOPS = {"H100": 989.4e12, "H200": 989.4e12, "A100": 312e12}


@dataclass(frozen=True)
class FlopModel:
    trainable_matmul_params: float  # per token (MoE experts: their active share)
    frozen_matmul_params: float
    num_layers: int  # decoder layers whose attention sees every earlier token of its document
    attn_width: float  # their num_attention_heads * head_dim, the mean over them
    head_trainable_params: float = 0  # of the above, the LM head's (counted on target tokens only)
    head_frozen_params: float = 0
    # layers whose attention sees less: (query width, window, chunk) each (a sliding window of `window` keys, itself
    # included; chunks of `chunk` tokens). Layers without attention (linear-attention, Mamba) are in neither.
    local_layers: tuple[tuple[float, int | None, int | None], ...] = ()

    @property
    def spans(self) -> tuple[tuple[int | None, int | None], ...]:
        """The distinct (window, chunk) of the local layers: what a caller of ``flops_from_sums`` sums per span."""
        return tuple(dict.fromkeys((window, chunk) for _, window, chunk in self.local_layers))

    @classmethod
    def from_model(cls, model: nn.Module) -> "FlopModel":
        from ..patches.experts import experts_shapes

        counts = {True: [0, 0], False: [0, 0]}  # requires_grad -> [all matmul weights, the head's]
        get_head = getattr(model, "get_output_embeddings", None)
        head = get_head() if callable(get_head) else None
        in_head = {id(m) for m in head.modules()} if head is not None else set()
        modules = dict(model.named_modules())
        # MoE experts (3-D weights, no nn.Linear): a token runs through top_k of the E experts, and so through top_k / E
        # of their PEFT adapters (whose nn.Linear stacks every expert's rank-r factors)
        routed: dict[str, float] = {}
        for shape in experts_shapes(model):
            experts = modules[shape.path]
            weights = shape.top_k * (shape.hidden * shape.up_width + shape.intermediate * shape.hidden)  # no biases
            counts[any(p.requires_grad for p in experts.parameters(recurse=False))][0] += weights
            place = shape.path.split(".base_layer")[0]
            routed[place + "."] = shape.top_k / shape.num_experts
            # the router beside them: a (E, H) weight applied as a linear, in a module of its own class
            block = modules[place.rsplit(".", 1)[0]]
            for router in block.children():
                weight = getattr(router, "weight", None)
                if not isinstance(router, nn.Linear) and isinstance(weight, nn.Parameter) and \
                        tuple(weight.shape) == (shape.num_experts, shape.hidden):
                    counts[weight.requires_grad][0] += weight.numel()
        for name, module in modules.items():
            if isinstance(module, nn.Linear):
                # the matmul's size, not its storage's: a bitsandbytes Linear4bit packs two weights a byte
                weights = module.in_features * module.out_features
                share = next((r for prefix, r in routed.items() if name.startswith(prefix)), None)
                if share is not None:
                    weights = weights * share
                count = counts[module.weight.requires_grad]
                count[0] += weights
                count[1] += weights if id(module) in in_head else 0
        layers = attention_layers(model)
        full = [width for width, window, chunk in layers if not window and not chunk]
        local = tuple(layer for layer in layers if layer[1] or layer[2])
        return cls(counts[True][0], counts[False][0], len(full), sum(full) / len(full) if full else 0.0,
                   counts[True][1], counts[False][1], local)

    def step_flops(self, doc_lengths: Iterable[int], targets: int | None = None) -> float:
        """Model FLOPs of one optimizer step (forward + backward) over documents of these real lengths, `targets` of
        their tokens with a target (None: every token)."""
        lengths = [int(n) for n in doc_lengths]
        spans = {span: sum(attended(n, *span) for n in lengths) for span in self.spans}
        return float(self.flops_from_sums(sum(lengths), sum(n * n for n in lengths), targets, spans))

    def flops_from_sums(self, tokens, squared_lengths, targets=None, span_sums=None):
        """The same from the real token count, the sum of squared document lengths, the target count and, per span of
        ``spans``, the sum of ``attended`` over the documents (numbers or tensors: a training loop can accumulate them
        on the GPU and read them back when it logs). Without ``span_sums`` the local layers count as full ones (an
        upper bound)."""
        dense = (6 * self.trainable_matmul_params + 4 * self.frozen_matmul_params) * tokens
        if targets is not None:  # no LM-head work for a token without a target
            dense = dense - (6 * self.head_trainable_params + 4 * self.head_frozen_params) * (tokens - targets)
        attention = 6 * self.num_layers * self.attn_width * squared_lengths
        for width, window, chunk in self.local_layers:
            attention = attention + 6 * width * (squared_lengths if span_sums is None else span_sums[window, chunk])
        return dense + attention


def attended(n, window: int | None = None, chunk: int | None = None):
    """Twice the (query, key) pairs a causal document of ``n`` tokens attends, less n (n^2 without a window or
    chunk, the full formula's term): the sum over its positions p of 2 * min(p, window - 1) + 1, or of
    2 * (p mod chunk) + 1. ``n``: a number or a tensor of lengths."""
    if chunk:
        return (n // chunk) * chunk * chunk + (n % chunk) ** 2
    if not window:
        return n * n
    if isinstance(n, torch.Tensor):
        return torch.where(n <= window, n * n, window * window + (n - window) * (2 * window - 1))
    return n * n if n <= window else window * window + (n - window) * (2 * window - 1)


def attended_at(positions: torch.Tensor, window: int | None = None, chunk: int | None = None) -> torch.Tensor:
    """``attended`` per token from its position in its document (summed over a document's positions, the same)."""
    if chunk:
        return 2 * (positions % chunk) + 1
    if not window:
        return 2 * positions + 1
    return 2 * positions.clamp(max=window - 1) + 1


def attention_layers(model: nn.Module) -> list[tuple[float, int | None, int | None]]:
    """(query width, window, chunk) of each decoder layer with attention, as hf_accel's family of the model reads
    them (per-layer heads, sliding windows, chunks; hybrid models' linear-attention layers have none); the config's
    widths for a model hf_accel has no family for."""
    from ..errors import UnsupportedModel
    from ..patches import family_of

    config = model.config
    try:
        family = family_of(model)
    except UnsupportedModel:
        return [(float(width), None, None) for width in query_widths(config)]
    first = family.head_shape(config)
    layers = []
    for attention in family.layer_attentions(config).values():
        heads, _, head_dim = attention.heads or first
        layers.append((float(heads * head_dim), attention.window, attention.chunk))
    return layers


def query_widths(config) -> list[int]:
    """Each decoder layer's query width (heads x head_dim). transformers 5.25 keeps what varies by layer in
    ``config.per_layer_config`` (Gemma 4: reading ``config.head_dim`` there raises); 5.17 has one global value."""
    per_layer = getattr(config, "per_layer_config", None)
    layers = ([per_layer[i] for i in range(config.num_hidden_layers)] if per_layer is not None
              else [config] * config.num_hidden_layers)
    return [c.num_attention_heads * (getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads)
            for c in layers]


def peak_flops(device_name: str | None) -> float | None:
    """bf16 dense peak of a known GPU (by name), else None (MFU is then not reported)."""
    for key, value in PEAK_BF16_FLOPS.items():
        if device_name and key in device_name:
            return value
    return None


def doc_lengths_from_batch(batch: Mapping[str, torch.Tensor]) -> list[int]:
    """Real document lengths of a padded (attention_mask) or packed (cu_seq_lens / position_ids) batch.

    Packed rows' padding tails (labels all -100 and position_ids restarting) are indistinguishable from a real
    document here, so collators used with this function must not add one (one row per step, no pad_to_multiple_of).
    """
    if "attention_mask" in batch and batch["attention_mask"] is not None:
        return [int(n) for n in batch["attention_mask"].sum(dim=1).tolist() if n > 0]
    if "cu_seq_lens_q" in batch:
        return [int(n) for n in batch["cu_seq_lens_q"].diff().tolist() if n > 0]
    if "position_ids" in batch:
        lengths: list[int] = []
        for row in batch["position_ids"].tolist():
            starts = [i for i, p in enumerate(row) if p == 0] + [len(row)]
            lengths += [b - a for a, b in zip(starts, starts[1:]) if b > a]
        return lengths
    return [int(batch["input_ids"].shape[1])] * int(batch["input_ids"].shape[0])
