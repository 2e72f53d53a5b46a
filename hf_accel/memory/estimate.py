"""Training memory: fixed costs (weights, gradients, optimizer states, logits/loss) and an offline estimate.

- `estimate_training_memory(config_or_path, ...)`: parameters, gradients, optimizer states, activations per decoder
  layer (the family's formula: ``hf_accel.patches``' ``Family.layer_bytes``, the one import of the family registry
  outside patch()), logits/loss and the peak, without allocating the model (accelerate's
  `init_empty_weights`) and without the hub.
- The training state's bytes (weights, gradients, optimizer states, a sharding's share) live in `state`
  (re-exported here); the activation probe and the budget planner in `plan` / `planner`.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Sequence

import torch
from torch import nn

from . import chunks, mlp_chunks as mlp_chunking
from .plan import LayerActivation, format_bytes, plan_checkpointing, plan_peak_bytes
from .state import (Sharding, _optimizer_state_bytes, gradient_bytes, sharded_state_bytes,  # noqa: F401 (re-exported)
                    training_state_bytes)
from ..errors import ConfigurationError

DTYPE_BYTES = {"fp32": 4, "float32": 4, "bf16": 2, "bfloat16": 2, "fp16": 2, "float16": 2}


# ----------------------------------------------------------------------------------------------- fixed costs
def loss_bytes(tokens: int, vocab_size: int, dtype_bytes: int) -> int:
    """Logits, their fp32 copy for the loss (when not fp32) and log-softmax, all (tokens, vocab)."""
    return tokens * vocab_size * (dtype_bytes + (4 if dtype_bytes < 4 else 0) + 4)


# The fused loss's work per element of one chunk's logits, in bytes: the logits, their fp32 copy, softmax and
# gradient as torch computes them (measured by the probe on CPU: 16 in fp32, 18 in bf16); CUDA's Triton kernel writes
# the gradient in place, so this bounds it.
FUSED_CHUNK_ELEMENT_BYTES = 19


def fused_loss_bytes(tokens: int, vocab_size: int, hidden_size: int, compute_bytes: int, hidden_bytes: int,
                     head_cast_bytes: int = 0) -> int:
    """patch()'s fused loss (hf_accel.fused.cross_entropy): one chunk of logits at a time
    (``chunks.auto_chunk_size``: about 512 MiB of them) and its work, the hidden states' gradient made in the forward
    (in the compute dtype, then in the hidden states' own when they differ), and the head cast to the compute dtype
    when it is stored wider (``head_cast_bytes``: a 4-bit base's fp32 head under bf16 autocast). Not linear in tokens:
    the chunk stays."""
    chunk = chunks.auto_chunk_size(tokens, vocab_size, compute_bytes) if tokens else 0
    grad_hidden = tokens * hidden_size * (compute_bytes + (hidden_bytes if hidden_bytes != compute_bytes else 0))
    return chunk * vocab_size * FUSED_CHUNK_ELEMENT_BYTES + grad_hidden + head_cast_bytes


# ----------------------------------------------------------------------------------------------- offline estimate
def _known_shapes() -> dict:
    from transformers import FalconConfig, Gemma2Config, GPTNeoXConfig, LlamaConfig, MistralConfig, Qwen3Config

    return {  # the published architectures' shapes, built in code (no hub)
        "llama-3.2-1b": lambda: LlamaConfig(vocab_size=128256, hidden_size=2048, intermediate_size=8192,
                                            num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8,
                                            tie_word_embeddings=True),
        "llama-3-8b": lambda: LlamaConfig(vocab_size=128256, hidden_size=4096, intermediate_size=14336,
                                          num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8),
        "pythia-1.4b": lambda: GPTNeoXConfig(vocab_size=50304, hidden_size=2048, intermediate_size=8192,
                                             num_hidden_layers=24, num_attention_heads=16, rotary_pct=0.25),
        "falcon-1b": lambda: FalconConfig(vocab_size=50304, hidden_size=2048, num_hidden_layers=24,
                                          num_attention_heads=32, alibi=True, bias=True, parallel_attn=False,
                                          multi_query=False, new_decoder_architecture=False),
        "qwen3-8b": lambda: Qwen3Config(vocab_size=151936, hidden_size=4096, intermediate_size=12288,
                                        num_hidden_layers=36, num_attention_heads=32, num_key_value_heads=8,
                                        head_dim=128, tie_word_embeddings=False),
        "mistral-7b": lambda: MistralConfig(vocab_size=32000, hidden_size=4096, intermediate_size=14336,
                                            num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
                                            sliding_window=4096),
        "gemma-2-9b": lambda: Gemma2Config(vocab_size=256000, hidden_size=3584, intermediate_size=14336,
                                           num_hidden_layers=42, num_attention_heads=16, num_key_value_heads=8,
                                           head_dim=256, query_pre_attn_scalar=256, sliding_window=4096,
                                           attn_logit_softcapping=50.0, final_logit_softcapping=30.0),
    }


KNOWN_SHAPES = ("llama-3.2-1b", "llama-3-8b", "pythia-1.4b", "falcon-1b", "qwen3-8b", "mistral-7b", "gemma-2-9b")


def load_config(config_or_path):
    """A config object, a known shape name (KNOWN_SHAPES) or a local directory holding config.json."""
    from pathlib import Path

    from transformers import AutoConfig, PretrainedConfig

    if isinstance(config_or_path, PretrainedConfig):
        return config_or_path
    shapes = _known_shapes()
    if str(config_or_path).lower() in shapes:
        return shapes[str(config_or_path).lower()]()
    if Path(config_or_path).is_dir():
        return AutoConfig.from_pretrained(config_or_path, local_files_only=True)
    raise ConfigurationError(
        f"cannot load a config from {config_or_path!r}: pass a transformers config, a local directory with "
        f"config.json, or one of {list(KNOWN_SHAPES)}."
    )


def _family(config):
    """The model family's facts (hf_accel.patches): its LoRA targets and per-layer activation formula."""
    from ..patches import family_of

    return family_of(config)


def _layer_bytes(config, b: int, lora_rank: int | None, adapted, experts: tuple = (),
                 lora_experts: bool = False) -> tuple[LayerActivation, int]:
    """Per-token bytes one decoder layer keeps (flash-style attention: no seq x seq tensor; GQA not repeated), as the
    family counts what autograd saves in its layers (``Family.layer_bytes``), with what each LoRA-adapted linear
    saves (its input cast to fp32 under a half dtype, the rank-r A output); and of the 'none' figure, the part
    inside the MLP (its intermediates, the adapted MLP linears' saves), which a chunked MLP holds for one chunk.
    ``experts``: the layer's MoE experts modules (``ExpertsShape``), whose share the family measured with trainable
    weights: under LoRA they are frozen (no weight inputs kept) unless ``lora_experts`` puts adapters on them."""
    per_token = _family(config).layer_bytes(config, b)

    def lora_saves(count: int, in_features: int) -> int:
        return in_features * (4 if b < 4 else 0) + count * (lora_rank or 0) * 4

    outside, inside = (lora_saves(*counts) for counts in adapted)
    none_extra, op_extra = _experts_extra(experts, b, lora_rank, lora_experts)
    extra = outside + inside
    return (LayerActivation(per_token.none + extra + none_extra, per_token.op + extra + op_extra, per_token.full),
            per_token.mlp + inside)


def _experts_extra(experts: tuple, b: int, lora_rank: int | None, lora_experts: bool) -> tuple[int, int]:
    """(none, op) bytes per token the experts keep beyond what the family measured (trainable experts, no LoRA):
    frozen experts keep no weight inputs; LoRA on them keeps the rank-r products, and op-level checkpointing their
    outputs (the low-rank path's two grouped GEMMs per projection)."""
    none = op = 0
    for shape in experts:
        ours = shape.saved_bytes_per_token(b, lora_rank=(lora_rank or 0) if lora_experts else 0,
                                           trainable=not lora_rank)
        none += ours - shape.saved_bytes_per_token(b, trainable=True)
        if lora_experts:
            op += shape.top_k * (2 * lora_rank + shape.up_width + shape.hidden) * b
    return none, op


def _layer_at(per_token: LayerActivation, mlp_per_token: int, grads_per_token: int, chunking,
              tokens: int) -> LayerActivation:
    """One decoder layer's bytes over a micro-batch of `tokens`: the per-token figures times the tokens, except where
    patch()'s MLP chunking (``chunking``: a ``mlp_chunks.MlpChunking``, or None) runs this length in chunks: then the
    'none' figure keeps no MLP intermediates and the layer's backward rebuilds one chunk's at a time. The backward
    also holds the gradients of the layer's input and output (`grads_per_token`, every token's) and, unchunked,
    those of every token's MLP intermediates (counted as large as the intermediates: an upper bound of what the
    probe measures)."""
    chunk = chunking.chunk_at(tokens) if chunking is not None else 0
    none = per_token.none_bytes - (mlp_per_token if chunk else 0)
    return LayerActivation(none * tokens, per_token.op_bytes * tokens, per_token.full_bytes * tokens,
                           backward_bytes=mlp_per_token * (chunk or tokens) + grads_per_token * tokens)


@dataclass(frozen=True)
class MemoryEstimate:
    """Predicted training memory in bytes (see `table()`)."""

    config_name: str
    params: int
    trainable_params: int
    param_bytes: int
    grad_bytes: int
    optimizer_bytes: int
    layer: LayerActivation  # one decoder layer, whole batch
    choices: tuple[str, ...]
    activation_bytes: int  # all decoder layers as checkpointed by `choices`
    loss_bytes: int
    peak_bytes: int
    notes: tuple[str, ...] = field(default=())
    host_bytes: int = 0  # offloaded layers' inputs in pinned host memory
    loss_label: str = "logits + loss"  # the loss_bytes row: the fused loss's or the full logits'

    def table(self) -> str:
        counts = ", ".join(f"{self.choices.count(c)} {c}" for c in ("none", "op", "full", "offload", "spaced")
                           if c in self.choices)
        rows = [("parameters", f"{self.params:,} ({self.trainable_params:,} trainable)"),
                ("weights", format_bytes(self.param_bytes)), ("gradients", format_bytes(self.grad_bytes)),
                ("optimizer states", format_bytes(self.optimizer_bytes)),
                ("activations / layer (none | op | full)", " | ".join(
                    format_bytes(self.layer.retained(c)) for c in ("none", "op", "full"))),
                (f"activations ({counts})", format_bytes(self.activation_bytes)),
                (self.loss_label, format_bytes(self.loss_bytes)), ("peak", format_bytes(self.peak_bytes)),
                *([("host memory (offloaded inputs)", format_bytes(self.host_bytes))] if self.host_bytes else [])]
        lines = [f"| {self.config_name} | bytes |", "|---|---|"] + [f"| {k} | {v} |" for k, v in rows]
        return "\n".join(lines + [f"note: {n}" for n in self.notes])


@dataclass(frozen=True)
class _Parameters:
    """The parameters of the model a config describes: all of them, the LoRA adapters', and the weights a 4-bit base
    stores quantized (the linear layers' but the output embedding's, as transformers' bitsandbytes quantizer picks)."""

    total: int
    lora: int
    linear_weights: tuple[int, ...]  # numel of each quantizable linear weight
    # one decoder layer's adapted linears (LoRA): (count, sum of in_features) outside its MLP and inside it
    adapted: tuple[tuple[int, int], tuple[int, int]] = ((0, 0), (0, 0))
    experts: tuple = ()  # the first decoder layer's MoE experts modules (hf_accel.patches.experts.ExpertsShape)


def _count_parameters(config, lora_rank: int | None, lora_targets: Sequence[str],
                      lora_experts: bool = False) -> _Parameters:
    """The parameters of the model `config` describes, built on the meta device; ``lora_experts``: LoRA on every
    MoE experts module's 3-D projections too (PEFT's ``target_parameters``: rank r per expert)."""
    from ..patches.experts import experts_shapes

    from accelerate import init_empty_weights
    from transformers import AutoModelForCausalLM

    with init_empty_weights():
        model = AutoModelForCausalLM.from_config(config)
    # meta weights are not tied at construction (nor inside the context, which re-registers parameters)
    model.tie_weights()
    params = sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())
    output = model.get_output_embeddings()
    linears = [m for m in model.modules() if isinstance(m, nn.Linear) and m is not output]
    lora = 0
    if lora_rank:
        for name, module in model.named_modules():
            if _adapted(name, module, lora_targets):
                lora += lora_rank * (module.in_features + module.out_features)
    shapes = experts_shapes(model)
    if lora_experts and not shapes:
        raise ConfigurationError(f"lora_experts: {config.model_type} has no mixture-of-experts experts modules; leave "
                                 "it out (--lora-experts).")
    if lora_rank and lora_experts:
        lora += sum(s.num_experts * lora_rank * (s.hidden + s.up_width + s.intermediate + s.hidden) for s in shapes)
    from .targets import decoder_layers

    layers = decoder_layers(model)
    first = {id(m) for m in layers[0].modules()} if layers else set()
    named = dict(model.named_modules())
    return _Parameters(params, lora, tuple(m.weight.numel() for m in linears),
                       _adapted_in_first_layer(layers, lora_targets) if lora_rank else ((0, 0), (0, 0)),
                       tuple(s for s in shapes if id(named[s.path]) in first))


def _adapted(name: str, module: nn.Module, lora_targets: Sequence[str]) -> bool:
    return isinstance(module, nn.Linear) and name.rsplit(".", 1)[-1] in lora_targets


def _adapted_in_first_layer(layers: Sequence[nn.Module], lora_targets: Sequence[str]
                            ) -> tuple[tuple[int, int], tuple[int, int]]:
    """(count, sum of in_features) of the first of the decoder ``layers``' adapted linears outside its MLP and inside
    it."""
    if not layers:
        return (0, 0), (0, 0)
    mlp = getattr(layers[0], "mlp", None)
    inside = {id(m) for m in mlp.modules()} if isinstance(mlp, nn.Module) else set()
    found = [[0, 0], [0, 0]]
    for name, module in layers[0].named_modules():
        if _adapted(name, module, lora_targets):
            where = found[id(module) in inside]
            where[0] += 1
            where[1] += module.in_features
    return tuple(map(tuple, found))


def four_bit_bytes(numel: int, nested: bool = False) -> int:
    """Bytes bitsandbytes holds for one weight of ``numel`` elements in 4 bits (NF4 or FP4, blocks of 64): two
    elements a byte, one absmax per block (fp32; with nested statistics uint8, plus an fp32 absmax per 256 blocks, their
    256-entry code and an offset) and the 16-entry code."""
    blocks = -(-numel // 64)
    stats = blocks * 4 if not nested else blocks + -(-blocks // 256) * 4 + 256 * 4 + 4
    return -(-numel // 2) + stats + 16 * 4


def estimate_training_memory(config_or_path, dtype: str = "bf16", optimizer: str = "adamw",
                             lora_rank: int | None = None, lora_targets: Sequence[str] | None = None,
                             batch_tokens: int = 4096, checkpointing="none",
                             device_bytes: int | None = None, host_bytes: int | None = None,
                             base_4bit: bool = False, nested_quant: bool = False, keep_base_dtype: bool = False,
                             loss: str = "fused", mlp_chunks="auto", lora_experts: bool = False) -> MemoryEstimate:
    """Predict weights, gradients, optimizer states, activations and the peak of one training step, offline.

    dtype: weights and activations ("bf16", "fp16", "fp32"); LoRA adapters are fp32 (PEFT's default).
    base_4bit: QLoRA (needs lora_rank): the linear weights in bitsandbytes 4-bit (``nested_quant``: with nested
    statistics), every other weight in fp32 and the residual stream fp32, as PEFT's ``prepare_model_for_kbit_training``
    leaves them; activations are then counted at fp32 (an upper bound for autocast's half-precision intermediates).
    keep_base_dtype: with base_4bit, those other weights back in ``dtype`` after the preparation (``hf-accel sft
    --keep-base-dtype``, as TRL's SFTTrainer and Unsloth keep them): weights, residual stream and activations in
    ``dtype``.
    checkpointing: "none" | "full" | "every_N" | "op" | "budget:20GiB" | "budget:0.6" (needs device_bytes),
    planned on the formula's per-layer sizes (layers may be spaced; offloaded too, within `host_bytes` of host memory,
    when it is given). batch_tokens: tokens per micro-batch (packed, no padding).
    loss: "fused" (patch()'s default on CUDA: chunked logits, ``fused_loss_bytes``) or "full" (the stock loss: the
    whole (tokens, vocab) logits, their fp32 copy and log-softmax).
    mlp_chunks: patch()'s setting ("auto", a chunk size in tokens, or False): where it runs a length's MLPs in
    chunks, a layer holds one chunk's MLP intermediates.
    lora_experts: with lora_rank, LoRA on the MoE experts' 3-D projections too (PEFT's ``target_parameters``); MoE
    layers are counted as hf_accel's grouped experts path keeps them (total parameters in the weights, each token's
    top-k experts in the activations).
    """
    config = load_config(config_or_path)
    _check_arguments(dtype, lora_rank, base_4bit, nested_quant, keep_base_dtype, loss)
    # the kbit preparation: fp32 outside the 4-bit linears (unless they are kept in the run's dtype)
    b = 4 if base_4bit and not keep_base_dtype else DTYPE_BYTES[dtype]
    targets = tuple(lora_targets or _family(config).lora_targets)
    if lora_experts and not lora_rank:
        raise ConfigurationError("lora_experts puts LoRA adapters on the experts: pass lora_rank too (--lora-r 16).")
    counted = _count_parameters(config, lora_rank, targets, lora_experts)
    params, lora = counted.total, counted.lora
    quantized = sum(counted.linear_weights) if base_4bit else 0
    weight_bytes = params * b if not base_4bit else (
        (params - quantized) * b + sum(four_bit_bytes(n, nested_quant) for n in counted.linear_weights))
    trainable, train_bytes = (lora, 4) if lora_rank else (params, b)
    per_token, mlp_per_token = _layer_bytes(config, b, lora_rank, counted.adapted, counted.experts, lora_experts)
    state = trainable * train_bytes + _optimizer_state_bytes(trainable, train_bytes, optimizer)  # gradients, optimizer
    fixed = weight_bytes + lora * 4 + state
    compute_bytes = DTYPE_BYTES[dtype]  # what the forward computes in (autocast's dtype for a 4-bit base)
    width = _family(config).mlp_width(config)
    chunking = mlp_chunking.resolve(mlp_chunks, width, compute_bytes)  # what patch() binds (None: off)

    def plan(chunking: mlp_chunking.MlpChunking | None) -> tuple[list[str], int, LayerActivation, int]:
        """With this MLP chunking: the choices at batch_tokens, the longest micro-batch up to it that fits, one layer
        at batch_tokens and the plan's peak."""
        def layers_at(tokens: int) -> list[LayerActivation]:
            return [_layer_at(per_token, mlp_per_token, 2 * config.hidden_size * b, chunking, tokens)] \
                * config.num_hidden_layers

        breaks = () if chunking is None else (chunking.longest_unchunked,)
        choices, longest = _choices_for(checkpointing, layers_at, fixed, loss_at, device_bytes, host_bytes,
                                        batch_tokens, breaks)
        layer = layers_at(batch_tokens)[0]
        return choices, longest, layer, plan_peak_bytes([layer] * len(choices), choices, fixed, loss_at(batch_tokens))

    loss_at = _loss_function(config, loss, b, compute_bytes)
    choices, longest, layer, peak = plan(chunking)
    budget = _budget(checkpointing, device_bytes) if str(checkpointing).startswith("budget:") else None
    if budget is not None and peak > budget and chunking is not None and chunking.auto \
            and chunking.every_long_call() != chunking:
        # as the run's budget does before refusing a length auto leaves unchunked: chunk every MLP call over a chunk
        # (so the longest length is searched so too, also from a length over auto's threshold)
        every = chunking.every_long_call()
        chunked = plan(every)
        if chunked[3] <= budget:
            chunking, (choices, longest, layer, peak) = every, chunked
        longest = max(longest, chunked[1])
    notes = _notes(loss, quantized, nested_quant, b) + _mlp_chunks_note(chunking, batch_tokens, mlp_per_token)
    if budget is not None:
        notes += (_budget_verdict(checkpointing[7:], batch_tokens, peak <= budget, longest),)
    tail = loss_at(batch_tokens)
    return MemoryEstimate(
        config_name=str(config_or_path) if isinstance(config_or_path, str) else config.model_type, params=params + lora,
        trainable_params=trainable, param_bytes=weight_bytes + lora * 4, grad_bytes=trainable * train_bytes,
        optimizer_bytes=_optimizer_state_bytes(trainable, train_bytes, optimizer), layer=layer,
        choices=tuple(choices), activation_bytes=sum(layer.retained(c) for c in choices), loss_bytes=tail,
        peak_bytes=peak, notes=notes, host_bytes=sum(layer.full_bytes for c in choices if c == "offload"),
        loss_label="fused loss (a chunk of logits)" if loss == "fused" else "logits + loss",
    )


def _check_arguments(dtype: str, lora_rank: int | None, base_4bit: bool, nested_quant: bool, keep_base_dtype: bool,
                     loss: str) -> None:
    """estimate_training_memory's arguments that do not fit together, refused with what to pass instead."""
    if dtype not in DTYPE_BYTES:
        raise ConfigurationError(f"unknown dtype {dtype!r}; allowed: {sorted(DTYPE_BYTES)}.")
    if base_4bit and not lora_rank:
        raise ConfigurationError("a 4-bit base is frozen and trains LoRA adapters (QLoRA): pass lora_rank "
                                 "(estimate-memory --lora-rank 16).")
    if nested_quant and not base_4bit:
        raise ConfigurationError("nested_quant describes a 4-bit base: pass base_4bit=True too (--load-in-4bit).")
    if keep_base_dtype and not base_4bit:
        raise ConfigurationError("keep_base_dtype describes a 4-bit base's other weights: pass base_4bit=True too "
                                 "(--load-in-4bit).")
    if loss not in ("fused", "full"):
        raise ConfigurationError(f"unknown loss {loss!r}: 'fused' (patch()'s default on CUDA) or 'full' (the stock "
                                 "loss over the whole logits).")


def _notes(loss: str, quantized: int, nested_quant: bool, stored_bytes: int) -> tuple[str, ...]:
    """What the estimate counts and how it stands to patch()'s CUDA defaults; `quantized`: a 4-bit base's linear
    weights (0: none), `stored_bytes`: the bytes of an element of its other weights and activations."""
    loss_note = ("the fused loss (patch()'s CUDA default; --loss full: the stock loss) with its chunk's work as torch "
                 "computes it" if loss == "fused" else "the stock loss over the whole logits (--loss fused: patch()'s "
                 "CUDA default)")
    notes = ("attention counted flash-style (no seq x seq tensor); HF's eager/sdpa paths with a mask add one",
             f"{loss_note}, and eager layers: an upper bound for patch()'s CUDA defaults, whose loss kernel works in "
             "place and whose compiled layers save less (Llama-1B at 16k tokens: this estimate 40.5 GiB, 55.5 with "
             "--loss full; measured on the H200: the fused defaults 27.2, attention-only patch 57.2); a budget: plan "
             "probes the real forward instead")
    if quantized:
        kept = "PEFT's kbit preparation" if stored_bytes == 4 else "the other weights kept in the run's dtype"
        notes += (f"a 4-bit base ({'nested statistics, ' if nested_quant else ''}{kept}): {quantized:,} linear "
                  f"weights in 4 bits, the other weights, the residual stream and the activations counted in "
                  f"{'fp32' if stored_bytes == 4 else '16-bit'}",)
    return notes


def _mlp_chunks_note(chunking: mlp_chunking.MlpChunking | None, tokens: int, mlp_per_token: int) -> tuple[str, ...]:
    """At lengths where patch()'s mlp_chunks setting (or a budget plan, below auto's threshold) runs each MLP in
    token chunks, say how the estimate counts it."""
    chunk = chunking.chunk_at(tokens) if chunking is not None else 0
    if not chunk:
        return ()
    by = (f"mlp_chunks={chunk}" if not chunking.auto else "mlp_chunks='auto'" if chunking.min_tokens > chunk else
          "the budget plan, as it does before refusing a length mlp_chunks='auto' leaves unchunked")
    return (f"at {tokens:,} tokens each MLP runs in chunks of {chunk:,} tokens ({by}): counted so, a layer holds one "
            f"chunk's MLP intermediates ({format_bytes(mlp_per_token * chunk)}) in its backward instead of every "
            f"token's ({format_bytes(mlp_per_token * tokens)}) from forward to backward",)


def _budget_verdict(budget: str, tokens: int, fits: bool, longest: int) -> str:
    """Whether the budget holds the micro-batch; if not, the longest that fits."""
    if fits:
        from .budget import HEADROOM

        return f"budget {budget}: fits (with the run's {HEADROOM:.0%} headroom)"
    return (f"budget {budget}: does NOT fit with any plan by this estimate (an upper bound, see above: the run's own "
            f"plan measures the real forward); the longest micro-batch of at most {tokens:,} tokens it holds is "
            f"{longest:,} tokens")


def _loss_function(config, loss: str, stored_bytes: int, compute_bytes: int) -> Callable[[int], int]:
    """Bytes of the loss tail at t tokens: the fused loss's (a 4-bit base's fp32 head cast to the compute dtype) or
    the full logits' (in the stored dtype, as the estimate's layers are counted)."""
    vocab, hidden = config.vocab_size, config.hidden_size
    if loss == "fused":
        head_cast = vocab * hidden * compute_bytes if stored_bytes > compute_bytes else 0
        return lambda t: fused_loss_bytes(t, vocab, hidden, compute_bytes, stored_bytes, head_cast)
    return lambda t: loss_bytes(t, vocab, stored_bytes) + t * (4 * hidden + 4)


def _budget(spec, device_bytes: int | None) -> int:
    from .budget import MemoryBudget
    from .checkpointing import policy_from_spec

    policy = policy_from_spec(spec)
    budget = MemoryBudget(budget=policy.budget, device_bytes=device_bytes)
    return int(budget.budget_bytes(torch.device("meta")) * (1 - budget.headroom))  # what the run plans for


def _choices_for(spec, layers_at: Callable[[int], list[LayerActivation]], fixed: int, extra_at: Callable[[int], int],
                 device_bytes: int | None, host_bytes: int | None, tokens: int,
                 breaks: Sequence[int] = ()) -> tuple[list[str], int]:
    """The policy's per-layer choices, and for a budget the longest micro-batch it holds (the layers' bytes at t
    tokens are `layers_at(t)`, the loss tail's `extra_at(t)`; `breaks`: see ``longest_feasible_tokens``)."""
    from .budget import MemoryBudget
    from .checkpointing import policy_from_spec
    from .planner import longest_feasible_tokens

    policy = policy_from_spec(spec)
    layers = layers_at(tokens)
    if not isinstance(policy, MemoryBudget):
        return policy.layer_choices([None] * len(layers)), 0
    modes = ("none", "op", "full", *(("offload",) if host_bytes is not None else ()), "spaced")
    planning = dict(fixed_bytes=fixed, budget_bytes=_budget(spec, device_bytes), modes=modes,
                    host_budget_bytes=host_bytes or 0)
    plan = plan_checkpointing(layers, extra_bytes=extra_at(tokens), **planning)
    return list(plan.choices), (tokens if plan.fits else
                                longest_feasible_tokens(layers_at, tokens, extra_bytes=extra_at, breaks=breaks,
                                                        **planning))
