"""FSDP2 on 2 GPUs with every speed-up on trains like 1 GPU, saves a model that loads, and exits (issue 19a).

Each case launches ``tests/dist_sft.py`` (``scripts/sft.py`` per rank, ``<out>/rank<R>/``) through ``accelerate launch``
twice on the same global batches (docs/MULTI_GPU.md, "Equal global batches"): 2 processes x grad-accum 1 and
1 process x grad-accum 2, both under the same FSDP2 config (so both keep fp32 master weights and compute in bf16).
sft.py's speed-ups are left at their CUDA defaults ("auto": fused loss, liger fused ops when installed, compiled
decoder layers). Models: ``--model-shape llama-small / neox-small / falcon-small`` (random init, 4 layers, width 1024),
trained on the embedded digit task, pre-tokenized (a loss that clearly falls). One more test runs the real-size
Llama-1B launch that hung at exit on 2xH200 (issue 19).

Run on a machine with 2 GPUs: ``python -m pytest -m gpu tests/gpu/test_multi_gpu.py -v`` (about 8-12 min).
The launches inherit the environment (NCCL settings included) and get ``HF_ACCEL_HANG_DUMP_S`` so a hung rank prints
its Python stacks. The cases, commands and checks live in tests/multi_gpu_runs.py, tested on CPU by
tests/test_multi_gpu_runs.py.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

from multi_gpu_runs import (CASES, EXAMPLES, REAL_SIZE_TIMEOUT_S, ROOT, STEPS, LAUNCH_TIMEOUT_S, ZERO3_CASES, Case,
                            assert_full_model_reloads, assert_loaded_equals_saved, assert_loss_fell,
                            assert_same_losses, case_args,
                            launch_command, launch_or_fail, read_run, saved_tensors)

needs_two_gpus = pytest.mark.skipif(torch.cuda.device_count() < 2,
                                    reason=f"needs 2 CUDA GPUs (found {torch.cuda.device_count()}): FSDP2 over NCCL")


@pytest.fixture(scope="module")
def digit_data(tmp_path_factory) -> Path:
    """The embedded digit task (copy / reverse / sort), pre-tokenized: ids far below every shape's vocabulary."""
    from hf_accel.data.default_task import build_tokenizer, make_examples
    from hf_accel.data.prepare import tokenize_example

    tok = build_tokenizer()
    path = tmp_path_factory.mktemp("data") / "digits.jsonl"
    with path.open("w") as f:
        for example in make_examples(EXAMPLES, seed=0):
            row = tokenize_example(example, tok)
            f.write(json.dumps({"input_ids": list(row["input_ids"]), "labels": list(row["labels"])}) + "\n")
    return path


def _speedups_on(log: str, compiled: bool = True) -> None:
    import importlib.util

    wanted = ["fused_ce: on", *(["compile: on"] if compiled else [])]
    if importlib.util.find_spec("liger_kernel") is not None:
        wanted.append("fused_ops: on")
    assert all(w in log for w in wanted), f"expected {wanted} in the patch report:\n{log[-4000:]}"


def _check_saved_model(case: Case, folder: Path) -> None:
    """The 2-process run's saved model loads (full: from_pretrained; LoRA: PEFT on a fresh base of the same shape)
    with exactly the saved weights."""
    if not case.lora:
        assert_full_model_reloads(folder, folder.parent / "reloaded")
        return
    saved = saved_tensors(folder, lora=True)
    from peft import PeftModel, get_peft_model_state_dict

    sys.path.insert(0, str(ROOT / "scripts"))
    import sft

    base = sft.build_model_shape(case.shape, seed=0, device="cuda:0")
    model = PeftModel.from_pretrained(base, folder)
    loaded = get_peft_model_state_dict(model)
    assert set(loaded) == set(saved), f"adapter keys differ: {sorted(set(loaded) ^ set(saved))[:6]}"
    assert_loaded_equals_saved(loaded, saved)
    lora_b = [t for n, t in saved.items() if "lora_B" in n]
    assert lora_b and any(t.abs().sum() > 0 for t in lora_b), "every lora_B is still zero: the adapter did not train"


@pytest.mark.gpu
@needs_two_gpus
@pytest.mark.parametrize("name", list(CASES))
def test_fsdp2_two_gpus_match_one_gpu(name, digit_data, tmp_path):
    """2 GPUs x grad-accum 1 vs 1 GPU x grad-accum 2 over the same global batches, every speed-up on: both exit in
    time, the per-step losses agree to bf16 error, the loss falls, the saved model loads with the saved weights."""
    _two_vs_one(CASES[name], digit_data, tmp_path, compiled=True)


def _two_vs_one(case: Case, data: Path, tmp_path: Path, compiled: bool) -> None:
    """2 GPUs x grad-accum 1 vs 1 GPU x grad-accum 2 over the same global batches: both exit in time, the per-step
    losses agree to bf16 error, the loss falls, the saved model loads with the saved weights."""
    runs = {}
    for processes, grad_accum in ((2, 1), (1, 2)):
        out = tmp_path / f"{processes}gpu"
        cmd = launch_command(case.config, processes, case_args(case, data, out, grad_accum))
        log = launch_or_fail(cmd, ROOT, LAUNCH_TIMEOUT_S, tmp_path / f"{processes}gpu.log")
        _speedups_on(log, compiled)
        runs[processes] = read_run(out, processes)
    two, one = runs[2], runs[1]
    assert two["steps"] == one["steps"] == STEPS and two["backend"] == one["backend"] != "stock"
    assert_same_losses(two["losses"], one["losses"])
    assert_loss_fell(two["losses"])
    _check_saved_model(case, tmp_path / "2gpu" / "rank0")


@pytest.mark.gpu
@needs_two_gpus
@pytest.mark.parametrize("name", list(ZERO3_CASES))
def test_zero3_two_gpus_match_one_gpu(name, digit_data, tmp_path):
    """Issue 19b: DeepSpeed ZeRO-3 (examples/accelerate/deepspeed_zero3.yaml), the same checks as FSDP2's; the
    Trainer keeps compiled layers off under DeepSpeed. deepspeed 0.19.8 is an sdist: on the GPU machine install it
    apart (`pack-wheels.sh ds deepspeed==0.19.8 ...`, DS_BUILD_OPS=0) and put it on PYTHONPATH."""
    pytest.importorskip("deepspeed", reason="DeepSpeed ZeRO-3 needs deepspeed installed")
    _two_vs_one(ZERO3_CASES[name], digit_data, tmp_path, compiled=False)


@pytest.mark.gpu
@pytest.mark.slow
@needs_two_gpus
def test_llama_1b_fsdp2_exits_with_steady_throughput(tmp_path):
    """Issue 19's hang: Llama-1B shapes, FSDP2 on 2 GPUs, every speed-up on, random tokens, 30 steps: the launch
    exits 0 in time (the full fp32 state dict, ~5 GB, is gathered and written first), and metrics.json holds the whole
    run's and the steady tokens/s."""
    out = tmp_path / "llama-1b"
    args = ["--model-shape", "llama-1b", "--max-steps", "30", "--max-tokens-per-batch", "16384",
            "--logging-steps", "10", "--eval-examples", "0", "--output-dir", str(out)]
    log = launch_or_fail(launch_command("fsdp2.yaml", 2, args), ROOT, REAL_SIZE_TIMEOUT_S, tmp_path / "llama-1b.log")
    _speedups_on(log)
    assert "saved the model to" in log, log[-4000:]
    metrics = read_run(out, 2)
    assert metrics["steps"] == 30
    throughput = metrics["throughput"]
    assert throughput.get("tokens_per_s", 0) > 0 and throughput.get("steady_tokens_per_s", 0) > 0, throughput
