"""The end-of-run throughput summary: the whole run and its steady part (after the first logging interval), on a
controlled clock. The multi-rank sums are checked by the 2-process runs in tests/test_distributed.py."""
import pytest
import torch

import tiny_models
from hf_accel.data.collators import DataCollatorForPacking
from hf_accel.training.metrics import ThroughputMeter, batch_counts, format_summary


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def packed(tokens: int) -> dict:
    return {"input_ids": torch.zeros(1, tokens, dtype=torch.long), "position_ids": torch.arange(tokens)[None]}


def test_summary_gives_steady_tokens_per_s_next_to_the_whole_run():
    clock = Clock()
    meter = ThroughputMeter(tiny_models.make("llama-gqa"), torch.device("cpu"), clock=clock)
    meter.add_batch(packed(100))
    clock.now += 10.0  # first interval: warm-up (CUDA start, JIT, torch.compile), slow
    first = meter.pop()
    assert first["tokens_per_s"] == 10.0
    for _ in range(3):
        meter.add_batch(packed(100))
        clock.now += 1.0
        meter.pop()
    clock.now += 1.0  # the end: no more batches
    summary = meter.summary()
    assert summary["tokens"] == 400 and summary["seconds"] == 14.0
    assert summary["tokens_per_s"] == 400 / 14.0
    assert summary["steady_tokens_per_s"] == 300 / 4.0 and summary["steady_seconds"] == 4.0
    table = format_summary(summary)
    assert "tokens/s, whole run" in table and "tokens/s, steady" in table and "75 (last 4.0 s" in table


def test_sharded_positions_count_the_whole_documents_attention():
    """Under sequence parallelism each rank meters only its slice of the packed row (DeepSpeed's Ulysses loader
    adapter hands rank r the r-th contiguous 1/N of every (batch, seq) tensor, position_ids as they are), with
    documents cut at the slice edges. The ranks' counts must still add up to the whole row's: its tokens, and its
    attention as the unsharded row's cu_seq_lens give it."""
    lengths = [300, 500, 224]  # a 1,024-token row; both 2-way and 4-way cuts go through documents
    positions = torch.cat([torch.arange(n) for n in lengths])[None]
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    whole = {"input_ids": torch.zeros(1, 1024, dtype=torch.long), "position_ids": positions,
             "cu_seq_lens_q": cu}
    tokens, slots, squared = batch_counts(whole)
    assert float(squared) == sum(n * n for n in lengths)
    model = tiny_models.make("llama-gqa")
    reference = ThroughputMeter(model, torch.device("cpu"))
    reference.add_batch(whole)
    for ranks in (2, 4):
        shards = [{k: v[:, i * 1024 // ranks:(i + 1) * 1024 // ranks] for k, v in whole.items() if k != "cu_seq_lens_q"}
                  for i in range(ranks)]
        counts = [batch_counts(shard) for shard in shards]
        assert sum(float(c[0]) for c in counts) == float(tokens)
        assert sum(float(c[2]) for c in counts) == float(squared)
        meters = [ThroughputMeter(model, torch.device("cpu")) for _ in shards]
        for meter, shard in zip(meters, shards):
            meter.add_batch(shard)
        torch.testing.assert_close(sum(float(m.total.flops) for m in meters), float(reference.total.flops), rtol=1e-12,
                                   atol=0)
    # the sequence-parallel collator's rows, padded to the token budget: the padding tail counts neither as tokens
    # nor as attention, on any shard
    collator = DataCollatorForPacking(pad_token_id=0)
    collator.sequence_parallel(2, row_length=1024)
    docs = [300, 500, 200]
    row = collator([{"input_ids": [5] * n, "labels": [5] * n} for n in docs])
    assert row["input_ids"].shape == (1, 1024)
    shards = [{k: v[:, i * 512:(i + 1) * 512] for k, v in row.items()} for i in range(2)]
    counts = [batch_counts(shard) for shard in shards]
    assert sum(float(c[0]) for c in counts) == sum(docs) and sum(c[1] for c in counts) == 1024
    assert sum(float(c[2]) for c in counts) == sum(n * n for n in docs)


def test_no_steady_figure_from_a_single_interval():
    clock = Clock()
    meter = ThroughputMeter(tiny_models.make("llama-gqa"), torch.device("cpu"), clock=clock)
    meter.add_batch(packed(50))
    clock.now += 5.0
    summary = meter.summary()  # the run ended before any log: no steady part to report
    assert summary["tokens_per_s"] == 10.0 and "steady_tokens_per_s" not in summary
    assert "n/a (one logging interval)" in format_summary(summary)


def test_summary_sets_a_memory_budgets_plan_against_the_measured_peak():
    """With a `budget:` checkpointing policy the end summary gives the budget, the plan's predicted peak and the
    measured one, and says so when the run went over."""
    from hf_accel.memory.budget import MemoryBudget, plan_vs_peak
    from hf_accel.memory.checkpointing import FullCheckpointing

    model = tiny_models.make("llama-gqa").train()
    policy = MemoryBudget(budget="1GiB", batch_tokens=32, verbose=False)
    assert plan_vs_peak(policy, 0.5) == {}  # not applied yet: no plan
    policy.apply(model)
    row = plan_vs_peak(policy, 0.5)
    assert row["budget_gib"] == 1.0 and row["peak_mem_gib"] == 0.5
    assert 0 < row["budget_predicted_gib"] <= 1.0
    assert plan_vs_peak(policy, None) == {} and plan_vs_peak(FullCheckpointing(), 0.5) == {}
    base = {"tokens": 1, "seconds": 1.0, "tokens_per_s": 1.0, "padding_fraction": 0.0, "data_wait_fraction": 0.0}
    table = format_summary({**base, **row})
    line = next(x for x in table.splitlines() if x.strip().startswith("memory budget"))
    assert line.endswith(f"1.00 GiB: plan predicted {row['budget_predicted_gib']:.2f} GiB, measured 0.50 GiB")
    assert "OVER the budget" in format_summary({**base, **row, "peak_mem_gib": 1.2})


class _ReportedPeak(ThroughputMeter):
    """A meter whose GPU peak reading (``torch.cuda.max_memory_allocated``, which a CPU cannot give) is a set value."""

    def __init__(self, peak_bytes: int, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.peak_bytes = peak_bytes

    def _local_peak_bytes(self) -> int:
        return self.peak_bytes


def _two_rank_summaries(rank: int, world: int, init_file: str, out: str) -> None:
    torch.distributed.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        meter = _ReportedPeak((1 + 2 * rank) * 2**30, tiny_models.make("llama-gqa"), torch.device("cpu"))
        meter.add_batch(packed(10 * (rank + 1)))
        logged = meter.pop()
        meter.add_batch(packed(10))
        summary = meter.summary()
        torch.save({"logged": logged, "summary": summary, "table": format_summary(summary)}, f"{out}.{rank}")
    finally:
        torch.distributed.destroy_process_group()


@pytest.mark.slow  # inductor / dynamo compiles or a multi-process launch: minutes on 2 cores
def test_peak_memory_is_the_largest_ranks(tmp_path):
    """A 2-GPU run's summary and logs report the largest rank's peak memory (rank 1's 3 GiB here, rank 0 saw 1),
    on every rank, and say over how many ranks; the tokens are the sum."""
    import torch.multiprocessing as mp

    out = str(tmp_path / "summary")
    mp.spawn(_two_rank_summaries, args=(2, str(tmp_path / "init"), out), nprocs=2, join=True)
    for rank in (0, 1):
        got = torch.load(f"{out}.{rank}")
        assert got["logged"]["peak_mem_gib"] == 3.0 and got["summary"]["peak_mem_gib"] == 3.0
        assert got["logged"]["tokens"] == 30 and got["summary"]["tokens"] == 50
        assert "3.00 GiB (the largest of 2 ranks)" in got["table"]
    single = _ReportedPeak(2**30, tiny_models.make("llama-gqa"), torch.device("cpu"))
    single.add_batch(packed(10))
    assert format_summary(single.summary()).splitlines()[-1].split() == ["peak", "GPU", "memory", "1.00", "GiB"]


def _pairs(n: int, window: int | None = None, chunk: int | None = None) -> int:
    """The (query, key) pairs a causal document of n tokens attends, counted from the mask itself."""
    q, k = torch.arange(n)[:, None], torch.arange(n)[None]
    seen = k <= q
    if window:
        seen &= q - k < window
    if chunk:
        seen &= q // chunk == k // chunk
    return int(seen.sum())


@pytest.mark.parametrize("window, chunk", [(None, None), (1, None), (3, None), (8, None), (None, 4), (None, 1)])
def test_attended_counts_the_pairs_a_window_or_chunk_lets_through(window, chunk):
    from hf_accel.training.flops import attended, attended_at

    for n in range(1, 30):
        assert attended(n, window, chunk) == 2 * _pairs(n, window, chunk) - n, n
        assert float(attended_at(torch.arange(n, dtype=torch.float64), window, chunk).sum()) == attended(n, window,
                                                                                                       chunk)
        assert float(attended(torch.tensor([float(n)]), window, chunk)[0]) == attended(n, window, chunk)


@pytest.mark.parametrize("name", ["mistral-window", "gemma3-text", "llama4-text", "qwen3.5-text"])
def test_local_and_linear_layers_count_what_they_attend_however_the_batch_comes(name):
    """A sliding-window layer is charged the pairs its window lets through, a chunked one those within its chunks, a
    linear-attention layer none (the attention layers are the config's full- and sliding-attention ones); the meter
    gives the same step FLOPs for the same documents packed by position_ids, by cu_seq_lens, or padded one per
    row."""
    from hf_accel.training.flops import FlopModel, attended

    model = tiny_models.make(name)
    config = model.config
    flops = FlopModel.from_model(model)
    kinds = getattr(config, "layer_types", None) or ["full_attention"] * config.num_hidden_layers
    assert flops.num_layers + len(flops.local_layers) == sum(k != "linear_attention" for k in kinds)
    assert bool(flops.local_layers) == (name != "qwen3.5-text")
    lengths = [13, 2, 9]  # 13 tokens: past every window and chunk of these configs
    want = flops.step_flops(lengths)
    dense = FlopModel(flops.trainable_matmul_params, flops.frozen_matmul_params, 0, 0.0, flops.head_trainable_params,
                      flops.head_frozen_params).step_flops(lengths)
    attention = 6 * flops.num_layers * flops.attn_width * sum(n * n for n in lengths) + sum(
        6 * w * sum(attended(n, window, chunk) for n in lengths) for w, window, chunk in flops.local_layers)
    assert want == pytest.approx(dense + attention, rel=1e-12)
    widths = [flops.attn_width] * flops.num_layers + [w for w, _, _ in flops.local_layers]
    every = FlopModel(flops.trainable_matmul_params, flops.frozen_matmul_params, config.num_hidden_layers,
                      sum(widths) / len(widths), flops.head_trainable_params, flops.head_frozen_params)
    assert want < every.step_flops(lengths)  # every decoder layer charged full attention: the formula before
    positions = torch.cat([torch.arange(n) for n in lengths])[None]
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    mask = torch.tensor([[1] * n + [0] * (13 - n) for n in lengths])
    for batch in ({"input_ids": torch.zeros(1, 24, dtype=torch.long), "position_ids": positions},
                  {"input_ids": torch.zeros(1, 24, dtype=torch.long), "cu_seq_lens_q": cu},
                  {"input_ids": torch.zeros(3, 13, dtype=torch.long), "attention_mask": mask}):
        meter = ThroughputMeter(model, torch.device("cpu"))
        meter.add_batch(batch)
        assert float(meter.total.flops) == pytest.approx(want, rel=1e-12), sorted(batch)
