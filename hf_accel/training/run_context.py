"""The run a Trainer applies its checkpoint policy for (``memory.context.RunContext``), from the Trainer's state: a
micro-batch of the size this run trains on, how the training state is sharded, whether gradients are freed before
each forward, and the autocast accelerate runs the forwards under.
"""
from __future__ import annotations

from typing import Any

from .data_loading import micro_batch_tokens


def run_context(trainer: Any) -> Any:
    """The ``RunContext`` of ``trainer``'s run: transformers' loop frees the gradients after each optimizer step
    (set_to_none), so with one micro-batch per step none exist during a forward; DeepSpeed keeps its own buffers.
    The autocast is read from accelerate's own context, the one it wraps the forwards in."""
    from ..memory.context import autocast_dtype, run_context as assemble

    return assemble(batch_tokens=micro_batch_tokens(trainer),
                    accumulation_steps=trainer.args.gradient_accumulation_steps,
                    engine_keeps_grads=getattr(trainer, "is_deepspeed_enabled", False),
                    sharding=sharding(trainer),
                    autocast=autocast_dtype(trainer.args.device.type, trainer.accelerator.autocast()))


def sharding(trainer: Any) -> Any:
    """How this process will hold the training state (``memory.state.Sharding``): under FSDP2 and DeepSpeed ZeRO-3 a
    1/world_size share, trainable parameters as fp32 master weights under mixed precision (accelerate upcasts them
    for FSDP2; DeepSpeed casts every parameter to bf16/fp16 and keeps an fp32 partition of the trainable ones).
    None: unsharded."""
    from ..memory.state import Sharding

    args = trainer.args
    mixed = args.bf16 or args.fp16
    if getattr(trainer, "is_fsdp_enabled", False) and getattr(trainer.accelerator, "is_fsdp2", False):
        return Sharding("fsdp2", args.world_size, 4 if mixed else None, 2 if mixed else None)
    plugin = getattr(trainer.accelerator.state, "deepspeed_plugin", None) \
        if getattr(trainer, "is_deepspeed_enabled", False) else None
    if plugin is not None and plugin.zero_stage == 3:
        return Sharding("zero3", args.world_size, 4 if mixed else None, 2 if mixed else None)
    return None
