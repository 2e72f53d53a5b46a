"""hf_accel.RLOOTrainer against plain trl.RLOOTrainer on the same tiny fp32 models, prompts and reward (TRL generates
the same completions for both): every logged step's loss, KL, entropy, clip ratios and rewards, and every gradient
of the first optimizer step, packed and padded, full fine-tuning and a PEFT adapter disabled as the reference (the KL
in the reward). RLOO's scoring forwards are GRPO's (hf_accel.training.grpo.RolloutTrainerMixin)."""
from __future__ import annotations

import pytest
import torch

from hf_accel.training.trainer import AccelArguments
from tests.test_grpo import assert_same_training, run
from tests.tiny_models import make
from tests.trl_runs import lora_policy, trl_config

trl = pytest.importorskip("trl")
from hf_accel.training.rloo import RLOOTrainer  # noqa: E402


def config(tmp_path, **kw):
    return trl_config(trl.RLOOConfig, tmp_path, dict(per_device_train_batch_size=8, num_generations=4,
                      max_completion_length=6, gradient_accumulation_steps=1, max_steps=2, optim="sgd",
                      learning_rate=0.5, max_grad_norm=0.0, beta=0.0, temperature=1.0), **kw)


def scoring_rows(model) -> list[tuple[int, ...]]:
    """The (rows, length) of the forwards that record gradients (the policy's scoring; generation runs without)."""
    rows: list[tuple[int, ...]] = []
    model.get_input_embeddings().register_forward_hook(
        lambda m, args, out: rows.append(tuple(args[0].shape)) if torch.is_grad_enabled() else None)
    return rows


@pytest.mark.parametrize("packing", [True, False], ids=["packed", "padded"])
def test_full_finetune_matches_trl(tmp_path, packing):
    model = make("llama-gqa", seed=0).train()
    rows = scoring_rows(model)
    ours = run(RLOOTrainer, model, config(tmp_path / "a", steps_per_generation=2, num_iterations=2),
               accel=AccelArguments(packing=packing, print_summary=False))
    theirs = run(trl.RLOOTrainer, make("llama-gqa", seed=0).train(),
                 config(tmp_path / "b", steps_per_generation=2, num_iterations=2))
    assert_same_training(ours, theirs)
    assert rows and all((n == 1) == packing for n, _ in rows), rows


def test_lora_with_kl_to_the_adapter_disabled_reference_matches_trl(tmp_path):
    pytest.importorskip("peft")  # lora_policy: non-zero B, the policy differs from its reference at step 1
    ours = run(RLOOTrainer, lora_policy(), config(tmp_path / "a", beta=0.1), accel=AccelArguments(print_summary=False))
    theirs = run(trl.RLOOTrainer, lora_policy(), config(tmp_path / "b", beta=0.1))
    assert_same_training(ours, theirs)
    assert theirs[1][-1]["kl"] > 0
    assert any(n.startswith("reference: the policy with its PEFT adapter disabled") for n in ours[0].patch_report.notes)


@pytest.mark.slow  # ~3 s each
@pytest.mark.parametrize("family", ["qwen3.5-text", "gpt-oss"])
def test_2026_families_match_trl(tmp_path, family):
    """Hybrid linear attention (Qwen3.5) and experts with attention sinks (gpt-oss), left-padded prompts packed."""
    ours = run(RLOOTrainer, make(family, seed=0).train(), config(tmp_path / "a"),
               accel=AccelArguments(print_summary=False))
    theirs = run(trl.RLOOTrainer, make(family, seed=0).train(), config(tmp_path / "b"))
    assert_same_training(ours, theirs)


def test_lazy_name_and_refusal(tmp_path):
    import hf_accel
    from hf_accel.errors import ConfigurationError

    assert hf_accel.RLOOTrainer is RLOOTrainer
    with pytest.raises(ConfigurationError, match="not served by hf_accel.RLOOTrainer"):
        RLOOTrainer(make("llama-gqa", seed=0), reward_funcs=lambda **kw: [], args=config(tmp_path),
                    accel=AccelArguments(max_tokens_per_batch=1024))
