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

from multi_gpu_runs import LAUNCH_TIMEOUT_S, LOSS_RTOL, ROOT, STEP1_RTOL, launch_command, launch_or_fail

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
