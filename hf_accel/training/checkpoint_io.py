"""Checkpoints that lose nothing: write into a hidden staging folder, fsync, then rename into place.

A process killed during a save leaves at most a stale staging folder (ignored by ``get_last_checkpoint`` and
removed by the next save); every ``checkpoint-N`` folder that exists is complete. ``AsyncWriter`` runs the disk
part of a save on a background thread after the state was copied to CPU, so training does not wait on the disk.
"""
from __future__ import annotations

import os
import shutil
import sys
import threading
import time
from typing import Callable

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
    """Make the complete checkpoint folder ``staged`` appear as ``final`` in one rename."""
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
            except BaseException as exc:  # surfaced on the training thread by wait()
                self._error = exc

        self._thread = threading.Thread(target=run, name="hf_accel-checkpoint-writer", daemon=False)
        self._thread.start()

    def wait(self) -> None:
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if self._error is not None:
            error, self._error = self._error, None
            raise RuntimeError("hf_accel: a background checkpoint write failed") from error
