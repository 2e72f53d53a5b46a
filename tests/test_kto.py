"""hf_accel.KTOTrainer against plain trl.KTOTrainer on the same tiny fp32 models and unpaired examples (desirable and
undesirable completions): every logged step's loss, KL, rewards, log-probs and TRL's other metrics, and every
gradient of the first optimizer step, packed and padded, a separate reference model and a PEFT adapter disabled as
the reference. KTO's forwards (the completions', and the KL rows' of mismatched pairs) are packed as DPO's are
(hf_accel.training.dpo.ReferenceTrainerMixin)."""
from __future__ import annotations

import pytest

from hf_accel.data.default_task import build_tokenizer, make_examples
from hf_accel.errors import ConfigurationError
from hf_accel.training.trainer import AccelArguments
from tests.test_dpo import RowShapes, assert_same_training
from tests.tiny_models import make
from tests.trl_runs import FirstGrads, lora_policy, trl_config

trl = pytest.importorskip("trl")
from hf_accel.training.kto import KTOTrainer  # noqa: E402

METRICS = ("rewards/chosen", "rewards/rejected", "rewards/margins", "logps/chosen", "logps/rejected", "kl",
           "entropy", "logits/chosen", "logits/rejected")


def config(tmp_path, **kw):
    return trl_config(trl.KTOConfig, tmp_path, dict(per_device_train_batch_size=4, gradient_accumulation_steps=1,
                      max_steps=3, optim="sgd", learning_rate=0.5, max_grad_norm=0.0, max_length=None), **kw)


def examples(n: int = 12):
    """Prompt / completion / label: the task's answer (desirable) or another example's (undesirable)."""
    from datasets import Dataset

    ex = make_examples(n + 1, seed=0, max_len=8)
    return Dataset.from_list([{"prompt": a["prompt"], "completion": a["completion"] if i % 2 else b["completion"],
                               "label": bool(i % 2)} for i, (a, b) in enumerate(zip(ex, ex[1:]))])


def run(trainer_cls, model, args, ref_model=None, **kw):
    grads = FirstGrads()
    trainer = trainer_cls(model=model, ref_model=ref_model, args=args, train_dataset=examples(),
                          processing_class=build_tokenizer(), callbacks=[grads], **kw)
    trainer.train()
    return trainer, [entry for entry in trainer.state.log_history if "loss" in entry], grads.grads


@pytest.mark.parametrize("packing", [True, False], ids=["packed", "padded"])
def test_matches_trl_with_reference_model(tmp_path, packing):
    policy = make("llama-gqa", seed=0).train()
    seen = RowShapes(policy)
    ours = run(KTOTrainer, policy, config(tmp_path / "a"), ref_model=make("llama-gqa", seed=1),
               accel=AccelArguments(packing=packing, print_summary=False))
    theirs = run(trl.KTOTrainer, make("llama-gqa", seed=0).train(), config(tmp_path / "b"),
                 ref_model=make("llama-gqa", seed=1))
    assert_same_training(ours, theirs, METRICS)
    assert theirs[1][0]["rewards/margins"] != 0  # a reference unlike the policy: the rewards mean something
    assert seen.shapes and all((rows == 1) == packing for rows, _ in seen.shapes), seen.shapes


def test_lora_adapter_disabled_as_reference_matches_trl(tmp_path):
    pytest.importorskip("peft")  # lora_policy: non-zero B, the policy differs from its reference at step 1
    ours = run(KTOTrainer, lora_policy(), config(tmp_path / "a"), accel=AccelArguments(print_summary=False))
    theirs = run(trl.KTOTrainer, lora_policy(), config(tmp_path / "b"))
    assert_same_training(ours, theirs, METRICS)
    assert any(n.startswith("reference: the policy with its PEFT adapter disabled") for n in ours[0].patch_report.notes)


@pytest.mark.slow  # ~2 s each
@pytest.mark.parametrize("family", ["qwen3.5-text", "gpt-oss"])
def test_2026_families_match_trl(tmp_path, family):
    ours = run(KTOTrainer, make(family, seed=0).train(), config(tmp_path / "a", max_steps=2),
               ref_model=make(family, seed=1), accel=AccelArguments(print_summary=False))
    theirs = run(trl.KTOTrainer, make(family, seed=0).train(), config(tmp_path / "b", max_steps=2),
                 ref_model=make(family, seed=1))
    assert_same_training(ours, theirs, METRICS)


def test_lazy_name_and_refusals(tmp_path):
    import hf_accel

    assert hf_accel.KTOTrainer is KTOTrainer
    for accel in (AccelArguments(fused_ce=True), AccelArguments(max_tokens_per_batch=256)):
        with pytest.raises(ConfigurationError, match="not served by hf_accel.KTOTrainer"):
            KTOTrainer(make("llama-gqa", seed=0), ref_model=make("llama-gqa", seed=1), args=config(tmp_path),
                       train_dataset=examples(), processing_class=build_tokenizer(), accel=accel)
