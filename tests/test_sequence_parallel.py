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

from hf_accel.data.collators import DataCollatorForPacking
from hf_accel.errors import ConfigurationError

sys.path.insert(0, str(Path(__file__).resolve().parent))
from multi_gpu_runs import launch_or_fail, zero3_cpu_launch  # noqa: E402

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
def test_two_sequence_parallel_ranks_train_like_one_process(tmp_path, case):
    """Each 60-token row is cut into two 30-token shards through the middle of a document, so a rank attending only
    within its shard, metadata built from a shard's positions, or labels shifted twice (the fused loss before it took
    ``shift_labels``) each change the losses."""
    pytest.importorskip("deepspeed", reason="Ulysses sequence parallelism needs deepspeed")
    flags = CASES[case]
    one = tmp_path / "one"
    launch_or_fail([sys.executable, str(ROOT / "tests" / "dist_sp.py"), "--out", str(one), *flags], tmp_path,
                   RUN_TIMEOUT_S, env={"OMP_NUM_THREADS": "1"})
    two = tmp_path / "two"
    launch_or_fail(zero3_cpu_launch(ROOT / "tests" / "dist_sp.py") + ["--sp", "2", "--out", str(two), *flags], tmp_path, RUN_TIMEOUT_S,
                   env={"OMP_NUM_THREADS": "1"})
    reference, ranks = _losses(one), [_losses(two, r) for r in (0, 1)]
    assert reference["attn_function"] == "hf_accel_attention"
    for rank in ranks:
        # DeepSpeed's wrapper runs under the patched model's own attention name, around hf_accel's function
        assert rank["attn"] == "hf_accel" and "uattn_wrapper" in rank["attn_function"], rank
        assert len(rank["losses"]) == len(reference["losses"]) == 4
        torch.testing.assert_close(torch.tensor(rank["losses"]), torch.tensor(reference["losses"]), rtol=RTOL, atol=0)
        if "offload" in flags:  # the policy really ran on the sharded run: each layer's input went to host and back
            assert rank["offloaded"] and rank["offloaded"] >= 4 * 2, rank
    assert reference["losses"][-1] < reference["losses"][0]


def test_collator_rows_for_sequence_parallelism():
    """Rows padded to a multiple of the SP size (the tail its own document, no target), only (rows, length) tensors:
    what DeepSpeed's data loader adapter can shard."""
    collator = DataCollatorForPacking(pad_token_id=0, pad_to_multiple_of=4)
    collator.sequence_parallel(3)
    features = [{"input_ids": list(range(3, 3 + n)), "labels": list(range(3, 3 + n))} for n in (5, 4)]
    batch = collator(features)
    assert set(batch) == {"input_ids", "labels", "position_ids"}
    assert batch["input_ids"].shape == (1, 12)  # 9 tokens, rounded up to a multiple of lcm(4, 3)
    assert batch["position_ids"][0].tolist() == [0, 1, 2, 3, 4, 0, 1, 2, 3, 0, 1, 2]
    assert batch["labels"][0, 9:].tolist() == [-100] * 3 and batch["labels"][0, [0, 5]].tolist() == [-100, -100]
    padded = DataCollatorForPacking(pad_token_id=0, fallback_to_padding=True)
    with pytest.raises(ConfigurationError, match="packed rows"):
        padded.sequence_parallel(2)


def _trainer_with_sp(model_type: str, collator, patch: bool = True):
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
                              accel=AccelArguments(patch=patch),
                              args=SimpleNamespace(world_size=2, gradient_accumulation_steps=3))
    return trainer, handler, AccelMixin._accel_sequence_parallel


def test_trainer_hands_deepspeed_hf_accels_attention_and_refuses_what_cannot_shard():
    from hf_accel.data.collators import DataCollatorForPadding

    trainer, handler, setup = _trainer_with_sp("llama", DataCollatorForPacking(pad_token_id=0))
    setup(trainer)
    assert handler.sp_attn_implementation == "hf_accel" and trainer.data_collator.sp_size == 2
    # one packed row per micro-batch: the size DeepSpeed's Ulysses wrapper checks activations against
    ds = trainer.accelerator.state.deepspeed_plugin.deepspeed_config
    assert (ds["train_micro_batch_size_per_gpu"], ds["train_batch_size"]) == (1, 6)
    unpatched, handler, setup = _trainer_with_sp("llama", DataCollatorForPacking(pad_token_id=0), patch=False)
    setup(unpatched)
    assert handler.sp_attn_implementation == "sdpa"  # the stock model keeps the user's choice
    with pytest.raises(ConfigurationError, match="Falcon"):
        setup(_trainer_with_sp("falcon", DataCollatorForPacking(pad_token_id=0))[0])
    with pytest.raises(ConfigurationError, match="packed batches"):
        setup(_trainer_with_sp("llama", DataCollatorForPadding(pad_token_id=0))[0])


def test_sft_script_refuses_sequence_parallelism_outside_a_deepspeed_launch(tmp_path, monkeypatch, capsys):
    from script_modules import script_module

    sft = script_module("sft")
    monkeypatch.delenv("ACCELERATE_USE_DEEPSPEED", raising=False)
    with pytest.raises(SystemExit):
        sft.parse_args(["--sequence-parallel", "2", "--output-dir", str(tmp_path / "out")])
    assert "deepspeed_zero3.yaml" in capsys.readouterr().err
    monkeypatch.setenv("ACCELERATE_USE_DEEPSPEED", "true")
    monkeypatch.setenv("WORLD_SIZE", "3")
    with pytest.raises(SystemExit):
        sft.parse_args(["--sequence-parallel", "2", "--output-dir", str(tmp_path / "out")])
    assert "must divide the 3 launched processes" in capsys.readouterr().err


@pytest.mark.slow
def test_sft_script_trains_with_sequence_parallelism(tmp_path):
    """scripts/sft.py --sequence-parallel 2 on 2 CPU processes under ZeRO-3 (the embedded task): exits 0 with its
    metrics and a falling loss, the same command a 2-GPU run takes (docs/MULTI_GPU.md)."""
    pytest.importorskip("deepspeed", reason="Ulysses sequence parallelism needs deepspeed")
    out = tmp_path / "run"
    log = launch_or_fail(zero3_cpu_launch(ROOT / "tests" / "dist_sft.py") + ["--sequence-parallel", "2", "--max-steps", "6", "--logging-steps", "1",
                                "--eval-examples", "0", "--max-tokens-per-batch", "160", "--output-dir", str(out)],
                         tmp_path, RUN_TIMEOUT_S, env={"OMP_NUM_THREADS": "1"})
    records = [json.loads(line) for line in (out / "rank0" / "logs.jsonl").read_text().splitlines()]
    losses = [r["loss"] for r in records if "loss" in r]
    assert len(losses) == 6 and losses[-1] < losses[0], (losses, log[-3000:])
    assert (out / "rank0" / "metrics.json").exists()
