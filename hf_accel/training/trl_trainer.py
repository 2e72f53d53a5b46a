"""``hf_accel.training.trainer.SFTTrainer``: TRL's ``SFTTrainer`` with hf_accel's patch, checkpoint policy, throughput
logging and atomic checkpoints.

TRL 1.16 owns the data path here: with ``packing=True`` (strategy "bfd") or ``padding_free=True`` it refuses custom
collators and emits one flattened row with ``position_ids``, ``cu_seq_lens_q/k`` and int ``max_length_q/k``, which
our attention seam consumes directly. During training it swaps ``model.forward`` for its fused LM-head forward; that
sits above the attention modules we patch, so the patch stays in effect (for Falcon too, where stock attention
would let packed documents attend to each other).
"""
from __future__ import annotations

from typing import Any

import torch
import trl

from ..errors import ConfigurationError
from .trainer import AccelArguments, AccelMixin


class SFTTrainer(AccelMixin, trl.SFTTrainer):
    """``trl.SFTTrainer`` plus ``accel`` (an ``AccelArguments``; its ``packing``, ``max_tokens_per_batch`` and
    ``fused_ce`` are TRL's business here: use ``SFTConfig(packing=..., max_length=...)``). Without ``args`` it
    trains padding-free with BFD packing (``SFTConfig(packing=True)``)."""

    def __init__(self, model: Any, args: trl.SFTConfig | None = None, *pos, accel: AccelArguments | None = None,
                 **kwargs) -> None:
        if accel is not None and accel.fused_ce is True:
            raise ConfigurationError(
                "AccelArguments(fused_ce=True) is not available through TRL (it replaces model.forward with its own "
                "LM-head forward); use SFTConfig(use_liger_kernel=True) or hf_accel.Trainer."
            )
        if args is None:
            on_gpu = torch.cuda.is_available()
            args = trl.SFTConfig(output_dir="hf_accel-sft", packing=True, report_to="none", bf16=on_gpu,
                                 use_cpu=not on_gpu)
        if accel is not None and accel.checkpointing is not None:
            # our policy decides which layers recompute; keep TRL from enabling full checkpointing on top
            for name in ("gradient_checkpointing", "activation_checkpointing"):  # 5.23 renamed the field
                if hasattr(args, name):
                    setattr(args, name, False)
        super().__init__(model, args, *pos, **kwargs)
        self._accel_setup(accel)

    def _accel_fused_ce(self) -> Any:
        return False  # TRL replaces model.forward during training: a loss bound there would never run
