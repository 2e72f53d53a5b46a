"""Benchmark harness: workload data, token-budget steps, the FLOP formula (hand count and torch's FLOP counter),
the results table, and scripts/bench.py --device cpu --tiny as a subprocess."""
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode
from transformers import LlamaConfig, LlamaForCausalLM

from hf_accel.bench.flops import FlopModel, doc_lengths_from_batch, peak_flops
from hf_accel.bench.report import add_ratios, markdown_table
from hf_accel.bench.workloads import (DataSpec, _local_sft_lengths, greedy_steps, make_data, micro_batches,
                                      sft_lengths)

REPO = Path(__file__).resolve().parents[1]
MEDIAN_RTOL = 0.05  # sample median of 20k log-normal draws (sigma 1): std error ~1% of the median


@pytest.mark.parametrize("generate", [lambda n, s: sft_lengths(n, s), lambda n, s: _local_sft_lengths(
    n, s.seed, s.median, s.max_len, s.min_len, s.sigma)], ids=["used", "local"])
def test_lengths_median_clipping_determinism(generate):
    spec = DataSpec()
    lengths = generate(20_000, spec)
    assert abs(statistics.median(lengths) - 350) <= MEDIAN_RTOL * 350
    assert min(lengths) == 16 and max(lengths) == 4096  # the tails are clipped, and reach the clip
    assert generate(20_000, spec) == lengths
    assert generate(20_000, DataSpec(seed=1)) != lengths


def test_greedy_steps_respect_budget_and_keep_order():
    lengths = [5, 9, 3, 12, 1, 1, 20, 7]
    steps = greedy_steps(lengths, 12)
    assert [i for step in steps for i in step] == list(range(len(lengths)))
    for step in steps:
        assert sum(lengths[i] for i in step) <= 12 or len(step) == 1  # an oversized sample is its own step
    assert steps[-2] == [6]  # 20 > 12: alone
    assert micro_batches(list(range(10)), 4) == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9]]


def test_make_data_enough_tokens_and_deterministic():
    spec = DataSpec.tiny()
    data = make_data(spec, vocab_size=100, steps=20)
    assert len(data.samples) >= spec.min_samples
    assert [len(s) for s in data.samples] == data.lengths
    assert sum(data.lengths) >= 20 * spec.tokens_per_step
    assert all(1 <= t < 100 for s in data.samples for t in s)  # 0 stays free for padding
    assert make_data(spec, 100, 20).samples == data.samples
    assert DataSpec().num_samples(1) >= 512


def _tiny_llama(tie: bool = False) -> LlamaForCausalLM:
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=tie)
    return LlamaForCausalLM(cfg)


def test_flop_formula_matches_hand_count():
    h, i, v, layers, kv_width = 64, 128, 128, 2, 2 * 16
    per_layer = h * h + 2 * h * kv_width + h * h + 3 * h * i  # q, k+v (GQA), o, gate/up/down
    fm = FlopModel.from_model(_tiny_llama())
    assert fm == FlopModel(layers * per_layer + v * h, 0, layers, 64)
    docs = [10, 3]
    want = 6 * (layers * per_layer + v * h) * 13 + 6 * layers * 64 * (10**2 + 3**2)
    assert fm.step_flops(docs) == want
    # LoRA r=4 on q_proj: the base weights cost 4 FLOPs/token (no weight gradient), adapters 6
    peft = pytest.importorskip("peft")
    model = peft.get_peft_model(_tiny_llama(), peft.LoraConfig(r=4, target_modules=["q_proj"]))
    lora = layers * (4 * h + h * 4)
    assert FlopModel.from_model(model) == FlopModel(lora, layers * per_layer + v * h, layers, 64)


def test_flop_formula_matches_torch_flop_counter():
    """Live reference: torch counts eager attention over the full S x S square (masked half included)."""
    model = _tiny_llama(tie=True)
    model.set_attn_implementation("eager")
    seq = 24
    ids = torch.randint(0, 128, (1, seq))
    with FlopCounterMode(display=False) as counter:
        model(input_ids=ids, labels=ids, use_cache=False).loss.backward()
    fm = FlopModel.from_model(model)
    masked_half = 6 * fm.num_layers * fm.attn_width * seq**2
    # rotary's inv_freq @ positions matmul (a few hundred FLOPs) is the only other counted op
    assert counter.get_total_flops() == pytest.approx(fm.step_flops([seq]) + masked_half, rel=1e-3)


def test_doc_lengths_from_batches():
    padded = {"input_ids": torch.zeros(2, 5), "attention_mask": torch.tensor([[1, 1, 1, 0, 0], [1] * 5])}
    assert doc_lengths_from_batch(padded) == [3, 5]
    packed = {"input_ids": torch.zeros(1, 6), "position_ids": torch.tensor([[0, 1, 2, 0, 1, 0]])}
    assert doc_lengths_from_batch(packed) == [3, 2, 1]
    assert doc_lengths_from_batch({**packed, "cu_seq_lens_q": torch.tensor([0, 4, 6], dtype=torch.int32)}) == [4, 2]
    assert peak_flops("NVIDIA H200") == 989.4e12 and peak_flops("cpu") is None


def test_ratio_uses_best_same_computation_stock():
    results = [
        {"config": "a", "status": "ok", "tokens_per_s": 100.0},
        {"config": "b", "status": "ok (documents attend ...)", "tokens_per_s": 300.0, "same_computation": False},
        {"config": "mine", "status": "ok", "tokens_per_s": 150.0, "mfu": 0.5},
        {"config": "c", "status": "skipped: needs CUDA"},
    ]
    assert add_ratios(results, ["a", "b", "c"]) == "a"
    assert results[2]["ratio_to_best_stock"] == 1.5 and "ratio_to_best_stock" not in results[3]
    table = markdown_table(results, "a")
    assert "| mine | 150 | 1.50 | 50.0% |" in table and "skipped: needs CUDA |" in table


def _run_bench(tmp_path, *args: str) -> tuple[str, dict]:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
    proc = subprocess.run([sys.executable, str(REPO / "scripts" / "bench.py"), "--device", "cpu", "--tiny",
                           "--out", str(tmp_path), *args], capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    (json_path,) = tmp_path.glob("*.json")
    assert json_path.with_suffix(".md").exists()
    return proc.stdout, json.loads(json_path.read_text())


def test_script_skips_cuda_configs_and_prints_table_last(tmp_path):
    stdout, record = _run_bench(tmp_path, "--configs", "hf-fa4-padded,liger-sdpa-padded")
    lines = [line for line in stdout.strip().splitlines() if line.strip()]
    assert lines[-1].startswith("| liger-sdpa-padded |") and lines[-3].startswith("|---")
    assert [r["status"] for r in record["results"]] == ["skipped: needs CUDA"] * 2
    assert {"torch", "transformers", "trl", "liger-kernel", "flash-attn-4", "gpu"} <= set(record["versions"])
    assert record["command"].startswith("python scripts/bench.py --device cpu --tiny --configs hf-fa4-padded")
    assert "--out" not in record["command"] and record["date"].endswith("+00:00")


@pytest.mark.slow
def test_script_tiny_cpu_runs_configs(tmp_path):
    configs = "hf-sdpa-padded,hf-sdpa-packed,trl-fa4-packed,hf_accel-best"
    stdout, record = _run_bench(tmp_path, "--configs", configs, "--substitute-attn", "sdpa")
    results = {r["config"]: r for r in record["results"]}
    assert stdout.strip().splitlines()[-1].startswith("| hf_accel-best |")
    for name in ("hf-sdpa-padded", "hf-sdpa-packed", "trl-fa4-packed"):
        assert results[name]["status"].startswith("ok"), results[name]
        assert results[name]["tokens_per_s"] > 0 and results[name]["loss_finite"]
    # padded and packed stock runs see the same samples in the same steps from the same init: same training
    assert results["hf-sdpa-padded"]["loss"] == pytest.approx(results["hf-sdpa-packed"]["loss"], rel=1e-4)
    assert results["hf-sdpa-padded"]["real_tokens"] == results["hf-sdpa-packed"]["real_tokens"]
    best = results["hf_accel-best"]["status"]
    assert best.startswith("ok") or "not importable" in best, results["hf_accel-best"]


def test_steady_rate_is_the_median_steps_and_ignores_one_stall():
    from hf_accel.bench.train import Timing, summarize

    model = LlamaForCausalLM(LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                         num_attention_heads=2, num_key_value_heads=1))
    timing = Timing(step_seconds=[1.0, 1.0, 9.0, 0.5], step_docs=[[60, 40], [100], [100], [50]], losses=[1.0] * 4)
    result = summarize(model, timing, None, "cpu")
    assert result["tokens_per_s"] == pytest.approx(350 / 11.5)
    assert result["steady_tokens_per_s"] == pytest.approx(100.0)  # rates 100, 100, 11.1, 100 -> median 100
    stock = {"config": "s", "status": "ok", "tokens_per_s": 50.0, "steady_tokens_per_s": 80.0, "step_seconds": [1.0]}
    mine = {"config": "m", "status": "ok", **result}
    add_ratios([stock, mine], ["s"])
    assert mine["steady_ratio_to_best_stock"] == pytest.approx(1.25)
    assert "| 100 | 1.25 | 9,000 ms | ok |" in markdown_table([stock, mine], "s")


def test_table_compares_losses_at_a_step_every_config_reached():
    """A config stopped early by the step-time budget must not have its loss compared with another's later step."""
    from hf_accel.bench.report import markdown_table

    results = [
        {"config": "a", "status": "ok", "tokens_per_s": 1.0, "losses": [3.0, 2.0, 1.0], "loss": 1.0},
        {"config": "b", "status": "ok", "tokens_per_s": 1.0, "losses": [3.5, 2.5], "loss": 2.5},
        {"config": "c", "status": "failed", "tokens_per_s": None, "losses": [9.0], "loss": 9.0},
    ]
    table = markdown_table(results, None)
    assert "loss at timed step 2" in table
    rows = {line.split("|")[1].strip(): line.split("|")[6].strip() for line in table.splitlines()[4:]}
    assert rows["a"] == "2.0000" and rows["b"] == "2.5000"


@pytest.mark.parametrize("warmup", [0, 2])
def test_run_loop_times_every_timed_step_and_reads_losses_after(warmup):
    """run_loop marks step ends without syncing; what it records lines up: one time, doc list and loss per step,
    and the losses are those of a plain step-by-step loop from the same init."""
    import copy

    from hf_accel.bench.train import RunSettings, Timing, hf_loss, run_loop
    from hf_accel.bench.workloads import WORKLOADS

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                         num_attention_heads=2, num_key_value_heads=1))
    reference = copy.deepcopy(model)
    ids = torch.randint(0, 32, (4, 2, 9))
    batches = [[{"input_ids": ids[i], "labels": ids[i].clone(), "attention_mask": torch.ones_like(ids[i])}]
               for i in range(4)]
    settings = RunSettings(WORKLOADS["llama-1b"], "cpu", True, steps=4 - warmup, warmup=warmup,
                           step_time_budget=1e9)
    timing = Timing()
    run_loop(model, iter(batches), hf_loss, settings, timing)
    assert len(timing.step_seconds) == len(timing.losses) == len(timing.step_docs) == 4 - warmup
    assert all(s > 0 for s in timing.step_seconds)

    opt = torch.optim.AdamW(reference.parameters(), lr=1e-5)
    want = []
    for micro in batches:
        loss = reference(**micro[0]).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        want.append(float(loss.detach()))
    assert timing.losses == pytest.approx(want[warmup:], rel=1e-5)


def test_host_events_name_what_stalled_a_step():
    """A compile in the first timed step and a full garbage collection in another are attributed to those steps,
    and the table's slowest-step cell names what happened in it."""
    import gc

    from hf_accel.bench.report import _slowest
    from hf_accel.bench.train import RunSettings, Timing, hf_loss, run_loop
    from hf_accel.bench.workloads import WORKLOADS

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                         num_attention_heads=2, num_key_value_heads=1))
    compiled_forward = torch.compile(model.forward, backend="eager", dynamic=False)
    calls = []

    def loss_fn(m, batch, step_targets):
        calls.append(1)
        if len(calls) == 3:
            gc.collect()
        return compiled_forward(**batch).loss

    ids = torch.randint(0, 32, (3, 2, 9))
    batches = [[{"input_ids": ids[i], "labels": ids[i].clone()}] for i in range(3)]
    settings = RunSettings(WORKLOADS["llama-1b"], "cpu", True, steps=3, warmup=0, step_time_budget=1e9)
    timing = Timing()
    gc.disable()  # only the collection the test makes: automatic ones would land in arbitrary steps
    try:
        run_loop(model, iter(batches), loss_fn, settings, timing)
    finally:
        gc.enable()
    by_step = {e["step"]: e for e in timing.host_events}
    assert by_step[0]["compiled_graphs"] >= 1  # the first call compiled
    assert by_step[2]["gc_full"] >= 1 and "compiled_graphs" not in by_step[2]
    assert 1 not in by_step  # nothing happened in step 1
    cell = _slowest({"step_seconds": [0.1, 0.2, 0.9], "host_events": timing.host_events})
    assert cell.startswith("900 ms (step 2: +") and "full GCs" in cell


def test_presets_name_real_workloads_and_configs_and_pending_ones_fail_clearly():
    from hf_accel.bench.configs import CONFIGS
    from hf_accel.bench.presets import PRESETS, PresetUnavailable, get_preset
    from hf_accel.bench.workloads import WORKLOADS

    assert {"llama-1b", "neox-1.4b", "falcon-1b", "llama-8b-lora", "long-context", "multi-gpu"} <= set(PRESETS)
    for preset in PRESETS.values():
        if preset.pending:
            with pytest.raises(PresetUnavailable, match=f"not implemented yet: {preset.pending}"):
                get_preset(preset.name)
            continue
        assert preset.workload in WORKLOADS and set(preset.configs) <= set(CONFIGS), preset.name
        # issue 18's comparison: a stock anchor, hf_accel with no flags, hf_accel with the best flags (the
        # long-context sweeps of issue 22 compare the stock stacks with hf_accel's best only; QLoRA's hf_accel row is
        # patch(model) with no flags)
        if "doc_lengths" not in preset.settings:
            assert {"hf_accel-defaults", "hf_accel-best"} <= set(preset.configs) or "hf_accel-qlora" in preset.configs
        assert any(CONFIGS[c].stock for c in preset.configs)


def test_preset_sets_defaults_that_flags_override_and_pending_preset_exits_2():
    sys.path.insert(0, str(REPO / "scripts"))
    try:
        import bench
    finally:
        sys.path.remove(str(REPO / "scripts"))
    args = bench.parse_args(["--preset", "llama-8b-lora", "--steps", "4"])
    assert (args.workload, args.steps, args.warmup, args.best_checkpointing) == ("llama-8b-lora", 4, 3, "budget:0.8")
    assert args.configs == ["trl-fa4-packed", "hf_accel-defaults", "hf_accel-best", "unsloth"]
    with pytest.raises(SystemExit) as exc:
        bench.parse_args(["--preset", "multi-gpu"])
    assert exc.value.code == 2
    assert bench.command(["--preset", "llama-1b", "--out", "/x/y", "--steps", "3"]) == \
        "python scripts/bench.py --preset llama-1b --steps 3"


@pytest.mark.parametrize("name, want", [
    ("hf_accel-defaults", {}),  # no flags at all: whatever patch() chooses by itself
    ("hf_accel", {"backend": "auto", "fused_ce": False, "fused_ops": False, "compile": False}),
])
def test_hf_accel_configs_pass_exactly_their_flags(monkeypatch, name, want):
    import hf_accel
    from hf_accel.bench import configs
    from hf_accel.bench.train import RunSettings, Timing
    from hf_accel.bench.workloads import WORKLOADS

    calls = []
    monkeypatch.setattr(hf_accel, "patch", lambda model, **kwargs: calls.append(kwargs) or "report")
    monkeypatch.setattr(configs, "build_model", lambda settings, attn: torch.nn.Linear(1, 1))
    monkeypatch.setattr(configs, "run_loop", lambda *a, **k: None)
    monkeypatch.setattr(configs, "_hf_accel_steps", lambda data, seed: iter(()))
    settings = RunSettings(WORKLOADS["llama-1b"], "cpu", True, steps=1, warmup=1, step_time_budget=1.0)
    configs.CONFIGS[name].run(settings, None, configs.Options(compile=True, fused_ops="on"), Timing())
    assert calls == [want]


def test_gpu_check_lists_what_did_not_fit_with_the_command_to_run_it(tmp_path):
    env = {**os.environ, "OUT": str(tmp_path), "JOB_SECONDS": "0"}
    bad = subprocess.run(["bash", str(REPO / "scripts" / "gpu_check.sh"), "nope"], capture_output=True, text=True,
                         env=env, timeout=60)
    assert bad.returncode == 2 and "usage" in bad.stderr
    proc = subprocess.run(["bash", str(REPO / "scripts" / "gpu_check.sh"), "tests"], capture_output=True, text=True,
                          env=env, timeout=120)
    assert proc.returncode == 0, proc.stderr
    (summary,) = (tmp_path / "benchmarks" / "results").glob("gpu_check_*/summary.md")
    line = next(ln for ln in summary.read_text().splitlines() if ln.startswith("Not started"))
    files = sorted(str(p.relative_to(REPO)) for p in (REPO / "tests" / "gpu").glob("test_*.py"))
    assert files and line == f"Not started (time): `bash scripts/gpu_check.sh tests {' '.join(files)}`"
