"""How a rank of a multi-process CPU run ends: at once, past the interpreter's teardown.

A process whose gloo process group is still alive when Python finalizes can abort there ("terminate called without
an active exception", exit -6): gloo's worker threads may still hold finished work whose tensors need the GIL while
the interpreter is torn down (pytorch PR 179291, abandoned). Seen on a rank of `sft.py` under a 2-process ZeRO-3 CPU
launch in CI, after the run had saved (docs/MULTI_GPU.md, "End of run"). ``destroy_process_group`` first is not the
cure: under DDP on gloo the Reducer frees the group later, holding the GIL, while gloo's thread still needs it (a
deadlock, seen on CPU). So a gloo rank runs the exit handlers (trackers, logging) while the interpreter is whole,
flushes, and leaves with ``os._exit``. NCCL ranks and single processes end as usual.
"""
from __future__ import annotations

import atexit
import os
import sys


def gloo_rank() -> bool:
    """Whether this process is one rank of several in a gloo process group (torch already imported by the run)."""
    dist = sys.modules.get("torch.distributed")
    if dist is None or not dist.is_available() or not dist.is_initialized() or dist.get_world_size() < 2:
        return False
    backend = str(dist.get_backend())  # "gloo", or "cpu:gloo,cuda:nccl" for a group on both
    return "gloo" in backend and "nccl" not in backend


def leave_rank(status: int) -> None:
    """On a gloo rank, end the process now with ``status``: exit handlers run, output flushed, no interpreter
    teardown. Elsewhere, return."""
    if not gloo_rank():
        return
    atexit._run_exitfuncs()  # what the interpreter would run first: trackers' finish, logging.shutdown
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)
