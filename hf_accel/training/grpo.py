"""``hf_accel.GRPOTrainer``: TRL's ``GRPOTrainer`` with hf_accel's patch on the policy (and on a separate reference
model), and the scoring forwards of prompt + completion run padding-free on one packed row.

TRL 1.16's GRPO step: ``_prepare_inputs`` generates (``model.generate`` or vLLM) and scores the completions, then every
scoring forward (the policy's with gradients, the old policy's and the reference's without) goes through
``_get_per_token_logps_and_entropies``: ``model(input_ids, attention_mask, labels, fused_lm_head=True)`` on rows of
left-padded prompt + right-padded completion, answered by TRL's chunked LM head (``add_fused_lm_head``: per-token
log-probabilities and entropies, no ``(tokens, vocab)`` logits). ``hf_accel.training.dpo.bind_packed_forward`` packs
those rows (each token keeps its column as its position, so the numbers are the padded forward's) and hands back the
padded-shape fields; TRL computes its loss (every ``loss_type``), KL, clipping, entropy masks and metrics from them
unchanged.

Generation is TRL's, untouched: ``model.generate`` calls carry no ``fused_lm_head`` and reach the stock forward
(the patched attention serves its prefill; decode steps behind a KV cache run transformers' own attention), and vLLM
is a separate engine.
"""
from __future__ import annotations

from typing import Any

import torch
import trl

from . import non_finite
from .dpo import PackedTRLMixin
from .trainer import AccelArguments, AccelMixin


class RolloutTrainerMixin(PackedTRLMixin):
    """What TRL's trainers over generated completions share (``(model, reward_funcs, args, ...)``: GRPO, RLOO): the
    constructor (``accel`` checked, vision models refused, TRL's own constructor, then the patch and the packing),
    the throughput meter fed from the generated batch, and the reference note."""

    _batches = "per_device_train_batch_size=..., num_generations=..."
    _rows = "prompt + completion"
    _left_padded = True

    def __init__(self, model: Any, reward_funcs: Any = None, args: Any = None, *pos,
                 accel: AccelArguments | None = None, **kwargs) -> None:
        args, accel = self._accel_before_trl(model, args, accel)
        super().__init__(model, reward_funcs, args, *pos, **kwargs)
        self._accel_after_trl(accel)

    def training_step(self, model, inputs, num_items_in_batch):
        # the inputs are dataset rows (generation happens in _prepare_inputs): AccelMixin's accounting of a collated
        # batch does not apply (TRL's training_step, after AccelMixin's in the MRO); the meter counts the generated
        # batch in compute_loss instead
        loss = super(AccelMixin, self).training_step(model, inputs, num_items_in_batch)
        return non_finite.note_loss(self, loss)

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        if self._meter is not None and self.model.training:
            self._meter.add_batch({
                "input_ids": torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], dim=1),
                "attention_mask": torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], dim=1),
            }, packed=self._accel_packs_padded_rows)
        return super().compute_loss(model, inputs, return_outputs=return_outputs,
                                    num_items_in_batch=num_items_in_batch)

    def _reference_note(self) -> str:
        if self.beta == 0.0:
            return "reference: none (beta=0.0: TRL computes no KL term)"
        return super()._reference_note()


class GRPOTrainer(RolloutTrainerMixin, AccelMixin, trl.GRPOTrainer):
    """``trl.GRPOTrainer`` plus ``accel`` (an ``AccelArguments``). ``accel.packing`` (default True): the policy's and
    the reference's scoring forwards run padding-free on one packed row; False keeps TRL's padded rows (the patch
    still applies). Generation stays TRL's. ``accel.max_tokens_per_batch`` is not served (TRL forms the batches)."""

    _name = "hf_accel.GRPOTrainer"
    _config = "GRPOConfig"
