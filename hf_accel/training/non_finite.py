"""A run whose loss or gradient norm stops being finite stops (or, asked for, skips the step), instead of training on
and saving a model of NaNs.

``NonFiniteGuard`` notes every micro-batch's loss and every optimizer step's gradient norm on the device they are on:
the first non-finite one (its step, which of the two, its value) is kept in three 0-d tensors by ``torch.where``, so
watching costs no host sync per step. The Trainer reads the record where it reads the device anyway: at each log (the
loss is read back there), before each checkpoint save (with a check that the trainable weights are finite, since an
update with a finite gradient can still overflow them), and when training ends. A non-finite value therefore stops
the run at the next of those points, names the step where it first appeared, and nothing of that step or later is
saved: the newest checkpoint stays the last good one.

``non_finite="skip"`` instead drops such a step's update (every gradient set to None, which torch's optimizers skip;
the step still counts, as a loss scaler's skipped step does) and counts it in ``Trainer.skipped_steps``. It needs the
decision before the optimizer step, so it reads the loss and gradient norm back every step (one host sync a step).

Under fp16 a loss scaler skips steps with inf gradients itself: there the gradient norm is left to it, and only the
loss is watched.
"""
from __future__ import annotations

import logging
import math
import os
from typing import Any

import torch

from ..errors import ConfigurationError, NonFiniteLoss

logger = logging.getLogger("hf_accel")

MODES = ("stop", "skip")
_WHAT = ("loss", "gradient norm", "trainable weights")


def check_mode(mode: str) -> None:
    if mode not in MODES:
        raise ConfigurationError(f"AccelArguments(non_finite={mode!r}); allowed: 'stop' (raise NonFiniteLoss at the "
                                 "first non-finite loss or gradient norm) or 'skip' (skip that step and count it).")


def _scalar(value: Any) -> torch.Tensor | float | None:
    if value is None:
        return None
    if hasattr(value, "full_tensor"):  # a DTensor (FSDP2's gradient norm)
        value = value.full_tensor()
    return value.detach() if torch.is_tensor(value) else float(value)


class NonFiniteGuard:
    """The first non-finite loss / gradient norm of a run, recorded on the device (see the module docstring)."""

    def __init__(self, mode: str = "stop", watch_grad_norm: bool = True, device: Any = "cpu") -> None:
        check_mode(mode)
        self.mode = mode
        self.device = torch.device(device)
        self.watch_grad_norm = watch_grad_norm
        self.skipped_steps = 0
        self._step: torch.Tensor | None = None  # -1 until something was non-finite
        self._what: torch.Tensor | None = None
        self._value: torch.Tensor | None = None
        self._step_bad: torch.Tensor | None = None  # skip mode: this optimizer step's micro-batches

    def _record(self, value: torch.Tensor | float, step: int, what: int) -> None:
        if not torch.is_tensor(value):  # already on the host (DeepSpeed's gradient norm)
            if math.isfinite(value):
                return
            value = torch.tensor(value, device=self._step.device if self._step is not None else self.device)
        value = value.float()
        if self._step is None:  # on the device of the first value: the loss's
            self._step = torch.full((), -1, dtype=torch.int64, device=value.device)
            self._what = torch.zeros((), dtype=torch.int64, device=value.device)
            self._value = torch.zeros((), dtype=torch.float32, device=value.device)
        value = value.to(self._step.device)
        new = (self._step < 0) & ~torch.isfinite(value)
        self._step = torch.where(new, step, self._step)
        self._what = torch.where(new, what, self._what)
        self._value = torch.where(new, value, self._value)

    def note_loss(self, loss: Any, step: int) -> None:
        """A micro-batch's loss, computed for optimizer step ``step`` (1-based, as the logs count)."""
        loss = _scalar(loss)
        if loss is None:
            return
        self._record(loss, step, 0)
        if self.mode == "skip" and torch.is_tensor(loss):
            bad = ~torch.isfinite(loss.float())
            self._step_bad = bad if self._step_bad is None else (self._step_bad | bad.to(self._step_bad.device))

    def note_grad_norm(self, grad_norm: Any, step: int) -> None:
        if self.watch_grad_norm and (grad_norm := _scalar(grad_norm)) is not None:
            self._record(grad_norm, step, 1)

    def skip_step(self, grad_norm: Any, model: torch.nn.Module, step: int) -> bool:
        """Skip mode, before the optimizer step: True (and every gradient dropped) when this step's loss or gradient
        norm is not finite. One host read."""
        grad_norm = _scalar(grad_norm) if self.watch_grad_norm else None
        bad_loss = bool(self._step_bad.item()) if self._step_bad is not None else False
        self._step_bad = None
        bad_norm = grad_norm is not None and not math.isfinite(float(grad_norm))
        if not (bad_loss or bad_norm):
            return False
        for param in model.parameters():
            param.grad = None
        self.skipped_steps += 1
        what = "loss" if bad_loss else "gradient norm"
        logger.warning("hf_accel: step %d: the %s is not finite; the step was skipped (non_finite='skip'; %d skipped "
                       "so far)", step, what, self.skipped_steps)
        return True

    def first(self, accelerator: Any = None) -> tuple[int, str, float] | None:
        """(step, what, value) of the first non-finite value over every process, or None. A host read; under a
        launcher a collective, so every process must call it at the same point."""
        record = torch.stack([t.to(torch.float64) for t in (self._step, self._what, self._value)]) \
            if self._step is not None else torch.tensor([-1.0, 0.0, 0.0], dtype=torch.float64)
        if accelerator is not None and accelerator.num_processes > 1:
            record = accelerator.gather(record.to(accelerator.device).view(1, 3)).view(-1, 3).cpu()
            found = [row for row in record.tolist() if row[0] >= 0]
            row = min(found) if found else None
        else:
            row = record.tolist()
            row = row if row[0] >= 0 else None
        return None if row is None else (int(row[0]), _WHAT[int(row[1])], row[2])


def trainable_weights_finite(model: torch.nn.Module) -> bool:
    """Whether every trainable weight this process holds is finite (each tensor's fp32 sum: NaN or inf in, or
    weights too large for any use, give a non-finite sum; no temporary the size of a weight)."""
    sums = []
    for param in model.parameters():
        if not param.requires_grad:
            continue
        local = getattr(param, "ds_tensor", None)  # a DeepSpeed ZeRO-3 partition
        local = param.to_local() if hasattr(param, "to_local") else (param if local is None else local)
        if local.numel():
            sums.append(local.detach().sum(dtype=torch.float32))
    return not sums or bool(torch.isfinite(torch.stack([s.to(sums[0].device) for s in sums])).all())


def error(step: int, what: str, value: float, newest_checkpoint: str | None, learning_rate: float,
          noticed: int, skip_mode: bool = False) -> NonFiniteLoss:
    """The library's NonFiniteLoss for a run that stopped (its advice names the Trainer's arguments)."""
    where = {"loss": f"the training loss was {value}", "gradient norm": f"the gradient norm was {value}",
             "trainable weights": "the trainable weights were not finite"}[what]
    seen = f" (noticed at step {noticed})" if noticed != step else ""
    kept = (f"the newest checkpoint, {newest_checkpoint}, is from before it" if newest_checkpoint else
            "no checkpoint was written before it")
    message = (f"{where} at step {step}{seen}; training stopped and nothing of that step or later "
               f"was saved: {kept}. Lower the learning rate (learning_rate={learning_rate:g}) or look at that step's "
               "data" + ("." if skip_mode else "; AccelArguments(non_finite='skip') skips such steps instead."))
    return NonFiniteLoss(message, step=step, what=what, value=value, checkpoint=newest_checkpoint)


def newest_checkpoint(output_dir: str | None) -> str | None:
    from .run_folders import checkpoints

    found = checkpoints(output_dir) if output_dir else []
    return os.path.join(output_dir, os.path.basename(found[0][1])) if found else None


# ---- the Trainer's side (hf_accel.training.trainer.AccelMixin calls these) ---------------------------------------

def guard_for(trainer: Any) -> NonFiniteGuard:
    mode = trainer.accel.non_finite
    check_mode(mode)
    if mode == "skip" and trainer.is_deepspeed_enabled:
        raise ConfigurationError("AccelArguments(non_finite='skip') drops a step's gradients before the optimizer "
                                 "step, and DeepSpeed's engine keeps them itself; pass non_finite='stop'.")
    # under fp16 a loss scaler skips inf-gradient steps itself (and expects a few): leave the norm to it
    return NonFiniteGuard(mode, watch_grad_norm=not trainer.args.fp16, device=trainer.args.device)


def note_loss(trainer: Any, loss: Any) -> Any:
    """training_step's loss noted for the step being computed; in skip mode a non-finite one is replaced, for the
    logged average only, by the average of the interval so far (what transformers' ``logging_nan_inf_filter`` adds)."""
    guard = getattr(trainer, "_guard", None)
    if guard is None:
        return loss
    guard.note_loss(loss, trainer.state.global_step + 1)
    if guard.mode != "skip" or not torch.is_tensor(loss) or not hasattr(trainer, "_tr_loss"):
        return loss
    steps = 1 + trainer.state.global_step - trainer._globalstep_last_logged
    return torch.where(torch.isfinite(loss), loss, (trainer._tr_loss / steps).to(loss.dtype))


def note_grad_norm(trainer: Any, model: torch.nn.Module, grad_norm: Any) -> None:
    guard = getattr(trainer, "_guard", None)
    if guard is None:
        return
    step = trainer.state.global_step + 1
    guard.note_grad_norm(grad_norm, step)
    if guard.mode == "skip":
        guard.skip_step(grad_norm, model, step)


def stop_if_found(trainer: Any, weights: bool = False) -> None:
    """Raise NonFiniteLoss if this run met a non-finite loss or gradient norm ("stop" mode), or (``weights``) holds
    non-finite trainable weights. Every process calls it at the same point (a collective under a launcher)."""
    guard, accelerator = getattr(trainer, "_guard", None), trainer.accelerator
    if guard is None:  # a Trainer stand-in of a test, or a save before _accel_setup
        return
    found = guard.first(accelerator) if guard.mode == "stop" else None
    if found is None and weights:
        bad = torch.tensor([0.0 if trainable_weights_finite(trainer.model) else 1.0], device=accelerator.device)
        if accelerator.num_processes > 1:
            bad = accelerator.gather(bad)
        if bool(bad.sum().item()):
            found = (trainer.state.global_step, "trainable weights", float("nan"))
    if found is None:
        return
    try:  # a background save in flight may be the newest checkpoint: let it land first
        trainer._writer.wait()
    except Exception:  # noqa: BLE001 (its own failure is not this error's story)
        pass
    step, what, value = found
    raise error(step, what, value, newest_checkpoint(trainer.args.output_dir), trainer.args.learning_rate,
                noticed=trainer.state.global_step, skip_mode=guard.mode == "skip")
