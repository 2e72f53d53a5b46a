"""What a benchmarked configuration is (`BenchConfig`) and the run's options for it (`Options`): the data configs.py
registers and apart.py's child set-up reads."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

from torch import nn

from .train import RunSettings, Timing
from .workloads import BenchData


@dataclass(frozen=True)
class Options:
    """Knobs of the `hf_accel-best` configuration (and the attention substitute for CPU smoke runs)."""

    fused_ce: str = "auto"  # auto (patch(fused_ce=True): the inline path) | inline | recompute | liger | off
    backend: str = "auto"  # passed to hf_accel.patch
    checkpointing: str | None = None  # passed to hf_accel.patch when set
    ce_chunk_size: int | None = None  # None: about 512 MiB of logits per chunk
    substitute_attn: str | None = None  # e.g. "sdpa": run FA4 configs with it (CPU smoke of the TRL path)
    fused_ops: str = "auto"  # auto | on | off: hf_accel.patch(fused_ops=...) (liger norms / SwiGLU)
    compile: bool = False  # hf_accel.patch(compile=True): decoder layers' training forwards through inductor
    mlp_chunks: str | int = "auto"  # hf_accel.patch(mlp_chunks=...): auto | a chunk size in tokens | 0 (off)
    extra_sites: tuple[str, ...] = ()  # bench.py --extra-site: more package folders first on every child's path
    site_root: str = "/tmp"  # where pack-wheels' install.sh puts a pack NAME: <site_root>/site-NAME


@dataclass(frozen=True)
class BenchConfig:
    name: str
    stock: bool  # a baseline others are compared against (everything not hf_accel)
    needs: tuple[str, ...]  # requirement names, see REQUIREMENTS
    run: Callable[[RunSettings, BenchData, Options, Timing], nn.Module]
    description: str
    wrong_for: tuple[str, ...] = field(default=())  # families where this config computes something else
    changes_computation: str | None = None  # why it computes something else on every family (fp8), or None
    sites: tuple[str, ...] = field(default=())  # package packs its child puts first on PYTHONPATH (see child_env)
    # how it runs under a launcher (bench.py --nproc, FSDP2); None: one process only (--nproc skips it)
    launched: Callable[[RunSettings, BenchData, Options, Timing], nn.Module] | None = None
    # it loads its model from files it writes first (Unsloth): it cannot run workloads built on the device
    loads_files: bool = False
