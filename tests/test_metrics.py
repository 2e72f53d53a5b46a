"""The end-of-run throughput summary: the whole run and its steady part (after the first logging interval), on a
controlled clock. The multi-rank sums are checked by the 2-process runs in tests/test_distributed.py."""
import torch

import tiny_models
from hf_accel.training.metrics import ThroughputMeter, format_summary


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def packed(tokens: int) -> dict:
    return {"input_ids": torch.zeros(1, tokens, dtype=torch.long), "position_ids": torch.arange(tokens)[None]}


def test_summary_gives_steady_tokens_per_s_next_to_the_whole_run():
    clock = Clock()
    meter = ThroughputMeter(tiny_models.make("llama-gqa"), torch.device("cpu"), clock=clock)
    meter.add_batch(packed(100))
    clock.now += 10.0  # first interval: warm-up (CUDA start, JIT, torch.compile), slow
    first = meter.pop()
    assert first["tokens_per_s"] == 10.0
    for _ in range(3):
        meter.add_batch(packed(100))
        clock.now += 1.0
        meter.pop()
    clock.now += 1.0  # the end: no more batches
    summary = meter.summary()
    assert summary["tokens"] == 400 and summary["seconds"] == 14.0
    assert summary["tokens_per_s"] == 400 / 14.0
    assert summary["steady_tokens_per_s"] == 300 / 4.0 and summary["steady_seconds"] == 4.0
    table = format_summary(summary)
    assert "tokens/s, whole run" in table and "tokens/s, steady" in table and "75 (last 4.0 s" in table


def test_no_steady_figure_from_a_single_interval():
    clock = Clock()
    meter = ThroughputMeter(tiny_models.make("llama-gqa"), torch.device("cpu"), clock=clock)
    meter.add_batch(packed(50))
    clock.now += 5.0
    summary = meter.summary()  # the run ended before any log: no steady part to report
    assert summary["tokens_per_s"] == 10.0 and "steady_tokens_per_s" not in summary
    assert "n/a (one logging interval)" in format_summary(summary)


def test_summary_sets_a_memory_budgets_plan_against_the_measured_peak():
    """With a `budget:` checkpointing policy the end summary gives the budget, the plan's predicted peak and the
    measured one, and says so when the run went over."""
    from hf_accel.memory.budget import MemoryBudget, plan_vs_peak
    from hf_accel.memory.checkpointing import FullCheckpointing

    model = tiny_models.make("llama-gqa").train()
    policy = MemoryBudget(budget="1GiB", batch_tokens=32, verbose=False)
    assert plan_vs_peak(policy, 0.5) == {}  # not applied yet: no plan
    policy.apply(model)
    row = plan_vs_peak(policy, 0.5)
    assert row["budget_gib"] == 1.0 and row["peak_mem_gib"] == 0.5
    assert 0 < row["budget_predicted_gib"] <= 1.0
    assert plan_vs_peak(policy, None) == {} and plan_vs_peak(FullCheckpointing(), 0.5) == {}
    base = {"tokens": 1, "seconds": 1.0, "tokens_per_s": 1.0, "padding_fraction": 0.0, "data_wait_fraction": 0.0}
    table = format_summary({**base, **row})
    line = next(x for x in table.splitlines() if x.strip().startswith("memory budget"))
    assert line.endswith(f"1.00 GiB: plan predicted {row['budget_predicted_gib']:.2f} GiB, measured 0.50 GiB")
    assert "OVER the budget" in format_summary({**base, **row, "peak_mem_gib": 1.2})
