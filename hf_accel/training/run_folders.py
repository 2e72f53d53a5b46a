"""Which folder a run writes to, read from the file system alone (no torch: the ``hf-accel`` command calls this
before it loads anything).

A new run refuses a folder that already holds files (an earlier run's checkpoints would otherwise be picked up by a
later resume) unless asked to clear it, and suggests only what can work there. Without a folder of their own, runs
of the command get a new numbered one (``runs/<name>-<N>``), so running the same command twice never collides.
"""
from __future__ import annotations

import os
import re

from ..errors import ConfigurationError

CHECKPOINT_RE = re.compile(r"^checkpoint-(\d+)$")


def checkpoints(output_dir: str) -> list[tuple[int, str]]:
    """``(step, path)`` of the folder's ``checkpoint-N`` folders, newest first."""
    if not os.path.isdir(output_dir):
        return []
    found = [(int(m.group(1)), os.path.join(output_dir, d)) for d in os.listdir(output_dir)
             if (m := CHECKPOINT_RE.match(d)) and os.path.isdir(os.path.join(output_dir, d))]
    return sorted(found, reverse=True)


def check_output_dir(output_dir: str, *, resume: bool, overwrite: bool, flags: bool = False) -> None:
    """Raise ``ConfigurationError`` when a new run (neither resume nor overwrite) would write into a folder that
    already holds files; the message offers resuming only where a checkpoint exists. ``flags``: name the command's
    flags instead of the Trainer's arguments."""
    if resume or overwrite or not os.path.isdir(output_dir):
        return
    entries = sorted(os.listdir(output_dir))
    if not entries:
        return
    shown = ", ".join(entries[:5]) + (f", ... ({len(entries)} entries)" if len(entries) > 5 else "")
    options = []
    if checkpoints(output_dir):
        options.append("continue that run (--resume)" if flags else "resume that run (resume_from_checkpoint=True)")
    options.append("clear the folder (--overwrite)" if flags else "clear it (AccelArguments(overwrite_output_dir=True))")
    options.append("choose another --output-dir (or leave it out: each run then gets a new folder under runs/)"
                   if flags else "choose another output_dir")
    raise ConfigurationError(
        f"output folder {output_dir} already holds files of an earlier run ({shown}); a new run there would mix "
        f"with them. {_either(options)}."
    )


def _either(options: list[str]) -> str:
    text = ", ".join(options[:-1]) + (", or " if len(options) > 1 else "") + options[-1]
    return text[0].upper() + text[1:]


def _numbered(root: str, name: str) -> list[tuple[int, str]]:
    """``(N, path)`` of the folders ``<root>/<name>-<N>``, newest first."""
    pattern = re.compile(rf"^{re.escape(name)}-(\d+)$")
    if not os.path.isdir(root):
        return []
    found = [(int(m.group(1)), os.path.join(root, d)) for d in os.listdir(root)
             if (m := pattern.match(d)) and os.path.isdir(os.path.join(root, d))]
    return sorted(found, reverse=True)


def new_run_dir(root: str, name: str) -> str:
    """``<root>/<name>-<N>`` for the first N past every existing one (the folder is created by the run)."""
    runs = _numbered(root, name)
    return os.path.join(root, f"{name}-{runs[0][0] + 1 if runs else 1}")


def latest_run_dir(root: str, name: str) -> str | None:
    """The newest ``<root>/<name>-<N>`` that holds a checkpoint (what a resume without a folder continues)."""
    return next((path for _, path in _numbered(root, name) if checkpoints(path)), None)
