"""scripts/bench_pinned.py (issue 40: how fast the machine page-locks offloaded layer inputs) on CPU: each way runs in
its own process under its allocator setting and allocates exactly the offloader's pieces of the layer inputs asked
for (the H200 figures come from the same script without --device cpu)."""
from __future__ import annotations

import json

import pytest

from hf_accel.memory.offload import pinned_pieces
from script_modules import script_module


def test_each_way_allocates_the_offloader_s_pieces_under_its_own_setting(tmp_path):
    bench = script_module("bench_pinned")
    out = tmp_path / "pinned.json"
    results = bench.main(["--device", "cpu", "--gib", "0.003", "--tensors", "3", "--overlap", "--out", str(out)])
    assert json.loads(out.read_text()) == results and set(results["ways"]) == set(bench.WAYS)
    nbytes = int(0.003 * 2**30)
    for way, figures in results["ways"].items():
        # the child process saw its own setting; way hf_accel: none given, the offloader's made at run time
        want = bench.WAYS[way] if bench.WAYS[way] is not None else "pinned_use_cuda_host_register:True"
        assert figures["allocator_conf"].startswith(want), (way, figures["allocator_conf"])
        assert figures["bytes"] == 3 * nbytes and figures["pieces"] == 3 * len(pinned_pieces(nbytes))
        assert figures["alloc_gb_s"] > 0 and figures["copy_gb_s"] > 0 and figures["matmul_runs_during"] >= 1
    with pytest.raises(SystemExit):
        bench.main(["--device", "cpu", "--ways", "cudaMallocHost"])
