"""``hf_accel.training.trainer.Trainer``: a drop-in ``transformers.Trainer`` that patches the model, packs batches, applies a
checkpoint policy, logs real throughput, and saves checkpoints atomically (optionally in the background).

This module keeps the classes and the training-loop hooks; each concern the mixin wires lives in its own module:
``data_loading`` (tokenizing, the default collator, the token-budget loader), ``compile_rules`` (when a compile
request stands), ``run_context`` (the run a checkpoint policy is applied for), ``sequence_parallel`` (DeepSpeed
Ulysses wiring and resume), ``checkpoint_hooks`` (checkpoint files).

``hf_accel.training.trainer.SFTTrainer`` (TRL's ``SFTTrainer`` with the same behaviour) lives in ``trl_trainer.py`` and is
imported lazily, so TRL stays optional.

Loss normalisation is transformers' own: the Trainer counts the targets of every micro-batch of an optimizer step
(``num_items_in_batch``) and the model divides its summed cross-entropy by it, so packed, padded and regrouped
batches of the same samples give the same loss (see ``hf_accel.training.loss``).
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any

import transformers
from torch.utils.data import DataLoader

from . import checkpoint_io, compile_rules, cpu_threads, data_loading, non_finite, run_context, sequence_parallel
from .checkpoint_hooks import CheckpointFilesMixin, ReserveSnapshotAhead, RestoreLossWindow
from .data_loading import tokenize_dataset  # noqa: F401 (re-exported)
from .metrics import ThroughputMeter, format_summary
from .snapshot import SnapshotBuffers
from ..data.collators import REAL_TOKENS_KEY
from ..errors import ConfigurationError
from ..patch_options import PatchOptions
from ..patching import patch

logger = logging.getLogger("hf_accel")

__all__ = ["AccelArguments", "Trainer", "SFTTrainer"]


@dataclass
class AccelArguments:
    """What hf_accel adds to a Trainer.

    patch: route attention through hf_accel (False = stock transformers, for speed comparisons).
    backend: attention backend for ``hf_accel.patch`` ("auto", "fa4", "torch-fa2", "sdpa", ...).
    packing: padding-free batches (one packed row per micro-batch); False = dynamic padding.
    max_tokens_per_batch: with packing, form micro-batches by a token budget (``TokenBudgetBatchSampler``) instead of
        ``per_device_train_batch_size`` examples.
    checkpointing: a checkpoint policy or spec ("full", "every_2", "op", "budget:20GiB"); None leaves the model and
        ``TrainingArguments.gradient_checkpointing`` alone.
    fused_ce: training loss from hidden states by chunked cross-entropy (hf_accel.fused.cross_entropy), no full logits tensor
        (``patch(fused_ce=True)``: computed inside the model's forward, so DDP/FSDP see it).
    fused_ops: liger-kernel's fused norms / SwiGLU bound to this model (``patch(fused_ops=True)``; CUDA + liger).
    compile: each decoder layer's training forward through torch.compile, attention excluded (``patch(compile=...)``:
        True or a dict of torch.compile options). Costs a compile at the first steps; eval / generate stay eager.
    fused_ce, fused_ops and compile default to "auto": ``patch()``'s choice (on CUDA all three where they apply, off
        elsewhere; the report says why); "auto" compile also stands down under ``torch_compile``, FSDP1 and DeepSpeed.
    mlp_chunks: each decoder layer's MLP over chunks of tokens, each chunk checkpointed (``patch(mlp_chunks=...)``):
        "auto" (training calls whose MLP intermediates would exceed 16 GiB), a chunk size in tokens, or False.
    precision: None (the weights' own) or "fp8": the decoder linears train through torchao's float8 training
        (``patch(precision="fp8")``: full fine-tuning, an explicit opt-in that changes the computation).
    async_save: write checkpoints on a background thread after copying the state to CPU (single process only).
    save: what a checkpoint holds of the model: "full" (every weight, loadable by ``from_pretrained``) or
        "trainable" (only the parameters that train, plus a fingerprint of the frozen part that resume checks).
    layer_shards: with save="full", checkpoint weights as one safetensors file per decoder layer (+ embeddings, +
        the rest) with the standard index, so ``from_pretrained`` loads them and ``shards.load_layer_range`` reads
        only the layers it needs.
    overwrite_output_dir: a new run (no resume) clears ``output_dir`` first; without it a non-empty ``output_dir``
        is refused, so a run never mixes with an earlier run's files.
    print_summary: print a throughput table when training ends.
    non_blocking: copy each batch to the GPU without blocking the host (with ``dataloader_pin_memory``, the default).
        transformers' default copies blocking, and a blocking copy waits for the GPU to finish the previous step, so
        every step starts from an idle GPU. False keeps transformers' setting.
    non_finite: what a non-finite loss or gradient norm does: "stop" (raise ``NonFiniteLoss`` naming the step, with
        nothing of that step saved) or "skip" (drop that step's update and count it in ``Trainer.skipped_steps``;
        one host sync a step). See ``hf_accel.training.non_finite``.
    cpu_threads: torch's CPU threads while training on the CPU: "auto" (one less than the usable cores unless
        ``OMP_NUM_THREADS`` or ``torch.set_num_threads`` chose fewer; see ``hf_accel.training.cpu_threads``), a number,
        or None (torch's setting as it is).
    """

    patch: bool = True
    backend: str = "auto"
    packing: bool = True
    max_tokens_per_batch: int | None = None
    checkpointing: Any = None
    fused_ce: Any = "auto"
    fused_ops: Any = "auto"
    compile: Any = "auto"
    mlp_chunks: Any = "auto"
    precision: str | None = None
    async_save: bool = False
    save: str = "full"
    layer_shards: bool = False
    overwrite_output_dir: bool = False
    print_summary: bool = True
    non_blocking: bool = True
    non_finite: str = "stop"
    cpu_threads: Any = "auto"

    def patch_options(self, **decided: Any) -> PatchOptions:
        """These arguments as ``patch()``'s options (validated here: a bad value raises ConfigurationError), with
        what the Trainer ``decided`` for its run (fused_ce, compile and why "auto" compile stands down)."""
        given = dict(backend=self.backend, checkpointing=self.checkpointing, fused_ops=self.fused_ops,
                     fused_ce=self.fused_ce, compile=self.compile, mlp_chunks=self.mlp_chunks,
                     precision=self.precision)
        return PatchOptions(**{**given, **decided})


class AccelMixin(CheckpointFilesMixin):
    """The behaviour shared by ``Trainer`` and ``SFTTrainer``; expects to sit before a transformers Trainer in MRO."""

    accel: AccelArguments

    def _accel_setup(self, accel: AccelArguments | None) -> None:
        self.accel = accel or AccelArguments()
        self.patch_report = None
        self._accel_check_explicit()
        self._accel_patch()
        self._accel_sequence_parallel()
        if self.accel.async_save and self.args.world_size > 1:
            raise ConfigurationError(
                f"async_save=True with world_size={self.args.world_size}; background saves support one process only. "
                "Pass async_save=False (saves are still atomic)."
            )
        if self.accel.non_blocking and self.args.dataloader_pin_memory:
            # read when the Trainer prepares its dataloaders (accelerate's send_to_device(non_blocking=...))
            self.accelerator.dataloader_config.non_blocking = True
        self._check_save_options()
        self._guard = non_finite.guard_for(self)
        self._writer = checkpoint_io.AsyncWriter()
        self._buffers = SnapshotBuffers()
        self.add_callback(ReserveSnapshotAhead(self))
        self.add_callback(RestoreLossWindow(self))
        self._resumed_loss_window = None
        self._run_record: dict[str, Any] | None = None
        self._frozen_fingerprint: dict[str, Any] | None = None
        self._saving_checkpoint = False
        self._meter: ThroughputMeter | None = None
        self.throughput_summary: dict[str, float] | None = None

    def _accel_patch(self) -> None:
        """patch() with the options this run decides (or, unpatched, the checkpoint policy alone), the policy given
        the run it is applied for."""
        options = self.accel.patch_options(fused_ce=self._accel_fused_ce(), compile=self._accel_compile(),
                                           compile_stand_down=self._accel_compile_stands_down())
        policy = self._accel_applied_policy = options.policy
        context = self._accel_run_context() if policy is not None and policy.needs_run_context else None
        if self.accel.patch:
            self.patch_report = patch(self.model, options=options, context=context)
            logger.info("%s", self.patch_report)
            if self.patch_report.packing and getattr(self, "_own_collator", False) \
                    and hasattr(self.data_collator, "use_padding"):
                self.data_collator.use_padding(f"the patched model would not keep packed documents apart: "
                                               f"{self.patch_report.packing}")
        elif policy is not None:
            policy.apply(self.model, context)
        if self.patch_report is not None and self.patch_report.fused_ce and getattr(self, "_own_collator", False) \
                and hasattr(self.data_collator, "target_rows") and self.args.n_gpu <= 1:
            # the fused loss consumes the collator's target rows (and takes them out of the batch): no LM-head work
            # for masked positions. Only then: a stock forward must not receive the key. Not under nn.DataParallel
            # (several GPUs, one process): it splits every tensor of the batch along dim 0, the (T,) list too.
            self.data_collator.target_rows = True

    def _accel_default_checkpointing(self) -> None:
        """patch()'s default for the model's own checkpointing (``memory.defaults``: trimmed recompute, a 4-bit
        base's inputs in host memory), applied to the checkpointing ``train()`` turned on; the report says what it
        chose."""
        from ..patching import checkpoint_default

        default = checkpoint_default(self.model)
        if default.policy is not None:
            default.policy.apply(self.model)
            self.patch_report.checkpointing = default.describe()
            logger.info("hf_accel: checkpointing: %s", self.patch_report.checkpointing)

    # ---- each concern lives in its own module; these name them for the Trainers (and for tests' stand-ins) ------
    def _accel_sequence_parallel(self) -> None:
        sequence_parallel.wire(self)

    def _accel_check_explicit(self) -> None:
        compile_rules.check_explicit(self)

    def _accel_fused_ce(self) -> Any:
        return self.accel.fused_ce

    def _accel_compile(self) -> Any:
        return compile_rules.compile_setting(self)

    def _accel_compile_stands_down(self) -> str | None:
        return compile_rules.stand_down_reason(self)

    def _accel_run_context(self) -> Any:
        return run_context.run_context(self)

    def _accel_sharding(self) -> Any:
        return run_context.sharding(self)

    # ---- training loop hooks -------------------------------------------------------------------------------------

    def _inner_training_loop(self, *args, **kwargs):
        # Trainer.train() has just (re-)enabled checkpointing from its args: put our policy's choices back, or, where
        # patch() found no checkpointing of the model's to take over (memory.defaults), decide again now.
        from ..memory.checkpointing import applied_policy, reapply_checkpointing

        if applied_policy(self.model) is not None:
            reapply_checkpointing(self.model)
        elif self.accel.checkpointing is None and self.patch_report is not None:
            self._accel_default_checkpointing()
        self._meter = ThroughputMeter(self.model, self.args.device)
        # transformers' per-step NaN/inf check (logging_nan_inf_filter, on by default) reads every loss back: a host
        # sync that leaves the GPU idle while the next batch is collated (TRL collates in the training process). The
        # guard covers what it filters, on the device: "stop" raises at the log that would show a non-finite loss,
        # "skip" logs the interval's average in its place (non_finite.note_loss), as the filter does.
        kept = self.args.logging_nan_inf_filter
        self.args.logging_nan_inf_filter = False
        try:
            return super()._inner_training_loop(*args, **kwargs)
        finally:
            self.args.logging_nan_inf_filter = kept

    def _run_epoch(self, *args, **kwargs):
        with sequence_parallel.resume_skip(self):  # a resume under Ulysses skips inside DeepSpeed's loader adapter
            return super()._run_epoch(*args, **kwargs)

    def train(self, resume_from_checkpoint: str | bool | None = None, *args, **kwargs):
        resume_from_checkpoint = self._prepare_run(resume_from_checkpoint)
        try:
            with cpu_threads.for_training(self.accel.cpu_threads, self.args.device):
                out = super().train(resume_from_checkpoint, *args, **kwargs)
            non_finite.stop_if_found(self, weights=True)  # before anything saves the model this run ends with
        finally:
            self._writer.wait()
            self._sync_compile_notes()
        # After a normal end only: a summary's device reads must not replace the exception of a failed run.
        if self._meter is not None:
            from ..memory.budget import plan_vs_peak

            self.throughput_summary = self._meter.summary()
            # a memory budget's plan against what the run measured (is the plan tight, or over?)
            self.throughput_summary.update(
                plan_vs_peak(self._accel_applied_policy, self.throughput_summary.get("peak_mem_gib")))
            if self.accel.print_summary and self.args.should_log:
                print(format_summary(self.throughput_summary), flush=True)
        return out

    def get_batch_samples(self, *args, **kwargs):
        start = time.perf_counter()
        out = super().get_batch_samples(*args, **kwargs)
        if self._meter is not None:
            self._meter.add_wait(time.perf_counter() - start)
        return out

    # the meter counts a padded batch's slots as computed (True where the forwards run its real tokens packed)
    _accel_packs_padded_rows = False

    def training_step(self, model, inputs, *args, **kwargs):
        if self._meter is not None:
            self._meter.add_batch(inputs, packed=self._accel_packs_padded_rows)
        inputs.pop(REAL_TOKENS_KEY, None)  # the meter's, not the model's
        loss = super().training_step(model, inputs, *args, **kwargs)
        return non_finite.note_loss(self, loss)

    def _get_grad_norm(self, model, grad_norm=None):
        grad_norm = super()._get_grad_norm(model, grad_norm=grad_norm)
        non_finite.note_grad_norm(self, model, grad_norm)  # before the optimizer step (skip mode drops it here)
        return grad_norm

    @property
    def skipped_steps(self) -> int:
        """Steps skipped for a non-finite loss or gradient norm (``AccelArguments(non_finite="skip")``)."""
        return self._guard.skipped_steps

    def log(self, logs: dict[str, float], *args, **kwargs) -> None:
        if "loss" in logs and self._meter is not None:
            logs.update(self._meter.pop())
        if "loss" in logs and self._guard.mode == "skip":
            logs["skipped_steps"] = self._guard.skipped_steps
        self._sync_compile_notes()
        super().log(logs, *args, **kwargs)
        if "loss" in logs:  # the loss was just read back: stop here if anything was non-finite
            non_finite.stop_if_found(self)

    def _sync_compile_notes(self) -> None:
        """What the compiled layers decided about liger's / hub kernels' forwards (bound when train() starts) goes
        into the PatchReport's notes."""
        if getattr(self, "patch_report", None) is None:
            return
        from ..fused.foreign_forwards import compile_notes

        model = self.model.get_base_model() if hasattr(self.model, "get_base_model") else self.model
        self.patch_report.notes += [n for n in compile_notes(model) if n not in self.patch_report.notes]


class Trainer(AccelMixin, transformers.Trainer):
    """``transformers.Trainer`` with hf_accel's attention patch, packing collator, token-budget sampler, checkpoint
    policy, throughput logging and atomic checkpoints. Takes every ``transformers.Trainer`` argument plus ``accel``.

    Datasets may be pre-tokenized (``input_ids``, optional ``labels``) or raw (``messages``, ``prompt``/``completion``
    or ``text``; tokenized here with ``processing_class``, labels on completions / assistant turns only).
    """

    def __init__(self, model=None, args=None, data_collator=None, train_dataset=None, eval_dataset=None,
                 processing_class=None, *, accel: AccelArguments | None = None, **kwargs) -> None:
        accel = accel or AccelArguments()
        datasets = [data_loading.tokenized(dataset, processing_class) for dataset in (train_dataset, eval_dataset)]
        self._own_collator = data_collator is None
        if data_collator is None:
            data_collator = data_loading.default_collator(model, processing_class, accel)
        super().__init__(model=model, args=args, data_collator=data_collator, train_dataset=datasets[0],
                         eval_dataset=datasets[1], processing_class=processing_class, **kwargs)
        self._accel_setup(accel)

    def get_train_dataloader(self) -> DataLoader:
        if not (self.accel.packing and self.accel.max_tokens_per_batch and self._own_collator):
            return super().get_train_dataloader()
        return data_loading.token_budget_loader(self, *sequence_parallel.loader_ranks(self))


def __getattr__(name: str):
    if name == "SFTTrainer":  # TRL is optional: import it only when asked for
        from .trl_trainer import SFTTrainer

        return SFTTrainer
    raise AttributeError(f"module 'hf_accel.training.trainer' has no attribute {name!r}")

