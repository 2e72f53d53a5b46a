"""hf_accel.GRPOTrainer against plain trl.GRPOTrainer on the same tiny fp32 models, prompts and reward: TRL generates
the same completions for both (generation is TRL's, untouched); every logged step's loss, KL, entropy, clip ratios
and rewards, and every gradient of the first optimizer step, are TRL's, packed and padded, full fine-tuning and a
PEFT adapter disabled as the reference, several of TRL's loss types."""
from __future__ import annotations

import pytest
import torch

from hf_accel.data.default_task import build_tokenizer, make_examples
from hf_accel.training.trainer import AccelArguments
from tests.tiny_models import make
from tests.trl_runs import FirstGrads, lora_policy, lora_policy_recording_checkpointing, trl_config

trl = pytest.importorskip("trl")
from hf_accel.training.grpo import GRPOTrainer  # noqa: E402

LOSS_RTOL = 1e-5  # fp32 on both sides; packed vs padded attention: summation order only
METRIC_ATOL = 1e-5
GRAD_RTOL = 1e-4  # of each gradient's largest entry
METRICS = ("kl", "entropy", "reward", "reward_std", "clip_ratio/region_mean", "completions/mean_length")


def digit_reward(completions, **kwargs):
    """More digits, more reward: completions of one group differ, so advantages are not zero. (Two prompts of
    different lengths per batch: TRL left-pads the shorter one.)"""
    return [float(sum(ch.isdigit() for ch in c)) - 0.1 * len(c) for c in completions]


def config(tmp_path, **kw):
    return trl_config(trl.GRPOConfig, tmp_path, dict(per_device_train_batch_size=8, num_generations=4,
                      max_completion_length=6, gradient_accumulation_steps=1, max_steps=2, optim="sgd",
                      learning_rate=0.5, max_grad_norm=0.0, beta=0.0, temperature=1.0), **kw)


def prompts(n: int = 8):
    from datasets import Dataset

    return Dataset.from_list([{"prompt": ex["prompt"]} for ex in make_examples(n, seed=0, max_len=8)])


def run(trainer_cls, model, args, **kw):
    grads = FirstGrads()
    trainer = trainer_cls(model=model, reward_funcs=digit_reward, args=args, train_dataset=prompts(),
                          processing_class=build_tokenizer(), callbacks=[grads], **kw)
    trainer.train()
    logs = [entry for entry in trainer.state.log_history if "loss" in entry]
    return trainer, logs, grads.grads


def assert_same_training(ours, ref):
    (_, ours_logs, ours_grads), (_, ref_logs, ref_grads) = ours, ref
    assert len(ours_logs) == len(ref_logs) > 1
    assert ref_logs[0]["reward_std"] > 0  # advantages not all zero: the gradients mean something
    for mine, theirs in zip(ours_logs, ref_logs):
        assert mine["loss"] == pytest.approx(theirs["loss"], rel=LOSS_RTOL, abs=1e-7)
        for key in METRICS:
            if key in theirs:
                assert mine[key] == pytest.approx(theirs[key], rel=LOSS_RTOL, abs=METRIC_ATOL), key
    assert ours_grads.keys() == ref_grads.keys() and ref_grads
    for name, g in ref_grads.items():
        err = ((ours_grads[name] - g).abs().max() / g.abs().max().clamp_min(1e-12)).item()
        assert err < GRAD_RTOL, (name, err)


class RowShapes:
    """The (rows, length) of every input_ids the embedding sees with fused_lm_head scoring (not generation)."""

    def __init__(self, model):
        self.shapes: list[tuple[int, ...]] = []
        model.get_input_embeddings().register_forward_hook(lambda m, args, out: self.shapes.append(tuple(args[0].shape)))


@pytest.mark.parametrize("packing", [True, False], ids=["packed", "padded"])
def test_full_finetune_matches_trl(tmp_path, packing):
    ours = run(GRPOTrainer, make("llama-gqa", seed=0).train(), config(tmp_path / "a"),
               accel=AccelArguments(packing=packing, print_summary=False))
    theirs = run(trl.GRPOTrainer, make("llama-gqa", seed=0).train(), config(tmp_path / "b"))
    assert_same_training(ours, theirs)


@pytest.mark.parametrize("patched", [True, False], ids=["patched", "unpatched"])
def test_logged_padding_is_what_the_scoring_forwards_compute(tmp_path, patched):
    """Patched, the left-padded prompts and right-padded completions pack: no padding logged. Unpatched, stock
    attention cannot tell left-padded rows apart when packed, so they stay padded and their empty slots are logged."""
    model = make("llama-gqa", seed=0).train()
    scored = []  # the training forwards' rows (generation's run without grad)
    model.get_input_embeddings().register_forward_hook(
        lambda m, args, out: scored.append(tuple(args[0].shape)) if torch.is_grad_enabled() else None)
    trainer, _, _ = run(GRPOTrainer, model, config(tmp_path), accel=AccelArguments(patch=patched, print_summary=False))
    logs = [e for e in trainer.state.log_history if "padding_fraction" in e]
    assert logs and scored
    if patched:
        assert all(rows == 1 for rows, _ in scored) and all(e["padding_fraction"] == 0.0 for e in logs)
    else:
        assert any(rows > 1 for rows, _ in scored) and all(e["padding_fraction"] > 0.0 for e in logs)


@pytest.mark.parametrize("loss_type", ["grpo", *(pytest.param(t, marks=pytest.mark.slow) for t in ("dr_grpo", "bnpo"))])
def test_loss_types_match_trl(tmp_path, loss_type):
    kw = dict(loss_type=loss_type, steps_per_generation=2, num_iterations=2)  # old log-probs computed, clipping
    ours = run(GRPOTrainer, make("llama-gqa", seed=0).train(), config(tmp_path / "a", **kw),
               accel=AccelArguments(print_summary=False))
    theirs = run(trl.GRPOTrainer, make("llama-gqa", seed=0).train(), config(tmp_path / "b", **kw))
    assert_same_training(ours, theirs)


@pytest.mark.slow  # ~3 s each
@pytest.mark.parametrize("family", ["qwen3.5-text", "qwen3-moe", "gpt-oss"])
def test_2026_families_match_trl(tmp_path, family):
    """Hybrid linear attention (Qwen3.5) and experts (Qwen3-MoE, gpt-oss), with old log-probs computed without grad
    (two iterations per generation) and left-padded prompts packed."""
    kw = dict(steps_per_generation=2, num_iterations=2)
    ours = run(GRPOTrainer, make(family, seed=0).train(), config(tmp_path / "a", **kw),
               accel=AccelArguments(print_summary=False))
    theirs = run(trl.GRPOTrainer, make(family, seed=0).train(), config(tmp_path / "b", **kw))
    assert_same_training(ours, theirs)


def test_lora_with_kl_to_the_adapter_disabled_reference_matches_trl(tmp_path):
    pytest.importorskip("peft")  # lora_policy: non-zero B, the policy differs from its reference at step 1
    model = lora_policy()
    seen = RowShapes(model.get_base_model())
    ours = run(GRPOTrainer, model, config(tmp_path / "a", beta=0.1), accel=AccelArguments(print_summary=False))
    theirs = run(trl.GRPOTrainer, lora_policy(), config(tmp_path / "b", beta=0.1))
    assert_same_training(ours, theirs)
    assert theirs[1][-1]["kl"] > 0  # the reference's log-probs differ from the policy's after a step
    assert any(rows == 1 for rows, _ in seen.shapes)  # scoring forwards packed (generation's are (B, S))
    assert any(n.startswith("reference: the policy with its PEFT adapter disabled") for n in ours[0].patch_report.notes)


def test_lazy_name():
    import hf_accel

    assert hf_accel.GRPOTrainer is GRPOTrainer


def test_checkpoint_policy_survives_generation_and_the_reference(tmp_path):
    """TRL turns checkpointing off and on again (its own arguments: every layer) around generation and the reference
    forward: the policy's per-layer choice must hold at every training forward."""
    pytest.importorskip("peft")
    model, seen, layers = lora_policy_recording_checkpointing()
    run(GRPOTrainer, model, config(tmp_path, beta=0.1, max_steps=3),
        accel=AccelArguments(checkpointing="every_2", print_summary=False))
    assert len(seen) == 3 and len(set(seen)) == 1 and seen[0] != (True,) * layers, seen
