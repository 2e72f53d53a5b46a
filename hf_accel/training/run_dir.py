"""One output folder holds one run.

A new run refuses a folder that already holds files (an earlier run's checkpoints would otherwise be picked up by a
later resume), unless asked to clear it. Every checkpoint carries a run record (``hf_accel_run.json``: a run id and
the settings that decide what the run computes); resume picks the newest *complete* checkpoint, sets damaged ones
aside with a message naming the bad file, and continues only a run with the same settings.
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import uuid
from typing import Any

from ..errors import CheckpointError, ConfigurationError
from .checkpoint_io import verify_checkpoint
from .run_folders import CHECKPOINT_RE, check_output_dir, checkpoints  # noqa: F401 (this module's API)

logger = logging.getLogger("hf_accel")

RUN_RECORD = "hf_accel_run.json"
# Settings that change what a run computes (max_steps / epochs may grow on resume; logging and saving may change).
TRAINING_FIELDS = (
    "learning_rate", "weight_decay", "adam_beta1", "adam_beta2", "adam_epsilon", "max_grad_norm", "optim",
    "lr_scheduler_type", "warmup_steps", "warmup_ratio", "per_device_train_batch_size",
    "gradient_accumulation_steps", "seed", "data_seed", "bf16", "fp16", "world_size", "train_sampling_strategy",
)
_VOLATILE_MODEL_KEYS = {"transformers_version", "architectures", "use_cache", "name_or_path", "torch_dtype"}
_DATA_SAMPLE = 32  # examples hashed to tell one dataset from another


# ---- a new run: the folder must be empty (run_folders.check_output_dir) -------------------------------------

def clear_output_dir(output_dir: str) -> None:
    """Remove everything inside ``output_dir`` (the folder itself stays). Refuses folders that are clearly not a
    run's output: the filesystem root, the home folder, the working directory, a git checkout."""
    path = os.path.realpath(output_dir)
    if not os.path.isdir(path):
        return
    protected = {os.path.realpath(p) for p in (os.sep, os.path.expanduser("~"), os.getcwd())}
    if path in protected or os.path.exists(os.path.join(path, ".git")):
        raise ConfigurationError(
            f"overwrite_output_dir=True would delete everything in {output_dir}, which is not a run's output folder "
            "(the root, home or working directory, or a git checkout). Pass a dedicated output folder."
        )
    for name in os.listdir(path):
        full = os.path.join(path, name)
        if os.path.isdir(full) and not os.path.islink(full):
            shutil.rmtree(full)
        else:
            os.remove(full)
    logger.warning("hf_accel: cleared output folder %s (overwrite_output_dir=True)", output_dir)


# ---- what a run is -------------------------------------------------------------------------------------------------

def new_run_id() -> str:
    return uuid.uuid4().hex[:12]


def _jsonable(value: Any) -> Any:
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    return str(value)


def _digest(obj: Any) -> str:
    return hashlib.sha256(json.dumps(_jsonable(obj), sort_keys=True).encode()).hexdigest()[:16]


def run_config(model: Any, args: Any, accel: Any, train_dataset: Any) -> dict[str, Any]:
    """The settings that decide what a run computes, flattened to ``section.key`` → JSON value."""
    config: dict[str, Any] = {"model.class": type(model).__name__}
    model_config = getattr(model, "config", None)
    if model_config is not None:
        for key, value in sorted(model_config.to_dict().items()):
            if not key.startswith("_") and key not in _VOLATILE_MODEL_KEYS:
                config[f"model.{key}"] = _jsonable(value)
    trainable = [(n, list(p.shape)) for n, p in model.named_parameters() if p.requires_grad]
    config["trainable.count"] = len(trainable)
    config["trainable.names_and_shapes"] = _digest(trainable)
    for field in TRAINING_FIELDS:
        config[f"training.{field}"] = _jsonable(getattr(args, field, None))
    for field in ("save", "packing", "max_tokens_per_batch"):
        config[f"accel.{field}"] = _jsonable(getattr(accel, field, None))
    config.update(_data_config(train_dataset))
    return config


def _data_config(dataset: Any) -> dict[str, Any]:
    try:
        n = len(dataset)
    except TypeError:  # an iterable dataset: its length is unknown
        return {"data.examples": None}
    picks = sorted({round(i * (n - 1) / max(1, _DATA_SAMPLE - 1)) for i in range(min(n, _DATA_SAMPLE))})
    try:
        sample = [list(dataset[i]["input_ids"]) for i in picks]
    except (KeyError, TypeError, IndexError):
        sample = None
    return {"data.examples": n, "data.sample": _digest(sample) if sample is not None else None}


def write_run_record(folder: str, record: dict[str, Any]) -> None:
    with open(os.path.join(folder, RUN_RECORD), "w", encoding="utf-8") as f:
        json.dump(record, f, indent=1, sort_keys=True)


def read_run_record(folder: str) -> dict[str, Any] | None:
    path = os.path.join(folder, RUN_RECORD)
    if not os.path.exists(path):
        return None
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def differences(saved: dict[str, Any], now: dict[str, Any]) -> list[str]:
    keys = sorted(set(saved) | set(now))
    return [f"{k}: checkpoint {saved.get(k)!r}, now {now.get(k)!r}" for k in keys if saved.get(k) != now.get(k)]


# ---- resume: which checkpoint ---------------------------------------------------------------------------------------

def set_aside(path: str, why: str) -> str:
    """Rename ``checkpoint-N`` to ``<why>-checkpoint-N`` (out of reach of resume and of checkpoint rotation)."""
    parent, name = os.path.split(path)
    target = os.path.join(parent, f"{why}-{name}")
    suffix = 1
    while os.path.exists(target):
        suffix += 1
        target = os.path.join(parent, f"{why}{suffix}-{name}")
    os.rename(path, target)
    return target


def select_checkpoint(output_dir: str, requested: str | bool, *, move: bool = True) -> str:
    """The checkpoint to resume from: ``requested`` if it is a path (verified), else the newest complete one of
    ``output_dir``; newer damaged ones are set aside (``damaged-checkpoint-N``) with a warning naming the bad file.
    Raises ``CheckpointError`` when no complete checkpoint exists."""
    if isinstance(requested, str):
        problem = verify_checkpoint(requested)
        if problem:
            raise CheckpointError(f"cannot resume from {requested}: {problem}. Pick another checkpoint, or pass "
                                  "resume_from_checkpoint=True to use the newest complete one.")
        return requested
    found = checkpoints(output_dir)
    if not found:
        raise CheckpointError(f"resume was asked for but {output_dir} holds no checkpoint-N folder; start a new run "
                              "(without resume) or point output_dir at the run to continue.")
    damaged: list[tuple[str, str]] = []
    for _, path in found:
        problem = verify_checkpoint(path)
        if problem is None:
            for bad, reason in damaged:
                moved = set_aside(bad, "damaged") if move else bad
                logger.warning("hf_accel: %s is damaged (%s); resuming from %s instead; the damaged one is kept as "
                               "%s", os.path.basename(bad), reason, os.path.basename(path), os.path.basename(moved))
            return path
        damaged.append((path, problem))
    listed = "; ".join(f"{os.path.basename(p)}: {why}" for p, why in damaged)
    raise CheckpointError(f"no complete checkpoint in {output_dir} ({listed}). Restore one, or start a new run "
                          "with overwrite_output_dir=True (--overwrite).")


def check_same_run(checkpoint: str, record: dict[str, Any] | None, config: dict[str, Any],
                   explicit: bool) -> None:
    """Refuse to continue a checkpoint of another run (different settings); checkpoints without a run record
    (stock transformers, older hf_accel) resume only when named explicitly."""
    if record is None:
        if not explicit:
            raise CheckpointError(
                f"{checkpoint} has no {RUN_RECORD} (written by stock transformers or an older hf_accel), so it cannot "
                "be told apart from another run's. Pass its path as resume_from_checkpoint to resume from it anyway."
            )
        logger.warning("hf_accel: %s has no run record; resuming from it as asked, without checking its settings",
                       checkpoint)
        return
    diff = differences(record.get("config", {}), config)
    if diff:
        shown = "; ".join(diff[:6]) + (f"; ... ({len(diff)} differences)" if len(diff) > 6 else "")
        raise ConfigurationError(
            f"{checkpoint} belongs to run {record.get('run_id')} with other settings ({shown}). Resume continues the "
            "same run only: restore those settings, or start a new run in another folder (or overwrite_output_dir)."
        )


def check_steps_left(checkpoint: str, step: int, max_steps: int) -> None:
    if max_steps > 0 and step >= max_steps:
        raise ConfigurationError(
            f"{checkpoint} is at step {step} and this run stops at max_steps={max_steps}: resuming would train no "
            "step and overwrite the saved model with that checkpoint's. Raise max_steps above "
            f"{step}, or start a new run (another folder, or overwrite_output_dir=True)."
        )


def set_aside_later(output_dir: str, step: int) -> None:
    """Checkpoints past the one resumed from belong to an abandoned continuation: move them out of the run."""
    for later_step, path in checkpoints(output_dir):
        if later_step > step:
            moved = set_aside(path, "superseded")
            logger.warning("hf_accel: resuming from step %d; the later %s was set aside as %s", step,
                           os.path.basename(path), os.path.basename(moved))
