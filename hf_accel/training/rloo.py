"""``hf_accel.RLOOTrainer``: TRL's ``RLOOTrainer`` (REINFORCE leave-one-out) with hf_accel's patch on the policy (and
on a separate reference model), and the scoring forwards of prompt + completion run padding-free on one packed row.

TRL 1.16's RLOO step is GRPO's in shape: ``_prepare_inputs`` generates and scores the completions, and every scoring
forward (the policy's with gradients, the old policy's and the reference's without) calls
``model(input_ids, attention_mask, labels, fused_lm_head=True)`` on rows of left-padded prompt + right-padded
completion. ``hf_accel.training.grpo.RolloutTrainerMixin`` packs them as it does GRPO's; the leave-one-out baseline,
the KL in the reward, clipping and every metric are TRL's, computed from the same per-token numbers.
"""
from __future__ import annotations

import trl

from .grpo import RolloutTrainerMixin
from .trainer import AccelMixin


class RLOOTrainer(RolloutTrainerMixin, AccelMixin, trl.RLOOTrainer):
    """``trl.RLOOTrainer`` plus ``accel`` (an ``AccelArguments``), as ``hf_accel.GRPOTrainer``: ``accel.packing``
    (default True) packs the scoring forwards; generation stays TRL's; ``accel.max_tokens_per_batch`` is not served
    (TRL forms the batches)."""

    _name = "hf_accel.RLOOTrainer"
    _config = "RLOOConfig"
