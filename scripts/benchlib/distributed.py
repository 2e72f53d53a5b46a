"""bench.py --nproc N: each configuration's child under `accelerate launch` (FSDP2 by default), what its ranks gather
to rank 0, and hf_accel's configurations run through hf_accel.Trainer (a plain loop cannot run under FSDP2).

Under a launcher every rank builds the model on its own GPU (cuda:LOCAL_RANK) and trains on its own share of the
data; after the run rank 0 gathers every rank's step tokens and documents and peak memory. A step's global tokens
are the sum over ranks; its time is rank 0's (the ranks meet in collectives every step, so they keep in step).
"""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from .targets import trainer_data_targets
from .train import RunSettings, Timing, train_timed
from .workloads import BenchData


@dataclass(frozen=True)
class Rank:
    """This process's place under a launcher (torchrun's environment; one process without it)."""

    rank: int = 0
    local_rank: int = 0
    world_size: int = 1

    @classmethod
    def from_env(cls, env: dict[str, str] | None = None) -> "Rank":
        env = os.environ if env is None else env
        return cls(int(env.get("RANK", 0)), int(env.get("LOCAL_RANK", 0)), int(env.get("WORLD_SIZE", 1)))

    def device(self, device: str) -> str:
        """cuda:LOCAL_RANK for a CUDA run (made the current device), else `device` unchanged."""
        if not device.startswith("cuda"):
            return device
        torch.cuda.set_device(self.local_rank)
        return f"cuda:{self.local_rank}"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch_argv(accelerate_config: Path, nproc: int, script_argv: list[str]) -> list[str]:
    """`python -m accelerate.commands.launch ... SCRIPT ARGS` for `nproc` processes on a free rendezvous port."""
    return [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(accelerate_config),
            "--num_processes", str(nproc), "--main_process_port", str(free_port()), *script_argv]


class ChildGroups:
    """The process groups `run_group` has running, and whether the run was stopped from outside.

    Each child runs in its own session (so that a timeout can kill a launcher with all its ranks), which also puts it
    out of reach of a signal sent to bench.py's own process group: `timeout 500 python scripts/bench.py ...` would end
    bench.py and leave its child training on the GPU (it happened: a device call's outer `timeout` ended bench.py
    mid-configuration and no record was written). `stop` kills every running group and marks the run stopped; bench.py
    calls it from its SIGTERM / SIGINT handler, records what it has and exits."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._running: set[subprocess.Popen] = set()
        self.stopped_by: str | None = None  # the signal's name once stopped

    def start(self, argv: list[str], env: dict[str, str]) -> subprocess.Popen:
        with self._lock:
            if self.stopped_by is not None:
                raise RunStopped(self.stopped_by)
            proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                                    start_new_session=True)
            self._running.add(proc)
        if self.stopped_by is not None:  # the signal came while Popen ran, before the group was known
            kill_tree(proc.pid)
        return proc

    def reset(self) -> None:
        """A new run (bench.main called again in one process, as the tests do)."""
        self.stopped_by = None

    def finished(self, proc: subprocess.Popen) -> None:
        with self._lock:
            self._running.discard(proc)

    def stop(self, reason: str) -> None:
        """Mark the run stopped and kill every running group (safe to call from a signal handler: no waiting)."""
        self.stopped_by = self.stopped_by or reason
        for proc in list(self._running):
            kill_tree(proc.pid)


class RunStopped(RuntimeError):
    """The run was stopped (a signal to bench.py) before or while this child ran."""


def kill_tree(pid: int) -> None:
    """SIGKILL process group `pid` (a launcher started in its own session) and every descendant of process `pid`
    (found before the kill: orphans are re-parented at once): torch's elastic agent starts each rank in a session of
    its own, out of the launcher's group, so killing the group alone leaves the ranks running."""
    import psutil  # accelerate's dependency

    try:
        below = psutil.Process(pid).children(recursive=True)
    except psutil.NoSuchProcess:
        below = []
    try:
        os.killpg(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass  # already gone
    for child in below:
        try:
            child.kill()
        except psutil.NoSuchProcess:
            pass


CHILDREN = ChildGroups()


class HostWatch:
    """While a child runs: its processes' resident memory summed (the peak) and the host memory this machine still
    had (the least; cgroup-aware), sampled every ``interval`` s on a thread. A child the kernel kills (SIGKILL, no
    Python error: Unsloth at 344k tokens, run 31) leaves no record of its own; these say whether the host ran out."""

    def __init__(self, pid: int, interval: float = 2.0) -> None:
        self.pid, self.interval = pid, interval
        self.peak_rss_bytes, self.min_available_bytes = 0, None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> "HostWatch":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        while True:
            self.sample()
            if self._stop.wait(self.interval):
                return

    def sample(self) -> None:
        import psutil  # accelerate's dependency

        from hf_accel.memory.machine import host_available_bytes

        try:
            root = psutil.Process(self.pid)
            processes = [root, *root.children(recursive=True)]
        except psutil.Error:
            return
        rss = 0
        for process in processes:
            try:
                rss += process.memory_info().rss
            except psutil.Error:
                pass
        available = host_available_bytes()
        self.peak_rss_bytes = max(self.peak_rss_bytes, rss)
        self.min_available_bytes = available if self.min_available_bytes is None else min(self.min_available_bytes,
                                                                                          available)

    def figures(self) -> dict[str, float]:
        """What the record keeps: GiB, rounded."""
        out = {"host_rss_peak_gib": round(self.peak_rss_bytes / 2**30, 2)}
        if self.min_available_bytes is not None:
            out["host_available_min_gib"] = round(self.min_available_bytes / 2**30, 2)
        return out


def run_group(argv: list[str], env: dict[str, str], timeout: float) -> subprocess.CompletedProcess:
    """Run `argv` in its own process group; on a timeout kill the whole group (launcher and every rank) and raise
    subprocess.TimeoutExpired carrying the captured stderr. Raises RunStopped when `CHILDREN.stop` ended the run
    (before the start or during it: the group is killed either way). The result's (or the timeout's) ``host``, a
    ``HostWatch``: the group's host memory while it ran."""
    proc = CHILDREN.start(argv, env)
    try:
        with HostWatch(proc.pid) as host:
            try:
                out, err = proc.communicate(timeout=timeout)
            except subprocess.TimeoutExpired as exc:
                kill_tree(proc.pid)
                out, err = proc.communicate()
                expired = subprocess.TimeoutExpired(argv, timeout, output=out, stderr=err)
                expired.host = host
                raise expired from exc
    finally:
        CHILDREN.finished(proc)
    if CHILDREN.stopped_by is not None:
        raise RunStopped(CHILDREN.stopped_by)
    completed = subprocess.CompletedProcess(argv, proc.returncode, out, err)
    completed.host = host
    return completed


def gather_ranks(timing: Timing, device: str) -> tuple[Timing, dict[str, Any]]:
    """Every rank's step documents and peak memory, on every rank (call it on all of them, after the run).

    Returns the global timing (rank 0's step times, each step's documents from every rank, each step's loss as the
    mean of the ranks' losses: under transformers' average_tokens_across_devices a rank's loss is its summed
    cross-entropy over the step's global target count times the world size, so one rank's alone is not the step's
    loss) and what the result JSON records per rank: nproc, rank_step_tokens (per rank, per timed step),
    peak_gib_per_rank and its max peak_gib (CUDA: max_memory_allocated) or peak_rss_gib_per_rank (CPU: the
    process's peak resident set)."""
    import resource

    import torch.distributed as dist

    cuda = device.startswith("cuda")
    if cuda:
        peak_bytes = torch.cuda.max_memory_allocated()
    else:
        peak_bytes = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux
    mine = {"step_docs": timing.step_docs, "steps": len(timing.step_seconds), "peak_bytes": peak_bytes,
            "losses": timing.losses, "step_targets": timing.step_targets}
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        ranks: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(ranks, mine)
    else:
        ranks = [mine]
    steps = min(min(r["steps"], len(r["step_docs"])) for r in ranks)
    merged = Timing(step_seconds=timing.step_seconds[:steps],
                    step_docs=[[n for r in ranks for n in r["step_docs"][i]] for i in range(steps)],
                    losses=[sum(r["losses"][i] for r in ranks) / len(ranks)
                            for i in range(min(steps, *(len(r["losses"]) for r in ranks)))],
                    notes=timing.notes, host_events=timing.host_events, profile=timing.profile,  # rank 0's
                    data_targets=timing.data_targets)  # every rank's data set is the same
    if all(len(r["step_targets"]) >= steps for r in ranks):
        merged.step_targets = [sum(r["step_targets"][i] for r in ranks) for i in range(steps)]
    info: dict[str, Any] = {"nproc": len(ranks),
                            "rank_step_tokens": [[sum(d) for d in r["step_docs"][:steps]] for r in ranks]}
    peaks = [r["peak_bytes"] / 2**30 for r in ranks]
    if cuda:
        info.update(peak_gib_per_rank=peaks, peak_gib=max(peaks))
    else:
        info["peak_rss_gib_per_rank"] = peaks
    return merged, info


def run_accel_trainer(model: nn.Module, data: BenchData, settings: RunSettings, timing: Timing,
                      accel: Any, all_rows: bool = False) -> nn.Module:
    """hf_accel.Trainer with `accel` (AccelArguments: its patch, token-budget packing), bf16 on CUDA, the same
    step timing as run_trl. One micro-batch of at most accel.max_tokens_per_batch tokens per rank and step.
    Prompt-masked data: a labels column (-100 on prompts). ``all_rows``: the collator lists no target rows (the
    fused loss then takes every row)."""
    from datasets import Dataset
    from transformers import TrainingArguments

    from hf_accel import Trainer

    cuda = settings.device.startswith("cuda")
    with tempfile.TemporaryDirectory() as out:
        args = TrainingArguments(
            output_dir=out, max_steps=settings.warmup + settings.steps, per_device_train_batch_size=1,
            gradient_accumulation_steps=1, learning_rate=1e-5, lr_scheduler_type="constant", warmup_steps=0,
            optim="adamw_torch_fused", bf16=cuda, use_cpu=not cuda, save_strategy="no", report_to="none",
            disable_tqdm=True, dataloader_num_workers=0, seed=settings.seed, ddp_find_unused_parameters=False,
        )  # logging_nan_inf_filter as its default: hf_accel's Trainer turns transformers' per-step check off itself
        accel.print_summary = False

        columns = {"input_ids": data.samples}
        if data.prompts is not None:
            columns["labels"] = [data.labels(i) for i in range(len(data.samples))]

        def make(cls: type, timer: Any) -> Any:
            trainer = cls(model=model, args=args, train_dataset=Dataset.from_dict(columns), accel=accel,
                          callbacks=[timer])
            if trainer.patch_report is not None:
                timing.notes.append(f"patch: {trainer.patch_report}")
            if all_rows and hasattr(trainer.data_collator, "target_rows"):
                trainer.data_collator.target_rows = False
            timing.notes.append(f"target rows: {getattr(trainer.data_collator, 'target_rows', None)}")
            if data.prompts is not None:
                timing.data_targets = trainer_data_targets(trainer)
            return trainer

        train_timed(Trainer, settings, timing, make)
    return model
