"""Checkpoints that lose nothing: write into a hidden staging folder, fsync, then rename into place.

A process killed during a save leaves at most a stale staging folder (ignored by ``get_last_checkpoint`` and
removed by the next save); every ``checkpoint-N`` folder that exists is complete. The last file written before the
rename is a manifest (each file's size and a CRC-32 of its content, ``checksums``), so a checkpoint damaged later
(truncated, overwritten in place, emptied) is detected by ``verify_checkpoint`` before anything of it is loaded. ``AsyncWriter`` runs the disk part of a save on a
background thread after the state was copied to CPU, so training does not wait on the disk.

Loading stays safe: weights are read through safetensors only, every other file with ``torch.load(weights_only=True)``
(transformers' loaders do the same; ``verify_checkpoint`` parses them that way too, memory-mapped). DeepSpeed's engine
files (``global_stepN/``) are the exception: DeepSpeed loads them itself, so they get the size and structure checks only.
"""
from __future__ import annotations

import errno
import json
import logging
import os
import shutil
import struct
import sys
import threading
import time
import zipfile
from typing import Callable

from . import checksums
from ..errors import CheckpointError

logger = logging.getLogger("hf_accel")

STAGING_DIR = ".hf_accel-staging"
# Test hook: "STEP:MARKER" makes the save of global step STEP create MARKER and sleep mid-save (files written,
# not yet renamed), so a test can kill the process deterministically inside a save.
PAUSE_ENV = "HF_ACCEL_PAUSE_IN_SAVE"


def fsync_tree(path: str) -> None:
    """fsync every file under ``path``, then the folders themselves (so the renames below are durable)."""
    for root, _, files in os.walk(path):
        for name in files:
            fd = os.open(os.path.join(root, name), os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        fsync_dir(root)


def fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    except OSError:  # some filesystems do not fsync folders; the rename is still atomic
        pass
    finally:
        os.close(fd)


def staging_path(run_dir: str, name: str) -> str:
    """A fresh, empty staging folder for checkpoint ``name`` under ``run_dir`` (a leftover one is removed)."""
    root = os.path.join(run_dir, STAGING_DIR)
    path = os.path.join(root, name)
    shutil.rmtree(path, ignore_errors=True)
    os.makedirs(root, exist_ok=True)
    return root


def maybe_pause(step: int) -> None:
    spec = os.environ.get(PAUSE_ENV)
    if not spec:
        return
    pause_step, marker = spec.split(":", 1)
    if int(pause_step) == step:
        with open(marker, "w") as f:
            f.write(str(os.getpid()))
        print(f"hf_accel: pausing inside the save of step {step} ({PAUSE_ENV})", file=sys.stderr, flush=True)
        time.sleep(600)


def publish(staged: str, final: str, step: int) -> None:
    """Make the complete checkpoint folder ``staged`` appear as ``final`` in one rename (manifest written last)."""
    write_manifest(staged)
    fsync_tree(staged)
    maybe_pause(step)
    if os.path.exists(final):  # re-saving the same step (e.g. after a resume): move the old one out of the way
        old = final + ".old"
        shutil.rmtree(old, ignore_errors=True)
        os.rename(final, old)
        os.rename(staged, final)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.rename(staged, final)
    fsync_dir(os.path.dirname(final))
    try:  # the staging root, once empty, leaves the run folder as it was
        os.rmdir(os.path.dirname(staged))
    except OSError:
        pass


class AsyncWriter:
    """One background thread for checkpoint writes; ``submit`` waits for the previous write first, so at most one
    snapshot is held in CPU memory. Errors of a write are raised by the next ``submit`` or ``wait``."""

    def __init__(self) -> None:
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None

    def submit(self, write: Callable[[], None]) -> None:
        self.wait()

        def run() -> None:
            try:
                write()
            except BaseException as exc:  # surfaced on the training thread by wait(); logged now, loudly
                logger.error("hf_accel: background checkpoint write failed: %r (raised at the next save)", exc)
                self._error = exc

        self._thread = threading.Thread(target=run, name="hf_accel-checkpoint-writer", daemon=False)
        self._thread.start()

    def wait(self) -> None:
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if self._error is not None:
            error, self._error = self._error, None
            if isinstance(error, CheckpointError):
                raise error
            raise CheckpointError(f"a background checkpoint write failed: {error!r}") from error


# ---- failures while writing ------------------------------------------------------------------------------------

def save_failed(error: OSError, staged: str, name: str, run_dir: str) -> CheckpointError:
    """The typed error for a save that could not be written; removes the partial staging folder (frees the space)
    and leaves every published checkpoint in place."""
    shutil.rmtree(staged, ignore_errors=True)
    try:
        os.rmdir(os.path.dirname(staged))
    except OSError:
        pass
    kept = sorted((d for d in os.listdir(run_dir) if d.startswith("checkpoint-")), key=_step_of)
    previous = f"the previous checkpoint ({kept[-1]}) is untouched" if kept else "no earlier checkpoint exists"
    why = "the disk is full" if error.errno == errno.ENOSPC else f"the write failed ({error})"
    free = shutil.disk_usage(run_dir).free if os.path.isdir(run_dir) else 0
    return CheckpointError(
        f"saving {name} into {run_dir} failed: {why}; {free / 2**30:.2f} GiB free there. The partial save was removed "
        f"and {previous}. Free space (or lower save_total_limit) and resume from the last checkpoint."
    )


def _step_of(name: str) -> int:
    tail = name.rsplit("-", 1)[-1]
    return int(tail) if tail.isdigit() else -1


# ---- manifest and verification ---------------------------------------------------------------------------------

MANIFEST = "hf_accel_manifest.json"


def write_manifest(folder: str) -> None:
    """Record every file under ``folder`` with its size and the CRC-32 of each block of its content (read back right
    after the files were written: from the page cache, on ``checksums.workers()`` threads); written last, so its
    presence means the save finished."""
    files = {}
    for root, _, names in os.walk(folder):
        for name in names:
            path = os.path.join(root, name)
            rel = os.path.relpath(path, folder)
            if rel != MANIFEST:
                files[rel] = os.path.getsize(path)
    sums = {"algorithm": checksums.ALGORITHM, "block_bytes": checksums.BLOCK_BYTES,
            "files": checksums.checksums(folder, sorted(files))}
    with open(os.path.join(folder, MANIFEST), "w", encoding="utf-8") as f:
        json.dump({"format": 2, "files": files, "checksums": sums}, f, indent=1, sort_keys=True)


def verify_checkpoint(folder: str) -> str | None:
    """None when ``folder`` is a complete, readable checkpoint; otherwise one line naming the damaged file and why.

    Checks sizes against the manifest, then the content against its checksums (manifests written since they carry
    them), then each file's structure without loading tensors: safetensors headers and data extents, torch files
    parsed with ``weights_only=True`` (memory-mapped), JSON files parsed.
    """
    if not os.path.isdir(folder):
        return f"{folder}: not a folder"
    entries = os.listdir(folder)
    if not entries:
        return f"{folder}: empty folder"
    manifest_path = os.path.join(folder, MANIFEST)
    sums = None
    if os.path.exists(manifest_path):
        try:
            with open(manifest_path, encoding="utf-8") as f:
                manifest = json.load(f)
            files, sums = manifest["files"], manifest.get("checksums")
        except (OSError, ValueError, KeyError, TypeError) as exc:
            return f"{manifest_path}: unreadable manifest ({exc})"
    else:  # written by stock transformers or an older hf_accel: structure checks only
        files = {os.path.relpath(os.path.join(r, n), folder): None for r, _, ns in os.walk(folder) for n in ns}
    for rel, size in sorted(files.items()):
        path = os.path.join(folder, rel)
        if not os.path.isfile(path):
            return f"{path}: missing"
        actual = os.path.getsize(path)
        if size is not None and actual != size:
            return f"{path}: {actual} bytes, the save wrote {size} (truncated or overwritten)"
    if sums is not None:
        problem = _check_content(folder, sums)
        if problem:
            return problem
    for rel in sorted(files):
        path = os.path.join(folder, rel)
        problem = _check_structure(path)
        if problem:
            return f"{path}: {problem}"
    return None


def _check_content(folder: str, sums: dict) -> str | None:
    try:
        algorithm, block_bytes, expected = sums["algorithm"], int(sums["block_bytes"]), dict(sums["files"])
    except (KeyError, TypeError, ValueError) as exc:
        return f"{os.path.join(folder, MANIFEST)}: unreadable checksums ({exc!r})"
    if algorithm != checksums.ALGORITHM:
        return f"{os.path.join(folder, MANIFEST)}: checksums by {algorithm!r}, which this hf_accel cannot check"
    try:
        return checksums.mismatch(folder, expected, block_bytes)
    except OSError as exc:
        return f"{folder}: cannot read back for its checksums ({exc})"


def _check_structure(path: str) -> str | None:
    name = os.path.basename(path)
    try:
        if name.endswith(".safetensors"):
            return _check_safetensors(path)
        if name.endswith(".json"):
            with open(path, encoding="utf-8") as f:
                json.load(f)
        elif name.endswith((".pt", ".pth", ".bin")):
            if not zipfile.is_zipfile(path):
                return "not a torch checkpoint (no zip directory; truncated or overwritten)"
            if name == "training_args.bin":  # a full pickle that resume never loads: structure only
                return None
            if _is_engine_state(path):  # DeepSpeed's own pickles, which only DeepSpeed's loader reads: structure only
                return None
            import torch

            with _numpy_allowlist():  # the allowlist transformers' own RNG loader uses
                torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except Exception as exc:  # any parse failure means: do not load this checkpoint
        return f"unreadable ({type(exc).__name__}: {str(exc).splitlines()[0][:200] if str(exc) else ''})"
    return None


def _is_engine_state(path: str) -> bool:
    """A file of DeepSpeed's engine state (``global_stepN/*_model_states.pt``, ``*_optim_states.pt``): full pickles
    (its config and enums beside the tensors) that resume hands to DeepSpeed's ``load_checkpoint``, which reads them
    with ``weights_only=False`` itself. Parsing them with ``weights_only=True`` here refused every ZeRO checkpoint."""
    return os.path.basename(os.path.dirname(path)).startswith("global_step")


def _numpy_allowlist():
    try:
        from transformers.trainer_pt_utils import safe_globals
    except ImportError:
        import contextlib

        return contextlib.nullcontext()
    return safe_globals()


def _check_safetensors(path: str) -> str | None:
    size = os.path.getsize(path)
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            return "truncated safetensors header"
        (n,) = struct.unpack("<Q", head)
        if n > size - 8:
            return f"safetensors header claims {n} bytes, the file holds {size - 8}"
        header = json.loads(f.read(n))
    end = max((v["data_offsets"][1] for k, v in header.items() if k != "__metadata__"), default=0)
    if 8 + n + end != size:
        return f"safetensors data ends at byte {8 + n + end}, the file has {size} (truncated)"
    return None
