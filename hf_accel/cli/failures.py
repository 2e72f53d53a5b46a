"""How a command of ``hf-accel`` fails: one line on stderr with the cause and the flag to change, never a traceback.

- hf_accel's own errors print as ``hf-accel sft: error: [Type: ]message``: exit status 2 for an argument that cannot
  work (``UsageError``, as argparse's own), 1 for anything found later. Library messages advise the Python API
  (``backend='auto'``, ``overwrite_output_dir``); ``for_cli`` says the command's flags instead.
- Ctrl-C (``KeyboardInterrupt``) and ``RunInterrupted`` (a run stopped by Ctrl-C after saving a checkpoint) exit 130,
  the shell's status for SIGINT.
- Anything else (a bug, or a dependency's error hf_accel did not foresee) is one line naming its type and first line,
  and how to see the traceback (``HF_ACCEL_TRACEBACK=1``), exit status 1.
- A run that fails removes the run folder it created, if nothing was written into it (``remove_if_empty``).
"""
from __future__ import annotations

import os
import re
import shutil
import sys
from typing import Any, Callable

from ..errors import HFAccelError, UsageError
from .leave import leave_rank

TRACEBACK_ENV = "HF_ACCEL_TRACEBACK"
INTERRUPTED = 130  # 128 + SIGINT

# (what a library message advises, what the command's user does instead); tests/test_cli_failures.py checks that
# every left-hand text is still written by hf_accel, so a reworded library message cannot silently bypass this table
CLI_ADVICE: tuple[tuple[str, str], ...] = (
    ("Pass backend='auto' or one of:", "Pass --backend auto or one of:"),
    ("or start a new run in another folder (or overwrite_output_dir).",
     "or start a new run in another --output-dir (or --overwrite)."),
    ("restore those settings,", "restore those flags,"),
    ("Raise max_steps above", "Raise --max-steps above"),
    ("or start a new run (another folder, or overwrite_output_dir=True).",
     "or start a new run (another --output-dir, or --overwrite)."),
    ("start a new run with overwrite_output_dir=True (--overwrite)", "start a new run with --overwrite"),
    ("Pass its path as resume_from_checkpoint to resume from it anyway.",
     "Move it out of --output-dir, or start a new run there with --overwrite."),
    ("Pass async_save=False (saves are still atomic).", "Drop --async-save (saves are still atomic)."),
    ("under FSDP/DeepSpeed pass save='full'.", "under FSDP/DeepSpeed pass --save full."),
    ("Pass fused_ops=False.", "Pass --no-fused-ops."),
    ("Pass compile=False", "Pass --no-compile"),
    ("or pass fused_ce=False.", "or pass --no-fused-ce."),
    ("Pass an absolute budget such as 'budget:20GiB', or MemoryBudget(..., device_bytes=N).",
     "Pass an absolute budget such as --checkpointing budget:20GiB."),
    ("lower save_total_limit", "lower --save-total-limit"),
)


def for_cli(message: str) -> str:
    """A library error's message with its Python-API advice replaced by the command's flags."""
    for library, command in CLI_ADVICE:
        message = message.replace(library, command)
    return message


class RunInterrupted(HFAccelError):
    """A run stopped by Ctrl-C after its current step, with a checkpoint saved (the message says how to resume)."""


def _one_line(text: str) -> str:
    return re.sub(r"\s*\n\s*", " ", str(text).strip())


def run_command(main: Callable[[Any], Any], argv: list[str] | None, prog: str) -> int:
    """Run ``main(argv)``; every failure prints as one line (see the module docstring). Returns the exit status; a
    rank of a multi-process CPU run ends there with it instead (``leave.leave_rank``)."""
    status = _status_of(main, argv, prog)
    leave_rank(status)
    return status


def _status_of(main: Callable[[Any], Any], argv: list[str] | None, prog: str) -> int:
    try:
        main(argv)
    except RunInterrupted as e:
        print(f"{prog}: {e}", file=sys.stderr, flush=True)
        return INTERRUPTED
    except KeyboardInterrupt:
        print(f"{prog}: interrupted (Ctrl-C)", file=sys.stderr, flush=True)
        return INTERRUPTED
    except HFAccelError as e:
        usage = isinstance(e, UsageError)
        text = _one_line(for_cli(str(e)))
        print(f"{prog}: error: {text}" if usage else f"{prog}: error: {type(e).__name__}: {text}", file=sys.stderr,
              flush=True)
        return 2 if usage else 1
    except Exception as e:  # noqa: BLE001 (the command's promise: one line, the traceback on request)
        if os.environ.get(TRACEBACK_ENV, "").lower() in ("1", "true", "yes"):
            raise
        first = _one_line(str(e).strip().splitlines()[0] if str(e).strip() else "")
        print(f"{prog}: error: {type(e).__name__}: {first[:500]} (an error hf_accel did not foresee; "
              f"{TRACEBACK_ENV}=1 shows the traceback; please report it with `hf-accel env`)", file=sys.stderr,
              flush=True)
        return 1
    return 0


def holds_files(folder: str) -> bool:
    return any(files for _, _, files in os.walk(folder))


def remove_if_empty(folder: str | None) -> bool:
    """Remove ``folder`` (and its empty subfolders) when no file was written under it; True when removed."""
    if not folder or not os.path.isdir(folder) or holds_files(folder):
        return False
    shutil.rmtree(folder, ignore_errors=True)
    return not os.path.exists(folder)
