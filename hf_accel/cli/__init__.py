"""The installed ``hf-accel`` command: ``hf-accel sft`` (fine-tune; ``--config run.yaml``), ``hf-accel
estimate-memory`` (offline memory estimate), ``hf-accel env`` (versions, GPU, backends).

Each subcommand checks its arguments before importing torch or loading anything; every failure prints as one line
(``failures``), Ctrl-C included.
Under a launcher: ``accelerate launch [--config_file ...] -m hf_accel.cli sft --output-dir DIR ...``.
"""
from __future__ import annotations

import sys

COMMANDS = {
    "sft": ("hf_accel.cli.sft", "fine-tune a causal LM (the embedded offline task by default)"),
    "estimate-memory": ("hf_accel.cli.estimate", "predict training memory from a config, offline"),
    "env": ("hf_accel.cli.env", "versions, the GPU, and which attention backends can run here"),
}


def usage() -> str:
    rows = "\n".join(f"  {name:<16} {text}" for name, (_, text) in COMMANDS.items())
    return (f"usage: hf-accel COMMAND [ARGS]  (hf-accel COMMAND --help for its flags)\n\ncommands:\n{rows}\n\n"
            "Multi-GPU: accelerate launch --config_file examples/accelerate/fsdp2.yaml -m hf_accel.cli sft "
            "--output-dir DIR ...")


def main(argv: list[str] | None = None) -> int:
    """The console entry point; returns the exit status."""
    import importlib

    from .failures import run_command

    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help", "help"):
        print(usage())
        return 0 if argv else 2
    name, rest = argv[0], argv[1:]
    if name not in COMMANDS:
        print(f"hf-accel: error: unknown command {name!r}; commands: {', '.join(COMMANDS)} (hf-accel --help)",
              file=sys.stderr)
        return 2
    module = importlib.import_module(COMMANDS[name][0])
    return run_command(module.main, rest, f"hf-accel {name}")
