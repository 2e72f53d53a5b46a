"""Every failure of ``hf-accel sft`` is one line with the cause and the flag to change (issue 68c-e): found before
loading where it can be (a model_type this transformers does not know, a folder without a tokenizer, a hub id
without a network, a backend that cannot train here, a token budget under the longest example), library advice said
as flags, unforeseen errors in one line too; Ctrl-C finishes the step, saves, prints the line that resumes the run
(which resumes it) and exits 130, a second Ctrl-C stops at once; a failed run leaves no empty folder behind; a run
whose loss goes nan exits 1 and saves no model."""
from __future__ import annotations

import json
import math
import os
import shlex
import signal
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from hf_accel.cli import failures

ROOT = Path(__file__).resolve().parent.parent
TINY = ["--max-steps", "2", "--eval-examples", "0", "--logging-steps", "1"]


@pytest.fixture
def sft(monkeypatch):
    from hf_accel.cli import sft

    monkeypatch.setattr(torch, "set_num_threads", lambda n: None)  # leave the test process's threads alone
    return sft


def one_line(capsys) -> str:
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "Traceback" not in err[0], err
    return err[0]


def tiny_model_folder(path: Path, tokenizer: bool = True) -> Path:
    from hf_accel.data.default_task import build_tokenizer, tiny_llama

    tok = build_tokenizer()
    tiny_llama(len(tok), hidden_size=32).save_pretrained(path)
    if tokenizer:
        tok.save_pretrained(path)
    return path


def test_a_model_type_transformers_does_not_know_is_named_before_loading(tmp_path, sft, capsys):
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "config.json").write_text(json.dumps({"model_type": "llama-from-the-future"}))
    assert sft.cli(["--model", str(tmp_path / "m"), *TINY, "--output-dir", "out"]) == 2
    line = one_line(capsys)
    assert "config.json has model_type 'llama-from-the-future', which transformers" in line and "upgrade" in line
    assert not os.path.exists("out")


def test_a_folder_without_tokenizer_asks_for_tokenizer_and_the_flag_works(tmp_path, sft, capsys):
    model = tiny_model_folder(tmp_path / "model", tokenizer=False)
    tiny_model_folder(tmp_path / "base")
    (tmp_path / "data.jsonl").write_text("".join(json.dumps({"text": "abc=cba"}) + "\n" for _ in range(8)))
    argv = ["--model", str(model), "--dataset", "data.jsonl", *TINY, "--max-length", "32"]
    assert sft.cli([*argv, "--output-dir", "out"]) == 2
    line = one_line(capsys)
    assert "--model" in line and "has no tokenizer" in line and "pass --tokenizer PATH_OR_ID" in line
    assert sft.cli([*argv, "--tokenizer", str(tmp_path / "base"), "--output-dir", "out"]) == 0
    assert (Path("out") / "model.safetensors").exists()


def test_a_hub_id_without_network_fails_in_one_line_without_loading(sft, capsys, monkeypatch):
    """No network and no cached copy: refused by one metadata request, never by transformers' retrying loaders."""
    import huggingface_hub
    import transformers
    from huggingface_hub import constants

    def unreachable(*a, **kw):
        raise ConnectionError("[Errno -2] Name or service not known")

    def must_not_load(*a, **kw):
        raise AssertionError("a loader ran (it retries for tens of seconds without a network)")

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(huggingface_hub.HfApi, "model_info", unreachable)
    for loader in (transformers.AutoTokenizer, transformers.AutoConfig, transformers.AutoModelForCausalLM):
        monkeypatch.setattr(loader, "from_pretrained", must_not_load)
    assert sft.cli(["--model", "someone/some-model", *TINY, "--output-dir", "out"]) == 2
    line = one_line(capsys)
    assert "--model someone/some-model: not a local folder, the hub cannot be reached" in line
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    assert sft.cli(["--model", "someone/some-model", *TINY, "--output-dir", "out"]) == 2
    assert "not in the hub cache while HF_HUB_OFFLINE=1" in one_line(capsys)


def test_a_backend_that_cannot_train_here_is_refused_with_the_flag(sft, capsys):
    from hf_accel.cli.env import trains_here

    if torch.cuda.is_available():
        pytest.skip("flex trains on CUDA")
    assert trains_here("flex") == (False, "no backward on cpu (forward only)")
    assert sft.cli([*TINY, "--backend", "flex", "--output-dir", "out"]) == 2
    line = one_line(capsys)
    assert "--backend flex cannot train on this machine (cpu): no backward on cpu" in line
    assert "pass --backend auto (here: sdpa, reference)" in line


def test_env_says_which_backends_train_here(capsys):
    from hf_accel.cli import main

    assert main(["env"]) == 0
    rows = {line.split()[0]: line.split()[1:3] for line in capsys.readouterr().out.splitlines()
            if line.split() and line.split()[0] in ("flex", "sdpa", "reference")}
    assert rows["sdpa"] == ["yes", "yes"] and rows["reference"] == ["yes", "yes"]
    if not torch.cuda.is_available():
        assert rows["flex"] == ["yes", "no"]


def test_a_token_budget_under_the_longest_example_names_both_flags(sft, capsys):
    assert sft.cli([*TINY, "--max-tokens-per-batch", "16", "--output-dir", "out"]) == 2
    line = one_line(capsys)
    assert "--max-tokens-per-batch 16 is less than" in line and "raise --max-tokens-per-batch to" in line
    assert "--max-length 16" in line and "oversized" not in line and "max_tokens=" not in line
    assert not os.path.exists("out")  # nothing was written: the run's folder is gone


@pytest.mark.slow  # two runs of the command; the token budget and backend tests cover the fast suite
def test_library_advice_is_said_as_flags(sft, capsys):
    """A resume with other settings: the run-folder check's advice names --output-dir / --overwrite, not the
    Trainer's overwrite_output_dir."""
    assert sft.cli([*TINY, "--save-steps", "1", "--output-dir", "out"]) == 0
    capsys.readouterr()
    assert sft.cli(["--max-steps", "3", "--eval-examples", "0", "--lr", "1e-3", "--resume", "--output-dir",
                    "out"]) == 1
    line = one_line(capsys)
    assert "training.learning_rate: checkpoint 0.003, now 0.001" in line
    assert "another --output-dir (or --overwrite)" in line and "overwrite_output_dir" not in line


def library_messages() -> list[str]:
    """Every string literal of hf_accel and patches (adjacent literals joined, f-string fields as {})."""
    import ast

    texts = []
    for folder in ("hf_accel", "patches"):
        for path in (ROOT / folder).rglob("*.py"):
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.Constant) and isinstance(node.value, str):
                    texts.append(node.value)
                elif isinstance(node, ast.JoinedStr):
                    texts.append("".join(v.value if isinstance(v, ast.Constant) else "{}" for v in node.values))
    return texts


def test_every_library_phrase_the_table_translates_is_still_written_by_hf_accel():
    messages = [m for m in library_messages() if not any(m == c for _, c in failures.CLI_ADVICE)]
    for library, command in failures.CLI_ADVICE:
        assert any(library in m for m in messages if m != library), library
        assert "=" not in command.replace("--", ""), command


def test_an_unforeseen_error_is_one_line_and_the_empty_run_folder_goes(sft, capsys, monkeypatch):
    from hf_accel.training.trainer import Trainer

    def broken(self, *a, **kw):
        os.makedirs(os.path.join(self.args.output_dir, "empty-subfolder"), exist_ok=True)
        raise RuntimeError("something deep inside failed\nsecond line")

    monkeypatch.setattr(Trainer, "train", broken)
    assert sft.cli([*TINY]) == 1
    line = one_line(capsys)
    assert line.startswith("hf-accel sft: error: RuntimeError: something deep inside failed (an error hf_accel did "
                           "not foresee; HF_ACCEL_TRACEBACK=1 shows the traceback")
    assert not os.path.exists(os.path.join("runs", "tiny-task-1"))
    monkeypatch.setenv("HF_ACCEL_TRACEBACK", "1")
    with pytest.raises(RuntimeError, match="something deep"):
        sft.cli([*TINY])


class SigintAt:
    """Sends this process SIGINT ``times`` times at the end of optimizer step ``step`` (a user pressing Ctrl-C)."""

    def __init__(self, step: int, times: int = 1) -> None:
        self.step, self.times = step, times

    def callback(self):
        import transformers

        outer = self

        class Callback(transformers.TrainerCallback):
            def on_step_end(self, args, state, control, **kwargs):
                if state.global_step == outer.step:
                    for _ in range(outer.times):
                        os.kill(os.getpid(), signal.SIGINT)

        return Callback()


def with_sigint(sft, monkeypatch, at: SigintAt) -> None:
    real = sft.make_trainer

    def make_trainer(*a, **kw):
        trainer = real(*a, **kw)
        trainer.add_callback(at.callback())  # before the command's own stop callback: fires within the same step
        return trainer

    monkeypatch.setattr(sft, "make_trainer", make_trainer)


def losses_of(folder: str) -> list[float]:
    return json.loads((Path(folder) / "metrics.json").read_text())["losses"]


CUT = ["--max-steps", "6", "--eval-examples", "0", "--logging-steps", "1", "--max-tokens-per-batch", "128"]


def interrupted_run(sft, capsys, monkeypatch, folder: str) -> list[str]:
    """The command of CUT, Ctrl-C at step 3: checks what it says and leaves; returns the resume command it printed."""
    plain = sft.make_trainer
    with_sigint(sft, monkeypatch, SigintAt(3))
    assert sft.cli([*CUT, "--output-dir", folder]) == failures.INTERRUPTED
    monkeypatch.setattr(sft, "make_trainer", plain)
    err = capsys.readouterr().err
    last = err.strip().splitlines()[-1]
    assert "Ctrl-C: finishing this step" in err and "Traceback" not in err
    assert last.startswith(f"hf-accel sft: interrupted at step 3/6: saved {folder}/checkpoint-3; continue with: "), \
        last
    assert sorted(d for d in os.listdir(folder) if d.startswith("checkpoint")) == ["checkpoint-3"]
    assert not os.path.exists(os.path.join(folder, "model.safetensors"))  # an unfinished run saves no result
    command = shlex.split(last.split("continue with: ", 1)[1])
    assert command[:2] == ["hf-accel", "sft"] and command[-3:] == ["--output-dir", folder, "--resume"]
    return command


def test_ctrl_c_finishes_the_step_saves_and_prints_the_resume_line(sft, capsys, monkeypatch):
    """Without --save-steps too (the run saved nothing before, and Ctrl-C lost everything)."""
    interrupted_run(sft, capsys, monkeypatch, "cut")


@pytest.mark.slow  # three runs of the command
def test_the_printed_resume_line_continues_to_the_uninterrupted_losses(sft, capsys, monkeypatch):
    assert sft.cli([*CUT, "--output-dir", "whole"]) == 0
    capsys.readouterr()
    command = interrupted_run(sft, capsys, monkeypatch, "cut")
    assert sft.cli(command[2:]) == 0
    assert losses_of("cut")[-3:] == pytest.approx(losses_of("whole")[-3:], rel=1e-6)


def test_a_second_ctrl_c_stops_at_once_naming_the_newest_checkpoint(sft, capsys, monkeypatch):
    with_sigint(sft, monkeypatch, SigintAt(3, times=2))
    assert sft.cli(["--max-steps", "6", "--eval-examples", "0", "--save-steps", "2", "--output-dir", "out"]) == 130
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert "stopped at once (second Ctrl-C); the newest checkpoint is out/checkpoint-2" in last
    assert "--output-dir out --resume" in last
    assert sorted(d for d in os.listdir("out") if d.startswith("checkpoint")) == ["checkpoint-2"]


def test_a_diverging_command_exits_1_naming_the_step_and_saves_no_model(sft, capsys):
    """The issue's `--lr 1e9`: it printed `saved the model` and exited 0 with every weight nan."""
    assert sft.cli(["--lr", "1e9", "--max-steps", "8", "--eval-examples", "0", "--save-steps", "1",
                    "--output-dir", "out"]) == 1
    line = capsys.readouterr().err.strip().splitlines()[-1]
    assert line.startswith("hf-accel sft: error: NonFiniteLoss: the training loss was nan at step "), line
    step = int(line.split("at step ")[1].split(";")[0])
    assert "Lower --lr (1e+09 now), or pass --non-finite skip" in line
    assert not (Path("out") / "model.safetensors").exists()
    kept = sorted(int(d.split("-")[1]) for d in os.listdir("out") if d.startswith("checkpoint-"))
    assert kept and max(kept) < step and f"out/checkpoint-{max(kept)}" in line
    weights = load_file(Path("out") / f"checkpoint-{max(kept)}" / "model.safetensors")
    assert all(torch.isfinite(w).all() for w in weights.values())
    metrics = json.loads((Path("out") / "metrics.json").read_text())  # the plot and metrics show what happened
    assert metrics["stopped"] and (Path("out") / "training.png").exists()
    assert any(not math.isfinite(loss) for loss in metrics["losses"])


RANK_SCRIPT = r'''
import atexit, sys, threading, time
from pathlib import Path
import torch.distributed as dist
from hf_accel.cli.failures import run_command
from hf_accel.errors import HFAccelError

rank, rendezvous, out = int(sys.argv[1]), sys.argv[2], Path(sys.argv[3])
dist.init_process_group("gloo", init_method=f"file://{rendezvous}", rank=rank, world_size=2)
atexit.register(lambda: (out / f"atexit.{rank}").write_text("ran"))

def main(argv):
    dist.barrier()
    # what the interpreter's teardown would wait on: a thread that is not a daemon, as gloo's own are not joinable
    threading.Thread(target=time.sleep, args=(120,), daemon=False).start()
    if rank == 1:
        raise HFAccelError("rank 1 failed")

sys.exit(run_command(main, [], "hf-accel sft"))
'''


def test_a_gloo_rank_ends_at_once_with_its_status_after_the_exit_handlers(tmp_path):
    """A rank of a 2-process gloo group leaves through ``os._exit`` once the command is done (the interpreter's
    teardown, where gloo's threads can abort a finished rank, never runs): the exit handlers ran, each rank's status
    is its own, and a thread the teardown would wait for does not hold the process. Without ``leave_rank`` both
    processes wait for their 120 s thread and the 60 s timeout fails the test."""
    import subprocess
    import sys as _sys

    script = tmp_path / "rank.py"
    script.write_text(RANK_SCRIPT)
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    procs = [subprocess.Popen([_sys.executable, str(script), str(rank), str(tmp_path / "rendezvous"), str(tmp_path)],
                              env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for rank in (0, 1)]
    try:
        outs = [p.communicate(timeout=60)[0] for p in procs]
    finally:
        for p in procs:
            p.kill()
    assert [p.returncode for p in procs] == [0, 1], outs
    assert "hf-accel sft: error: HFAccelError: rank 1 failed" in outs[1], outs
    assert all((tmp_path / f"atexit.{rank}").read_text() == "ran" for rank in (0, 1))
