"""Quiet by default: what a run prints is what a user can act on.

Progress bars of the libraries below us (datasets' ``map``, tokenizing) draw only on a terminal; in a log file tqdm's
carriage-return chains are noise, and hf_accel's own progress prints one line per logging interval there instead.
"""
from __future__ import annotations

import sys


def on_terminal() -> bool:
    return bool(getattr(sys.stderr, "isatty", lambda: False)())


def quiet_libraries() -> None:
    """Turn datasets' and transformers' progress bars off unless stderr is a terminal."""
    if on_terminal():
        return
    import datasets
    import transformers

    datasets.disable_progress_bars()
    transformers.utils.logging.disable_progress_bar()
