#!/usr/bin/env python
"""How fast this machine gives offloaded checkpointing its page-locked host memory (issue 40's first long step).

    python scripts/bench_pinned.py --out pinned.json                 # GPU: the 344k-token QLoRA shape, 3 ways
    python scripts/bench_pinned.py --device cpu --gib 0.01 --tensors 2   # CPU smoke run (the test uses it)

Run 30 (tests/gpu/RESULTS.md) saw the GPU idle ~40 s of the first 344k-token step while torch's caching host
allocator page-locked the layer inputs (``cudaHostAlloc``, one block at a time; run 31 measured 2.95 GB/s here, with a
matmul beside it held until the allocation ended). torch can instead allocate, touch the pages on N threads and
register them (``PYTORCH_CUDA_ALLOC_CONF=pinned_use_cuda_host_register:True,pinned_num_register_threads:N``). Each
way runs in its own child process (the setting is the process's and freed blocks stay cached), allocating
``--tensors`` layer inputs of ``--gib`` each in the pieces the offloader asks for
(``memory.offload.pinned_pieces``), then copying a device tensor into them as the offloader's pack does (the copy's
GB/s shows whether the memory is page-locked: pageable copies run several times slower). With ``--overlap`` a second
set is allocated on a thread while the main thread runs matmuls: the matmuls' slowdown says whether reserving the
pieces in the background, before the step needs them, would cost the step anything. Way ``hf_accel``: no allocator
environment, the setting hf_accel's offloader makes at run time (``memory.offload.register_pinned_host_memory``):
it should read as ``register-8``.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

# 344,064 tokens x hidden 4096 x bf16: one Llama-3-8B layer input at issue 40c's length
LAYER_GIB = 344064 * 4096 * 2 / 2**30
WAYS = {"cudaHostAlloc": "", "register-8": "pinned_use_cuda_host_register:True,pinned_num_register_threads:8",
        "register-16": "pinned_use_cuda_host_register:True,pinned_num_register_threads:16",
        "hf_accel": None}  # no environment: the setting hf_accel's offloader makes at run time (memory.offload)


def child(device: str, gib: float, tensors: int, overlap: bool, runtime: bool = False) -> dict:
    """One way's figures, in this process (its allocator settings come from the environment, or with `runtime` from
    hf_accel's offloader, which sets them after torch has started)."""
    import torch

    from hf_accel.memory.offload import pinned_pieces, register_pinned_host_memory

    cuda = device == "cuda"
    pin = cuda
    nbytes = int(gib * 2**30)
    sizes = [n for _ in range(tensors) for n in pinned_pieces(nbytes)]
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    if cuda:
        torch.empty(1, device="cuda")
        torch.empty(1, pin_memory=True)  # the allocator's own set-up, outside the timing
    set_at_runtime = register_pinned_host_memory() if runtime else None
    start = time.perf_counter()
    pieces = [torch.empty(n, dtype=torch.uint8, pin_memory=pin) for n in sizes]
    alloc_s = time.perf_counter() - start
    source = torch.empty(nbytes, dtype=torch.uint8, device=device)
    sync()
    start = time.perf_counter()
    for piece, part in zip(pieces[:len(sizes) // tensors], source.split(sizes[:len(sizes) // tensors])):
        piece.copy_(part, non_blocking=cuda)
    sync()
    copy_s = time.perf_counter() - start
    out = {"allocator_conf": set_at_runtime or os.environ.get("PYTORCH_CUDA_ALLOC_CONF", ""),
           "bytes": sum(p.numel() for p in pieces), "pieces": len(pieces), "alloc_s": alloc_s,
           "alloc_gb_s": sum(sizes) / alloc_s / 1e9,
           "copy_gb_s": nbytes / copy_s / 1e9, "pinned": bool(pieces[0].is_pinned()) if cuda else False}
    if overlap:
        out.update(_overlap(torch, device, sizes, pin, sync))
    return out


def _overlap(torch, device: str, sizes: list[int], pin: bool, sync) -> dict:
    """Matmul time alone, then while a thread allocates ``sizes`` more: the slowdown and the thread's GB/s."""
    n = 4096 if device == "cuda" else 128  # (the CPU smoke run only checks the harness)
    a = torch.randn(n, n, device=device, dtype=torch.bfloat16 if device == "cuda" else torch.float32)

    def matmuls(n: int = 50) -> float:
        sync()
        start = time.perf_counter()
        for _ in range(n):
            a @ a
        sync()
        return time.perf_counter() - start

    matmuls(5)
    alone = matmuls()
    held, took = [], {}

    def reserve() -> None:
        start = time.perf_counter()
        held.extend(torch.empty(n, dtype=torch.uint8, pin_memory=pin) for n in sizes)
        took["s"] = time.perf_counter() - start

    thread = threading.Thread(target=reserve)
    thread.start()
    during, runs = 0.0, 0
    while runs == 0 or thread.is_alive():  # (at least one run: a small allocation may end before the first)
        during += matmuls()
        runs += 1
    thread.join()
    return {"matmul_s_alone": alone, "matmul_s_during": during / max(runs, 1), "matmul_runs_during": runs,
            "background_alloc_gb_s": sum(sizes) / took["s"] / 1e9}


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    parser.add_argument("--gib", type=float, default=LAYER_GIB, help="bytes of one layer input, in GiB")
    parser.add_argument("--tensors", type=int, default=8, help="layer inputs to allocate")
    parser.add_argument("--ways", default=",".join(WAYS), help=f"comma-separated, of {', '.join(WAYS)}")
    parser.add_argument("--overlap", action="store_true", help="also allocate on a thread beside matmuls")
    parser.add_argument("--out", default=None, help="JSON file for the results")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--runtime", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        print(json.dumps(child(args.device, args.gib, args.tensors, args.overlap, args.runtime)))
        return {}
    results = {"command": "python scripts/bench_pinned.py " + " ".join(argv if argv is not None else sys.argv[1:]),
               "date": time.strftime("%Y-%m-%dT%H:%M:%S"), "ways": {}}
    from hf_accel.memory.offload import ALLOCATOR_ENV  # (no allocator setting of this shell reaches a child)

    for way in args.ways.split(","):
        if way not in WAYS:
            parser.error(f"--ways: unknown way {way!r}; choose from {', '.join(WAYS)}")
        env = {k: v for k, v in os.environ.items() if k not in ALLOCATOR_ENV}
        if WAYS[way] is not None:
            env["PYTORCH_CUDA_ALLOC_CONF"] = WAYS[way]
        cmd = [sys.executable, __file__, "--child", "--device", args.device, "--gib", str(args.gib),
               "--tensors", str(args.tensors)] + (["--overlap"] if args.overlap else []) + (
                   ["--runtime"] if WAYS[way] is None else [])
        done = subprocess.run(cmd, env=env, capture_output=True, text=True)
        if done.returncode != 0:
            results["ways"][way] = {"error": done.stderr.strip().splitlines()[-1:]}
        else:
            results["ways"][way] = json.loads(done.stdout.strip().splitlines()[-1])
        print(way, json.dumps(results["ways"][way]), flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=1))
    return results


if __name__ == "__main__":
    main()
