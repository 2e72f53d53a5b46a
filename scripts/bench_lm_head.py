"""LM head + cross-entropy, forward and backward, alone: hf_accel's fused_ce methods vs Liger vs cut-cross-entropy vs
the plain head.

    python scripts/bench_lm_head.py                      # Llama-3 shapes: 16,384 tokens, hidden 2048, vocab 128,256
    python scripts/bench_lm_head.py --tokens 2048 --hidden 64 --vocab 1000 --device cpu   # smoke

Each method runs the summed loss / N on the same bf16 inputs; reported: median ms for forward + backward (CUDA
events), peak memory above the inputs, and the error of loss and gradients against an fp32 reference of the plain
head. Prints a table last; --out writes the JSON.

cut-cross-entropy (Apple's CCE, what Unsloth uses; CUDA, Triton) runs as "cce" (its default: gradient entries below a
bf16-level threshold are filtered out, filter_eps="high") and "cce-nofilter" (filter_eps=None: every entry). Methods
whose package or device is missing are rows saying so.
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import statistics
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from hf_accel.fused.cross_entropy import liger_available, linear_cross_entropy


def plain(hidden, head, labels):
    return F.cross_entropy(head(hidden).float(), labels, ignore_index=-100, reduction="sum")


def cce(hidden, head, labels, filter_eps):
    from cut_cross_entropy import linear_cross_entropy as cce_loss

    return cce_loss(hidden, head.weight, labels, ignore_index=-100, reduction="sum", filter_eps=filter_eps)


# method -> why it cannot run on `device` (None: it can); methods not named run everywhere
def _cce_missing(device: torch.device) -> str | None:
    if importlib.util.find_spec("cut_cross_entropy") is None:
        return "cut-cross-entropy not installed (pip install cut-cross-entropy==25.1.1)"
    return None if device.type == "cuda" else "cut-cross-entropy's Triton kernels need CUDA"


REQUIREMENTS = {
    "liger": lambda device: None if liger_available() and device.type == "cuda" else "needs liger-kernel and CUDA",
    "cce": _cce_missing,
    "cce-nofilter": _cce_missing,
}
METHODS = "plain,liger,cce,cce-nofilter,recompute,inline,inline:1024,inline:4096,inline:8192"


def run_method(name, chunk, hidden, head, labels, n_items):
    if name == "plain":
        return plain(hidden, head, labels) / n_items
    if name in ("cce", "cce-nofilter"):
        return cce(hidden, head, labels, "high" if name == "cce" else None) / n_items
    return linear_cross_entropy(hidden, head, labels, num_items_in_batch=n_items, chunk_size=chunk, method=name)


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.float() - want.float()).norm() / want.float().norm().clamp(min=1e-30))


def _versions() -> dict[str, str | None]:
    from importlib import metadata

    found = {}
    for name in ("liger-kernel", "cut-cross-entropy", "triton"):
        try:
            found[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            found[name] = None
    return found


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", type=int, default=16384)
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--vocab", type=int, default=128256)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--methods", default=METHODS)
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args()

    torch.manual_seed(0)
    dev = torch.device(args.device)
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    head = nn.Linear(args.hidden, args.vocab, bias=False, device=dev, dtype=dtype)
    nn.init.normal_(head.weight, std=0.02)
    hidden0 = torch.randn(args.tokens, args.hidden, device=dev, dtype=dtype)
    labels = torch.randint(0, args.vocab, (args.tokens,), device=dev)
    labels[:: 97] = -100
    n_items = int((labels != -100).sum())

    ref_head = nn.Linear(args.hidden, args.vocab, bias=False, device=dev, dtype=torch.float32)
    ref_head.weight.data.copy_(head.weight.data.float())
    ref_hidden = hidden0.float().clone().requires_grad_(True)
    ref_loss = plain(ref_hidden, ref_head, labels) / n_items
    ref_loss.backward()
    ref = (ref_loss.detach(), ref_hidden.grad, ref_head.weight.grad)
    del ref_head, ref_hidden, ref_loss

    rows = []
    for spec in args.methods.split(","):
        name, _, chunk = spec.partition(":")
        missing = REQUIREMENTS[name](dev) if name in REQUIREMENTS else None
        if missing:
            rows.append({"method": spec, "status": f"skipped: {missing}"})
            continue
        times, loss, grads = [], None, None
        for i in range(args.iters + 3):
            head.weight.grad = None
            hidden = hidden0.detach().clone().requires_grad_(True)
            if dev.type == "cuda":
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats()
                base = torch.cuda.memory_allocated()
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
            t0 = time.perf_counter()
            loss = run_method(name, int(chunk) if chunk else None, hidden, head, labels, n_items)
            loss.backward()
            if dev.type == "cuda":
                end.record()
                torch.cuda.synchronize()
                ms = start.elapsed_time(end)
                peak = (torch.cuda.max_memory_allocated() - base) / 2**30
            else:
                ms, peak = (time.perf_counter() - t0) * 1e3, None
            if i >= 3:
                times.append(ms)
            grads = (hidden.grad, head.weight.grad)
        rows.append({
            "method": spec, "ms": statistics.median(times), "peak_extra_gib": peak, "status": "ok",
            "loss_abs_err": abs(float(loss.detach()) - float(ref[0])),
            "grad_hidden_rel_err": rel_err(grads[0], ref[1]), "grad_weight_rel_err": rel_err(grads[1], ref[2]),
        })
        del loss, grads, hidden

    result = {"tokens": args.tokens, "hidden": args.hidden, "vocab": args.vocab, "dtype": str(dtype),
              "device": torch.cuda.get_device_name() if dev.type == "cuda" else "cpu", "torch": torch.__version__,
              "versions": _versions(),
              "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "rows": rows}
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=1))
    print(f"\n## LM head + CE fwd+bwd, {args.tokens} tokens x {args.hidden} -> {args.vocab} ({dtype}, {result['device']})")
    print("| method | ms | extra peak GiB | loss err | grad hidden rel err | grad weight rel err |")
    print("|---|---:|---:|---:|---:|---:|")
    for r in rows:
        if r["status"] != "ok":
            print(f"| {r['method']} | {r['status']} | | | | |")
            continue
        peak = "-" if r["peak_extra_gib"] is None else f"{r['peak_extra_gib']:.2f}"
        print(f"| {r['method']} | {r['ms']:.2f} | {peak} | {r['loss_abs_err']:.2e} | {r['grad_hidden_rel_err']:.2e} "
              f"| {r['grad_weight_rel_err']:.2e} |")


if __name__ == "__main__":
    main()
