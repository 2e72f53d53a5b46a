"""Ulysses sequence parallelism on 2 GPUs (issue 19f): ``scripts/sft.py --sequence-parallel 2`` under DeepSpeed
ZeRO-3 trains one 16k-token document per step like 1 GPU under the same config, with half the activations per GPU.

Sixteen different documents, one per step, as one process would train them (run 16 used one repeated document). The
losses of two random documents on a random model differ by less than bf16 error, so the test that tells a repeated
or reordered row apart is the CPU one, `tests/test_sequence_parallel.py` (fp32, equal to ~1e-7; it caught rows
trained once per rank on CPU, docs/MULTI_GPU.md found item 9). Needs deepspeed on the GPU machine (the `ds` pack).
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from multi_gpu_runs import (CONFIGS, LAUNCH_TIMEOUT_S, LOSS_RTOL, ROOT, STEP1_RTOL, assert_resumed_like_uninterrupted,
                            launch_command, launch_killed_in_save, launch_or_fail)

from benchlib.distributed import launch_argv

DOC = 16384
STEPS = 6


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason=f"needs 2 CUDA GPUs (found {torch.cuda.device_count()})")
def test_two_gpus_of_sequence_parallelism_train_like_one(tmp_path):
    pytest.importorskip("deepspeed", reason="Ulysses sequence parallelism needs deepspeed")
    g = torch.Generator().manual_seed(0)
    docs = [torch.randint(3, 32000, (DOC,), generator=g).tolist() for _ in range(16)]
    data = tmp_path / "docs.jsonl"
    data.write_text("".join(json.dumps({"input_ids": doc, "labels": doc}) + "\n" for doc in docs))
    runs = {}
    for processes, extra in ((1, []), (2, ["--sequence-parallel", "2"])):
        out = tmp_path / f"{processes}gpu"
        args = ["--model-shape", "llama-small", "--dataset", str(data), "--bf16", "--seed", "0", "--max-steps",
                str(STEPS), "--max-length", str(DOC), "--max-tokens-per-batch", str(DOC), "--logging-steps", "1",
                "--eval-examples", "0", "--lr", "1e-4", "--output-dir", str(out), *extra]
        log = launch_or_fail(launch_command("deepspeed_zero3.yaml", processes, args), ROOT, LAUNCH_TIMEOUT_S,
                             tmp_path / f"{processes}gpu.log")
        runs[processes] = json.loads((out / "rank0" / "metrics.json").read_text()), log
    (one, _), (two, log) = runs[1], runs[2]
    assert len(one["losses"]) == len(two["losses"]) == STEPS, log[-3000:]
    torch.testing.assert_close(torch.tensor(two["losses"][:1]), torch.tensor(one["losses"][:1]), rtol=STEP1_RTOL,
                               atol=0)
    torch.testing.assert_close(torch.tensor(two["losses"]), torch.tensor(one["losses"]), rtol=LOSS_RTOL, atol=0)
    # each GPU holds half the sequence's activations (the weights are ZeRO-3 partitions in both runs)
    assert float(two["throughput"]["peak_mem_gib"]) < float(one["throughput"]["peak_mem_gib"]), (one, two)


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason=f"needs 2 CUDA GPUs (found {torch.cuda.device_count()})")
def test_sequence_parallel_run_killed_in_a_save_resumes_on_two_gpus(tmp_path):
    """The CPU resume test on the GPUs (bf16, NCCL): `sft.py --sequence-parallel 2` under ZeRO-3 saving every 3 steps,
    SIGKILLed inside the save of step 6 and resumed, logs the uninterrupted run's losses and ends at its weights."""
    pytest.importorskip("deepspeed", reason="Ulysses sequence parallelism needs deepspeed")

    def command(out: Path, *extra: str) -> list[str]:
        return launch_argv(CONFIGS / "deepspeed_zero3.yaml", 2, [str(ROOT / "scripts" / "sft.py"),
                           "--model-shape", "llama-small", "--bf16", "--seed", "0", "--sequence-parallel", "2",
                           "--max-steps", "6", "--save-steps", "3", "--max-tokens-per-batch", "4096",
                           "--logging-steps", "1", "--eval-examples", "0", "--lr", "1e-4", "--output-dir", str(out),
                           *extra])

    whole, cut = tmp_path / "whole", tmp_path / "cut"
    launch_or_fail(command(whole), ROOT, LAUNCH_TIMEOUT_S, tmp_path / "whole.log")
    launch_killed_in_save(command(cut), ROOT, 6, LAUNCH_TIMEOUT_S, tmp_path / "cut.log")
    assert (cut / "checkpoint-3").is_dir() and not (cut / "checkpoint-6").exists()
    launch_or_fail(command(cut, "--resume"), ROOT, LAUNCH_TIMEOUT_S, tmp_path / "resumed.log")
    assert_resumed_like_uninterrupted(cut, whole, steps=6, rtol=LOSS_RTOL, atol=1e-2)

