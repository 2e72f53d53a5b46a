"""``hf_accel.training.trainer.SFTTrainer``: TRL's ``SFTTrainer`` with hf_accel's patch, its fused loss, checkpoint
policy, throughput logging and atomic checkpoints.

TRL 1.16 owns the data path here: with ``packing=True`` (strategy "bfd" or "wrapped") or ``padding_free=True`` it
refuses custom collators and emits flattened rows with ``position_ids`` (and, where its collator adds them,
``cu_seq_lens_q/k`` and int ``max_length_q/k``), which our attention seam consumes directly. During training it calls
its fused LM-head forward; that sits above the attention modules we patch, so the patch stays in effect (for Falcon
too, where stock attention would let packed documents attend to each other). The loss of a training step comes from
hf_accel's fused loss in TRL's loss form, TRL's metrics alongside (``hf_accel.training.trl_loss``), where it can.

Text models only: a vision-language model is refused (the patch's seam is the decoder's attention of a causal LM).
"""
from __future__ import annotations

import logging
from typing import Any

import torch
import trl

from ..errors import ConfigurationError
from ..fused.cross_entropy import TARGET_ROWS_KEY
from . import trl_loss
from .trainer import AccelArguments, AccelMixin

logger = logging.getLogger("hf_accel")


class SFTTrainer(AccelMixin, trl.SFTTrainer):
    """``trl.SFTTrainer`` plus ``accel`` (an ``AccelArguments``; its ``packing`` and ``max_tokens_per_batch`` are TRL's
    business here: use ``SFTConfig(packing=..., max_length=...)``). ``accel.fused_ce`` picks the training loss:
    "auto" (hf_accel's fused loss on CUDA), True (also elsewhere) or False (TRL's own). Without ``args`` it trains
    padding-free with BFD packing (``SFTConfig(packing=True)``)."""

    def __init__(self, model: Any, args: trl.SFTConfig | None = None, *pos, accel: AccelArguments | None = None,
                 **kwargs) -> None:
        if args is None:
            on_gpu = torch.cuda.is_available()
            args = trl.SFTConfig(output_dir="hf_accel-sft", packing=True, report_to="none", bf16=on_gpu,
                                 use_cpu=not on_gpu)
        if accel is not None and accel.checkpointing is not None:
            # our policy decides which layers recompute; keep TRL from enabling full checkpointing on top
            for name in ("gradient_checkpointing", "activation_checkpointing"):  # 5.23 renamed the field
                if hasattr(args, name):
                    setattr(args, name, False)
        if not isinstance(model, str):
            refuse_vision(model, "hf_accel.SFTTrainer")
        super().__init__(model, args, *pos, **kwargs)
        refuse_vision(self.model, "hf_accel.SFTTrainer")  # (TRL loads a model given by name)
        self._accel_setup(accel)
        self._refuse_packing_it_cannot_keep_apart()
        self._loss_warned: set[str] = set()
        self._hf_accel_loss = trl_loss.unserved_reason(self)
        if self._hf_accel_loss is None:
            base = self.model.get_base_model() if hasattr(self.model, "get_base_model") else self.model
            trl_loss.bind_head(base)
            self.data_collator = trl_loss.add_target_rows(self.data_collator)
            self._loss_note(f"loss: TRL's SFT loss ({_loss_name(self)}) and its metrics from hf_accel's fused loss "
                            "(target rows only, gradients in the forward, no full logits)")
            self._speedup_line("fused_ce: on (TRL's loss form, bound above TRL's LM-head forward; see the loss note)")
        else:
            self._loss_note(f"loss: TRL's own ({self._hf_accel_loss})")
            self._speedup_line(f"fused_ce: off (TRL's own loss: {self._hf_accel_loss})")

    def _refuse_packing_it_cannot_keep_apart(self) -> None:
        """TRL packs (``packing=True``) or lays documents end to end (``padding_free=True``); a patched model whose
        report says it would not keep them apart (its own positions, token mixing outside the seam) is refused here,
        before training, and left unpatched."""
        report = self.patch_report
        packs = [name for name in ("packing", "padding_free") if getattr(self.args, name, False)]
        if report is None or not report.packing or not packs:
            return
        from ..patching import unpatch

        unpatch(self.model)
        raise ConfigurationError(
            f"SFTConfig({', '.join(f'{name}=True' for name in packs)}) puts several documents in one row, and this "
            f"model would let them reach each other: {report.packing}. Pass SFTConfig(packing=False, "
            "padding_free=False) to train on padded rows.")

    def _accel_fused_ce(self) -> Any:
        return False  # TRL's forward replaces model.forward during training: our loss is bound above it instead

    def _accel_check_explicit(self) -> None:
        accel = self.accel
        if accel.fused_ce is not True or accel.patch:
            return super()._accel_check_explicit()
        accel.fused_ce = "auto"  # here the fused loss is bound by this trainer, not by patch(): allowed unpatched
        try:
            super()._accel_check_explicit()
        finally:
            accel.fused_ce = True

    def _speedup_line(self, line: str) -> None:
        """The report's fused_ce line says what serves the loss here (patch() itself binds none under TRL)."""
        if self.patch_report is not None:
            self.patch_report.speedups = [line if old.startswith("fused_ce:") else old
                                          for old in self.patch_report.speedups]

    def _loss_note(self, line: str) -> None:
        logger.info("hf_accel: %s", line)
        if self.patch_report is not None and line not in self.patch_report.notes:
            self.patch_report.notes.append(line)

    def _loss_falls_back(self, why: str) -> None:
        line = f"loss: TRL's own for this model's training steps ({why})"
        if line not in self._loss_warned:
            self._loss_warned.add(line)
            logger.warning("hf_accel: %s", line)
            self._loss_note(line)

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        rows = inputs.pop(TARGET_ROWS_KEY, None)
        if (self._hf_accel_loss is None and not return_outputs and self.model.training
                and torch.is_grad_enabled()):
            base = self.model.get_base_model() if hasattr(self.model, "get_base_model") else self.model
            why = trl_loss.head_reason(base)  # per call: a wrapper may swap the head after __init__
            if why is None:
                return trl_loss.compute_loss(self, model, inputs, num_items_in_batch, rows)
            self._loss_falls_back(why)
        return super().compute_loss(model, inputs, return_outputs=return_outputs,
                                     num_items_in_batch=num_items_in_batch)

    def log(self, logs: dict[str, float], *args, **kwargs) -> None:
        trl_loss.resolve_metrics(self)  # the device-side metrics of the steps since the last log, read back once
        super().log(logs, *args, **kwargs)


def _loss_name(trainer: Any) -> str:
    form = trl_loss.loss_form(trainer.args, trainer.label_smoother)
    name = f"loss_type={trainer.args.loss_type!r}"
    if form.label_smoothing:
        name += f", label_smoothing_factor={form.label_smoothing}"
    if trainer.aux_loss_enabled:
        name += f", router_aux_loss_coef={trainer.router_aux_loss_coef}"
    return name


def refuse_vision(model: Any, name: str) -> None:
    """Refuses a model with a vision (or other non-text) tower: ``name``'s trainer (``hf_accel.SFTTrainer``, ...)
    trains text-only causal LMs. A model given by name (a str) is checked once TRL has loaded it."""
    config = getattr(model, "config", None)
    if config is not None and config.get_text_config() is not config:
        raise ConfigurationError(
            f"{name} trains text-only causal LMs; got {type(model).__name__} ({config.model_type}), a model with a "
            f"vision (or other non-text) tower. Train it with trl.{name.rsplit('.', 1)[-1]}, or fine-tune its "
            f"language model alone with {name}: hf_accel.text_model(model) gives it as a causal LM sharing this "
            "model's weights."
        )
