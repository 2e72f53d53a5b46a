"""Training memory: fixed costs (weights, gradients, optimizer states, logits/loss) and an offline estimate.

- `estimate_training_memory(config_or_path, ...)`: parameters, gradients, optimizer states, activations per decoder
  layer (the family's formula: ``hf_accel.patches``' ``Family.layer_bytes``, the one import of the family registry
  outside patch()), logits/loss and the peak, without allocating the model (accelerate's
  `init_empty_weights`) and without the hub.
- The activation probe and the budget planner live in `checkpoint_plan` (re-exported here).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

import torch
from torch import nn

from .plan import GradientBytes, LayerActivation, format_bytes, plan_checkpointing, plan_peak_bytes
from ..errors import ConfigurationError

DTYPE_BYTES = {"fp32": 4, "float32": 4, "bf16": 2, "bfloat16": 2, "fp16": 2, "float16": 2}


# ----------------------------------------------------------------------------------------------- fixed costs
def _optimizer_state_bytes(numel: int, elem_bytes: int, optimizer: str) -> int:
    """torch's AdamW keeps exp_avg and exp_avg_sq in the parameter's dtype; 8-bit Adam one byte each."""
    per_param = {"adamw": 2 * elem_bytes, "adam": 2 * elem_bytes, "adamw_8bit": 2, "sgd": 0}
    if optimizer not in per_param:
        raise ConfigurationError(f"unknown optimizer {optimizer!r}; allowed: {sorted(per_param)}.")
    return numel * per_param[optimizer]


@dataclass(frozen=True)
class Sharding:
    """The training state split over ``world_size`` processes, as each process holds it.

    ``engine`` "fsdp2": every parameter, gradient and optimizer state is a 1/world_size shard; under mixed precision
    accelerate upcasts the trainable parameters to fp32 master weights first (``master_bytes=4``: their gradients and
    AdamW states are fp32 too); each decoder layer's parameters are gathered whole, in the compute dtype, while it
    runs (two at a time: the next one is prefetched), and the root's own (embeddings, head, final norm) for the step.
    ``engine`` "zero3" (DeepSpeed): the same shards, but under mixed precision DeepSpeed first casts every parameter
    to the compute dtype (``compute_bytes``), keeps an fp32 master partition of the trainable ones besides, and its
    gradient partitions stay in the compute dtype (the fp32 copy exists only inside the optimizer step, when the
    activations are gone).
    """

    engine: str  # "fsdp2" | "zero3"
    world_size: int
    master_bytes: int | None = None  # bytes per trainable element of master weights / grads / states; None: as held
    compute_bytes: int | None = None  # bytes per element of the mixed-precision compute dtype (gathered copies;
    # under ZeRO-3 the partitions too); None: as held

    def held_element_bytes(self, p: torch.Tensor) -> int:
        """Bytes per element of ``p``'s own shard (DeepSpeed's is cast to the compute dtype)."""
        return (self.compute_bytes or p.element_size()) if self.engine == "zero3" else p.element_size()

    def gradient_element_bytes(self, p: torch.Tensor) -> int:
        """Bytes per element of ``p``'s gradient shard: the master dtype's, except DeepSpeed's compute-dtype ones."""
        if self.engine == "zero3" or self.master_bytes is None:
            return self.held_element_bytes(p)
        return self.master_bytes


def training_state_bytes(model: nn.Module, optimizer: str = "adamw", grads: bool = True,
                         sharding: Sharding | None = None) -> int:
    """Weights (all) + gradients (unless ``grads=False``) and optimizer states (trainable parameters only) of a real
    model, on one process: all of it, or its share under ``sharding`` plus what that gathers while computing."""
    if sharding is not None:
        return sum(sharded_state_bytes(model, optimizer, grads, sharding))
    unique = {p.untyped_storage().data_ptr(): p for p in model.parameters()}.values()
    total = sum(p.numel() * p.element_size() for p in unique)
    for p in unique:
        if p.requires_grad:
            total += p.numel() * p.element_size() * grads + _optimizer_state_bytes(p.numel(), p.element_size(),
                                                                                   optimizer)
    return total


def sharded_state_bytes(model: nn.Module, optimizer: str, grads: bool, sharding: Sharding) -> tuple[int, int]:
    """(this process's shard of weights, gradients and optimizer states; the compute-dtype copies it gathers) for
    ``model`` as it is before the sharding wrapper takes it (as hf_accel's Trainers plan: before accelerate's
    prepare)."""
    from .targets import decoder_layers

    unique = {p.untyped_storage().data_ptr(): p for p in model.parameters()}.values()
    shard = 0
    for p in unique:
        held = p.numel() * sharding.held_element_bytes(p)
        if not p.requires_grad:
            shard += held
            continue
        master_bytes = sharding.master_bytes or p.element_size()
        weights = p.numel() * master_bytes
        if sharding.engine == "zero3" and sharding.master_bytes:
            weights += held  # DeepSpeed keeps the compute-dtype partition besides the master one
        shard += (weights + p.numel() * sharding.gradient_element_bytes(p) * grads
                  + _optimizer_state_bytes(p.numel(), master_bytes, optimizer))

    def gathered_bytes(params) -> int:
        return sum(p.numel() * (sharding.compute_bytes or p.element_size()) for p in params)

    layers = decoder_layers(model)
    layer_bytes = [gathered_bytes(layer.parameters()) for layer in layers]
    in_layers = {id(p) for layer in layers for p in layer.parameters()}
    root = gathered_bytes(p for p in unique if id(p) not in in_layers)
    gathered = 2 * max(layer_bytes, default=0) + root  # compute-dtype copies: the running and the prefetched layer
    return -(-shard // sharding.world_size), gathered


def gradient_bytes(model: nn.Module, layers: Sequence[nn.Module], sharding: Sharding | None = None) -> GradientBytes:
    """The trainable parameters' gradient bytes in each of ``layers`` (the probed decoder layers) and elsewhere (this
    process's shards of them under ``sharding``)."""
    seen: set[int] = set()

    def trainable_bytes(params) -> int:
        total = 0
        for p in params:
            key = p.untyped_storage().data_ptr()
            if p.requires_grad and key not in seen:
                seen.add(key)
                if sharding is None:
                    total += p.numel() * p.element_size()
                else:
                    total += -(-p.numel() * sharding.gradient_element_bytes(p) // sharding.world_size)
        return total

    per_layer = tuple(trainable_bytes(layer.parameters()) for layer in layers)
    return GradientBytes(per_layer=per_layer, other=trainable_bytes(model.parameters()))


def loss_bytes(tokens: int, vocab_size: int, dtype_bytes: int) -> int:
    """Logits, their fp32 copy for the loss (when not fp32) and log-softmax, all (tokens, vocab)."""
    return tokens * vocab_size * (dtype_bytes + (4 if dtype_bytes < 4 else 0) + 4)


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


def _layer_activation(config, b: int) -> LayerActivation:
    """Per-token bytes one decoder layer keeps (flash-style attention: no seq x seq tensor; GQA not repeated), as the
    family counts what autograd saves in its layers (``Family.layer_bytes``)."""
    per_token = _family(config).layer_bytes(config, b)
    return LayerActivation(per_token.none, per_token.op, per_token.full)


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

    def table(self) -> str:
        counts = ", ".join(f"{self.choices.count(c)} {c}" for c in ("none", "op", "full", "offload", "spaced")
                           if c in self.choices)
        rows = [("parameters", f"{self.params:,} ({self.trainable_params:,} trainable)"),
                ("weights", format_bytes(self.param_bytes)), ("gradients", format_bytes(self.grad_bytes)),
                ("optimizer states", format_bytes(self.optimizer_bytes)),
                ("activations / layer (none | op | full)", " | ".join(
                    format_bytes(self.layer.retained(c)) for c in ("none", "op", "full"))),
                (f"activations ({counts})", format_bytes(self.activation_bytes)),
                ("logits + loss", format_bytes(self.loss_bytes)), ("peak", format_bytes(self.peak_bytes)),
                *([("host memory (offloaded inputs)", format_bytes(self.host_bytes))] if self.host_bytes else [])]
        lines = [f"| {self.config_name} | bytes |", "|---|---|"] + [f"| {k} | {v} |" for k, v in rows]
        return "\n".join(lines + [f"note: {n}" for n in self.notes])


def _count_parameters(config, lora_rank: int | None, lora_targets: Sequence[str]) -> tuple[int, int]:
    """(all parameters, LoRA parameters) of the model `config` describes, built on the meta device."""
    from accelerate import init_empty_weights
    from transformers import AutoModelForCausalLM

    with init_empty_weights():
        model = AutoModelForCausalLM.from_config(config)
    # meta weights are not tied at construction (nor inside the context, which re-registers parameters)
    model.tie_weights()
    params = sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())
    lora = 0
    if lora_rank:
        for name, module in model.named_modules():
            if isinstance(module, nn.Linear) and name.rsplit(".", 1)[-1] in lora_targets:
                lora += lora_rank * (module.in_features + module.out_features)
    return params, lora


def estimate_training_memory(config_or_path, dtype: str = "bf16", optimizer: str = "adamw",
                             lora_rank: int | None = None, lora_targets: Sequence[str] | None = None,
                             batch_tokens: int = 4096, checkpointing="none",
                             device_bytes: int | None = None, host_bytes: int | None = None) -> MemoryEstimate:
    """Predict weights, gradients, optimizer states, activations and the peak of one training step, offline.

    dtype: weights and activations ("bf16", "fp16", "fp32"); LoRA adapters are fp32 (PEFT's default).
    checkpointing: "none" | "full" | "every_N" | "op" | "budget:20GiB" | "budget:0.6" (needs device_bytes),
    planned on the formula's per-layer sizes (layers may be spaced; offloaded too, within `host_bytes` of host memory,
    when it is given). batch_tokens: tokens per micro-batch (packed, no padding).
    """
    config = load_config(config_or_path)
    if dtype not in DTYPE_BYTES:
        raise ConfigurationError(f"unknown dtype {dtype!r}; allowed: {sorted(DTYPE_BYTES)}.")
    b = DTYPE_BYTES[dtype]
    targets = tuple(lora_targets or _family(config).lora_targets)
    params, lora = _count_parameters(config, lora_rank, targets)
    trainable, train_bytes = (lora, 4) if lora_rank else (params, b)
    per_token = _layer_activation(config, b)
    if lora_rank:  # each adapted linear saves its input cast to fp32 (half dtypes) and the rank-r A output
        per_layer_in = _lora_inputs_per_layer(config, targets)
        extra = per_layer_in * (4 if b < 4 else 0) + len(targets) * lora_rank * 4
        per_token = LayerActivation(per_token.none_bytes + extra, per_token.op_bytes + extra, per_token.full_bytes)
    layer = LayerActivation(*(n * batch_tokens for n in (per_token.none_bytes, per_token.op_bytes,
                                                         per_token.full_bytes)))
    fixed = params * b + lora * 4 + trainable * train_bytes + _optimizer_state_bytes(trainable, train_bytes, optimizer)
    loss = loss_bytes(batch_tokens, config.vocab_size, b) + batch_tokens * (4 * config.hidden_size + 4)
    layers = [layer] * config.num_hidden_layers
    choices, longest = _choices_for(checkpointing, layers, fixed, loss, device_bytes, host_bytes, batch_tokens)
    notes = ("attention counted flash-style (no seq x seq tensor); HF's eager/sdpa paths with a mask add one",
             "eager layers and the full-logits loss: an upper bound for patch()'s CUDA defaults, whose fused loss "
             "holds one ~512 MiB chunk of logits and whose compiled layers save less (Llama-1B at 16k tokens: this "
             "formula 55.4 GiB; measured on the H200: attention-only patch 57.2, the fused defaults 27.2); a "
             "budget: plan probes the real forward instead")
    peak = plan_peak_bytes([layer] * len(choices), choices, fixed, loss)
    if isinstance(checkpointing, str) and checkpointing.startswith("budget:"):
        notes += (f"budget {checkpointing[7:]}: " + ("fits" if peak <= _budget(checkpointing, device_bytes) else
                                                      f"does NOT fit with any plan; the longest micro-batch it "
                                                      f"holds is {longest:,} tokens"),)
    return MemoryEstimate(
        config_name=str(config_or_path) if isinstance(config_or_path, str) else config.model_type, params=params + lora,
        trainable_params=trainable, param_bytes=params * b + lora * 4, grad_bytes=trainable * train_bytes,
        optimizer_bytes=_optimizer_state_bytes(trainable, train_bytes, optimizer), layer=layer,
        choices=tuple(choices), activation_bytes=sum(layer.retained(c) for c in choices), loss_bytes=loss,
        peak_bytes=peak, notes=notes, host_bytes=sum(layer.full_bytes for c in choices if c == "offload"),
    )


def _lora_inputs_per_layer(config, targets: Sequence[str]) -> int:
    """Sum of in_features over one layer's adapted linears (for the fp32 input copies)."""
    h = config.hidden_size
    family = _family(config)
    i = family.mlp_width(config)
    heads, _, head_dim = family.head_shape(config)
    in_features = {"q_proj": h, "k_proj": h, "v_proj": h, "o_proj": heads * head_dim, "gate_proj": h, "up_proj": h,
                   "down_proj": i, "query_key_value": h, "dense": h, "dense_h_to_4h": h, "dense_4h_to_h": i}
    return sum(in_features.get(t, h) for t in targets)


def _budget(spec, device_bytes: int | None) -> int:
    from .budget import MemoryBudget
    from .checkpointing import policy_from_spec

    policy = policy_from_spec(spec)
    return MemoryBudget(budget=policy.budget, device_bytes=device_bytes).budget_bytes(torch.device("meta"))


def _choices_for(spec, layers: list[LayerActivation], fixed: int, extra: int, device_bytes: int | None,
                 host_bytes: int | None, tokens: int) -> tuple[list[str], int]:
    """The policy's per-layer choices, and for a budget the longest micro-batch it holds (the formula is linear in
    tokens)."""
    from .budget import MemoryBudget
    from .checkpointing import policy_from_spec
    from .planner import longest_feasible_tokens

    policy = policy_from_spec(spec)
    if not isinstance(policy, MemoryBudget):
        return policy.layer_choices([None] * len(layers)), 0
    modes = ("none", "op", "full", *(("offload",) if host_bytes is not None else ()), "spaced")
    planning = dict(fixed_bytes=fixed, budget_bytes=_budget(spec, device_bytes), extra_bytes=extra, modes=modes,
                    host_budget_bytes=host_bytes or 0)
    plan = plan_checkpointing(layers, **planning)
    return list(plan.choices), (tokens if plan.fits else longest_feasible_tokens(layers, tokens, **planning))
