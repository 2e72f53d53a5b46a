"""torch's CPU threads while a Trainer trains on the CPU.

torch starts with one thread per core. An OpenMP thread without a free core stalls every parallel op of the step, so
on a machine where anything else runs (a 2-core machine with one other busy process) all-core training ran 5-30x
slower than with one core left free (docs/guide/troubleshooting.md). ``AccelArguments(cpu_threads="auto")`` therefore
trains with one thread less than the usable cores, unless the user chose: ``OMP_NUM_THREADS`` / ``MKL_NUM_THREADS``
set, or ``torch.set_num_threads`` below the core count. The setting is put back when ``train()`` returns. GPU runs
are left alone.
"""
from __future__ import annotations

import contextlib
import logging
import os
from typing import Any, Iterator

import torch

logger = logging.getLogger("hf_accel")


def usable_cores() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def training_threads(setting: Any, device: torch.device) -> int | None:
    """The thread count to train with, or None to leave torch's as it is."""
    if setting is None or device.type != "cpu":
        return None
    if setting != "auto":
        if not isinstance(setting, int) or isinstance(setting, bool) or setting < 1:
            from ..errors import ConfigurationError

            raise ConfigurationError(f"AccelArguments(cpu_threads={setting!r}); allowed: 'auto', None (leave torch's "
                                     "setting), or a positive number of threads.")
        return setting
    if any(os.environ.get(name) for name in ("OMP_NUM_THREADS", "MKL_NUM_THREADS")):
        return None
    cores = usable_cores()
    if torch.get_num_threads() < cores:  # chosen by the user (or a launcher) already
        return None
    return max(1, cores - 1)


@contextlib.contextmanager
def for_training(setting: Any, device: torch.device) -> Iterator[None]:
    threads = training_threads(setting, device)
    before = torch.get_num_threads()
    if threads is None or threads == before:
        yield
        return
    torch.set_num_threads(threads)
    logger.info("hf_accel: training on the CPU with %d threads (of %d usable cores; AccelArguments(cpu_threads=...) "
                "or OMP_NUM_THREADS chooses)", threads, usable_cores())
    try:
        yield
    finally:
        torch.set_num_threads(before)
