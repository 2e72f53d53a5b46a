"""The long-context preset's plumbing (issue 22) on the CPU: tiny model, tiny lengths, one (config, length) per
process, a config's first OOM recorded as "OOM" and its longer lengths skipped."""
import dataclasses
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from script_modules import script_module

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_long_context_preset_trains_one_document_per_step_in_a_child(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, str(REPO / "scripts" / "bench.py"), "--preset", "long-context", "--device", "cpu",
           "--tiny", "--doc-lengths", "96", "--configs", "hf_accel-best", "--steps", "1", "--warmup", "1",
           "--best-checkpointing", "budget:125GiB", "--out", str(tmp_path)]  # (the preset's: a share of a GPU)
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    record = json.loads(next(tmp_path.glob("llama-8b-lora-long-tiny_*.json")).read_text())
    results = record["results"]
    assert [(r["config"], r["doc_length"]) for r in results] == [("hf_accel-best", 96)]
    for r, n in zip(results, (96,)):
        assert r["status"] == "ok", r.get("log_tail")
        assert r["step_tokens"] == [n] and r["tokens_per_s"] > 0  # one document of that length per step
        assert any("memory budget" in note for note in r["notes"])  # the preset's checkpointing reached the config
        assert r["host_peak_gib"] > 0 and "layer inputs on the device" in r["checkpointing_plan"]["split"]
    assert record["model_config"]["rope_parameters"]["rope_type"] == "llama3"
    assert "| hf_accel-best | 96 |" in proc.stdout


@pytest.mark.slow
def test_hybrid_long_context_preset_trains_one_document_through_both_layer_kinds(tmp_path):
    """Issue 71d's long-document row: the Qwen3.5 preset's tiny run trains one document a step with hf_accel's
    budget plan and through stock's one-row path (transformers refuses TRL's position_ids rows for these layers
    without causal-conv1d), its Gated DeltaNet and attention layers both in the model."""
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, str(REPO / "scripts" / "bench.py"), "--preset", "long-context-qwen3.5", "--device", "cpu",
           "--tiny", "--doc-lengths", "96", "--configs", "hf-sdpa-padded,hf_accel-best", "--steps", "1", "--warmup",
           "1", "--best-checkpointing", "budget:125GiB", "--out", str(tmp_path)]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    record = json.loads(next(tmp_path.glob("qwen3.5-9b-lora-long-tiny_*.json")).read_text())
    results = record["results"]
    assert [(r["config"], r["doc_length"], r["status"]) for r in results] == [
        ("hf-sdpa-padded", 96, "ok"), ("hf_accel-best", 96, "ok")], results
    assert all(r["step_tokens"] == [96] and r["tokens_per_s"] > 0 for r in results)
    assert set(record["model_config"]["layer_types"]) == {"linear_attention", "full_attention"}


@pytest.mark.slow
def test_a_length_the_budget_plan_refuses_names_the_longest_and_stops_the_config(tmp_path):
    """Issue 40: a document no plan fits under --best-checkpointing's budget is refused before its first step with
    the longest length the plan holds (recorded, and in the table), and the config's longer lengths are skipped; the
    child's model has positions for the longest document (tiny config: 2048 by default)."""
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, str(REPO / "scripts" / "bench.py"), "--preset", "long-context", "--device", "cpu",
           "--tiny", "--doc-lengths", "96,2304,4096", "--configs", "hf_accel-best", "--steps", "1", "--warmup", "0",
           "--best-checkpointing", "budget:3MiB+offload", "--out", str(tmp_path)]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    record = json.loads(next(tmp_path.glob("*.json")).read_text())
    ok, refused, skipped = record["results"]
    assert ok["status"] == "ok" and refused["status"].startswith("refused by the budget plan: at most ~")
    plan = ok["checkpointing_plan"]  # what its predicted peak is made of, to set beside the measured one
    assert plan["predicted_terms_gib"]["peak"] == pytest.approx(plan["predicted_peak_gib"])
    assert 0 < plan["predicted_terms_gib"]["retained"] + plan["predicted_terms_gib"]["held"]
    assert 0 < plan["largest_layer_gib"]["full"] < plan["largest_layer_gib"]["none"]
    assert 96 < refused["longest_feasible_tokens"] < 2304 and skipped["status"].startswith("skipped: failed")
    assert record["model_config"]["max_position_embeddings"] == 4096
    assert f"(its budget plan: at most ~{refused['longest_feasible_tokens']:,})" in proc.stdout


# torch's total_memory of an H100 80GB HBM3 (benchmarks/results, runs 31-32) and of an H200 (143,771 MiB)
H100_80GB_BYTES, H200_BYTES = int(79.1787109375 * 2**30), 143771 * 2**20


@pytest.mark.parametrize("preset", ["long-context", "long-context-qlora", "long-context-qwen3.5"])
def test_long_context_presets_run_on_an_80gb_card_and_an_h200(preset):
    """Each long-context preset's cap and budget fit an 80 GB card as well as an H200 (run 32, an H100: the QLoRA
    preset's 80 GiB cap and the 8B LoRA preset's 125 GiB budget were refused before any step); the QLoRA preset's
    cap is that card's own size on either (Unsloth's 342,733 tokens were measured on one), its budget no more."""
    from hf_accel.memory.budget import MemoryBudget
    from hf_accel.memory.spec import parse_bytes, parse_checkpointing

    args = script_module("bench").parse_args(["--preset", preset, "--device", "cpu"])
    budget = parse_checkpointing(args.best_checkpointing).budget  # a size, or a share of the device
    for total in (H100_80GB_BYTES, H200_BYTES):
        cap = total if args.device_memory_cap_gib is None else args.device_memory_cap_gib * 2**30
        assert cap <= total
        planned = MemoryBudget(budget=budget, device_bytes=int(cap)).budget_bytes(torch.device("cpu"))
        assert 0.85 * cap < planned <= cap
    if preset == "long-context-qlora":
        assert H100_80GB_BYTES - 2**25 < args.device_memory_cap_gib * 2**30 <= H100_80GB_BYTES
        assert parse_bytes(budget) == pytest.approx(args.device_memory_cap_gib * 2**30)


def test_device_memory_cap_and_positions_for_long_documents():
    """--device-memory-cap-gib reaches every child and is recorded (applied on CUDA only); a sweep's documents get
    positions enough (Llama-3 rope scaling does not read the field)."""
    from benchlib.workloads import WORKLOADS, build_config, with_positions

    bench = script_module("bench")
    args = bench.parse_args(["--preset", "long-context-qlora", "--device", "cpu"])
    assert "--device-memory-cap-gib" in bench.child_argv(args, "unsloth-qlora", REPO / "x.json")
    assert bench.cap_device_memory(80, "cpu")["device_memory_cap"].startswith("not applied")
    assert bench.cap_device_memory(None, "cuda") == {}
    workload = WORKLOADS["llama-8b-lora-long"]
    assert build_config(with_positions(workload, 524288)).max_position_embeddings == 524288
    assert with_positions(workload, 1024) is workload
    tiny = with_positions(workload, 4096, tiny=True)
    assert build_config(tiny, tiny=True).max_position_embeddings == 4096
    assert build_config(tiny).max_position_embeddings == build_config(workload).max_position_embeddings


def test_first_oom_skips_longer_lengths_and_table_names_longest(monkeypatch, tmp_path):
    """One GPU: every config measures a length before any measures the next (2026-11-30 14:30, the configs one after
    another: TRL and HF sdpa spent the whole time budget and hf_accel measured no length)."""
    bench = script_module("bench")
    statuses = {("a", 32): "ok", ("a", 64): "OOM", ("b", 32): "ok", ("b", 64): "ok", ("b", 128): "error: timeout"}
    ran = []

    def fake_run_one(args, name, timeout, gpu=None):
        ran.append((name, args.doc_length))
        return {"config": name, "doc_length": args.doc_length, "status": statuses[(name, args.doc_length)],
                "tokens_per_s": 10.0, "mfu": None}

    monkeypatch.setattr(bench, "run_one", fake_run_one)
    monkeypatch.setattr(bench, "CONFIGS", {n: dataclasses.replace(bench.CONFIGS["hf_accel-best"], name=n)
                                           for n in ("a", "b")})
    assert bench.main(["--workload", "llama-1b-long", "--configs", "a,b", "--doc-lengths", "128,32,64",
                       "--device", "cpu", "--tiny", "--out", str(tmp_path)]) == 0
    assert ran == [("a", 32), ("b", 32), ("a", 64), ("b", 64), ("b", 128)]
    results = json.loads(next(tmp_path.glob("*.json")).read_text())["results"]
    assert results[2] == {"config": "a", "doc_length": 128, "status": "skipped: OOM at a shorter length"}
    table = next(tmp_path.glob("*.md")).read_text()
    assert "| a | 32 |" in table and "| b | 64 |" in table  # the longest length each config trained


def test_sweep_gpus_runs_configs_side_by_side_in_one_record(monkeypatch, tmp_path):
    """--sweep-gpus 2: two lengths at once on two GPUs, each config's lengths in order, every config advancing one
    length at a time (three configs on two GPUs: 2026-11-30 a config queued behind another lost its longest lengths
    to the time budget), one record in config order."""
    import threading
    import time

    bench = script_module("bench")
    ran, running, most = [], [], [0]
    lock = threading.Lock()

    def fake_run_one(args, name, timeout, gpu=None):
        with lock:
            assert name not in running  # a config's lengths one after another (a shorter OOM skips the longer)
            running.append(name)
            most[0] = max(most[0], len(running))
        time.sleep(0.1)
        with lock:
            running.remove(name)
            ran.append((name, args.doc_length, gpu))
        return {"config": name, "doc_length": args.doc_length, "status": "ok", "tokens_per_s": 10.0, "mfu": None,
                "gpu": gpu}

    monkeypatch.setattr(bench, "run_one", fake_run_one)
    monkeypatch.setattr(bench, "CONFIGS", {n: dataclasses.replace(bench.CONFIGS["hf_accel-best"], name=n)
                                           for n in ("a", "b", "c")})
    assert bench.main(["--workload", "llama-1b-long", "--configs", "a,b,c", "--doc-lengths", "64,32,128",
                       "--sweep-gpus", "2", "--device", "cpu", "--tiny", "--out", str(tmp_path)]) == 0
    assert most[0] == 2 and {g for _, _, g in ran} == {0, 1}  # side by side
    for name in "abc":
        assert [l for n, l, _ in ran if n == name] == [32, 64, 128]  # each config's lengths in order
    # fair progress: no config starts its third length before every config has finished its first
    first_done = max(ran.index((n, 32, g)) for n, l, g in ran if l == 32)
    assert all(ran.index(r) > first_done for r in ran if r[1] == 128)
    records = list(tmp_path.glob("*.json"))
    assert len(records) == 1
    results = json.loads(records[0].read_text())["results"]
    assert [(r["config"], r["doc_length"]) for r in results] == [(n, l) for n in "abc" for l in (32, 64, 128)]
    with pytest.raises(SystemExit):  # only with a long-context sweep
        bench.parse_args(["--workload", "llama-1b-long", "--sweep-gpus", "0", "--doc-lengths", "32"])
    with pytest.raises(SystemExit):
        bench.parse_args(["--workload", "llama-1b", "--sweep-gpus", "2"])


def test_run_one_pins_its_child_to_one_gpu(monkeypatch):
    bench = script_module("bench")
    seen = {}

    def fake_run_group(argv, env, timeout):
        seen["env"] = env
        raise subprocess.TimeoutExpired(argv, timeout)

    monkeypatch.setattr(bench, "run_group", fake_run_group)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3,5")
    args = bench.parse_args(["--workload", "llama-1b-long", "--configs", "hf_accel-best", "--doc-lengths", "32",
                             "--device", "cpu", "--tiny"])
    args.doc_length = 32
    result = bench.run_one(args, "hf_accel-best", args.config_timeout, gpu=1)
    assert seen["env"]["CUDA_VISIBLE_DEVICES"] == "5"  # the machine's second visible GPU
    assert result["gpu"] == 1 and result["doc_length"] == 32 and result["status"].startswith("error: timeout")


def test_a_timeout_the_time_budget_shortened_is_no_failure(monkeypatch):
    """A configuration started with less of the run's time budget left than it may take, and cut when that ran out,
    did not fail at that length: it is recorded as skipped for time (2026-11-30 16:10, Unsloth at 128k was cut after
    the budget's last 123 s; the table showed "error: timeout" there and 256k as skipped after a failure, as if
    Unsloth could not train 128k)."""
    bench = script_module("bench")

    def slow(argv, env, timeout):
        raise subprocess.TimeoutExpired(argv, timeout)

    monkeypatch.setattr(bench, "run_group", slow)
    args = bench.parse_args(["--workload", "llama-1b-long", "--configs", "hf_accel-best", "--doc-lengths", "32",
                             "--device", "cpu", "--tiny", "--config-timeout", "400"])
    args.doc_length = 32
    cut = bench.run_one(args, "hf_accel-best", 123.0)
    assert cut["status"] == "skipped: time budget exhausted after 123s"
    assert bench.run_one(args, "hf_accel-best", 400.0)["status"] == "error: timeout after 400s"


def test_a_timed_out_configuration_keeps_what_its_child_printed(monkeypatch, capsys):
    """A configuration killed at its timeout keeps the tail of both its streams: the budget plan's split (stdout) and
    the child's progress lines (stderr: how far it got). Run 30's 344k QLoRA step timed out with only the weight
    loading bar in its record, so nothing said whether the plan or the step had used the time."""
    bench = script_module("bench")
    from benchlib.train import progress

    child = ("import sys, time; print('checkpointing plan: 20 layer inputs in host memory', flush=True); "
             "print('[bench child +95s] model ready', file=sys.stderr, flush=True); time.sleep(60)")
    monkeypatch.setattr(bench, "child_argv", lambda *a, **k: [sys.executable, "-c", child])
    args = bench.parse_args(["--workload", "llama-1b-long", "--configs", "hf_accel-best", "--doc-lengths", "32",
                             "--device", "cpu", "--tiny", "--config-timeout", "3"])
    args.doc_length = 32
    result = bench.run_one(args, "hf_accel-best", 3.0)
    assert result["status"] == "error: timeout after 3s"
    assert "20 layer inputs in host memory" in result["log_tail"] and "model ready" in result["log_tail"]
    progress("step 1 of 1 queued")  # the child's own lines: seconds since it started, on stderr
    assert re.fullmatch(r"\[bench child \+\d+s\] step 1 of 1 queued\n", capsys.readouterr().err)


@pytest.mark.parametrize("mode", ["long-context", "long-context-2-gpus", "workload"])
def test_sigterm_stops_the_run_kills_the_child_and_writes_the_record(monkeypatch, tmp_path, mode):
    """An outer `timeout` (SIGTERM) while a configuration runs: its child's process group is killed (it runs in its
    own session, out of reach of a signal to bench.py's group), every result so far and the rest as skipped are
    written, and bench.py exits 143 (2026-11-30 16:30: a device call's outer timeout ended bench.py mid-run; no record
    was written and the child was left training)."""
    import signal
    import threading
    import time

    from benchlib.distributed import CHILDREN

    bench = script_module("bench")
    monkeypatch.setattr(bench, "CONFIGS", {n: dataclasses.replace(bench.CONFIGS["hf_accel-best"], name=n)
                                           for n in ("a", "b")})
    monkeypatch.setattr(bench, "child_argv", lambda *a, **k: [sys.executable, "-c", "import time; time.sleep(120)"])
    seen = {}

    def send_sigterm_once_the_child_runs():
        deadline, running = time.monotonic() + 60, 2 if mode == "long-context-2-gpus" else 1
        while len(CHILDREN._running) < running and time.monotonic() < deadline:
            time.sleep(0.05)
        seen["pids"] = [proc.pid for proc in CHILDREN._running]
        time.sleep(0.3)
        os.kill(os.getpid(), signal.SIGTERM)

    sender = threading.Thread(target=send_sigterm_once_the_child_runs)
    sender.start()
    workload = {"long-context": ["--workload", "llama-1b-long", "--doc-lengths", "32,64"],
                "long-context-2-gpus": ["--workload", "llama-1b-long", "--doc-lengths", "32,64", "--sweep-gpus", "2"],
                "workload": ["--workload", "llama-1b"]}[mode]
    before = signal.getsignal(signal.SIGTERM)
    started = time.monotonic()
    code = bench.main([*workload, "--configs", "a,b", "--device", "cpu", "--tiny", "--config-timeout", "100",
                       "--time-budget", "200", "--out", str(tmp_path)])
    sender.join()
    assert code == 128 + signal.SIGTERM.value and time.monotonic() - started < 60
    assert len(seen["pids"]) == (2 if mode == "long-context-2-gpus" else 1)
    for pid in seen["pids"]:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)  # the child is gone (and reaped)
    record = json.loads(next(tmp_path.glob("*.json")).read_text())
    assert record["stopped_by"] == "SIGTERM"
    statuses = [r["status"] for r in record["results"]]
    stopped = [s for s in statuses if s.startswith("skipped: the run was stopped (SIGTERM) after")]
    assert len(stopped) == len(seen["pids"])  # the configurations that were running
    assert len(statuses) == (4 if mode.startswith("long") else 2)  # every (config, length) has its row
    assert all(s == "skipped: the run was stopped (SIGTERM)" for s in statuses if s not in stopped)
    assert signal.getsignal(signal.SIGTERM) is before and CHILDREN._running == set()  # handlers restored
    # the stop ends with its run: a later run in this process (a test calling run_one after this one in the same
    # worker) starts its children, not "skipped: the run was stopped"
    assert CHILDREN.stopped_by is None


def test_child_records_cuda_oom_as_oom(monkeypatch, tmp_path):
    bench = script_module("bench")

    def out_of_memory(*args, **kwargs):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")

    config = dataclasses.replace(bench.CONFIGS["hf_accel-best"], run=out_of_memory)
    monkeypatch.setitem(bench.CONFIGS, "hf_accel-best", config)
    out = tmp_path / "result.json"
    bench.main(["--workload", "llama-1b-long", "--configs", "hf_accel-best", "--doc-length", "64", "--device", "cpu",
                "--tiny", "--child", str(out)])
    assert json.loads(out.read_text())["status"] == "OOM"


def test_sweep_gpus_raises_what_a_worker_raised(monkeypatch, tmp_path):
    """An error inside a GPU worker (not a failed child: a bug in bench.py itself) stops the run loudly, as the serial
    sweep would, instead of writing a record with that config's lengths missing."""
    bench = script_module("bench")

    def broken_run_one(args, name, timeout, gpu=None):
        raise RuntimeError(f"bench bug in {name}")

    monkeypatch.setattr(bench, "run_one", broken_run_one)
    monkeypatch.setattr(bench, "CONFIGS", {n: dataclasses.replace(bench.CONFIGS["hf_accel-best"], name=n)
                                           for n in ("a", "b")})
    with pytest.raises(RuntimeError, match="bench bug"):
        bench.main(["--workload", "llama-1b-long", "--configs", "a,b", "--doc-lengths", "32,64", "--sweep-gpus", "2",
                    "--device", "cpu", "--tiny", "--out", str(tmp_path)])
    assert not list(tmp_path.glob("*.json"))


def test_a_child_the_kernel_kills_is_recorded_with_its_host_memory(monkeypatch):
    """A child killed with SIGKILL (the kernel's OOM killer: no Python error, no record of its own; Unsloth at 344k
    tokens in run 31) is recorded as killed, with the host memory its processes held at the last look and the least
    the machine had left; a child that ends normally gets the same figures beside its own record."""
    bench = script_module("bench")
    hold = "import os, time; x = bytearray(300 << 20); x[::4096] = b'1' * len(x[::4096]); time.sleep(3)"
    for tail, killed in (("; os.kill(os.getpid(), 9)", True), ("", False)):
        monkeypatch.setattr(bench, "child_argv", lambda args, name, out, nproc, tail=tail: [
            sys.executable, "-c", hold + tail])
        args = bench.parse_args(["--workload", "llama-1b-long", "--configs", "hf_accel-best", "--doc-lengths", "32",
                                 "--device", "cpu", "--tiny"])
        args.doc_length = 32
        result = bench.run_one(args, "hf_accel-best", 60.0)
        assert result["host_rss_peak_gib"] >= 0.25 and result["host_available_min_gib"] > 0, result
        if killed:
            assert result["status"].startswith("error: killed (SIGKILL"), result["status"]
            assert "GiB resident" in result["status"] and "GiB of the host left" in result["status"]
        else:
            assert result["status"] == "error: process exited with code 0 (crash or OOM kill)"  # (no record written)
    # and one cut at its timeout (run 30's 344k step: host memory climbed to 99 GiB before the cut)
    monkeypatch.setattr(bench, "child_argv", lambda args, name, out, nproc: [
        sys.executable, "-c", hold.replace("sleep(3)", "sleep(60)")])
    result = bench.run_one(args, "hf_accel-best", 5.0)
    assert result["status"] == "skipped: time budget exhausted after 5s" and result["host_rss_peak_gib"] >= 0.25, result
