"""Ctrl-C during ``hf-accel sft``: the first one finishes the current optimizer step, saves a checkpoint and stops
(the command then prints the line that resumes the run and exits 130); a second one stops at once.

Single process only: under a launcher every rank gets the signal at a different point of its step, and agreeing on
one stopping step would cost a collective every step; there Ctrl-C stops at once, as before.
"""
from __future__ import annotations

import argparse
import os
import shlex
import signal
import sys
import threading
from typing import Any

from transformers import TrainerCallback


class GracefulStop(TrainerCallback):
    """A SIGINT handler (installed by ``with``) and the callback that turns its request into a save and a stop."""

    def __init__(self) -> None:
        self.requested = False
        self.stopped_at: int | None = None
        self._previous: Any = None

    def __enter__(self) -> "GracefulStop":
        if threading.current_thread() is threading.main_thread() and int(os.environ.get("WORLD_SIZE", "1")) == 1:
            self._previous = signal.signal(signal.SIGINT, self._handle)
        return self

    def __exit__(self, *exc: Any) -> None:
        if self._previous is not None:
            signal.signal(signal.SIGINT, self._previous)
            self._previous = None

    def _handle(self, signum, frame) -> None:
        if self.requested:
            signal.signal(signal.SIGINT, signal.default_int_handler)
            raise KeyboardInterrupt
        self.requested = True
        print("\nCtrl-C: finishing this step, then saving a checkpoint and stopping (Ctrl-C again stops at once, "
              "without saving)", file=sys.stderr, flush=True)

    def on_step_end(self, args, state, control, **kwargs):
        if self.requested and self.stopped_at is None:
            self.stopped_at = state.global_step
            control.should_save = True
            control.should_training_stop = True


_DROPPED = {"--resume": 0, "--overwrite": 0, "--output-dir": 1, "--output_dir": 1}


def resume_command(argv: list[str], output_dir: str, prog: str = "hf-accel sft") -> str:
    """The command line that continues this run: its own arguments, without --overwrite, with its folder and
    --resume."""
    kept, skip = [], 0
    for arg in argv:
        if skip:
            skip -= 1
            continue
        name = arg.split("=", 1)[0]
        if name in _DROPPED:
            skip = _DROPPED[name] if "=" not in arg else 0
            continue
        kept.append(arg)
    return " ".join([prog, *map(shlex.quote, kept), "--output-dir", shlex.quote(output_dir), "--resume"])


def interrupted_message(args: argparse.Namespace, argv: list[str], step: int, max_steps: int,
                        checkpoint: str | None, at_once: bool) -> str:
    where = f"step {step}/{max_steps}" if max_steps > 0 else f"step {step}"
    if checkpoint is None:
        return (f"interrupted at {where}; no checkpoint was saved, so the run cannot be resumed (start it again"
                f"{'' if at_once else '; the save failed'})")
    how = "stopped at once (second Ctrl-C); the newest checkpoint is" if at_once else "saved"
    return f"interrupted at {where}: {how} {checkpoint}; continue with: {resume_command(argv, args.output_dir)}"
