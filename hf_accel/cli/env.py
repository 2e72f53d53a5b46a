"""``hf-accel env``: what this machine offers hf_accel — versions, the GPU, and which attention backends can run here
(and why the others cannot). Paste its output into a bug report."""
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


def report() -> str:
    import torch

    from .. import __version__
    from ..attention.kernels import format_backends

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
    lines += ["", "attention backends:", format_backends()]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    if argv:
        from ..errors import UsageError

        raise UsageError(f"hf-accel env takes no arguments; got {' '.join(argv)}")
    print(report())
