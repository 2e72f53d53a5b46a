"""Ulysses sequence parallelism (accelerate ``ParallelismConfig(sp_backend="deepspeed", sp_size=2)``, DeepSpeed's
all-to-all attention wrapper) around hf_accel's own attention, on 2 CPU processes (gloo, ZeRO-3): every step's loss
equals one process's on the same packed rows, with the fused loss on and off (issue 19f's first step; the GPU run is
in docs/MULTI_GPU.md). Plus the collator's sequence-parallel rows and the Trainer's refusals."""
from __future__ import annotations

import json
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from hf_accel.data.collators import REAL_TOKENS_KEY, DataCollatorForPacking
from hf_accel.errors import ConfigurationError, InvalidBatch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from multi_gpu_runs import (assert_resumed_like_uninterrupted, launch_killed_in_save, launch_or_fail,  # noqa: E402
                            zero3_cpu_launch)

ROOT = Path(__file__).resolve().parent.parent
RUN_TIMEOUT_S = 150  # ~15 s on 2 cores; longer means a rank waits in a collective
# fp32: the ranks compute the same sums in another order (attention over all-to-all'd heads, the loss as a
# token-weighted mean of the two shards' means); measured: equal to ~1e-7
RTOL = 1e-5


def _losses(out: Path, rank: int = 0) -> dict:
    return json.loads((out / f"losses.rank{rank}.json").read_text())


CASES = {
    "plain": [],
    "fused-ce": ["--fused-ce"],
    # the long-document setting: LoRA (frozen base weights, which ZeRO-3 re-partitions around a checkpoint's
    # recompute) with offloaded, non-reentrant checkpointing, whose recompute re-runs the all-to-alls
    "lora-offload": ["--fused-ce", "--lora", "--checkpointing", "offload"],
}


@pytest.mark.slow
@pytest.mark.parametrize("case", list(CASES))
def test_two_sequence_parallel_ranks_train_like_one_process(deepspeed_cpu, tmp_path, case):
    """Each 60-token row is cut into two 30-token shards through the middle of a document, so a rank attending only
    within its shard, metadata built from a shard's positions, or labels shifted twice (the fused loss before it took
    ``shift_labels``) each change the losses."""
    flags = CASES[case]
    one = tmp_path / "one"
    launch_or_fail([sys.executable, str(ROOT / "tests" / "dist_sp.py"), "--out", str(one), *flags], tmp_path,
                   RUN_TIMEOUT_S, env={"OMP_NUM_THREADS": "1"})
    two = tmp_path / "two"
    launch_or_fail(zero3_cpu_launch(ROOT / "tests" / "dist_sp.py") + ["--sp", "2", "--out", str(two), *flags], tmp_path, RUN_TIMEOUT_S,
                   env={"OMP_NUM_THREADS": "1"})
    reference, ranks = _losses(one), [_losses(two, r) for r in (0, 1)]
    # one process: the config keeps reporting the user's implementation; hf_accel's seam serves the forwards
    assert reference["attn"] == "sdpa" and reference["patched"], reference
    for rank in ranks:
        # DeepSpeed's wrapper runs under the patched model's own attention name, around hf_accel's function
        assert rank["attn"] == "hf_accel" and "uattn_wrapper" in rank["attn_function"], rank
        assert len(rank["losses"]) == len(reference["losses"]) == 4
        torch.testing.assert_close(torch.tensor(rank["losses"]), torch.tensor(reference["losses"]), rtol=RTOL, atol=0)
        if "offload" in flags:  # the policy really ran on the sharded run: each layer's input went to host and back
            assert rank["offloaded"] and rank["offloaded"] >= 4 * 2, rank
    # every step trains other documents: a run that repeated a row, or took them in another order, would not match
    assert len(set(reference["losses"])) == 4, reference


def test_collator_rows_for_sequence_parallelism():
    """Rows padded to a multiple of the SP size (the tail its own document, no target), only (rows, length) tensors:
    what DeepSpeed's data loader adapter can shard."""
    collator = DataCollatorForPacking(pad_token_id=0, pad_to_multiple_of=4)
    collator.sequence_parallel(3)
    features = [{"input_ids": list(range(3, 3 + n)), "labels": list(range(3, 3 + n))} for n in (5, 4)]
    batch = collator(features)
    assert set(batch) == {"input_ids", "labels", "position_ids", REAL_TOKENS_KEY}
    assert batch["input_ids"].shape == (1, 12)  # 9 tokens, rounded up to a multiple of lcm(4, 3)
    assert batch["position_ids"][0].tolist() == [0, 1, 2, 3, 4, 0, 1, 2, 3, 0, 1, 2]
    assert batch["labels"][0, 9:].tolist() == [-100] * 3 and batch["labels"][0, [0, 5]].tolist() == [-100, -100]
    assert batch[REAL_TOKENS_KEY][0].tolist() == [1] * 9 + [0] * 3
    # a row length (the token budget): every rank's rows equally long, whatever they hold, as the adapter's
    # all-gather needs; a row longer than it is refused
    budget = DataCollatorForPacking(pad_token_id=0)
    budget.sequence_parallel(2, row_length=15)
    short, full = budget(features[1:]), budget(features)
    assert short["input_ids"].shape == full["input_ids"].shape == (1, 16)
    assert short[REAL_TOKENS_KEY].sum() == 4 and full[REAL_TOKENS_KEY].sum() == 9
    with pytest.raises(InvalidBatch, match="longer than the sequence-parallel row length"):
        budget([{"input_ids": list(range(3, 20)), "labels": list(range(3, 20))}])
    padded = DataCollatorForPacking(pad_token_id=0, fallback_to_padding=True)
    with pytest.raises(ConfigurationError, match="packed rows"):
        padded.sequence_parallel(2)


def _trainer_with_sp(model_type: str, collator, patch: bool = True, budget: int | None = 64):
    """The Trainer's state its sequence-parallel step reads: accelerate's parallelism config (an SP config needs
    as many processes as its size, so the one-process test builds the object without them)."""
    from accelerate.utils import DeepSpeedSequenceParallelConfig

    from hf_accel.training.trainer import AccelArguments, AccelMixin

    handler = DeepSpeedSequenceParallelConfig(sp_attn_implementation="sdpa")
    config = SimpleNamespace(sp_backend="deepspeed", sp_enabled=True, sp_size=2, sp_handler=handler)
    model = SimpleNamespace(config=SimpleNamespace(model_type=model_type, _attn_implementation="hf_accel"))
    plugin = SimpleNamespace(deepspeed_config={"train_micro_batch_size_per_gpu": 32, "train_batch_size": 64})
    trainer = SimpleNamespace(accelerator=SimpleNamespace(parallelism_config=config,
                                                          state=SimpleNamespace(deepspeed_plugin=plugin)),
                              model=model, data_collator=collator, _own_collator=True,
                              accel=AccelArguments(patch=patch, max_tokens_per_batch=budget),
                              args=SimpleNamespace(world_size=2, gradient_accumulation_steps=3))
    return trainer, handler, AccelMixin._accel_sequence_parallel


def test_trainer_hands_deepspeed_hf_accels_attention_and_refuses_what_cannot_shard():
    from hf_accel.data.collators import DataCollatorForPadding

    trainer, handler, setup = _trainer_with_sp("llama", DataCollatorForPacking(pad_token_id=0))
    setup(trainer)
    assert handler.sp_attn_implementation == "hf_accel" and trainer.data_collator.sp_size == 2
    assert trainer.data_collator.sp_row_length == 64  # the token budget: equal rows on every rank
    # one packed row per micro-batch: the size DeepSpeed's Ulysses wrapper checks activations against
    ds = trainer.accelerator.state.deepspeed_plugin.deepspeed_config
    assert (ds["train_micro_batch_size_per_gpu"], ds["train_batch_size"]) == (1, 6)
    unpatched, handler, setup = _trainer_with_sp("llama", DataCollatorForPacking(pad_token_id=0), patch=False)
    setup(unpatched)
    assert handler.sp_attn_implementation == "sdpa"  # the stock model keeps the user's choice
    with pytest.raises(ConfigurationError, match="(?i)falcon"):
        setup(_trainer_with_sp("falcon", DataCollatorForPacking(pad_token_id=0))[0])
    with pytest.raises(ConfigurationError, match="packed batches"):
        setup(_trainer_with_sp("llama", DataCollatorForPadding(pad_token_id=0))[0])
    with pytest.raises(ConfigurationError, match="token budget"):  # rows of one length for the loader's gather
        setup(_trainer_with_sp("llama", DataCollatorForPacking(pad_token_id=0), budget=None)[0])


def test_sft_script_refuses_sequence_parallelism_outside_a_deepspeed_launch(tmp_path, monkeypatch):
    from hf_accel.cli import sft
    from hf_accel.errors import UsageError

    argv = ["--sequence-parallel", "2", "--output-dir", str(tmp_path / "out")]
    monkeypatch.delenv("ACCELERATE_USE_DEEPSPEED", raising=False)
    with pytest.raises(UsageError, match="deepspeed_zero3.yaml"):
        sft.parse_args(argv)
    monkeypatch.setenv("ACCELERATE_USE_DEEPSPEED", "true")
    monkeypatch.setenv("WORLD_SIZE", "3")
    with pytest.raises(UsageError, match="must divide the 3 launched processes"):
        sft.parse_args(argv)
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(UsageError, match="--max-tokens-per-batch"):
        sft.parse_args(argv)


@pytest.mark.slow
def test_sft_script_trains_with_sequence_parallelism(deepspeed_cpu, tmp_path):
    """scripts/sft.py --sequence-parallel 2 on 2 CPU processes under ZeRO-3 (the embedded task): exits 0 with its
    metrics and a falling loss, the same command a 2-GPU run takes (docs/MULTI_GPU.md)."""
    out = tmp_path / "run"
    log = launch_or_fail(zero3_cpu_launch(ROOT / "tests" / "dist_sft.py") + ["--sequence-parallel", "2", "--max-steps", "6", "--logging-steps", "1",
                                "--eval-examples", "0", "--max-tokens-per-batch", "160", "--output-dir", str(out)],
                         tmp_path, RUN_TIMEOUT_S, env={"OMP_NUM_THREADS": "1"})
    records = [json.loads(line) for line in (out / "rank0" / "logs.jsonl").read_text().splitlines()]
    losses = [r["loss"] for r in records if "loss" in r]
    assert len(losses) == 6 and losses[-1] < losses[0], (losses, log[-3000:])
    assert (out / "rank0" / "metrics.json").exists()


@pytest.mark.slow
def test_sequence_parallel_bench_measures_one_and_two_processes_in_one_run(deepspeed_cpu, tmp_path):
    """scripts/bench_sequence_parallel.py on CPU processes under ZeRO-3 (the embedded task's tiny Llama, LoRA): per
    document length, one process and two sequence-parallel ones in the same run and record. The two split each
    document: they train the tokens one process trains, with its losses (two data-parallel ranks would train twice
    the tokens), and a length the model cannot take ends with sft.py's own error, its longer lengths still tried."""
    import subprocess

    out = tmp_path / "records"
    cmd = [sys.executable, str(ROOT / "scripts" / "bench_sequence_parallel.py"), "--lengths", "40,128", "--gpus", "1,2",
           "--sft-args", "--lora-r 4", "--config", str(ROOT / "examples" / "accelerate" / "deepspeed_zero3_cpu.yaml"),
           "--deepspeed-config-file", str(ROOT / "examples" / "accelerate" / "ds_zero3_cpu.json"),
           "--config-timeout", str(RUN_TIMEOUT_S), "--out", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=4 * RUN_TIMEOUT_S,
                          env={**__import__("os").environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    (record_path,) = out.glob("sequence-parallel_*.json")
    record = json.loads(record_path.read_text())
    rows = {(r["gpus"], r["doc_length"]): r for r in record["results"]}
    one, two = rows[(1, 40)], rows[(2, 40)]
    assert one["status"] == two["status"] == "ok", (one, two)
    assert (one["world_size"], two["world_size"]) == (1, 2)
    assert one["tokens"] == two["tokens"] == 40 * 2  # 2 steps of one 40-token document, on either count
    torch.testing.assert_close(torch.tensor(two["losses"]), torch.tensor(one["losses"]), rtol=RTOL, atol=0)
    for gpus in (1, 2):  # the tiny model has 64 positions
        assert "max_position_embeddings" in rows[(gpus, 128)]["status"], rows[(gpus, 128)]
    table = record_path.with_suffix(".md").read_text()
    assert "| longest that trained | 40 | 40 |" in table and "bench_sequence_parallel.py --lengths 40,128" in table


@pytest.mark.slow
def test_sequence_parallel_run_killed_in_a_save_resumes_like_an_uninterrupted_one(deepspeed_cpu, tmp_path):
    """`sft.py --sequence-parallel 2` on 2 CPU processes under ZeRO-3, saving every 3 steps, SIGKILLed inside the save
    of step 6, resumes from checkpoint-3 with --resume and logs the uninterrupted run's losses, ending at its weights.
    Step 3 falls between the two rows of one gathered group (DeepSpeed's loader adapter yields each rank's row in
    turn), so the resume must skip a row and a half of this rank's rows. Failed before: the resume refused every ZeRO
    checkpoint (DeepSpeed's engine files are full pickles), then accelerate's skip found no `.dataset` on the adapter;
    and on a CPU launch every rank saved as process 0."""

    def command(out: Path, *extra: str) -> list[str]:
        return zero3_cpu_launch(ROOT / "scripts" / "sft.py") + [
            "--sequence-parallel", "2", "--max-steps", "6", "--save-steps", "3", "--logging-steps", "1",
            "--eval-examples", "0", "--max-tokens-per-batch", "160", "--output-dir", str(out), *extra]

    env = {"OMP_NUM_THREADS": "1"}
    whole, cut = tmp_path / "whole", tmp_path / "cut"
    printed = launch_or_fail(command(whole), tmp_path, RUN_TIMEOUT_S, env=env)
    # ZeRO-3 keeps the model's facts (the probe's copy is built as one process would)
    assert "hf_accel: patched" in printed and "probe forward failed" not in printed, printed[-3000:]
    launch_killed_in_save(command(cut), tmp_path, 6, RUN_TIMEOUT_S, tmp_path / "cut.log", env=env)
    assert (cut / "checkpoint-3").is_dir() and not (cut / "checkpoint-6").exists()
    launch_or_fail(command(cut, "--resume"), tmp_path, RUN_TIMEOUT_S, env=env)
    assert_resumed_like_uninterrupted(cut, whole, steps=6, rtol=RTOL)
