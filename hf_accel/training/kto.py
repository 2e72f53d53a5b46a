"""``hf_accel.KTOTrainer``: TRL's ``KTOTrainer`` with hf_accel's patch on the policy and the reference model, and the
completion forwards (and the KL forwards of mismatched pairs) run padding-free on one packed row.

TRL 1.16's KTO data path: ``DataCollatorForUnpairedPreference`` right-pads prompt + completion rows (and the
``KL_*`` rows that pair each prompt with another example's completion), and ``_compute_loss`` calls the policy and
the reference as ``model(input_ids, attention_mask, labels, fused_lm_head=True)``, as DPO's does.
``hf_accel.training.dpo.ReferenceTrainerMixin`` packs those calls as it does DPO's; the KTO loss, its KL estimate,
the desirable / undesirable weights and every metric are TRL's, computed from the same per-token numbers.
"""
from __future__ import annotations

import trl

from .dpo import ReferenceTrainerMixin
from .trainer import AccelMixin


class KTOTrainer(ReferenceTrainerMixin, AccelMixin, trl.KTOTrainer):
    """``trl.KTOTrainer`` plus ``accel`` (an ``AccelArguments``), as ``hf_accel.DPOTrainer``: ``accel.packing``
    (default True) packs the forwards of the policy and of the reference model; ``accel.max_tokens_per_batch`` is not
    served (TRL's ``per_device_train_batch_size`` forms the batches)."""

    _name = "hf_accel.KTOTrainer"
    _rows = "completion (and KL) rows"
    _config = "KTOConfig"
