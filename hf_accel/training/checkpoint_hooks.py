"""The checkpoint-file side of hf_accel's Trainers: one run per output folder, atomic (optionally background) saves
with a manifest, trainable-only saves with a fingerprint of the frozen base, per-layer weight shards, and resume that
skips damaged checkpoints and continues only the run that wrote them.

``CheckpointFilesMixin`` overrides transformers' ``Trainer`` save / load hooks; ``AccelMixin`` (trainer.py) inherits it.
The file formats and checks live in ``checkpoint_io``, ``run_dir``, ``selective``, ``shards`` and ``snapshot``.
"""
from __future__ import annotations

import copy
import dataclasses
import json
import logging
import os
from typing import Any

import torch
import transformers
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR, rotate_checkpoints

from . import adapters, checkpoint_io, non_finite, selective, shards
from . import run_dir as run_dir_module
from ..errors import CheckpointError, ConfigurationError

logger = logging.getLogger("hf_accel")

# The losses a run summed since its last log, and the step it logged last, as of a checkpoint: a resumed run's next
# log then averages the same steps the uninterrupted run's did (transformers restarts the window at the resume step).
LOSS_WINDOW = "hf_accel_loss_window.json"


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


class ReserveSnapshotAhead(transformers.TrainerCallback):
    """Background saves: after the first optimizer step of a run (the optimizer state exists then), page-lock the
    snapshot's host buffers on a thread and fingerprint a trainable-only save's frozen base, so the first save costs
    the training loop what every later one does."""

    def __init__(self, trainer: "CheckpointFilesMixin") -> None:
        import weakref

        self._trainer = weakref.ref(trainer)
        self._done = False

    def on_train_begin(self, args, state, control, **kwargs):
        self._done = False

    def on_step_end(self, args, state, control, **kwargs):
        trainer = self._trainer()
        if self._done or trainer is None:
            return
        self._done = True
        if trainer.accel.async_save and args.save_strategy != "no" and args.world_size == 1:
            trainer._buffers.reserve(trainer._live_state())
            if trainer.accel.save == "trainable":  # hashed once per run: not inside the first save's stall
                trainer._fingerprint(trainer._unwrapped())


class RestoreLossWindow(transformers.TrainerCallback):
    """On a resume, put the checkpoint's pending loss window back into the Trainer once transformers has reset it
    (its ``_inner_training_loop`` does so just before ``on_train_begin``)."""

    def __init__(self, trainer: "CheckpointFilesMixin") -> None:
        import weakref

        self._trainer = weakref.ref(trainer)

    def on_train_begin(self, args, state, control, **kwargs):
        trainer = self._trainer()
        window = getattr(trainer, "_resumed_loss_window", None) if trainer is not None else None
        if not window or not hasattr(trainer, "_tr_loss"):
            return
        trainer._resumed_loss_window = None
        trainer._tr_loss += window["loss_sum"]
        trainer._globalstep_last_logged = window["last_logged"]
        trainer._total_loss_scalar -= window["loss_sum"]  # train_loss counts this call's steps only


class CheckpointFilesMixin:
    """Save / resume hooks of transformers' Trainer, for checkpoint files a run can trust; sits before it in MRO."""

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

    def _loss_window(self) -> dict[str, Any] | None:
        """The pending loss window (every process takes part: its loss is averaged over them, as a log does)."""
        if not hasattr(self, "_tr_loss"):
            return None
        from transformers.trainer_pt_utils import nested_gather

        total = nested_gather(self._tr_loss.detach(), self.args.parallel_mode).mean().item()  # one read per save
        return {"loss_sum": total, "last_logged": int(self._globalstep_last_logged)}

    def _save_checkpoint(self, model, trial) -> None:
        non_finite.stop_if_found(self, weights=True)  # a checkpoint is never of a step at or after a non-finite one
        run_dir = self._get_output_dir(trial=trial)
        name = f"{PREFIX_CHECKPOINT_DIR}-{self.state.global_step}"
        self._pending_window = self._loss_window()
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
        _write_loss_window(staged, self._pending_window)
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

    def _unwrapped(self) -> torch.nn.Module:
        """accelerate's unwrap_model for a background save, kept while ``self.model`` stays the same object (it walks
        every module and reads package metadata: ~10 ms a call for Llama-8B LoRA, inside the save's stall)."""
        cached = getattr(self, "_unwrapped_for", None)
        if cached is None or cached[0] is not self.model:
            self._unwrapped_for = (self.model, self.accelerator.unwrap_model(self.model))
        return self._unwrapped_for[1]

    def _live_state(self) -> dict[str, Any]:
        """What a background save copies to the host: the model's weights (or its trainable ones) and the
        optimizer state, as references to the live tensors."""
        unwrapped = self._unwrapped()
        model_state = selective.trainable_state(unwrapped) if self.accel.save == "trainable" else \
            unwrapped.state_dict()
        return {"model": model_state, "optimizer": self.optimizer.state_dict()}

    def _save_checkpoint_async(self, run_dir: str, name: str, state: dict[str, Any]) -> None:
        """Copy everything a checkpoint holds into the host buffers now; write, fsync and rename it on the writer
        thread (the caller waited for the previous write)."""
        self.store_flos()
        self._export_callback_states()
        unwrapped = self._unwrapped()
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
        window = self._pending_window
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
                adapters.save_adapter(unwrapped, staged, snapshot["model"])
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
            _write_loss_window(staged, window)
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
        self._resumed_loss_window = _read_loss_window(path)
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

    def _save(self, output_dir: str | None = None, state_dict: dict | None = None) -> None:
        """transformers' ``_save`` (the writing process only), with a PEFT model's adapter selected by
        ``adapters.save_adapter``: under FSDP's activation checkpointing peft's own selection found no key of the
        gathered state dict and wrote an empty adapter."""
        unwrapped = self.accelerator.unwrap_model(self.model, keep_torch_compile=False)
        if not adapters.is_peft_model(unwrapped):
            return super()._save(output_dir, state_dict if state_dict is None else share_tied_copies(unwrapped,
                                                                                                     state_dict))
        output_dir = output_dir if output_dir is not None else self.args.output_dir
        os.makedirs(output_dir, exist_ok=True)
        adapters.save_adapter(unwrapped, output_dir, state_dict if state_dict is not None else unwrapped.state_dict())
        tokenizer = self.processing_class or getattr(self.data_collator, "tokenizer", None)
        if tokenizer is not None and hasattr(tokenizer, "save_pretrained"):
            tokenizer.save_pretrained(output_dir)
        torch.save(self.args, os.path.join(output_dir, transformers.trainer.TRAINING_ARGS_NAME))

    def _load_from_checkpoint(self, resume_from_checkpoint: str, model=None) -> None:
        if not selective.is_selective(resume_from_checkpoint):
            return super()._load_from_checkpoint(resume_from_checkpoint, model)
        selective.load_trainable(model if model is not None else self.model, resume_from_checkpoint)


def _write_loss_window(folder: str, window: dict[str, Any] | None) -> None:
    if window is not None:
        with open(os.path.join(folder, LOSS_WINDOW), "w", encoding="utf-8") as f:
            json.dump(window, f)


def _read_loss_window(folder: str) -> dict[str, Any] | None:
    """A checkpoint's loss window; None for checkpoints written before it existed (the resumed log then averages
    only the steps after the resume, as transformers' does)."""
    path = os.path.join(folder, LOSS_WINDOW)
    if not os.path.exists(path):
        return None
    with open(path, encoding="utf-8") as f:
        window = json.load(f)
    return {"loss_sum": float(window["loss_sum"]), "last_logged": int(window["last_logged"])}


def share_tied_copies(model: torch.nn.Module, state_dict: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``state_dict`` with each weight the model ties to another (``all_tied_weights_keys``, e.g. a Llama head tied to
    its input embedding) pointing at that other tensor, when the two hold the same values.

    A full state dict gathered from shards (accelerate's under FSDP2) holds tied weights as separate copies, and
    transformers' save drops a tied name only when it shares storage with its source, so the file held the head a
    second time. Sharing the storage lets transformers keep the name it expects on reload. Copies that differ stay as
    they are (what transformers writes for them)."""
    tied = getattr(model, "all_tied_weights_keys", None) or {}
    out = dict(state_dict)
    for target, source in tied.items():
        copy_, original = out.get(target), out.get(source)
        if (isinstance(copy_, torch.Tensor) and isinstance(original, torch.Tensor) and copy_ is not original
                and copy_.shape == original.shape and copy_.dtype == original.dtype and torch.equal(copy_, original)):
            out[target] = original
    return out
