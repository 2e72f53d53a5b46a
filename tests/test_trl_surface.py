"""The rest of TRL's SFT surface through hf_accel.SFTTrainer (patched, hf_accel's fused loss), each held to plain
trl.SFTTrainer on the same tiny fp32 model and data (losses, first-step gradients, logged metrics): BFD and wrapped
packing, padding-free batches without packing (tests/test_trl_loss.py), evaluation during training, max_length
truncation, a chat template with assistant_only_loss; a vision-language model is refused with a clear message."""
from __future__ import annotations

import pytest
import torch

from hf_accel.data.default_task import build_tokenizer, make_examples
from hf_accel.errors import ConfigurationError
from hf_accel.training.trainer import AccelArguments
from tests.tiny_models import make

trl = pytest.importorskip("trl")
from tests.test_trl_loss import ACCEL, assert_same_training, config, prompt_completion, run, served  # noqa: E402
from hf_accel.training.trl_trainer import SFTTrainer  # noqa: E402


def both(tmp_path, data, ours_kw=None, **options):
    ours = run(SFTTrainer, make("llama-gqa").train(), config(tmp_path / "o", **options), data,
               accel=AccelArguments(**ACCEL), **(ours_kw or {}))
    ref = run(trl.SFTTrainer, make("llama-gqa").train(), config(tmp_path / "r", **options), data)
    assert served(ours[0])
    return ours, ref


@pytest.mark.parametrize("strategy, max_length", [("bfd", 64),
                                                  pytest.param("wrapped", 16, marks=pytest.mark.slow)])
def test_packing_strategies(tmp_path, strategy, max_length):
    (ours, ours_logs, ours_grads), (ref, ref_logs, ref_grads) = both(
        tmp_path, prompt_completion(), packing=True, packing_strategy=strategy, max_length=max_length,
        per_device_train_batch_size=2)
    batch = next(iter(ours.get_train_dataloader()))
    if strategy == "bfd":  # whole documents, one padding-free row, positions restarting at each document
        assert batch["input_ids"].shape[0] == 1 and (batch["position_ids"] == 0).sum() > 1
    else:  # the token stream cut into rows of max_length
        assert batch["input_ids"].shape == (2, max_length)
    assert_same_training(ours_logs, ref_logs, ours_grads, ref_grads)


@pytest.mark.slow  # two TRL runs (~10 s on 2 cores)
def test_max_length_truncation(tmp_path):
    (ours, ours_logs, ours_grads), (_, ref_logs, ref_grads) = both(tmp_path, prompt_completion(), max_length=8)
    assert max(len(x) for x in ours.train_dataset["input_ids"]) == 8
    assert_same_training(ours_logs, ref_logs, ours_grads, ref_grads)
    model = ours.model.eval()  # generation after training: the forward keeps the signature generate() checks
    assert model.generate(torch.tensor([[2, 5, 6]]), max_new_tokens=3, do_sample=False).shape[1] >= 4


def test_evaluation_during_training(tmp_path):
    from datasets import Dataset

    evaluation = Dataset.from_list(make_examples(6, seed=1))
    options = dict(eval_strategy="steps", eval_steps=1)
    ours = run(SFTTrainer, make("llama-gqa").train(), config(tmp_path / "o", **options), prompt_completion(),
               eval_dataset=evaluation, accel=AccelArguments(**ACCEL))
    ref = run(trl.SFTTrainer, make("llama-gqa").train(), config(tmp_path / "r", **options), prompt_completion(),
              eval_dataset=evaluation)
    assert_same_training(ours[1], ref[1], ours[2], ref[2])
    evals = [[e for e in t.state.log_history if "eval_loss" in e] for t in (ours[0], ref[0])]
    assert len(evals[0]) == len(evals[1]) == 2
    for mine, theirs in zip(*evals):
        for key in ("eval_loss", "eval_entropy", "eval_mean_token_accuracy"):
            assert mine[key] == pytest.approx(theirs[key], rel=1e-5), key


# A chat template with generation markers (TRL's assistant_only_loss reads them), over the default task's
# character vocabulary: "u:" / "a:" role prefixes, "=" ends a user turn, "<eos>" an assistant turn.
CHAT_TEMPLATE = (
    "{% for m in messages %}{{ m['role'][0] }}:{% if m['role'] == 'assistant' %}{% generation %}"
    "{{ m['content'] }}<eos>{% endgeneration %}{% else %}{{ m['content'] }}={% endif %}{% endfor %}"
)


def chats(n: int = 10):
    from datasets import Dataset

    rows = []
    for i, ex in enumerate(make_examples(2 * n, seed=3)):
        if i % 2:
            continue
        follow = make_examples(1, seed=100 + i)[0]
        rows.append({"messages": [
            {"role": "user", "content": ex["prompt"][:-1]}, {"role": "assistant", "content": ex["completion"]},
            {"role": "user", "content": follow["prompt"][:-1]}, {"role": "assistant", "content": follow["completion"]},
        ]})
    return Dataset.from_list(rows)


def test_assistant_only_loss_with_a_chat_template(tmp_path):
    def tokenizer():
        tok = build_tokenizer()
        tok.chat_template = CHAT_TEMPLATE
        return tok

    options = dict(assistant_only_loss=True)
    ours = SFTTrainer(model=make("llama-gqa").train(), args=config(tmp_path / "o", **options), train_dataset=chats(),
                      processing_class=tokenizer(), accel=AccelArguments(**ACCEL))
    ref = trl.SFTTrainer(model=make("llama-gqa").train(), args=config(tmp_path / "r", **options),
                         train_dataset=chats(), processing_class=tokenizer())
    labels = ours.train_dataset[0]["labels"]
    assert -100 in labels and any(t != -100 for t in labels)  # user turns masked, assistant turns trained
    from tests.test_trl_loss import FirstGrads

    grads = [FirstGrads(), FirstGrads()]
    for trainer, g in zip((ours, ref), grads):
        trainer.add_callback(g)
        trainer.train()
    logs = [[e for e in t.state.log_history if "loss" in e] for t in (ours, ref)]
    assert served(ours)
    assert_same_training(logs[0], logs[1], grads[0].grads, grads[1].grads)


@pytest.mark.parametrize("trainer", ["SFTTrainer", "DPOTrainer", "GRPOTrainer"])
def test_a_vision_language_model_is_refused(trainer):
    """Each of our TRL trainers refuses it before TRL's constructor, naming TRL's own trainer to use instead."""
    import hf_accel
    from transformers import CLIPVisionConfig, LlamaConfig, LlavaConfig, LlavaForConditionalGeneration

    config = LlavaConfig(
        text_config=LlamaConfig(vocab_size=96, hidden_size=32, intermediate_size=48, num_hidden_layers=1,
                                num_attention_heads=2, num_key_value_heads=1),
        vision_config=CLIPVisionConfig(hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                       num_attention_heads=2, image_size=8, patch_size=4),
        image_token_index=95)
    model = LlavaForConditionalGeneration(config)
    args = getattr(trl, trainer.replace("Trainer", "Config"))(output_dir="unused", report_to="none", use_cpu=True)
    extra = {"reward_funcs": lambda completions, **_: [0.0] * len(completions)} if trainer == "GRPOTrainer" else {}
    with pytest.raises(ConfigurationError, match=f"text-only causal LMs.*llava.*trl.{trainer}"):
        getattr(hf_accel, trainer)(model=model, args=args, accel=AccelArguments(**ACCEL), **extra)
    assert torch.is_tensor(next(model.parameters()))  # untouched
