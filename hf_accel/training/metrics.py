"""Throughput metrics per logging interval: real tokens/s, MFU, padding and data-wait fractions, peak GPU memory.
The end summary gives the whole run and its steady part (from the end of the first logging interval, which holds
CUDA start-up, kernel JIT and torch.compile), both global over ranks.

Counted on the batches the training loop actually ran (every micro-batch), in the training process itself (a
collator's own counters live in DataLoader workers when ``num_workers > 0``). FLOPs follow ``hf_accel.training.flops``:
6 * trainable + 4 * frozen matmul weights per real token (the LM head's per token with a target only: a masked
position needs no logits), plus causal attention per document.
"""
from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Mapping

import torch

from .flops import FlopModel, attended, attended_at, peak_flops
from ..data.collators import REAL_TOKENS_KEY


def device_peak_flops(device: torch.device) -> float | None:
    """bf16 dense peak of the training GPU, or None (CPU, unknown GPU: MFU is then not reported)."""
    if device.type != "cuda":
        return None
    return peak_flops(torch.cuda.get_device_name(device))


def batch_counts(batch: Mapping[str, Any], packed: bool = False) -> tuple[Any, Any, Any]:
    """(real tokens, token slots, sum of squared document lengths) of one micro-batch, computed where the batch is:
    tensors on the GPU stay there (no host sync per step; the meter reads its sums back when the Trainer logs).
    ``packed``: a padded batch whose real tokens the model's forwards run packed into one row (hf_accel's DPO / GRPO
    scoring forwards): its slots are its real tokens.

    Padded batches: one document per row, real tokens from the mask. A packed batch (no mask) counts every slot as
    real, which holds for one packed row per micro-batch (no padding tail), as the Trainer builds; its documents come
    from ``cu_seq_lens_q``, or from ``position_ids`` restarting at 0 (a document of n tokens has positions 0..n-1,
    and the sum of 2p + 1 over them is n^2).
    """
    input_ids = batch["input_ids"]
    slots = input_ids.numel()
    real = batch.get(REAL_TOKENS_KEY)
    if real is not None:  # sequence-parallel rows (or a shard of them): their padding tail is marked, not counted
        real = real.to(torch.float64)
        return real.sum(), slots, ((2 * batch["position_ids"].to(torch.float64) + 1) * real).sum()
    mask = batch.get("attention_mask")
    if mask is not None:
        lengths = mask.sum(dim=1, dtype=torch.float64)
        real = lengths.sum()
        return real, real if packed else slots, lengths.square().sum()
    cu = batch.get("cu_seq_lens_q")
    if cu is not None:
        return slots, slots, cu.diff().to(torch.float64).square().sum()
    positions = batch.get("position_ids")
    if positions is not None:
        return slots, slots, (2 * positions.to(torch.float64) + 1).sum()
    rows, seq = input_ids.shape[0], input_ids.shape[-1]
    return slots, slots, float(rows * seq * seq)


def span_sum(batch: Mapping[str, Any], window: int | None, chunk: int | None) -> Any:
    """The sum of ``flops.attended`` over one micro-batch's documents for a layer of this window or chunk, where the
    batch is (no host sync), read as ``batch_counts`` reads the documents."""
    real = batch.get(REAL_TOKENS_KEY)
    if real is not None:
        return (attended_at(batch["position_ids"].to(torch.float64), window, chunk) * real.to(torch.float64)).sum()
    mask = batch.get("attention_mask")
    if mask is not None:
        return attended(mask.sum(dim=1, dtype=torch.float64), window, chunk).sum()
    cu = batch.get("cu_seq_lens_q")
    if cu is not None:
        return attended(cu.diff().to(torch.float64), window, chunk).sum()
    positions = batch.get("position_ids")
    if positions is not None:
        return attended_at(positions.to(torch.float64), window, chunk).sum()
    input_ids = batch["input_ids"]
    return float(input_ids.shape[0] * attended(input_ids.shape[-1], window, chunk))


def batch_targets(batch: Mapping[str, Any]) -> Any:
    """Target tokens of one micro-batch, where the batch is (no host sync): labels that are not -100 after the causal
    shift, or ``shift_labels`` as given (a sequence-parallel shard's); None without labels (every token counts)."""
    shifted = batch.get("shift_labels")
    if shifted is not None:
        return shifted.ne(-100).sum()
    labels = batch.get("labels")
    return None if labels is None else labels[..., 1:].ne(-100).sum()


@dataclass
class Window:
    start: float
    tokens: Any = 0  # int, or a 0-dim tensor on the batches' device until read back
    slots: Any = 0  # int, or a 0-dim tensor (a packed batch's real tokens) until read back
    flops: Any = 0.0
    data_wait_s: float = 0.0


class ThroughputMeter:
    """Accumulates micro-batches and data waits; ``pop(...)`` returns the metrics of the interval and starts a new one;
    ``summary()`` those of the whole run and of its steady part (after the first ``pop``)."""

    def __init__(self, model: torch.nn.Module, device: torch.device,
                 clock: Callable[[], float] = time.perf_counter) -> None:
        self.flop_model = FlopModel.from_model(model)
        self.peak = device_peak_flops(device)
        self.device = device
        self.clock = clock
        self.window = Window(start=clock())
        self.total = Window(start=self.window.start)
        self.steady: Window | None = None  # opens when the first interval closes
        self.total_steps = 0

    def _open_windows(self) -> list[Window]:
        return [self.window, self.total] + ([self.steady] if self.steady is not None else [])

    def add_batch(self, batch: Mapping[str, Any], packed: bool = False) -> None:
        """One micro-batch (``batch_counts``; ``packed``: its forwards run its real tokens packed)."""
        tokens, slots, squared_lengths = batch_counts(batch, packed)
        spans = {span: span_sum(batch, *span) for span in self.flop_model.spans}
        flops = self.flop_model.flops_from_sums(tokens, squared_lengths, batch_targets(batch), spans)
        for w in self._open_windows():
            w.tokens = w.tokens + tokens  # may become a device tensor: read back in _metrics
            w.slots = w.slots + slots
            w.flops = w.flops + flops

    def add_wait(self, seconds: float) -> None:
        for w in self._open_windows():
            w.data_wait_s += seconds

    def _local_peak_bytes(self) -> int | None:
        """This process's peak allocated GPU memory so far; None on CPU (not reported there)."""
        return torch.cuda.max_memory_allocated(self.device) if self.device.type == "cuda" else None

    def _metrics(self, w: Window, now: float) -> dict[str, float]:
        """Metrics of a window over every rank: counts summed, time of the slowest rank, peak memory of the largest
        (``peak_mem_gib``, the run's peak so far; ``world_size`` says over how many ranks). Every rank calls this at
        the same logging step and at the end (each call is two small collectives)."""
        elapsed = max(now - w.start, 1e-9)
        tokens, slots, flops, wait = float(w.tokens), float(w.slots), float(w.flops), w.data_wait_s  # host reads
        peak = self._local_peak_bytes()
        world = 1
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            world = torch.distributed.get_world_size()
            device = self.device if torch.distributed.get_backend() == "nccl" else torch.device("cpu")
            totals = torch.tensor([tokens, slots, flops, wait], dtype=torch.float64, device=device)
            torch.distributed.all_reduce(totals)
            largest = torch.tensor([elapsed, float(peak or 0)], dtype=torch.float64, device=device)
            torch.distributed.all_reduce(largest, op=torch.distributed.ReduceOp.MAX)
            (tokens, slots, flops, wait), (elapsed, peak_max) = totals.tolist(), largest.tolist()
            peak = peak_max if peak is not None else None
        out = {
            "tokens": tokens,
            "seconds": elapsed,
            "tokens_per_s": tokens / elapsed,
            "padding_fraction": 1.0 - tokens / slots if slots else 0.0,
            "data_wait_fraction": min(1.0, wait / world / elapsed),
        }
        if self.peak:
            out["mfu"] = flops / elapsed / (self.peak * world)
        if peak is not None:
            out["peak_mem_gib"] = peak / 2**30
        out["world_size"] = world
        return out

    def pop(self) -> dict[str, float]:
        now = self.clock()
        out = self._metrics(self.window, now)
        out.pop("seconds")
        out.pop("world_size")
        self.window = Window(start=now)
        if self.steady is None:
            self.steady = Window(start=now)
        return out

    def summary(self) -> dict[str, float]:
        """The whole run (``tokens_per_s``, ``mfu``, ...) and, once a first logging interval has closed and more
        tokens followed, its steady part: ``steady_tokens_per_s``, ``steady_seconds`` (and ``steady_mfu``)."""
        now = self.clock()
        out = self._metrics(self.total, now)
        if self.steady is not None:  # every rank has the same number of closed intervals: the collectives match
            steady = self._metrics(self.steady, now)
            if steady["tokens"] > 0:
                out.update({f"steady_{k}": steady[k] for k in ("tokens_per_s", "seconds", "mfu") if k in steady})
        return out


def format_summary(summary: Mapping[str, float]) -> str:
    """A small aligned table for the end of training (all ranks together)."""
    rows = [
        ("real tokens", f"{summary['tokens']:,.0f}"),
        ("time", f"{summary['seconds']:.1f} s"),
        ("tokens/s, whole run", f"{summary['tokens_per_s']:,.0f}"),
        ("tokens/s, steady", f"{summary['steady_tokens_per_s']:,.0f} (last {summary['steady_seconds']:.1f} s, after "
         "the first logging interval)" if "steady_tokens_per_s" in summary else "n/a (one logging interval)"),
        ("MFU, whole run", f"{summary['mfu']:.1%}" if "mfu" in summary else "n/a (no known GPU peak)"),
        ("MFU, steady", f"{summary['steady_mfu']:.1%}" if "steady_mfu" in summary else "n/a"),
        ("padding", f"{summary['padding_fraction']:.1%}"),
        ("data wait", f"{summary['data_wait_fraction']:.1%}"),
        ("peak GPU memory", (f"{summary['peak_mem_gib']:.2f} GiB" + (
            f" (the largest of {summary['world_size']:.0f} ranks)" if summary.get("world_size", 1) > 1 else ""))
         if "peak_mem_gib" in summary else "n/a (CPU)"),
    ]
    if "budget_gib" in summary:  # a checkpointing memory budget: its plan against the measured peak
        over = summary["peak_mem_gib"] > summary["budget_gib"]
        rows.append(("memory budget", f"{summary['budget_gib']:.2f} GiB: plan predicted "
                     f"{summary['budget_predicted_gib']:.2f} GiB, measured {summary['peak_mem_gib']:.2f} GiB"
                     + (" (OVER the budget: pass MemoryBudget(headroom=...) larger, or a lower budget)" if over
                        else "")))
    width = max(len(k) for k, _ in rows)
    return "\n".join(["hf_accel training summary"] + [f"  {k:<{width}}  {v}" for k, v in rows])
