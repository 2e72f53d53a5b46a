"""The installed ``hf-accel`` command (hf_accel/cli): arguments checked before anything heavy is imported, one line per
refusal, ``--config`` files with flags overriding them, numbered run folders, ``env`` and ``estimate-memory``."""
from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from hf_accel.cli import args as cli_args
from hf_accel.cli import main
from hf_accel.errors import UsageError

ROOT = Path(__file__).resolve().parent.parent

# argv -> what the one-line refusal must say (each refused before torch is imported)
REFUSED = {
    ("--max-steps", "-3"): "--max-steps -3: must be a positive number of optimizer steps",
    ("--max-steps", "0"): "--max-steps 0: must be a positive number",
    ("--lora-r", "0"): "--lora-r 0: a LoRA rank is at least 1",
    ("--lora-r", "-2"): "--lora-r -2: a LoRA rank is at least 1",
    ("--lora-alpha", "16"): "--lora-alpha applies to LoRA: add --lora-r",
    ("--checkpointing", "bogus"): "--checkpointing bogus: unknown checkpointing spec 'bogus'. Allowed: 'none'",
    ("--checkpointing", "budget:lots"): "unknown checkpointing spec 'budget:lots'",
    ("--mlp-chunks", "big"): "--mlp-chunks 'big': expected auto, a chunk size in tokens",
    ("--backend", "fa9"): "--backend: invalid choice: 'fa9'",
    ("--max-steps", "ten"): "--max-steps: invalid int value: 'ten'",
    ("--bad-rows", "keep"): "--bad-rows: invalid choice: 'keep'",
    ("--max-stepz", "3"): "unknown argument '--max-stepz'; did you mean --max-steps?",
    ("--epochs", "0"): "--epochs 0.0: must be a positive number",
    ("--epochs", "inf"): "--epochs inf: must be a positive number",
    ("--lr", "nan"): "--lr nan: must be a positive number",
    ("--grad-accum", "0"): "--grad-accum 0: must be at least 1",
    ("--eval-examples", "-1"): "--eval-examples -1: must be 0",
    ("--dataset", "missing.jsonl"): "--dataset missing.jsonl: no such file or folder",
    ("--dataset", "notes.txt"): "--dataset notes.txt: unknown file type '.txt'",
    ("--model", "./no-model"): "--model ./no-model: no such local folder",
    ("--model", "x", "--smollm2"): "--model cannot be combined with --smollm2",
    ("--no-patch", "--compile"): "--no-patch trains stock transformers, but --compile works through hf_accel's patch",
    ("--resume", "--overwrite"): "--resume continues the run in --output-dir and --overwrite clears it",
    ("--resume",): "--resume: no run of tiny-task under runs/ holds a checkpoint",
    ("--config", "missing.yaml"): "--config missing.yaml: no such file",
    ("--model", "./stored-nf4"): "--model ./stored-nf4 is stored quantized (bitsandbytes 4-bit): its weights cannot "
                                  "train, LoRA adapters on them can: add --lora-r",
    ("--load-in-4bit",): "--load-in-4bit freezes the base in 4 bits and trains LoRA adapters on it (QLoRA): add "
                         "--lora-r",
    ("--use-bnb-nested-quant",): "--use-bnb-nested-quant applies to a 4-bit base: add --load-in-4bit",
    ("--keep-base-dtype", "--bf16"): "--keep-base-dtype applies to a 4-bit base: add --load-in-4bit",
    ("--load-in-4bit", "--lora-r", "4", "--peft-kbit-preparation", "--keep-base-dtype"): "--keep-base-dtype keeps the "
    "4-bit base's other weights in bf16, and this run computes in fp32",
    ("--load-in-4bit", "--lora-r", "4", "--bf16", "--keep-base-dtype"): "--keep-base-dtype puts back in bf16 what "
    "PEFT's preparation upcasts",
    ("--peft-kbit-preparation",): "--peft-kbit-preparation applies to a 4-bit base: add --load-in-4bit",
    ("--bnb-4bit-quant-type", "fp4"): "--bnb-4bit-quant-type applies to a 4-bit base",
    ("--bnb-4bit-quant-type", "int4"): "--bnb-4bit-quant-type: invalid choice: 'int4'",
    ("--load-in-4bit", "--lora-r", "4", "--model-shape", "llama-1b"): "--load-in-4bit loads saved weights in 4 bits, "
                                                                      "and --model-shape llama-1b builds random",
    # issue 68: the toy model on real data, empty data, contradicting flags, more threads than cores
    ("--dataset", "data.jsonl"): "--dataset data.jsonl needs the model to fine-tune: add --model PATH_OR_ID",
    ("--dataset", "empty.jsonl", "--tiny-model"): "--dataset empty.jsonl holds no rows (0 bytes)",
    ("--dataset", "blank.jsonl", "--tiny-model"): "--dataset blank.jsonl holds no rows (3 bytes, blank)",
    ("--dataset", "empty.json", "--model", "x"): "--dataset empty.json holds no rows",
    ("--model", "x", "--tiny-model"): "--model cannot be combined with --tiny-model: pick one model",
    ("--tokenizer", "tok"): "--tokenizer applies to --model",
    ("--packing", "--no-packing"): "--packing and --no-packing contradict each other: pass one of them",
    ("--no-fused-ce", "--fused-ce"): "--no-fused-ce and --fused-ce contradict each other",
    ("--threads", "4096"): "--threads 4096: this process may use",
    ("--non-finite", "ignore"): "--non-finite: invalid choice: 'ignore'",
}


def test_every_refusal_is_one_line_before_torch_is_imported(tmp_path):
    """Each wrong argument exits 2 with one line naming it (no usage dump, no traceback), and torch, datasets and
    peft are still unimported when it is refused."""
    (tmp_path / "notes.txt").write_text("x")
    (tmp_path / "data.jsonl").write_text('{"text": "8 + 36 = 44"}\n')
    (tmp_path / "empty.jsonl").write_text("")
    (tmp_path / "blank.jsonl").write_text("\n \n")
    (tmp_path / "empty.json").write_text(" [ ]\n")
    (tmp_path / "stored-nf4").mkdir()
    (tmp_path / "stored-nf4" / "config.json").write_text(json.dumps(
        {"model_type": "llama", "quantization_config": {"quant_method": "bitsandbytes", "load_in_4bit": True}}))
    script = (
        "import json, sys, contextlib, io\n"
        "from hf_accel.cli import main\n"
        "out = []\n"
        f"for argv in {[list(a) for a in REFUSED]!r}:\n"
        "    err = io.StringIO()\n"
        "    with contextlib.redirect_stderr(err):\n"
        "        rc = main(['sft', *argv])\n"
        "    out.append([rc, err.getvalue()])\n"
        "heavy = [m for m in ('torch', 'datasets', 'peft') if m in sys.modules]\n"
        "print(json.dumps({'results': out, 'heavy': heavy}))\n"
    )
    proc = subprocess.run([sys.executable, "-c", script], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    assert report["heavy"] == []
    for (rc, err), (argv, message) in zip(report["results"], REFUSED.items()):
        lines = err.strip().splitlines()
        assert rc == 2 and len(lines) == 1 and lines[0].startswith("hf-accel sft: error: "), (argv, err)
        assert message in lines[0], (argv, lines[0])
        assert "usage:" not in err and "Traceback" not in err


def test_load_in_4bit_without_bitsandbytes_or_under_sharding_is_refused(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None if name == "bitsandbytes" else
                        real(name))
    with pytest.raises(UsageError, match=r"bitsandbytes, which is not installed: pip install 'hf_accel\[qlora\]'"):
        cli_args.parse_sft_args(["--load-in-4bit", "--lora-r", "4"])
    monkeypatch.setattr(importlib.util, "find_spec", real)
    monkeypatch.setenv("ACCELERATE_USE_FSDP", "true")
    with pytest.raises(UsageError, match="--load-in-4bit under FSDP or DeepSpeed is not supported"):
        cli_args.parse_sft_args(["--load-in-4bit", "--lora-r", "4"])


@pytest.mark.parametrize("value", ["1", "true", "True", "yes", "Y", "t", "on", "0", "false", "no", "off", ""])
def test_launcher_flags_are_read_as_accelerate_reads_them(monkeypatch, value):
    """Every place that asks "was this an FSDP / DeepSpeed launch?" answers what accelerate itself answers."""
    from accelerate.utils.environment import parse_flag_from_env

    from hf_accel.cli.quiet import deepspeed_launch
    from hf_accel.memory.targets import fsdp_activation_checkpointing_active

    for name in ("ACCELERATE_USE_DEEPSPEED", "ACCELERATE_USE_FSDP", "FSDP_ACTIVATION_CHECKPOINTING"):
        monkeypatch.setenv(name, value) if value else monkeypatch.delenv(name, raising=False)
    expected = parse_flag_from_env("ACCELERATE_USE_DEEPSPEED")
    assert deepspeed_launch() == expected
    assert fsdp_activation_checkpointing_active(torch.nn.Linear(1, 1)) == expected
    if expected:
        with pytest.raises(UsageError, match="--load-in-4bit under FSDP or DeepSpeed is not supported"):
            cli_args.parse_sft_args(["--load-in-4bit", "--lora-r", "4"])


def test_stored_quantization_is_read_from_the_checkpoint_config():
    from hf_accel.cli.quantized import stored_quantization

    assert stored_quantization({}) is None
    assert stored_quantization({"quantization_config": {"quant_method": "gguf"}}) is None  # dequantized on loading
    assert stored_quantization({"quantization_config": {"quant_method": "bitsandbytes",
                                                        "load_in_8bit": True}}) == "bitsandbytes 8-bit"
    assert stored_quantization({"quantization_config": {"quant_method": "gptq", "bits": 4}}) == "gptq"


def test_config_file_keys_are_the_flags_and_flags_override_it(tmp_path):
    (tmp_path / "run.yaml").write_text("max_steps: 7\nlora_r: 4\nfused_ce: false\nmlp_chunks: 8192\nbad-rows: drop\n")
    args = cli_args.parse_sft_args(["--config", "run.yaml"])
    assert (args.max_steps, args.lora_r, args.fused_ce, args.mlp_chunks, args.bad_rows) == (7, 4, False, 8192, "drop")
    args = cli_args.parse_sft_args(["--config", "run.yaml", "--max-steps", "3", "--fused-ce"])
    assert (args.max_steps, args.fused_ce, args.lora_r) == (3, True, 4)  # flags win, the rest stays from the file
    (tmp_path / "run.json").write_text(json.dumps({"max_steps": 5, "packing": False}))
    args = cli_args.parse_sft_args(["--config=run.json"])
    assert (args.max_steps, args.packing) == (5, False)
    # without a file: the flags' own defaults ("auto" speed-ups are None, i.e. not given)
    args = cli_args.parse_sft_args([])
    assert (args.max_steps, args.fused_ce, args.packing, args.mlp_chunks) == (None, None, True, "auto")


@pytest.mark.parametrize("text, message", [
    ("max_step: 7\n", "unknown key 'max_step'; did you mean 'max_steps'?"),
    ("max_steps: seven\n", "max_steps: expected int, got 'seven' (str)"),
    ("max_steps: true\n", "max_steps: expected int, got True (bool)"),
    ("bad_rows: keep\n", "bad_rows: expected one of 'fail', 'drop'"),
    ("max_steps: -1\n", "--max-steps -1: must be a positive number"),  # values get the flags' checks too
    ("- 1\n- 2\n", "expected a mapping of argument names to values, got a list"),
    ("max_steps: [1\n", "not valid YAML"),
])
def test_config_file_mistakes_are_named(tmp_path, text, message):
    (tmp_path / "run.yaml").write_text(text)
    with pytest.raises(UsageError) as exc:
        cli_args.parse_sft_args(["--config", "run.yaml"])
    assert message in str(exc.value) and "\n" not in str(exc.value)


def test_runs_get_numbered_folders_and_resume_finds_the_newest_with_a_checkpoint(tmp_path):
    """Without --output-dir each run gets runs/<model>-<N> (command 1 twice, or then --smollm2, never collide);
    --resume without one continues the newest folder of that model holding a checkpoint."""
    first = cli_args.parse_sft_args([]).output_dir
    assert first == os.path.join("runs", "tiny-task-1")
    os.makedirs(first)
    (Path(first) / "metrics.json").write_text("{}")
    assert cli_args.parse_sft_args([]).output_dir == os.path.join("runs", "tiny-task-2")
    assert cli_args.parse_sft_args(["--model-shape", "llama-small"]).output_dir == os.path.join("runs",
                                                                                               "llama-small-1")
    with pytest.raises(UsageError, match="no run of tiny-task under runs/ holds a checkpoint"):
        cli_args.parse_sft_args(["--resume"])
    os.makedirs(os.path.join(first, "checkpoint-5"))
    os.makedirs(os.path.join("runs", "tiny-task-3"))  # newer, but nothing to resume there
    assert cli_args.parse_sft_args(["--resume"]).output_dir == first


def test_under_a_launcher_the_folder_is_named(monkeypatch):
    """Numbered folders are per process: several ranks numbering their own would write apart."""
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(UsageError, match="pass --output-dir"):
        cli_args.parse_sft_args([])
    assert cli_args.parse_sft_args(["--output-dir", "out"]).output_dir == "out"


def test_a_used_folder_suggests_resume_only_where_there_is_a_checkpoint(tmp_path):
    os.makedirs("out")
    (Path("out") / "metrics.json").write_text("{}")
    with pytest.raises(UsageError) as exc:
        cli_args.parse_sft_args(["--output-dir", "out"])
    assert "--resume" not in str(exc.value) and "--overwrite" in str(exc.value) and "runs/" in str(exc.value)
    with pytest.raises(UsageError, match="holds no checkpoint-N folder to continue"):
        cli_args.parse_sft_args(["--output-dir", "out", "--resume"])
    os.makedirs(os.path.join("out", "checkpoint-3"))
    with pytest.raises(UsageError, match=r"Continue that run \(--resume\)"):
        cli_args.parse_sft_args(["--output-dir", "out"])
    assert cli_args.parse_sft_args(["--output-dir", "out", "--resume"]).output_dir == "out"


def test_name_lists_for_the_early_checks_match_the_library():
    from hf_accel.attention.kernels import BACKENDS
    from hf_accel.cli.shapes import MODEL_SHAPES

    assert set(cli_args.BACKEND_NAMES) == {"auto", *BACKENDS}
    assert tuple(MODEL_SHAPES) == cli_args.MODEL_SHAPE_NAMES


def test_estimate_memory_command_prints_the_estimate(capsys):
    from hf_accel.memory.estimate import estimate_training_memory

    assert main(["estimate-memory", "llama-3.2-1b", "--lora-rank", "8", "--checkpointing", "op"]) == 0
    want = estimate_training_memory("llama-3.2-1b", lora_rank=8, checkpointing="op").table()
    assert capsys.readouterr().out.strip() == want.strip()
    assert main(["estimate-memory", "llama-3.2-1b", "--checkpointing", "budget:0.5"]) == 2
    assert "add --device-gib" in capsys.readouterr().err
    qlora = ["--lora-rank", "8", "--load-in-4bit", "--use-bnb-nested-quant"]
    assert main(["estimate-memory", "llama-3.2-1b", *qlora]) == 0
    want = estimate_training_memory("llama-3.2-1b", lora_rank=8, base_4bit=True, nested_quant=True).table()
    assert capsys.readouterr().out.strip() == want.strip() and "a 4-bit base (nested statistics" in want
    assert main(["estimate-memory", "llama-3.2-1b", *qlora, "--keep-base-dtype"]) == 0
    kept = estimate_training_memory("llama-3.2-1b", lora_rank=8, base_4bit=True, nested_quant=True,
                                    keep_base_dtype=True)
    assert capsys.readouterr().out.strip() == kept.table().strip() and "counted in 16-bit" in kept.table()
    assert kept.param_bytes < estimate_training_memory("llama-3.2-1b", lora_rank=8, base_4bit=True,
                                                       nested_quant=True).param_bytes
    for argv, message in ((["--load-in-4bit"], "add --lora-r "),
                          (["--lora-rank", "8", "--use-bnb-nested-quant"], "add --load-in-4bit"),
                          (["--lora-rank", "8", "--keep-base-dtype"], "--keep-base-dtype applies to a 4-bit base"),
                          (["--host-gib", "nan"], "--host-gib nan: must be a positive number"),
                          (["--device-gib", "0"], "--device-gib 0.0: must be a positive number"),
                          (["--checkpointing", "budget:2"], "needs a unit")):
        assert main(["estimate-memory", "llama-3.2-1b", *argv]) == 2
        assert message in capsys.readouterr().err


def test_env_command_names_versions_and_backends(capsys):
    from importlib import metadata

    from hf_accel.attention.kernels import BACKENDS

    assert main(["env"]) == 0
    out = capsys.readouterr().out
    assert f"transformers {metadata.version('transformers')}" in out and f"torch {metadata.version('torch')}" in out
    assert all(name in out for name in BACKENDS)
    assert main(["env", "--verbose"]) == 2 and main(["nope"]) == 2 and main([]) == 2


def test_installed_command_and_module_entry_run(tmp_path):
    """The console script pip installs, and `python -m hf_accel.cli` (what `accelerate launch -m` runs)."""
    import shutil

    exe = shutil.which("hf-accel")
    assert exe, "pip install -e . installs the hf-accel command"
    for command in ([exe, "--help"], [sys.executable, "-m", "hf_accel.cli", "sft", "--help"]):
        proc = subprocess.run(command, capture_output=True, text=True, timeout=120)
        assert proc.returncode == 0 and ("sft" in proc.stdout), proc.stderr[-2000:]
    assert "--config FILE" in proc.stdout and "--max-steps" in proc.stdout


@pytest.mark.slow
def test_sft_under_accelerate_launch_two_processes(tmp_path):
    """`accelerate launch --config_file examples/accelerate/ddp_cpu.yaml -m hf_accel.cli sft ...` (2 CPU processes,
    gloo DDP): exits 0, rank 0 writes the model and metrics.json, rank 1 its metrics.rank1.json."""
    from benchlib.distributed import launch_argv

    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    env.update(OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1")
    command = launch_argv(ROOT / "examples" / "accelerate" / "ddp_cpu.yaml", 2, [
        "-m", "hf_accel.cli", "sft", "--max-steps", "3", "--eval-examples", "0", "--output-dir", "out"])
    proc = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=400)
    assert proc.returncode == 0, proc.stderr[-3000:]
    metrics = json.loads((tmp_path / "out" / "metrics.json").read_text())
    assert metrics["steps"] == 3 and (tmp_path / "out" / "model.safetensors").exists()
    assert (tmp_path / "out" / "metrics.rank1.json").exists()


def test_a_short_run_logs_its_first_and_last_step_and_draws_its_plot(tmp_path, monkeypatch, capsys):
    """5 steps, fewer than one default logging interval used to be: the first and the last step log, the summary
    line says where the loss went, and training.png is drawn (matplotlib is a dependency)."""
    import torch

    from hf_accel.cli import sft

    monkeypatch.setattr(torch, "set_num_threads", lambda n: None)  # leave the test process's threads alone
    metrics = sft.main(["--max-steps", "5", "--eval-examples", "0", "--logging-steps", "25", "--output-dir", "out"])
    steps = [log["step"] for log in metrics["log_history"] if "loss" in log]
    assert steps == [1, 5] and len(metrics["losses"]) == 2
    out = capsys.readouterr().out
    assert f"loss: {metrics['losses'][0]:.3f} (first step) -> {metrics['losses'][1]:.3f} (last step)" in out
    assert (tmp_path / "out" / "training.png").stat().st_size > 1000


@pytest.mark.slow  # a subprocess of the command
def test_a_run_is_quiet_and_does_not_import_deepspeed(tmp_path):
    """With the dev extra installed (DeepSpeed, bitsandbytes), a plain run neither imports DeepSpeed (3 s of start-up
    and a GPU-detection warning, for an engine that cannot exist outside a DeepSpeed launch) nor prints messages a
    user cannot act on (a LoRA run, which imports PEFT and bitsandbytes, too), and a log that is not a terminal gets
    no progress-bar carriage returns."""
    pytest.importorskip("deepspeed")
    script = ("import sys\nfrom hf_accel.cli import sft\n"
              "sft.main(['--max-steps', '3', '--eval-examples', '0', '--output-dir', 'out'])\n"
              "print('deepspeed imported:', 'deepspeed' in sys.modules)\n"
              "sft.main(['--max-steps', '2', '--eval-examples', '0', '--output-dir', 'lora', '--lora-r', '4'])\n")
    env = {k: v for k, v in os.environ.items() if k not in ("ACCELERATE_USE_DEEPSPEED", "DS_ACCELERATOR")}
    proc = subprocess.run([sys.executable, "-c", script], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "deepspeed imported: False" in proc.stdout
    for noise in ("Setting accelerator", "gemm_4bit_forward", "publisher trust check", "is deprecated", "\r"):
        assert noise not in proc.stderr and noise not in proc.stdout, (noise, proc.stderr[-2000:])
