"""What this machine lets the process take: host memory available now (a container's cgroup limit honoured) and a
CUDA device's allocation cap. One place for both, so the ``budget:`` plan, the QLoRA defaults' host-copy limit and
the background saves' buffers all count host memory the same way."""
from __future__ import annotations

import contextlib
import os

import torch

CGROUP_ROOT = "/sys/fs/cgroup"


def host_available_bytes(cgroup_root: str | None = None) -> int:
    """Host memory this process can still take: the kernel's MemAvailable (psutil), or less where a cgroup (a
    container's memory limit) allows less: its limit minus its usage, reclaimable file pages counted as free."""
    import psutil  # accelerate's dependency

    cgroup_root = CGROUP_ROOT if cgroup_root is None else cgroup_root
    available = psutil.virtual_memory().available
    for limit_name, usage_name, inactive_key in (("memory.max", "memory.current", "inactive_file"),
                                                 ("memory/memory.limit_in_bytes", "memory/memory.usage_in_bytes",
                                                  "total_inactive_file")):
        try:
            with open(os.path.join(cgroup_root, limit_name)) as f:
                limit = int(f.read().strip())  # "max": no limit (ValueError)
            with open(os.path.join(cgroup_root, usage_name)) as f:
                usage = int(f.read().strip())
        except (OSError, ValueError):
            continue
        inactive = 0
        with contextlib.suppress(OSError, ValueError):
            with open(os.path.join(cgroup_root, os.path.dirname(limit_name), "memory.stat")) as f:
                stats = dict(line.split() for line in f if len(line.split()) == 2)
            inactive = int(stats.get(inactive_key, 0))
        return min(available, max(limit - usage + inactive, 0))
    return available


def device_cap_bytes(device: torch.device) -> int | None:
    """What this process may allocate on a CUDA device: its size times the per-process memory fraction
    (torch.cuda.set_per_process_memory_fraction); None off CUDA."""
    if device.type != "cuda":
        return None
    index = device.index if device.index is not None else torch.cuda.current_device()
    total = torch.cuda.get_device_properties(index).total_memory
    fraction = getattr(torch.cuda, "get_per_process_memory_fraction", None)  # torch >= 2.8
    return round(total * (fraction(index) if fraction is not None else 1.0))
