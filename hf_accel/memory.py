"""Training memory: an offline estimate from a config, a probe of real activation sizes, and the budget planner.

- `estimate_training_memory(config_or_path, ...)`: parameters, gradients, optimizer states, activations per decoder
  layer (a per-family formula), logits/loss and the peak, without allocating the model (accelerate's
  `init_empty_weights`) and without the hub.
- `probe_layer_activations(model, batch)`: one forward on a real batch, counting the bytes autograd saves per
  decoder layer (`saved_tensors_hooks`) and what op-level / full checkpointing would keep instead.
- `plan_checkpointing(layers, fixed_bytes=, budget_bytes=)`: a pure function choosing the least recompute that fits.
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import Sequence

import torch
from torch import nn

from .errors import ConfigurationError

DTYPE_BYTES = {"fp32": 4, "float32": 4, "bf16": 2, "bfloat16": 2, "fp16": 2, "float16": 2}
_GIB = 1024**3

# Recompute cost of one decoder layer, in units of that layer's forward. Op-level recomputes only element-wise ops
# (norms, rotary, activation function): no FLOPs to speak of, memory-bound, roughly a tenth of a layer's forward.
RECOMPUTE_COST = {"none": 0.0, "op": 0.1, "full": 1.0}


def parse_bytes(text: str) -> int:
    """'20GiB', '512MiB', '1.5GB', '1000000' -> bytes."""
    units = {"kib": 1024, "mib": 1024**2, "gib": _GIB, "tib": 1024**4, "kb": 1e3, "mb": 1e6, "gb": 1e9, "tb": 1e12,
             "b": 1}
    lowered = text.strip().lower()
    for unit, scale in sorted(units.items(), key=lambda kv: -len(kv[0])):
        if lowered.endswith(unit):
            return int(float(lowered[: -len(unit)]) * scale)
    return int(float(lowered))


def format_bytes(n: float) -> str:
    return f"{n / _GIB:.2f} GiB" if abs(n) >= _GIB / 10 else f"{n / 1024**2:.1f} MiB"


# ----------------------------------------------------------------------------------------------- the planner
@dataclass(frozen=True)
class LayerActivation:
    """Bytes one decoder layer keeps from forward to backward under each choice (measured or estimated)."""

    none_bytes: int
    op_bytes: int
    full_bytes: int

    def retained(self, choice: str) -> int:
        return {"none": self.none_bytes, "op": self.op_bytes, "full": self.full_bytes}[choice]


@dataclass(frozen=True)
class CheckpointPlan:
    """Per-layer choices with their predicted peak; `fits` is False when even full checkpointing is over budget."""

    choices: tuple[str, ...]
    predicted_peak_bytes: int
    budget_bytes: int
    fixed_bytes: int
    recompute_cost: float
    fits: bool

    def table(self) -> str:
        full = [i for i, c in enumerate(self.choices) if c == "full"]
        op = [i for i, c in enumerate(self.choices) if c == "op"]
        return "\n".join([
            "| item | value |", "|---|---|",
            f"| full checkpointing | {len(full)} layers {full} |",
            f"| op-level checkpointing | {len(op)} layers {op} |",
            f"| no checkpointing | {self.choices.count('none')} layers |",
            f"| recompute (layer forwards) | {self.recompute_cost:.1f} |",
            f"| fixed (params, grads, optimizer) | {format_bytes(self.fixed_bytes)} |",
            f"| predicted peak | {format_bytes(self.predicted_peak_bytes)} |",
            f"| budget | {format_bytes(self.budget_bytes)}{'' if self.fits else ' (does NOT fit)'} |",
        ])


def plan_peak_bytes(layers: Sequence[LayerActivation], choices: Sequence[str], fixed_bytes: int,
                    extra_bytes: int = 0) -> int:
    """Peak = fixed + every layer's retained activations + the largest one recomputed layer rebuilds in backward."""
    retained = sum(layer.retained(c) for layer, c in zip(layers, choices))
    rebuilt = max((layer.none_bytes - layer.retained(c) for layer, c in zip(layers, choices)), default=0)
    return fixed_bytes + extra_bytes + retained + rebuilt


def plan_cost(choices: Sequence[str]) -> float:
    return sum(RECOMPUTE_COST[c] for c in choices)


def plan_checkpointing(layers: Sequence[LayerActivation], *, fixed_bytes: int, budget_bytes: int,
                       extra_bytes: int = 0) -> CheckpointPlan:
    """The least-recompute per-layer choice whose predicted peak fits `budget_bytes` (pure function, exact).

    For each cap on the bytes one recomputed layer rebuilds, a knapsack over layers (cost in tenths of a layer
    forward) finds the least retained memory per total cost; the cheapest fitting plan wins, ties to the lower
    peak. When nothing fits, the plan with the lowest peak is returned with fits=False.
    """
    units = {c: round(cost * 10) for c, cost in RECOMPUTE_COST.items()}
    caps = sorted({layer.none_bytes - layer.retained(c) for layer in layers for c in units})
    best_fit, best_any = None, None
    for cap in caps or [0]:
        table: dict[int, tuple[int, tuple[str, ...]]] = {0: (0, ())}  # total cost -> (least retained, choices)
        for layer in layers:
            grown: dict[int, tuple[int, tuple[str, ...]]] = {}
            for cost, (retained, choices) in table.items():
                for c, unit in units.items():
                    if layer.none_bytes - layer.retained(c) > cap:
                        continue
                    entry = (retained + layer.retained(c), choices + (c,))
                    if cost + unit not in grown or entry[0] < grown[cost + unit][0]:
                        grown[cost + unit] = entry
            table = grown
        for cost, (_, choices) in table.items():
            peak = plan_peak_bytes(layers, choices, fixed_bytes, extra_bytes)
            if peak <= budget_bytes and (best_fit is None or (cost, peak) < best_fit[:2]):
                best_fit = (cost, peak, choices)
            if best_any is None or (peak, cost) < best_any[:2]:
                best_any = (peak, cost, choices)
    choices = best_fit[2] if best_fit else best_any[2]
    peak = plan_peak_bytes(layers, choices, fixed_bytes, extra_bytes)
    return CheckpointPlan(tuple(choices), peak, budget_bytes, fixed_bytes, plan_cost(choices), best_fit is not None)


# ----------------------------------------------------------------------------------------------- measurement
def _storage_key(t: torch.Tensor) -> tuple[int, int]:
    storage = t.untyped_storage()
    return storage.data_ptr(), storage.nbytes()


def probe_layer_activations(model: nn.Module, batch: dict, layers: Sequence[nn.Module] | None = None,
                            save_ops: frozenset | None = None) -> list[LayerActivation]:
    """One forward (train mode, no checkpointing) on `batch`; per decoder layer the bytes it would keep.

    none: storages autograd saves inside the layer (`saved_tensors_hooks`, each storage counted once, parameters
    excluded); op: the layer's input plus the outputs of the ops op-level checkpointing saves; full: its input.
    """
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_leaves

    from .checkpointing import decoder_layers, default_save_ops

    layers = list(layers if layers is not None else decoder_layers(model))
    save_ops = save_ops if save_ops is not None else default_save_ops()
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen: set[int] = set(params)
    saved = [0] * len(layers)
    op_out = [0] * len(layers)
    inputs = [0] * len(layers)
    current: list[int | None] = [None]

    def pack(t: torch.Tensor) -> torch.Tensor:
        ptr, nbytes = _storage_key(t)
        if current[0] is not None and ptr not in seen:
            seen.add(ptr)
            saved[current[0]] += nbytes
        return t

    class SaveableOutputs(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            if current[0] is not None and func.overloadpacket in save_ops:
                op_out[current[0]] += sum(_storage_key(t)[1] for t in tree_leaves(out) if isinstance(t, torch.Tensor))
            return out

    def enter(index):
        def hook(module, args, kwargs):
            hidden = args[0] if args else kwargs.get("hidden_states")
            inputs[index] = hidden.untyped_storage().nbytes()
            current[0] = index
        return hook

    def leave(module, args, output):
        current[0] = None

    flags = [layer.gradient_checkpointing for layer in layers]
    handles = []
    try:
        for i, layer in enumerate(layers):
            layer.gradient_checkpointing = False
            handles.append(layer.register_forward_pre_hook(enter(i), with_kwargs=True))
            handles.append(layer.register_forward_hook(leave))
        with torch.enable_grad(), torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), SaveableOutputs():
            out = model(**batch)
        del out
    finally:
        for handle in handles:
            handle.remove()
        for layer, flag in zip(layers, flags):
            layer.gradient_checkpointing = flag
    return [LayerActivation(s, i + o, i) for s, o, i in zip(saved, op_out, inputs)]


def live_activation_bytes(model: nn.Module, batch: dict) -> int:
    """Bytes of every storage created during `model(**batch)` and still alive after it, the output excluded.

    Sees through checkpointing (inputs a checkpoint keeps, op-level caches), which saved-tensor hooks cannot: inside
    a checkpoint torch's own hooks replace ours. The reference the policies' memory claims are tested against.
    """
    from torch.multiprocessing.reductions import StorageWeakRef
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_leaves

    before = {p.untyped_storage().data_ptr() for p in itertools.chain(model.parameters(), model.buffers())}
    refs: dict[int, tuple[StorageWeakRef, int]] = {}

    class Track(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            for t in tree_leaves(out):
                if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() not in before:
                    ref = StorageWeakRef(t.untyped_storage())
                    refs.setdefault(ref.cdata, (ref, t.untyped_storage().nbytes()))
            return out

    with torch.enable_grad(), Track():
        out = model(**batch)
    total = sum(n for ref, n in refs.values() if not ref.expired())
    return total - sum(t.untyped_storage().nbytes() for t in out.values() if isinstance(t, torch.Tensor))


# ----------------------------------------------------------------------------------------------- fixed costs
def _optimizer_state_bytes(numel: int, elem_bytes: int, optimizer: str) -> int:
    """torch's AdamW keeps exp_avg and exp_avg_sq in the parameter's dtype; 8-bit Adam one byte each."""
    per_param = {"adamw": 2 * elem_bytes, "adam": 2 * elem_bytes, "adamw_8bit": 2, "sgd": 0}
    if optimizer not in per_param:
        raise ConfigurationError(f"unknown optimizer {optimizer!r}; allowed: {sorted(per_param)}.")
    return numel * per_param[optimizer]


def training_state_bytes(model: nn.Module, optimizer: str = "adamw") -> int:
    """Weights (all) + gradients and optimizer states (trainable parameters only) of a real model."""
    unique = {p.untyped_storage().data_ptr(): p for p in model.parameters()}.values()
    total = sum(p.numel() * p.element_size() for p in unique)
    for p in unique:
        if p.requires_grad:
            total += p.numel() * p.element_size() + _optimizer_state_bytes(p.numel(), p.element_size(), optimizer)
    return total


def loss_bytes(tokens: int, vocab_size: int, dtype_bytes: int) -> int:
    """Logits, their fp32 copy for the loss (when not fp32) and log-softmax, all (tokens, vocab)."""
    return tokens * vocab_size * (dtype_bytes + (4 if dtype_bytes < 4 else 0) + 4)


# ----------------------------------------------------------------------------------------------- offline estimate
def _known_shapes() -> dict:
    from transformers import FalconConfig, GPTNeoXConfig, LlamaConfig

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
    }


KNOWN_SHAPES = ("llama-3.2-1b", "llama-3-8b", "pythia-1.4b", "falcon-1b")
LORA_TARGETS = {"llama": ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"),
                "gpt_neox": ("query_key_value", "dense", "dense_h_to_4h", "dense_4h_to_h"),
                "falcon": ("query_key_value", "dense", "dense_h_to_4h", "dense_4h_to_h")}


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


def _layer_activation(config, b: int) -> LayerActivation:
    """Per-token bytes one decoder layer keeps (flash-style attention: no seq x seq tensor; GQA not repeated).

    Counted from what autograd saves in transformers' Llama / GPT-NeoX / Falcon layers: norm inputs (fp32 copies
    for half dtypes), norm outputs, q/k/v after rotary, attention output and log-sum-exp, MLP intermediates.
    """
    h, heads = config.hidden_size, config.num_attention_heads
    d = getattr(config, "head_dim", None) or h // heads
    kv = getattr(config, "num_key_value_heads", None) or getattr(config, "num_kv_heads", None) or heads
    if config.model_type == "falcon" and not config.new_decoder_architecture and config.multi_query:
        kv = 1
    lse = 4 * heads
    if config.model_type == "llama":
        i = config.intermediate_size
        norm = 4 * h + 4 + 2 * h * b  # fp32 input copy, rsqrt, normalized, weighted
        none = 2 * norm + (2 * heads * d + 2 * kv * d) * b + lse + 4 * i * b
        op = h * b + (2 * heads * d + 2 * kv * d + 2 * h + 2 * i) * b + lse
    elif config.model_type == "gpt_neox":
        i = config.intermediate_size
        sequential = 0 if config.use_parallel_residual else h * b + 8
        none = (10 * h + 2 * i) * b + 16 + lse + sequential
        op = h * b + (3 * h + heads * d + h + i + h) * b + lse  # qkv, attention, dense, mlp
    elif config.model_type == "falcon":
        i = getattr(config, "ffn_hidden_size", None) or 4 * h
        n_ln = 2 if (config.new_decoder_architecture and getattr(config, "num_ln_in_parallel_attn", 2) == 2) or \
            not config.parallel_attn else 1
        sequential = 0 if config.parallel_attn or config.new_decoder_architecture else h * b
        none = h * b + n_ln * (8 + h * b) + sequential + (2 * heads * d + 2 * kv * d) * b + lse + 2 * i * b
        op = h * b + ((heads + 2 * kv) * d + heads * d + h + i + h) * b + lse
    else:
        raise ConfigurationError(
            f"no activation formula for model_type {config.model_type!r}; supported: llama, gpt_neox, falcon."
        )
    return LayerActivation(none, op, h * b)


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

    def table(self) -> str:
        counts = ", ".join(f"{self.choices.count(c)} {c}" for c in ("none", "op", "full") if c in self.choices)
        rows = [("parameters", f"{self.params:,} ({self.trainable_params:,} trainable)"),
                ("weights", format_bytes(self.param_bytes)), ("gradients", format_bytes(self.grad_bytes)),
                ("optimizer states", format_bytes(self.optimizer_bytes)),
                ("activations / layer (none | op | full)", " | ".join(
                    format_bytes(self.layer.retained(c)) for c in ("none", "op", "full"))),
                (f"activations ({counts})", format_bytes(self.activation_bytes)),
                ("logits + loss", format_bytes(self.loss_bytes)), ("peak", format_bytes(self.peak_bytes))]
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
                             device_bytes: int | None = None) -> MemoryEstimate:
    """Predict weights, gradients, optimizer states, activations and the peak of one training step, offline.

    dtype: weights and activations ("bf16", "fp16", "fp32"); LoRA adapters are fp32 (PEFT's default).
    checkpointing: "none" | "full" | "every_N" | "op" | "budget:20GiB" | "budget:0.6" (needs device_bytes),
    planned on the formula's per-layer sizes. batch_tokens: tokens per micro-batch (packed, no padding).
    """
    config = load_config(config_or_path)
    if dtype not in DTYPE_BYTES:
        raise ConfigurationError(f"unknown dtype {dtype!r}; allowed: {sorted(DTYPE_BYTES)}.")
    b = DTYPE_BYTES[dtype]
    targets = tuple(lora_targets or LORA_TARGETS.get(config.model_type, ()))
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
    choices = _choices_for(checkpointing, [layer] * config.num_hidden_layers, fixed, loss, device_bytes)
    notes = ("attention counted flash-style (no seq x seq tensor); HF's eager/sdpa paths with a mask add one",)
    peak = plan_peak_bytes([layer] * len(choices), choices, fixed, loss)
    if isinstance(checkpointing, str) and checkpointing.startswith("budget:"):
        notes += (f"budget {checkpointing[7:]}: " + ("fits" if peak <= _budget(checkpointing, device_bytes)
                                                      else "does NOT fit even with full checkpointing"),)
    return MemoryEstimate(
        config_name=str(config_or_path) if isinstance(config_or_path, str) else config.model_type, params=params + lora,
        trainable_params=trainable, param_bytes=params * b + lora * 4, grad_bytes=trainable * train_bytes,
        optimizer_bytes=_optimizer_state_bytes(trainable, train_bytes, optimizer), layer=layer,
        choices=tuple(choices), activation_bytes=sum(layer.retained(c) for c in choices), loss_bytes=loss,
        peak_bytes=peak, notes=notes,
    )


def _lora_inputs_per_layer(config, targets: Sequence[str]) -> int:
    """Sum of in_features over one layer's adapted linears (for the fp32 input copies)."""
    h = config.hidden_size
    i = getattr(config, "intermediate_size", None) or getattr(config, "ffn_hidden_size", None) or 4 * h
    in_features = {"q_proj": h, "k_proj": h, "v_proj": h, "o_proj": h, "gate_proj": h, "up_proj": h,
                   "down_proj": i, "query_key_value": h, "dense": h, "dense_h_to_4h": h, "dense_4h_to_h": i}
    return sum(in_features.get(t, h) for t in targets)


def _budget(spec, device_bytes: int | None) -> int:
    from .checkpointing import MemoryBudget, policy_from_spec

    policy = policy_from_spec(spec)
    return MemoryBudget(budget=policy.budget, device_bytes=device_bytes).budget_bytes(torch.device("meta"))


def _choices_for(spec, layers: list[LayerActivation], fixed: int, extra: int, device_bytes: int | None) -> list[str]:
    from .checkpointing import MemoryBudget, policy_from_spec

    policy = policy_from_spec(spec)
    if isinstance(policy, MemoryBudget):
        budget = _budget(spec, device_bytes)
        return list(plan_checkpointing(layers, fixed_bytes=fixed, budget_bytes=budget, extra_bytes=extra).choices)
    return policy.layer_choices([None] * len(layers))
