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
