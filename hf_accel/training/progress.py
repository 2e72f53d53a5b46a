"""What a person watching a run sees: a progress bar (ETA, tokens/s, loss) and a loss / throughput plot.

``ProgressBar`` replaces transformers' ``ProgressCallback`` / ``PrinterCallback``: on a terminal a tqdm bar over the
optimizer steps (ETA from tqdm) whose postfix shows the last logged loss and real tokens/s; elsewhere (a log file,
CI) one line per logging interval with the same numbers and an ETA. Loss and tokens/s are read from the logs the
Trainer already makes (``hf_accel.training.metrics`` adds ``tokens_per_s``), so the bar adds no host sync per step.
"""
from __future__ import annotations

import math
import sys
import time
from typing import Any, Mapping, Sequence, TextIO

from transformers import TrainerCallback


def _clock(seconds: float) -> str:
    seconds = int(round(seconds))
    hours, rest = divmod(seconds, 3600)
    return f"{hours}:{rest // 60:02d}:{rest % 60:02d}" if hours else f"{rest // 60}:{rest % 60:02d}"


class ProgressBar(TrainerCallback):
    """Training and evaluation progress with ETA, tokens/s and loss (main process only).

    ``file``: where to write (default: stderr for the bar, stdout for lines). ``tty``: force the bar (True) or
    lines (False); default: a bar when ``file`` (stderr) is a terminal.
    """

    def __init__(self, file: TextIO | None = None, tty: bool | None = None) -> None:
        self.file = file
        stream = file or sys.stderr
        self.tty = tty if tty is not None else bool(getattr(stream, "isatty", lambda: False)())
        self.bar: Any = None
        self.eval_bar: Any = None
        self._start_time = 0.0
        self._start_step = 0
        self._postfix: dict[str, str] = {}

    # ---- training -------------------------------------------------------------------------------------------------

    def on_train_begin(self, args, state, control, **kwargs):
        if not state.is_local_process_zero:
            return
        self._start_time, self._start_step = time.perf_counter(), state.global_step
        if self.tty:
            from tqdm.auto import tqdm

            self.bar = tqdm(total=state.max_steps, initial=state.global_step, desc="train", unit="step",
                            file=self.file or sys.stderr, dynamic_ncols=True)

    def on_step_end(self, args, state, control, **kwargs):
        if self.bar is not None:
            self.bar.update(state.global_step - self.bar.n)

    def on_log(self, args, state, control, logs: Mapping[str, Any] | None = None, **kwargs):
        if not state.is_local_process_zero or not logs:
            return
        shown = {}
        if "loss" in logs:
            shown["loss"] = f"{logs['loss']:.4f}"
        if "tokens_per_s" in logs:
            shown["tok/s"] = f"{logs['tokens_per_s']:,.0f}"
        if "eval_loss" in logs:
            shown["eval_loss"] = f"{logs['eval_loss']:.4f}"
        if not shown:
            return
        if self.bar is not None:
            self._postfix.update(shown)
            self.bar.set_postfix(self._postfix, refresh=True)
            return
        done = state.global_step - self._start_step
        elapsed = time.perf_counter() - self._start_time
        eta = elapsed / done * (state.max_steps - state.global_step) if done > 0 else float("nan")
        numbers = " | ".join(f"{k} {v}" for k, v in shown.items())
        pct = f" ({state.global_step / state.max_steps:.0%})" if state.max_steps else ""
        print(f"step {state.global_step}/{state.max_steps}{pct} | {numbers} | {_clock(elapsed)} elapsed, ETA "
              f"{_clock(eta) if eta == eta else '?'}", file=self.file or sys.stdout, flush=True)

    def on_train_end(self, args, state, control, **kwargs):
        if self.bar is not None:
            self.bar.close()
            self.bar = None

    # ---- evaluation (Trainer.evaluate / predict) ------------------------------------------------------------------

    def on_prediction_step(self, args, state, control, eval_dataloader=None, **kwargs):
        if not (state.is_local_process_zero and self.tty):
            return
        if self.eval_bar is None:
            from tqdm.auto import tqdm

            total = len(eval_dataloader) if eval_dataloader is not None and hasattr(eval_dataloader, "__len__") \
                else None
            self.eval_bar = tqdm(total=total, desc="eval", unit="batch", leave=self.bar is None,
                                 file=self.file or sys.stderr, dynamic_ncols=True)
        self.eval_bar.update(1)

    def on_evaluate(self, args, state, control, **kwargs):
        if self.eval_bar is not None:
            self.eval_bar.close()
            self.eval_bar = None

    on_predict = on_evaluate


def plot_training(log_history: Sequence[Mapping[str, Any]], path: str) -> str | None:
    """Write a PNG of training loss and real tokens/s against the optimizer step to ``path`` (``training_figure``).

    Returns ``path``, or None when matplotlib is not installed (the plot is optional; nothing else depends on it)
    or nothing was logged.
    """
    fig = training_figure(log_history)
    if fig is None:
        return None
    fig.savefig(path, dpi=100)
    return path


def training_figure(log_history: Sequence[Mapping[str, Any]]) -> Any:
    """The figure of ``plot_training`` (matplotlib's object API: no pyplot global state, no display needed), or None.

    A non-finite loss (nan, inf) cannot be drawn where it is: each is marked by a red cross at the top of the loss
    axis, labelled with its value, and the first one by a dashed line (a line through the finite points alone would
    hide that the run went wrong).
    """
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError:
        return None
    loss = [(log["step"], float(log["loss"])) for log in log_history if "loss" in log and "step" in log]
    speed = [(log["step"], log["tokens_per_s"]) for log in log_history if "tokens_per_s" in log and "step" in log]
    evals = [(log["step"], log["eval_loss"]) for log in log_history if "eval_loss" in log and "step" in log]
    if not loss and not speed:
        return None
    fig = Figure(figsize=(9, 3.5), layout="constrained")
    FigureCanvasAgg(fig)
    ax_loss, ax_speed = fig.subplots(1, 2)
    finite = [(step, value) for step, value in loss if math.isfinite(value)]
    if finite:
        ax_loss.plot(*zip(*finite), marker=".", label="train")
    if evals:
        ax_loss.plot(*zip(*evals), marker="o", label="eval")
    _mark_non_finite(ax_loss, [(step, value) for step, value in loss if not math.isfinite(value)],
                     [v for _, v in finite + evals])
    ax_loss.set(title="loss", xlabel="step")
    ax_loss.legend()
    if speed:
        ax_speed.plot(*zip(*speed), marker=".", color="tab:green")
    ax_speed.set(title="real tokens/s (per logging interval)", xlabel="step")
    ax_speed.set_ylim(bottom=0)
    return fig


def _mark_non_finite(ax: Any, points: list[tuple[int, float]], finite_values: list[float]) -> None:
    if not points:
        return
    top = max(finite_values) * 1.05 if finite_values else 1.0
    names = sorted({str(value) for _, value in points})
    ax.plot([step for step, _ in points], [top] * len(points), linestyle="none", marker="x", color="tab:red",
            markersize=8, label=f"loss {' / '.join(names)} (not finite; drawn at the top)")
    ax.axvline(points[0][0], color="tab:red", linestyle="--", linewidth=1)


class LogEnds(TrainerCallback):
    """Log the last optimizer step too (``logging_first_step`` logs the first), so a run shorter than one logging
    interval still shows where its loss started and ended, and its plot has both ends."""

    def on_step_end(self, args, state, control, **kwargs):
        if state.max_steps and state.global_step >= state.max_steps:
            control.should_log = True
