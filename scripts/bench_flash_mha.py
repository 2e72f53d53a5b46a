"""Forward+backward time of FlashMHA (fa4, torch-fa2, auto) vs nn.MultiheadAttention on one causal self-attention.

Default shape: B=8, S=2048, 16 heads of 128 dims, bf16, CUDA. ``--tiny`` runs small fp32 shapes on the CPU (a smoke
test). Prints a markdown table last; ``--out`` writes the rows as JSON.

    python scripts/bench_flash_mha.py --out flash_mha.json
    python scripts/bench_flash_mha.py --tiny --out /tmp/flash_mha_tiny.json
"""
from __future__ import annotations

import argparse
import json
import time
from dataclasses import asdict, dataclass

import torch
from torch import nn

from hf_accel.errors import BackendUnavailable
from hf_accel.attention.flash_mha import FlashMHA


@dataclass
class Shape:
    batch: int
    seq: int
    heads: int
    head_dim: int
    dtype: str
    device: str

    @property
    def embed_dim(self) -> int:
        return self.heads * self.head_dim


@dataclass
class Row:
    name: str
    status: str  # "ok" or why it did not run
    ms: float | None = None
    tokens_per_s: float | None = None
    attn_tflops: float | None = None  # causal attention matmuls only (fwd + 2x bwd), projections excluded
    peak_mem_gib: float | None = None
    speedup: float | None = None  # vs nn.MultiheadAttention


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _time_fwd_bwd(module: nn.Module, call, x: torch.Tensor, warmup: int, iters: int) -> float:
    """Milliseconds per forward+backward, averaged over ``iters`` after ``warmup`` (JIT compiles happen there)."""
    grad = torch.randn_like(x)
    for _ in range(warmup):
        call(module, x).backward(grad)
    _sync(x.device)
    start = time.perf_counter()
    for _ in range(iters):
        module.zero_grad(set_to_none=True)
        call(module, x).backward(grad)
    _sync(x.device)
    return (time.perf_counter() - start) * 1000 / iters


def _attention_flops(shape: Shape) -> float:
    # QK^T and PV: 2 matmuls of 2*S*S*D each per head, halved by causality; backward does twice the forward's work.
    fwd = 2 * 2 * shape.batch * shape.heads * shape.seq * shape.seq * shape.head_dim / 2
    return 3 * fwd


def _configurations(shape: Shape):
    causal_mask = torch.ones(shape.seq, shape.seq, dtype=torch.bool, device=shape.device).triu(1)

    def torch_call(m, x):
        return m(x, x, x, attn_mask=causal_mask, is_causal=True, need_weights=False)[0]

    def ours_call(m, x):
        return m(x, is_causal=True)[0]

    yield "nn.MultiheadAttention", None, torch_call
    for backend in ("fa4", "torch-fa2", "auto"):
        yield f"FlashMHA {backend}", backend, ours_call


def run(shape: Shape, warmup: int, iters: int) -> list[Row]:
    device, dtype = torch.device(shape.device), getattr(torch, shape.dtype)
    torch.manual_seed(0)
    base = nn.MultiheadAttention(shape.embed_dim, shape.heads, batch_first=True, device=device, dtype=dtype)
    x = torch.randn(shape.batch, shape.seq, shape.embed_dim, device=device, dtype=dtype, requires_grad=True)
    rows = []
    for name, backend, call in _configurations(shape):
        module = base if backend is None else FlashMHA.from_torch(base, causal=True, backend=backend)
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        try:
            ms = _time_fwd_bwd(module, call, x, warmup, iters)
        except BackendUnavailable as err:
            why = str(err).split("tried ", 1)[-1].split(". ")[0]  # "fa4 (not installed)" etc.
            rows.append(Row(name, f"unavailable: {why}"))
            continue
        except RuntimeError as err:  # a kernel that fails on this machine is a result, not a reason to stop
            rows.append(Row(name, f"failed: {str(err).splitlines()[0][:200]}"))
            continue
        peak = torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None
        tokens = shape.batch * shape.seq
        rows.append(Row(name, "ok", ms, tokens / ms * 1000, _attention_flops(shape) / ms / 1e9, peak))
    baseline = rows[0].ms
    for row in rows:
        if row.ms and baseline:
            row.speedup = baseline / row.ms
    return rows


def markdown(shape: Shape, rows: list[Row]) -> str:
    def fmt(v, spec):
        return "-" if v is None else format(v, spec)

    head = (f"FlashMHA fwd+bwd, causal, B={shape.batch} S={shape.seq} H={shape.heads} D={shape.head_dim} "
            f"{shape.dtype} on {shape.device}\n\n")
    lines = ["| implementation | ms / step | tokens/s | attn TFLOP/s | peak GiB | speedup | status |",
             "|---|---:|---:|---:|---:|---:|---|"]
    for r in rows:
        speedup = "-" if r.speedup is None else f"{r.speedup:.2f}x"
        lines.append(f"| {r.name} | {fmt(r.ms, '.2f')} | {fmt(r.tokens_per_s, ',.0f')} | {fmt(r.attn_tflops, '.1f')} "
                     f"| {fmt(r.peak_mem_gib, '.2f')} | {speedup} | {r.status} |")
    return head + "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tiny", action="store_true", help="small fp32 shapes on the CPU (smoke test)")
    parser.add_argument("--out", help="write the rows as JSON here")
    parser.add_argument("--warmup", type=int, default=None)
    parser.add_argument("--iters", type=int, default=None)
    args = parser.parse_args(argv)
    if args.tiny:
        shape = Shape(batch=2, seq=32, heads=4, head_dim=16, dtype="float32", device="cpu")
        warmup, iters = 1, 2
    else:
        shape = Shape(batch=8, seq=2048, heads=16, head_dim=128, dtype="bfloat16", device="cuda")
        warmup, iters = 3, 20
    rows = run(shape, args.warmup or warmup, args.iters or iters)
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"shape": asdict(shape), "rows": [asdict(r) for r in rows]}, f, indent=2)
    print(markdown(shape, rows))


if __name__ == "__main__":
    main()
