"""``hf_accel.training.trainer.Trainer``: a drop-in ``transformers.Trainer`` that patches the model, packs batches, applies a
checkpoint policy, logs real throughput, and saves checkpoints atomically (optionally in the background).

``hf_accel.training.trainer.SFTTrainer`` (TRL's ``SFTTrainer`` with the same behaviour) lives in ``trl_trainer.py`` and is
imported lazily, so TRL stays optional.

Loss normalisation is transformers' own: the Trainer counts the targets of every micro-batch of an optimizer step
(``num_items_in_batch``) and the model divides its summed cross-entropy by it, so packed, padded and regrouped
batches of the same samples give the same loss (see ``hf_accel.training.loss``).
"""
from __future__ import annotations

import copy
import dataclasses
import json
import logging
import os
import time
from dataclasses import dataclass
from typing import Any

import torch
import transformers
from torch.utils.data import DataLoader
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR, rotate_checkpoints

from . import checkpoint_io, selective, shards
from .snapshot import SnapshotBuffers
from . import run_dir as run_dir_module
from ..data.collators import DataCollatorForPacking, DataCollatorForPadding
from ..errors import CheckpointError, ConfigurationError
from ..patching import patch
from ..data.sampling import TokenBudgetBatchSampler
from .metrics import ThroughputMeter, format_summary

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
        elsewhere; the report says why); "auto" compile also stands down under ``torch_compile``, FSDP and DeepSpeed.
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
    """

    patch: bool = True
    backend: str = "auto"
    packing: bool = True
    max_tokens_per_batch: int | None = None
    checkpointing: Any = None
    fused_ce: Any = "auto"
    fused_ops: Any = "auto"
    compile: Any = "auto"
    async_save: bool = False
    save: str = "full"
    layer_shards: bool = False
    overwrite_output_dir: bool = False
    print_summary: bool = True
    non_blocking: bool = True


def _to_cpu(obj: Any) -> Any:
    """A CPU copy of nested tensors (a snapshot that training may keep mutating the original of)."""
    if torch.is_tensor(obj):
        return obj.detach().to("cpu", copy=True)
    if isinstance(obj, dict):
        return {k: _to_cpu(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_to_cpu(v) for v in obj)
    return copy.deepcopy(obj)


def _rng_state() -> dict[str, Any]:
    """The RNG snapshot transformers' ``_load_rng_state`` reads back (single process)."""
    import random

    import numpy as np

    state = {"python": random.getstate(), "numpy": np.random.get_state(), "cpu": torch.random.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.random.get_rng_state()
    return state


class AccelMixin:
    """The behaviour shared by ``Trainer`` and ``SFTTrainer``; expects to sit before a transformers Trainer in MRO."""

    accel: AccelArguments

    def _accel_setup(self, accel: AccelArguments | None) -> None:
        self.accel = accel or AccelArguments()
        self.patch_report = None
        self._accel_check_explicit()
        if self.accel.patch:
            self.patch_report = patch(self.model, backend=self.accel.backend, checkpointing=self._accel_policy(),
                                      fused_ops=self.accel.fused_ops, fused_ce=self._accel_fused_ce(),
                                      compile=self._accel_compile())
            logger.info("%s", self.patch_report)
        elif self.accel.checkpointing is not None:
            self._accel_policy().apply(self.model)
        if self.accel.async_save and self.args.world_size > 1:
            raise ConfigurationError(
                f"async_save=True with world_size={self.args.world_size}; background saves support one process only. "
                "Pass async_save=False (saves are still atomic)."
            )
        if self.accel.non_blocking and self.args.dataloader_pin_memory:
            # read when the Trainer prepares its dataloaders (accelerate's send_to_device(non_blocking=...))
            self.accelerator.dataloader_config.non_blocking = True
        self._check_save_options()
        self._writer = checkpoint_io.AsyncWriter()
        self._buffers = SnapshotBuffers()
        self._run_record: dict[str, Any] | None = None
        self._frozen_fingerprint: dict[str, Any] | None = None
        self._saving_checkpoint = False
        self._meter: ThroughputMeter | None = None
        self.throughput_summary: dict[str, float] | None = None

    def _accel_check_explicit(self) -> None:
        """Explicit requests that cannot work raise here, before patching ("auto" stands down instead)."""
        compile_asked = self.accel.compile not in (False, None, "auto")
        if self.accel.fused_ce is True and not self.accel.patch:
            raise ConfigurationError("fused_ce=True works through hf_accel.patch; it needs AccelArguments(patch=True).")
        if compile_asked and not self.accel.patch:
            raise ConfigurationError("compile=True works through hf_accel.patch; it needs AccelArguments(patch=True).")
        if compile_asked and getattr(self.args, "torch_compile", False):
            raise ConfigurationError(
                "AccelArguments(compile=...) compiles the decoder layers and TrainingArguments(torch_compile=True) the "
                "whole model; use one. AccelArguments(compile=True) keeps attention on hf_accel's kernel."
            )

    def _accel_fused_ce(self) -> Any:
        return self.accel.fused_ce

    def _accel_compile(self) -> Any:
        """AccelArguments.compile for patch(); "auto" is off where something else compiles or shards the model."""
        if self.accel.compile != "auto":
            return self.accel.compile
        if getattr(self.args, "torch_compile", False) or getattr(self, "is_fsdp_enabled", False) or \
                getattr(self, "is_deepspeed_enabled", False):
            return False  # (compiled layers are not measured under FSDP / DeepSpeed yet)
        return "auto"

    def _accel_policy(self) -> Any:
        """The checkpoint policy; a memory budget probes a micro-batch of the size this run will train on."""
        if self.accel.checkpointing is None:
            return None
        from ..memory.checkpointing import MemoryBudget, policy_from_spec

        policy = policy_from_spec(self.accel.checkpointing)
        if isinstance(policy, MemoryBudget) and policy.sample_batch is None and policy.batch_tokens is None:
            tokens = self._micro_batch_tokens()
            if tokens:
                policy.batch_tokens = tokens
        return policy

    def _micro_batch_tokens(self) -> int | None:
        """The most tokens one micro-batch of this run can hold (None when unknown)."""
        batch = self.args.per_device_train_batch_size
        max_length = getattr(self.args, "max_length", None)  # TRL's SFTConfig: packed rows of max_length
        if getattr(self.args, "packing", False) and max_length:
            return int(max_length) * batch
        if self.accel.packing and self.accel.max_tokens_per_batch:
            return int(self.accel.max_tokens_per_batch)
        try:
            lengths = sorted(_example_lengths(self.train_dataset), reverse=True) if self.train_dataset else []
        except (KeyError, TypeError):
            return None
        if not lengths:
            return None
        return sum(lengths[:batch]) if self.accel.packing else lengths[0] * batch

    # ---- training loop hooks -------------------------------------------------------------------------------------

    def _inner_training_loop(self, *args, **kwargs):
        # Trainer.train() has just (re-)enabled checkpointing from its args; put our policy's choices back.
        if self.accel.checkpointing is not None:
            from ..memory.checkpointing import reapply_checkpointing

            reapply_checkpointing(self.model)
        self._meter = ThroughputMeter(self.model, self.args.device)
        return super()._inner_training_loop(*args, **kwargs)

    def train(self, resume_from_checkpoint: str | bool | None = None, *args, **kwargs):
        resume_from_checkpoint = self._prepare_run(resume_from_checkpoint)
        try:
            out = super().train(resume_from_checkpoint, *args, **kwargs)
        finally:
            self._writer.wait()
        # After a normal end only: a summary's device reads must not replace the exception of a failed run.
        if self._meter is not None:
            self.throughput_summary = self._meter.summary()
            if self.accel.print_summary and self.args.should_log:
                print(format_summary(self.throughput_summary), flush=True)
        return out

    def get_batch_samples(self, *args, **kwargs):
        start = time.perf_counter()
        out = super().get_batch_samples(*args, **kwargs)
        if self._meter is not None:
            self._meter.add_wait(time.perf_counter() - start)
        return out

    def training_step(self, model, inputs, *args, **kwargs):
        if self._meter is not None:
            self._meter.add_batch(inputs)
        return super().training_step(model, inputs, *args, **kwargs)

    def log(self, logs: dict[str, float], *args, **kwargs) -> None:
        if "loss" in logs and self._meter is not None:
            logs.update(self._meter.pop())
        super().log(logs, *args, **kwargs)

    def _issue_warnings_after_load(self, load_result: Any) -> None:
        """transformers warns about every key a resumed checkpoint lacks, including a tied weight (lm_head.weight
        tied to the embedding is saved once): not missing, it shares its tensor with a loaded one. Keep the warning
        for keys that really are missing."""
        missing = list(getattr(load_result, "missing_keys", None) or [])
        if missing and hasattr(load_result, "_replace"):
            params = dict(self.model.named_parameters(remove_duplicate=False))
            loaded = {id(p) for name, p in params.items() if name not in set(missing)}
            missing = [name for name in missing if not (name in params and id(params[name]) in loaded)]
            load_result = load_result._replace(missing_keys=missing)
        super()._issue_warnings_after_load(load_result)

    # ---- atomic (and optionally background) checkpoints ----------------------------------------------------------

    def _save_checkpoint(self, model, trial) -> None:
        run_dir = self._get_output_dir(trial=trial)
        name = f"{PREFIX_CHECKPOINT_DIR}-{self.state.global_step}"
        if self.accel.async_save:
            self._writer.wait()  # the previous write is done with the buffers (raises if it failed)
            state = self._live_state()
            reason = self._buffers.shortfall(state)
            if reason is None:
                self._save_checkpoint_async(run_dir, name, state)
                return
            logger.warning("hf_accel: %s; writing %s synchronously", reason, name)
        staging_root = os.path.join(run_dir, checkpoint_io.STAGING_DIR)
        staged = os.path.join(staging_root, name)
        if self.args.should_save:
            checkpoint_io.staging_path(run_dir, name)
        self.accelerator.wait_for_everyone()
        # transformers writes the whole checkpoint (model, optimizer, scheduler, RNG, state) under _get_output_dir;
        # point that at the staging folder for this one call.
        self._get_output_dir = lambda trial=None: staging_root
        self._saving_checkpoint = True
        try:
            super()._save_checkpoint(model, trial)
        except OSError as exc:  # e.g. a full disk: nothing was published, earlier checkpoints stay
            raise checkpoint_io.save_failed(exc, staged, name, run_dir) from exc
        finally:
            del self._get_output_dir
            self._saving_checkpoint = False
        self.accelerator.wait_for_everyone()
        if self.args.should_save:
            try:
                self._publish(staged, run_dir, name)
            except OSError as exc:
                raise checkpoint_io.save_failed(exc, staged, name, run_dir) from exc

    def _publish(self, staged: str, run_dir: str, name: str) -> None:
        best = self.state.best_model_checkpoint
        staging_root = os.path.join(run_dir, checkpoint_io.STAGING_DIR)
        if best and best.startswith(staging_root):
            self.state.best_model_checkpoint = os.path.join(run_dir, os.path.basename(best))
            self.state.save_to_json(os.path.join(staged, "trainer_state.json"))
        run_dir_module.write_run_record(staged, self._current_run_record())
        checkpoint_io.publish(staged, os.path.join(run_dir, name), self.state.global_step)
        rotate_checkpoints(
            output_dir=run_dir, save_total_limit=self.args.save_total_limit,
            best_model_checkpoint=self.state.best_model_checkpoint, use_mtime=False,
        )

    def _export_callback_states(self) -> None:
        """What transformers' _save_checkpoint does for stateful callbacks before writing trainer_state.json."""
        for cb in self.callback_handler.callbacks + [self.control]:
            if isinstance(cb, transformers.trainer_callback.ExportableState):
                name = cb.__class__.__name__
                if isinstance(self.state.stateful_callbacks.get(name), list):
                    self.state.stateful_callbacks[name].append(cb.state())
                else:
                    self.state.stateful_callbacks[name] = cb.state()

    def _live_state(self) -> dict[str, Any]:
        """What a background save copies to the host: the model's weights (or its trainable ones) and the
        optimizer state, as references to the live tensors."""
        unwrapped = self.accelerator.unwrap_model(self.model)
        model_state = selective.trainable_state(unwrapped) if self.accel.save == "trainable" else \
            unwrapped.state_dict()
        return {"model": model_state, "optimizer": self.optimizer.state_dict()}

    def _save_checkpoint_async(self, run_dir: str, name: str, state: dict[str, Any]) -> None:
        """Copy everything a checkpoint holds into the host buffers now; write, fsync and rename it on the writer
        thread (the caller waited for the previous write)."""
        self.store_flos()
        self._export_callback_states()
        unwrapped = self.accelerator.unwrap_model(self.model)
        trainable_only = self.accel.save == "trainable"
        copied = self._buffers.copy(state)
        snapshot = {
            "model": copied["model"],
            "optimizer": copied["optimizer"],
            "scheduler": _to_cpu(self.lr_scheduler.state_dict()) if self.lr_scheduler is not None else None,
            "rng": _rng_state(),
            "state": json.dumps(dataclasses.asdict(self.state), indent=2, sort_keys=True) + "\n",
            "args": copy.deepcopy(self.args),
        }
        step, processing_class, record = self.state.global_step, self.processing_class, self._current_run_record()
        fingerprint = self._fingerprint(unwrapped) if trainable_only else None
        staged = os.path.join(run_dir, checkpoint_io.STAGING_DIR, name)

        def write() -> None:
            try:
                write_files()
            except OSError as exc:  # e.g. a full disk: nothing was published, earlier checkpoints stay
                raise checkpoint_io.save_failed(exc, staged, name, run_dir) from exc

        def write_files() -> None:
            checkpoint_io.staging_path(run_dir, name)
            if trainable_only:
                selective.save_trainable(staged, snapshot["model"], fingerprint)
                unwrapped.config.save_pretrained(staged)
            elif self.accel.layer_shards:
                shards.save_layer_shards(unwrapped, staged, snapshot["model"])
            elif not hasattr(unwrapped, "peft_config"):  # streamed from the buffers: no serializer copy
                shards.save_single_file(unwrapped, staged, snapshot["model"])
            else:
                unwrapped.save_pretrained(staged, state_dict=snapshot["model"], safe_serialization=True)
            if processing_class is not None and hasattr(processing_class, "save_pretrained"):
                processing_class.save_pretrained(staged)
            torch.save(snapshot["args"], os.path.join(staged, transformers.trainer.TRAINING_ARGS_NAME))
            torch.save(snapshot["optimizer"], os.path.join(staged, transformers.trainer.OPTIMIZER_NAME))
            if snapshot["scheduler"] is not None:
                torch.save(snapshot["scheduler"], os.path.join(staged, transformers.trainer.SCHEDULER_NAME))
            torch.save(snapshot["rng"], os.path.join(staged, "rng_state.pth"))
            with open(os.path.join(staged, transformers.trainer.TRAINER_STATE_NAME), "w", encoding="utf-8") as f:
                f.write(snapshot["state"])
            run_dir_module.write_run_record(staged, record)
            checkpoint_io.publish(staged, os.path.join(run_dir, name), step)
            rotate_checkpoints(output_dir=run_dir, save_total_limit=self.args.save_total_limit,
                               best_model_checkpoint=self.state.best_model_checkpoint, use_mtime=False)

        self._writer.submit(write)

    # ---- what a checkpoint holds, and which one a resume continues -----------------------------------------------

    def _check_save_options(self) -> None:
        if self.accel.save not in ("full", "trainable"):
            raise ConfigurationError(f"AccelArguments(save={self.accel.save!r}); allowed: 'full' (every weight) or "
                                     "'trainable' (only the parameters that train, plus a fingerprint of the rest).")
        if self.accel.save == "trainable":
            if self.is_fsdp_enabled or self.is_deepspeed_enabled:
                raise ConfigurationError("AccelArguments(save='trainable') needs unsharded parameters (one process "
                                         "or DDP); under FSDP/DeepSpeed pass save='full'.")
            if self.accel.layer_shards:
                raise ConfigurationError("AccelArguments(layer_shards=True) shards full checkpoints; with "
                                         "save='trainable' pass layer_shards=False.")
            if self.args.load_best_model_at_end:
                raise ConfigurationError("AccelArguments(save='trainable') checkpoints hold no full model to load at "
                                         "the end; pass load_best_model_at_end=False or save='full'.")

        if self.accel.layer_shards and hasattr(self.model, "peft_config"):
            raise ConfigurationError("AccelArguments(layer_shards=True) applies to full models; a PEFT model saves its "
                                     "adapter only. Pass layer_shards=False (or save='trainable').")

    def _fingerprint(self, model) -> dict[str, Any]:
        if self._frozen_fingerprint is None:  # the frozen part does not change during a run
            self._frozen_fingerprint = selective.frozen_fingerprint(model)
        return self._frozen_fingerprint

    def _current_run_record(self) -> dict[str, Any]:
        if self._run_record is None:  # a save outside train(): a run of its own
            self._run_record = {"run_id": run_dir_module.new_run_id(), "config": self._run_config()}
        return self._run_record

    def _run_config(self) -> dict[str, Any]:
        return run_dir_module.run_config(self.accelerator.unwrap_model(self.model), self.args, self.accel,
                                         self.train_dataset)

    def _prepare_run(self, requested: str | bool | None) -> str | None:
        """A new run gets an empty (or cleared) output folder; a resume gets a verified checkpoint of the same run."""
        output_dir = self.args.output_dir
        config = self._run_config()
        if requested is None or requested is False:
            run_dir_module.check_output_dir(output_dir, resume=False, overwrite=self.accel.overwrite_output_dir)
            if self.accel.overwrite_output_dir and self.args.should_save:
                run_dir_module.clear_output_dir(output_dir)
            self.accelerator.wait_for_everyone()
            self._run_record = {"run_id": run_dir_module.new_run_id(), "config": config}
            return None
        path = None
        if self.args.should_save:  # the main process sets damaged checkpoints aside; the others then agree
            path = run_dir_module.select_checkpoint(output_dir, requested, move=True)
        self.accelerator.wait_for_everyone()
        if path is None:
            path = run_dir_module.select_checkpoint(output_dir, requested, move=False)
        record = run_dir_module.read_run_record(path)
        run_dir_module.check_same_run(path, record, config, explicit=isinstance(requested, str))
        for _, other in run_dir_module.checkpoints(output_dir):
            other_record = run_dir_module.read_run_record(other) if other != path else record
            if record and other_record and other_record.get("run_id") != record.get("run_id"):
                raise CheckpointError(
                    f"{output_dir} mixes checkpoints of two runs ({os.path.basename(path)}: run "
                    f"{record.get('run_id')}, {os.path.basename(other)}: run {other_record.get('run_id')}); move the "
                    "other run's checkpoints out, or resume from an explicit checkpoint path of another folder.")
        with open(os.path.join(path, transformers.trainer.TRAINER_STATE_NAME), encoding="utf-8") as f:
            step = int(json.load(f)["global_step"])
        run_dir_module.check_steps_left(path, step, self.args.max_steps)
        if self.args.should_save:
            run_dir_module.set_aside_later(output_dir, step)
        self.accelerator.wait_for_everyone()
        self._run_record = {"run_id": record["run_id"] if record else run_dir_module.new_run_id(), "config": config}
        logger.info("hf_accel: resuming run %s from %s", self._run_record["run_id"], path)
        return path

    def save_model(self, output_dir: str | None = None, _internal_call: bool = False) -> None:
        own_layout = self.accel.save == "trainable" or self.accel.layer_shards
        if not (self._saving_checkpoint and own_layout):
            return super().save_model(output_dir, _internal_call)
        if self.args.should_save:  # the model part of a checkpoint in our layout (transformers adds the rest)
            unwrapped = self.accelerator.unwrap_model(self.model)
            if self.accel.save == "trainable":
                selective.save_trainable(output_dir, selective.trainable_state(unwrapped),
                                         self._fingerprint(unwrapped))
                unwrapped.config.save_pretrained(output_dir)
            else:
                shards.save_layer_shards(unwrapped, output_dir)
            if self.processing_class is not None and hasattr(self.processing_class, "save_pretrained"):
                self.processing_class.save_pretrained(output_dir)

    def _load_from_checkpoint(self, resume_from_checkpoint: str, model=None) -> None:
        if not selective.is_selective(resume_from_checkpoint):
            return super()._load_from_checkpoint(resume_from_checkpoint, model)
        selective.load_trainable(model if model is not None else self.model, resume_from_checkpoint)


def _example_lengths(dataset: Any) -> list[int]:
    if hasattr(dataset, "column_names") and "length" in dataset.column_names:
        return [int(n) for n in dataset["length"]]
    return [len(example["input_ids"]) for example in dataset]


def _needs_tokenizing(dataset: Any) -> bool:
    if dataset is None:
        return False
    columns = getattr(dataset, "column_names", None)
    if columns is None:
        columns = list(dataset[0].keys()) if len(dataset) else []
    return "input_ids" not in columns


def tokenize_dataset(dataset: Any, tokenizer: Any) -> Any:
    """Tokenize a dataset of ``messages``, ``prompt``/``completion`` or ``text`` examples (a list or ``datasets``)."""
    from ..data.prepare import pretokenize, tokenize_example

    if hasattr(dataset, "map") and hasattr(dataset, "column_names"):
        return pretokenize(dataset, tokenizer)
    return [tokenize_example(example, tokenizer) for example in dataset]


class Trainer(AccelMixin, transformers.Trainer):
    """``transformers.Trainer`` with hf_accel's attention patch, packing collator, token-budget sampler, checkpoint
    policy, throughput logging and atomic checkpoints. Takes every ``transformers.Trainer`` argument plus ``accel``.

    Datasets may be pre-tokenized (``input_ids``, optional ``labels``) or raw (``messages``, ``prompt``/``completion``
    or ``text``; tokenized here with ``processing_class``, labels on completions / assistant turns only).
    """

    def __init__(self, model=None, args=None, data_collator=None, train_dataset=None, eval_dataset=None,
                 processing_class=None, *, accel: AccelArguments | None = None, **kwargs) -> None:
        accel = accel or AccelArguments()
        datasets = []
        for dataset in (train_dataset, eval_dataset):
            if _needs_tokenizing(dataset):
                if processing_class is None:
                    raise ConfigurationError(
                        "the dataset has no 'input_ids' column and no processing_class was given; pass a tokenizer "
                        "as processing_class, or pre-tokenize with hf_accel.data.prepare.pretokenize."
                    )
                dataset = tokenize_dataset(dataset, processing_class)
            datasets.append(dataset)
        self._own_collator = data_collator is None
        if data_collator is None:
            data_collator = self._default_collator(model, processing_class, accel)
        super().__init__(model=model, args=args, data_collator=data_collator, train_dataset=datasets[0],
                         eval_dataset=datasets[1], processing_class=processing_class, **kwargs)
        self._accel_setup(accel)

    @staticmethod
    def _default_collator(model, processing_class, accel: AccelArguments):
        pad_id = getattr(processing_class, "pad_token_id", None)
        if pad_id is None:
            pad_id = getattr(getattr(model, "config", None), "pad_token_id", None) or 0
        if not accel.packing:
            return DataCollatorForPadding(pad_token_id=pad_id)
        collator = DataCollatorForPacking(pad_token_id=pad_id)
        model_type = getattr(getattr(model, "config", None), "model_type", None)
        if not accel.patch and model_type == "falcon":
            # stock Falcon builds its mask without position_ids: packed documents would attend to each other
            collator.use_padding("stock (unpatched) Falcon cannot keep packed documents apart")
        return collator

    def get_train_dataloader(self) -> DataLoader:
        if not (self.accel.packing and self.accel.max_tokens_per_batch and self._own_collator):
            return super().get_train_dataloader()
        dataset = self.train_dataset
        sampler = TokenBudgetBatchSampler(
            _example_lengths(dataset), self.accel.max_tokens_per_batch, shuffle=True, seed=self.args.data_seed
            if self.args.data_seed is not None else self.args.seed, num_replicas=self.args.world_size,
            rank=self.args.process_index,
        )
        dataset = self._remove_unused_columns(dataset, description="training") if hasattr(dataset, "column_names") \
            else dataset
        collator = self.data_collator if hasattr(dataset, "column_names") else \
            self._get_collator_with_removed_columns(self.data_collator, description="training")
        loader = DataLoader(
            dataset, batch_sampler=sampler, collate_fn=collator, num_workers=self.args.dataloader_num_workers,
            pin_memory=self.args.dataloader_pin_memory, persistent_workers=self.args.dataloader_persistent_workers,
            prefetch_factor=self.args.dataloader_prefetch_factor,
        )
        prepared = self.accelerator.prepare(loader)
        # The sampler already shards by rank; make accelerate's BatchSamplerShard (multi-process) a passthrough.
        shard = getattr(prepared, "batch_sampler", None)
        if shard is not None and getattr(shard, "batch_sampler", None) is sampler:
            shard.num_processes, shard.process_index = 1, 0
        return prepared


def __getattr__(name: str):
    if name == "SFTTrainer":  # TRL is optional: import it only when asked for
        from .trl_trainer import SFTTrainer

        return SFTTrainer
    raise AttributeError(f"module 'hf_accel.training.trainer' has no attribute {name!r}")

