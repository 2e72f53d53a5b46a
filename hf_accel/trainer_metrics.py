"""Throughput metrics per logging interval: real tokens/s, MFU, padding and data-wait fractions, peak GPU memory.

Counted on the batches the training loop actually ran (every micro-batch), in the training process itself (a
collator's own counters live in DataLoader workers when ``num_workers > 0``). FLOPs follow ``hf_accel.bench.flops``:
6 * trainable + 4 * frozen matmul weights per real token, plus causal attention per document.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Mapping

import torch

from .bench.flops import FlopModel, doc_lengths_from_batch, peak_flops


def device_peak_flops(device: torch.device) -> float | None:
    """bf16 dense peak of the training GPU, or None (CPU, unknown GPU: MFU is then not reported)."""
    if device.type != "cuda":
        return None
    return peak_flops(torch.cuda.get_device_name(device))


def batch_tokens(batch: Mapping[str, Any]) -> tuple[int, int]:
    """(real tokens, token slots) of one batch: padded batches count their mask; a packed batch (no mask) counts
    every slot as real, which holds for one packed row per micro-batch (no padding tail), as the Trainer builds."""
    input_ids = batch["input_ids"]
    slots = input_ids.numel()
    mask = batch.get("attention_mask")
    if mask is not None:
        return int(mask.sum()), slots
    return slots, slots


@dataclass
class Window:
    tokens: int = 0
    slots: int = 0
    flops: float = 0.0
    data_wait_s: float = 0.0
    start: float = field(default_factory=time.perf_counter)


class ThroughputMeter:
    """Accumulates micro-batches and data waits; ``pop(...)`` returns the metrics of the interval and starts a new one."""

    def __init__(self, model: torch.nn.Module, device: torch.device) -> None:
        self.flop_model = FlopModel.from_model(model)
        self.peak = device_peak_flops(device)
        self.device = device
        self.window = Window()
        self.total = Window()
        self.total_steps = 0

    def add_batch(self, batch: Mapping[str, Any]) -> None:
        tokens, slots = batch_tokens(batch)
        flops = self.flop_model.step_flops(doc_lengths_from_batch(batch))
        for w in (self.window, self.total):
            w.tokens += tokens
            w.slots += slots
            w.flops += flops

    def add_wait(self, seconds: float) -> None:
        self.window.data_wait_s += seconds
        self.total.data_wait_s += seconds

    def _metrics(self, w: Window, now: float) -> dict[str, float]:
        """Metrics of a window, summed over every rank (each rank calls this at the same logging step)."""
        elapsed = max(now - w.start, 1e-9)
        tokens, slots, flops, wait = float(w.tokens), float(w.slots), w.flops, w.data_wait_s
        world = 1
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            world = torch.distributed.get_world_size()
            device = self.device if torch.distributed.get_backend() == "nccl" else torch.device("cpu")
            totals = torch.tensor([tokens, slots, flops, wait], dtype=torch.float64, device=device)
            torch.distributed.all_reduce(totals)
            tokens, slots, flops, wait = totals.tolist()
        out = {
            "tokens": tokens,
            "tokens_per_s": tokens / elapsed,
            "padding_fraction": 1.0 - tokens / slots if slots else 0.0,
            "data_wait_fraction": min(1.0, wait / world / elapsed),
        }
        if self.peak:
            out["mfu"] = flops / elapsed / (self.peak * world)
        return out

    def pop(self) -> dict[str, float]:
        now = time.perf_counter()
        out = self._metrics(self.window, now)
        if self.device.type == "cuda":
            out["peak_mem_gib"] = torch.cuda.max_memory_allocated(self.device) / 2**30
        self.window = Window(start=now)
        return out

    def summary(self) -> dict[str, float]:
        out = self._metrics(self.total, time.perf_counter())
        out["seconds"] = time.perf_counter() - self.total.start
        if self.device.type == "cuda":
            out["peak_mem_gib"] = torch.cuda.max_memory_allocated(self.device) / 2**30
        return out


def format_summary(summary: Mapping[str, float]) -> str:
    """A small aligned table for the end of training."""
    rows = [
        ("real tokens", f"{summary['tokens']:,.0f}"),
        ("time", f"{summary['seconds']:.1f} s"),
        ("tokens/s", f"{summary['tokens_per_s']:,.0f}"),
        ("MFU", f"{summary['mfu']:.1%}" if "mfu" in summary else "n/a (no known GPU peak)"),
        ("padding", f"{summary['padding_fraction']:.1%}"),
        ("data wait", f"{summary['data_wait_fraction']:.1%}"),
        ("peak GPU memory", f"{summary['peak_mem_gib']:.2f} GiB" if "peak_mem_gib" in summary else "n/a (CPU)"),
    ]
    width = max(len(k) for k, _ in rows)
    return "\n".join(["hf_accel training summary"] + [f"  {k:<{width}}  {v}" for k, v in rows])
