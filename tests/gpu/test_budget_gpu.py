"""checkpointing="budget:..." holds with the fast defaults (fused loss, fused ops, compiled layers): a few training
steps of Llama-3.2-1B shapes (random init, one packed row of 16,384 tokens, fused AdamW) peak at or under the
budget (issue 18b: 27.17 GiB under a 23 GiB budget before the probe used the run's micro-batch and loss), and a
budget no plan fits raises before the first step, naming the smallest that does."""
from __future__ import annotations

import re

import pytest
import torch

import hf_accel
from hf_accel.errors import ConfigurationError
from hf_accel.memory.budget import MemoryBudget
from test_models_gpu import SHAPES

pytestmark = pytest.mark.gpu
TOKENS = 16384
GIB = 1024**3


def batch(vocab: int, seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    lengths, total = [], 0
    while total < TOKENS:
        n = min(int(torch.randint(16, 2048, (1,), generator=g)), TOKENS - total)
        lengths.append(n)
        total += n
    ids = torch.randint(0, vocab, (1, TOKENS), generator=g)
    pos = torch.cat([torch.arange(n) for n in lengths])[None]
    labels = ids.masked_fill(pos == 0, -100)
    return {k: v.cuda() for k, v in dict(input_ids=ids, position_ids=pos, labels=labels).items()}


def assert_budget_holds(model, label: str, budget_gib: int, steps: int, capsys, autocast: bool = False):
    """patch(model, checkpointing=budget) with the fast defaults prints its plan, fits it, and `steps` training steps
    of packed 16k-token rows (fused AdamW on what trains) peak at or under the budget. Returns the patch report."""
    # this loop frees the gradients before each forward (one micro-batch per step, set_to_none), as hf_accel's
    # Trainers tell their budgets: the plan leaves them out of the forward's peak (run 13 over-predicted Llama-1B by
    # ~2.5 GiB, its gradients' size, while counting them)
    policy = MemoryBudget(budget=f"{budget_gib}GiB", batch_tokens=TOKENS, grads_freed=True)
    torch.cuda.reset_peak_memory_stats()
    report = hf_accel.patch(model, checkpointing=policy)
    assert "| predicted peak |" in capsys.readouterr().out  # the plan is printed
    assert policy.plan.fits and policy.plan.predicted_peak_bytes <= budget_gib * GIB
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-5, fused=True)
    for seed in range(steps):
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=autocast):
            loss = model(**batch(model.config.vocab_size, seed), use_cache=False).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() / GIB
    print(f"{label} budget {budget_gib} GiB: plan {policy.describe()}, predicted "
          f"{policy.plan.predicted_peak_bytes / GIB:.2f} GiB, measured peak {peak:.2f} GiB")
    assert peak <= budget_gib, f"peak {peak:.2f} GiB over the {budget_gib} GiB budget ({policy.describe()})"
    return report


@pytest.mark.parametrize("budget_gib", [23, 20])
def test_budget_holds_with_the_fast_defaults(budget_gib, capsys):
    torch.manual_seed(0)
    model = SHAPES["llama-1b"]().cuda().to(torch.bfloat16).train()
    # 4 steps: compile, the dynamic-shape recompile, then steady steps
    report = assert_budget_holds(model, "llama-1b", budget_gib, 4, capsys)
    assert report.fused_ce and report.compiled_layers, str(report)


def test_infeasible_budget_raises_before_the_first_step():
    torch.manual_seed(0)
    model = SHAPES["llama-1b"]().cuda().to(torch.bfloat16).train()
    with pytest.raises(ConfigurationError, match=r"smallest feasible budget is 'budget:[0-9.]+GiB'") as err:
        hf_accel.patch(model, checkpointing=MemoryBudget(budget="10GiB", batch_tokens=TOKENS))
    assert hf_accel.patch_report(model) is None  # nothing applied
    smallest = float(re.search(r"budget:([0-9.]+)GiB", str(err.value)).group(1))
    assert 10 < smallest < 20


def test_probe_of_two_layers_a_kind_measures_what_running_all_does():
    """The probe runs two decoder layers of each kind and passes the rest through (memory.layer_kinds): on the GPU,
    through patch()'s defaults (flash attention, fused loss and ops, compiled layers), every figure and the loss
    tail's peak equal running every layer (Llama-3.2-1B shapes, a packed 16k-token row, bf16)."""
    from hf_accel.memory.plan import probe_training_memory

    torch.manual_seed(0)
    model = SHAPES["llama-1b"]().cuda().to(torch.bfloat16).train()
    report = hf_accel.patch(model)
    assert report.compiled_layers, str(report)
    rows = batch(model.config.vocab_size, 0)
    fast = probe_training_memory(model, rows, compiled=True)
    every = probe_training_memory(model, rows, compiled=True, every_layer=True)
    assert fast.tail_peak_bytes == every.tail_peak_bytes
    for i, (a, b) in enumerate(zip(fast.layers, every.layers)):
        # one layer's backward is measured on the allocator, layer 0's in both: the same within the allocator's
        # rounding; the saved-tensor counts exactly
        assert (a.none_bytes, a.op_bytes, a.full_bytes, a.eager_none_bytes) == \
            (b.none_bytes, b.op_bytes, b.full_bytes, b.eager_none_bytes), i
        assert abs(a.backward_bytes - b.backward_bytes) <= 2**20, i


@pytest.mark.parametrize("budget_gib", [24, 40])
def test_budget_holds_for_llama_8b_lora(budget_gib, capsys):
    """Issue 18b's second workload: Llama-3-8B shapes (random init, bf16), PEFT LoRA r=16 on every decoder linear,
    then `patch(peft_model, checkpointing=budget)` with the fast defaults; bf16 autocast as Trainer runs LoRA."""
    from benchlib.train import add_lora
    from benchlib.workloads import WORKLOADS, build_config
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    workload = WORKLOADS["llama-8b-lora"]
    with torch.device("cuda"):
        model = AutoModelForCausalLM.from_config(build_config(workload), dtype=torch.bfloat16)
    model = add_lora(model.train(), workload)
    report = assert_budget_holds(model, "llama-8b-lora", budget_gib, 3, capsys, autocast=True)
    assert report.fused_ce, str(report)


@pytest.mark.parametrize("config,nproc", [("fsdp2.yaml", 1), ("fsdp2.yaml", 2), ("deepspeed_zero3.yaml", 1),
                                          ("deepspeed_zero3.yaml", 2)])
def test_budget_holds_under_a_sharding_launcher(config, nproc, tmp_path):
    """Under FSDP2 and ZeRO-3 the Trainer plans with each process's share of the state plus its gathered copies
    (memory.estimate.Sharding): `scripts/sft.py --model-shape llama-8b --lora-r 16 --checkpointing budget:40GiB`
    through `accelerate launch` trains 4 packed 16k-token steps with the fast defaults, prints its plan, and no rank
    peaks over the budget (the meter's peak is the largest rank's)."""
    import json
    import sys

    from benchlib.distributed import launch_argv
    from multi_gpu_runs import CONFIGS, ROOT, launch_or_fail

    if torch.cuda.device_count() < nproc:
        pytest.skip(f"needs {nproc} CUDA GPUs (found {torch.cuda.device_count()})")
    if config.startswith("deepspeed"):
        pytest.importorskip("deepspeed", reason="ZeRO-3 needs deepspeed installed")
    budget_gib = 40
    out = tmp_path / "run"
    cmd = launch_argv(CONFIGS / config, nproc, [
        str(ROOT / "scripts" / "sft.py"), "--model-shape", "llama-8b", "--lora-r", "16", "--bf16", "--max-steps", "4",
        "--max-tokens-per-batch", str(TOKENS), "--logging-steps", "1", "--eval-examples", "0",
        "--checkpointing", f"budget:{budget_gib}GiB", "--output-dir", str(out)])
    log = launch_or_fail(cmd, ROOT, 540, log=tmp_path / "launch.log")
    assert "| predicted peak |" in log, log[-4000:]
    peak = json.loads((out / "metrics.json").read_text())["throughput"]["peak_mem_gib"]
    print(f"{config} x{nproc}, budget {budget_gib} GiB: measured peak (largest rank) {peak:.2f} GiB", file=sys.stderr)
    assert peak <= budget_gib, f"peak {peak:.2f} GiB over the {budget_gib} GiB budget:\n{log[-4000:]}"
