"""What ``patch(model)`` does with the model's own checkpointing when ``checkpointing`` is left alone (None).

A model that checkpoints every decoder layer through torch's checkpoint (transformers' own, as its enable method or
PEFT's ``prepare_model_for_kbit_training`` turns it on) gets hf_accel's equivalent policy: the same recompute and the
same gradients bit for bit, plus what transformers' function cannot do.

- Its recompute is trimmed (``memory.trim``): where the family has output projections (Llama's ``mlp.down_proj``),
  the recompute skips their matmuls, which only the discarded layer output reads (their weights' gradients, where they
  train, need the input alone): a quarter of the recomputed matmul FLOPs on Llama-3-8B shapes.
- A 4-bit base on CUDA keeps each layer's saved input in pinned host memory instead of on the device
  (``OffloadedCheckpointing``): fp32 after the kbit preparation, 256 MiB a layer at 16k tokens of Llama-3-8B, 8 GiB for
  its 32 layers. The copies travel on a side stream behind a layer's compute: Llama-3-8B QLoRA trained at the
  on-device speed in 15.0 GiB instead of 21.5 (docs/qlora.md, one H200). They may take a share of the host memory free
  when patch() runs; past it a layer's input stays on the device.

``checkpointing="full"`` asks for the trimmed policy on the device whatever the base; a policy object with
``trim_recompute=False`` (``FullCheckpointing(trim_recompute=False)``) for the untrimmed recompute.
"""
from __future__ import annotations

import functools
import os
from dataclasses import dataclass

from torch import nn
from torch.utils.checkpoint import checkpoint

from .machine import host_available_bytes
from .policies import CheckpointingPolicy, FullCheckpointing, OffloadedCheckpointing, applied_policy
from .targets import decoder_layers, fsdp_activation_checkpointing_active
from ..attention.kernels.base import DeviceInfo

HOST_SHARE = 0.5  # of the host memory free at patch time (split between the processes of one machine)


@dataclass(frozen=True)
class CheckpointDefault:
    """The defaults' choice for the model's own checkpointing: ``policy`` None leaves it as it is; ``why`` says why,
    one line."""

    policy: CheckpointingPolicy | None
    why: str

    def describe(self) -> str:
        if self.policy is None:
            return f"the model's own ({self.why})"
        return f"{self.policy.describe()} (auto: {self.why})"


def checkpoint_default(model: nn.Module, device: DeviceInfo, *, base_4bit: bool, output_projections: tuple[str, ...],
                       host_free: int | None = None, processes: int | None = None) -> CheckpointDefault:
    """The defaults' choice for ``model`` on ``device``. ``base_4bit``: its linears are 4-bit (bitsandbytes
    ``Linear4bit``); ``output_projections``: its family's (``Family.output_projections``). ``host_free`` (bytes) and
    ``processes`` (on this machine) default to what the host reports (``LOCAL_WORLD_SIZE``); tests pass them."""
    why_not = _plain_full_checkpointing(model)
    if why_not is not None:
        return CheckpointDefault(None, why_not)
    trimmed = (f"its recompute skips the {' and '.join(output_projections)} matmul"
               f"{'s' if len(output_projections) > 1 else ''}: only the discarded layer output reads them")
    if base_4bit and device.type == "cuda":
        host_free = host_available_bytes() if host_free is None else host_free
        processes = max(1, int(os.environ.get("LOCAL_WORLD_SIZE", 1)) if processes is None else processes)
        limit = int(HOST_SHARE * host_free / processes)
        return CheckpointDefault(
            OffloadedCheckpointing(explicit=False, host_limit=limit),
            f"a 4-bit base under the model's checkpointing of every layer; the host copies may take half of the "
            f"host's free memory{', split between its ' + str(processes) + ' processes' if processes > 1 else ''}"
            f"{'; ' + trimmed if output_projections else ''}; checkpointing='full' keeps them on the device",
        )
    if not output_projections:
        return CheckpointDefault(None, "its family has no output projection a recompute may skip"
                                 if not base_4bit else "host-memory offload runs on CUDA only")
    if not all(_non_reentrant(getattr(layer, "_gradient_checkpointing_func", None)) for layer in decoder_layers(model)):
        # a reentrant recompute's output is used (no trim there), and reentrant may be someone's requirement
        # (DeepSpeed ZeRO-3 with PEFT): left as it is
        return CheckpointDefault(None, "the model checkpoints reentrant")
    return CheckpointDefault(FullCheckpointing(explicit=False),
                             f"the model's checkpointing of every layer, as hf_accel's policy: {trimmed}")


def _plain_full_checkpointing(model: nn.Module) -> str | None:
    """None where every decoder layer checkpoints through transformers' own function (torch's checkpoint, either
    variant: they compute the same), else why the defaults leave the checkpointing alone."""
    if applied_policy(model) is not None:
        return "an hf_accel checkpointing policy is applied"
    if fsdp_activation_checkpointing_active(model):
        return "FSDP's activation checkpointing is on"
    layers = decoder_layers(model)
    if not layers or not all(getattr(layer, "gradient_checkpointing", False) for layer in layers):
        return "the model does not checkpoint every decoder layer"
    if not all(_torch_checkpoint(getattr(layer, "_gradient_checkpointing_func", None)) for layer in layers):
        return "the model's layers checkpoint through a function or options of their own"
    return None


def _torch_checkpoint(func) -> bool:
    """torch's checkpoint as transformers binds it: the function itself, or a partial of it taking ``use_reentrant``
    only (a ``context_fn`` is a selective checkpoint, a choice of its own)."""
    if isinstance(func, functools.partial):
        return func.func is checkpoint and not func.args and set(func.keywords) <= {"use_reentrant"}
    return func is checkpoint


def _non_reentrant(func) -> bool:
    return isinstance(func, functools.partial) and func.keywords.get("use_reentrant") is False
