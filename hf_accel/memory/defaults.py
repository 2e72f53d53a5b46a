"""What ``patch(model)`` does with the model's own checkpointing when ``checkpointing`` is left alone (None).

A 4-bit base under transformers' own checkpointing of every decoder layer (PEFT's ``prepare_model_for_kbit_training``
turns it on) keeps each layer's saved input on the device until backward: fp32 after the kbit preparation, 256 MiB a
layer at 16k tokens of Llama-3-8B, 8 GiB for its 32 layers. On CUDA the defaults keep those inputs in pinned host
memory instead (``OffloadedCheckpointing``: the same recompute, the same gradients bit for bit), as long as the copies
fit in a share of the host memory that is free when patch() runs; past it a layer's input stays on the device. The
copies travel on a side stream behind a layer's compute: Llama-3-8B QLoRA trained at the on-device speed in 15.0 GiB
instead of 21.5 (docs/qlora.md, one H200). Every other model keeps its checkpointing as it is (``checkpointing=
"offload"`` asks for the same there), and ``checkpointing="full"`` keeps a 4-bit base's inputs on the device.
"""
from __future__ import annotations

import functools
import os
from dataclasses import dataclass

from torch import nn
from torch.utils.checkpoint import checkpoint

from .policies import OffloadedCheckpointing, applied_policy
from .targets import decoder_layers, fsdp_activation_checkpointing_active
from ..attention.kernels.base import DeviceInfo

HOST_SHARE = 0.5  # of the host memory free at patch time (split between the processes of one machine)


@dataclass(frozen=True)
class CheckpointStorage:
    """Where the defaults keep checkpointed layers' saved inputs: ``policy`` None leaves the model's checkpointing as
    it is; ``why`` says why, one line."""

    policy: OffloadedCheckpointing | None
    why: str

    def describe(self) -> str:
        if self.policy is None:
            return f"the model's own ({self.why})"
        return f"{self.policy.describe()} (auto: {self.why})"


def checkpoint_storage(model: nn.Module, device: DeviceInfo, *, base_4bit: bool, host_free: int | None = None,
                       processes: int | None = None) -> CheckpointStorage:
    """The defaults' choice for ``model`` on ``device``. ``base_4bit``: its linears are 4-bit (bitsandbytes
    ``Linear4bit``). ``host_free`` (bytes) and ``processes`` (on this machine) default to what the host reports
    (``LOCAL_WORLD_SIZE``); tests pass them."""
    if not base_4bit:
        return CheckpointStorage(None, "not a 4-bit base")
    if device.type != "cuda":
        return CheckpointStorage(None, "host-memory offload runs on CUDA only")
    why_not = _plain_full_checkpointing(model)
    if why_not is not None:
        return CheckpointStorage(None, why_not)
    host_free = _host_free() if host_free is None else host_free
    processes = max(1, int(os.environ.get("LOCAL_WORLD_SIZE", 1)) if processes is None else processes)
    limit = int(HOST_SHARE * host_free / processes)
    return CheckpointStorage(
        OffloadedCheckpointing(explicit=False, host_limit=limit),
        f"a 4-bit base under the model's checkpointing of every layer; the host copies may take half of the host's "
        f"free memory{', split between its ' + str(processes) + ' processes' if processes > 1 else ''}; "
        "checkpointing='full' keeps them on the device",
    )


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


def _host_free() -> int:
    import psutil  # accelerate's dependency

    return psutil.virtual_memory().available
