"""``hf-accel env``: what this machine offers hf_accel — versions, the GPU, and which attention backends can run here
and which can train here (a backend may run forward but have no backward on this device), with why not. Paste its
output into a bug report."""
from __future__ import annotations

import platform
from importlib import metadata

PACKAGES = ("torch", "transformers", "peft", "accelerate", "datasets", "trl", "liger-kernel", "flash-attn-4",
            "bitsandbytes", "deepspeed")


def _version(name: str) -> str:
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return "not installed"


def device_type() -> str:
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def trains_here(name: str) -> tuple[bool, str]:
    """(whether backend ``name`` can run forward and backward on this machine's device, why not), read from what the
    backend declares (its devices and backward devices) and whether it is installed here."""
    from ..attention.kernels import BACKENDS, list_backends

    status = next(s for s in list_backends() if s.name == name)
    if not status.available:
        return False, status.reason or "not available"
    caps, device = BACKENDS[name].capabilities, device_type()
    if device not in caps.devices:
        return False, f"runs on {', '.join(sorted(caps.devices))} only"
    if caps.backward_devices is not None and device not in caps.backward_devices:
        return False, f"no backward on {device} (forward only)"
    return True, ""


def training_backends() -> list[str]:
    from ..attention.kernels import BACKENDS

    return [name for name in BACKENDS if trains_here(name)[0]]


def backend_table() -> str:
    """One row per backend: whether it runs here, whether it trains here, and why not (or its notes)."""
    from ..attention.kernels import list_backends

    rows = ["backend    runs  trains  notes"]
    for status in list_backends():
        trains, why = trains_here(status.name)
        notes = status.reason or why or "; ".join(status.notes)
        if status.available and not trains:
            notes = f"{why}; {'; '.join(status.notes)}" if status.notes else why
        rows.append(f"{status.name:10s} {'yes' if status.available else 'no':5s} {'yes' if trains else 'no':7s} "
                    f"{notes}")
    return "\n".join(rows)


def report() -> str:
    import torch

    from .. import __version__

    lines = [f"hf_accel {__version__}", f"python {platform.python_version()} ({platform.platform()})"]
    lines += [f"{name} {_version(name)}" for name in PACKAGES]
    if torch.cuda.is_available():
        for i in range(torch.cuda.device_count()):
            props = torch.cuda.get_device_properties(i)
            lines.append(f"GPU {i}: {props.name}, {props.total_memory / 1024**3:.0f} GiB, compute capability "
                         f"{props.major}.{props.minor} (CUDA {torch.version.cuda})")
    else:
        lines.append(f"GPU: none visible to torch (CUDA build: {torch.version.cuda or 'no'}); hf_accel's speed-ups "
                     "(fused loss, liger ops, compiled layers) stay off on CPU")
    lines.append(f"CPU threads for torch: {torch.get_num_threads()}")
    lines += ["", f"attention backends ({device_type()}; `hf-accel sft --backend NAME` needs trains = yes):",
              backend_table()]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    if argv:
        from ..errors import UsageError

        raise UsageError(f"hf-accel env takes no arguments; got {' '.join(argv)}")
    print(report())
