"""The training state one process holds: weights, gradients and optimizer states, whole or as a sharding wrapper's
share (``Sharding``: FSDP2, DeepSpeed ZeRO-3). The budget plans with it (``budget``) and the offline estimate adds it up
(``estimate``, which re-exports these names).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch
from torch import nn

from .planner import GradientBytes
from ..errors import ConfigurationError


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
