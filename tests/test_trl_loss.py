"""hf_accel.SFTTrainer's training loss from hf_accel's fused loss (hf_accel.training.trl_loss, hf_accel.fused.ce_stats)
against plain trl.SFTTrainer on the same tiny fp32 models and data: every step's loss, every gradient of the first
optimizer step, and each metric TRL logs (entropy, mean_token_accuracy, num_tokens, aux_loss), for TRL's loss options
(loss_type "nll" / "dft", completion_only_loss, assistant_only_loss, label smoothing, the MoE auxiliary loss,
gradient accumulation, padding-free batches). tests/test_ce_stats.py holds the statistics kernels to plain torch
math."""
from __future__ import annotations

import pytest
import torch

from hf_accel.data.default_task import build_tokenizer, make_examples
from hf_accel.training.trainer import AccelArguments
from tests.tiny_models import make
from tests.trl_runs import FirstGrads, trl_config

trl = pytest.importorskip("trl")
from hf_accel.training.trl_trainer import SFTTrainer  # noqa: E402

LOSS_RTOL = 1e-5  # fp32 on both sides; TRL's head sums per vocabulary tile, ours per row: summation order only
GRAD_RTOL = 1e-4  # of each gradient's largest entry: the same math in fp32, the LM head's reductions in another order
METRIC_RTOL = 1e-5
OPTIM = dict(optim="sgd", learning_rate=0.05, max_grad_norm=0.0)  # no clipping: the gradients as computed


def config(tmp_path, **kw):
    return trl_config(trl.SFTConfig, tmp_path, dict(per_device_train_batch_size=4, gradient_accumulation_steps=1,
                      max_steps=2, train_sampling_strategy="sequential", max_length=None, dataset_num_proc=None,
                      **OPTIM), **kw)


def prompt_completion(n: int = 12):
    from datasets import Dataset

    return Dataset.from_list(make_examples(n, seed=0))


def run(trainer_cls, model, args, data, **kw):
    grads = FirstGrads()
    trainer = trainer_cls(model=model, args=args, train_dataset=data, processing_class=build_tokenizer(),
                          callbacks=[grads], **kw)
    trainer.train()
    logs = [entry for entry in trainer.state.log_history if "loss" in entry]
    return trainer, logs, grads.grads


def assert_same_training(ours_logs, ref_logs, ours_grads, ref_grads, metrics=("entropy", "mean_token_accuracy",
                                                                             "num_tokens")):
    assert len(ours_logs) == len(ref_logs) > 0
    for mine, theirs in zip(ours_logs, ref_logs):
        assert mine["loss"] == pytest.approx(theirs["loss"], rel=LOSS_RTOL)
        for key in metrics:
            assert mine[key] == pytest.approx(theirs[key], rel=METRIC_RTOL, abs=1e-7), key
    assert ours_grads.keys() == ref_grads.keys() and ref_grads
    for name, g in ref_grads.items():
        err = ((ours_grads[name] - g).abs().max() / g.abs().max().clamp_min(1e-12)).item()
        assert err < GRAD_RTOL, (name, err)


def served(trainer) -> bool:
    return trainer._hf_accel_loss is None and (trainer.patch_report is None or any(
        n.startswith("loss: TRL's SFT loss") for n in trainer.patch_report.notes))


ACCEL = dict(backend="reference", fused_ce=True, print_summary=False)


@pytest.mark.parametrize("options", [
    dict(),  # nll, completion_only_loss (the default for prompt/completion data)
    dict(loss_type="dft"),
    pytest.param(dict(completion_only_loss=False), marks=pytest.mark.slow),
    dict(label_smoothing_factor=0.1),
    dict(padding_free=True, gradient_accumulation_steps=2, per_device_train_batch_size=2),
], ids=["nll", "dft", "all-tokens", "label-smoothing", "padding-free-accumulated"])
def test_fused_loss_trains_like_trl(tmp_path, options):
    ours, ours_logs, ours_grads = run(SFTTrainer, make("llama-gqa").train(), config(tmp_path / "o", **options),
                                      prompt_completion(), accel=AccelArguments(**ACCEL))
    _, ref_logs, ref_grads = run(trl.SFTTrainer, make("llama-gqa").train(), config(tmp_path / "r", **options),
                                 prompt_completion())
    assert served(ours), ours.patch_report.notes
    assert_same_training(ours_logs, ref_logs, ours_grads, ref_grads)


@pytest.mark.slow  # two TRL runs (~10 s on 2 cores); tests/gpu/test_trl_sft_gpu.py trains LoRA and QLoRA too
def test_fused_loss_on_a_lora_model(tmp_path):
    from peft import LoraConfig

    lora = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "down_proj"], init_lora_weights=False)
    torch.manual_seed(1)
    ours, ours_logs, ours_grads = run(SFTTrainer, make("llama-gqa").train(), config(tmp_path / "o"),
                                      prompt_completion(), peft_config=lora, accel=AccelArguments(**ACCEL))
    torch.manual_seed(1)
    _, ref_logs, ref_grads = run(trl.SFTTrainer, make("llama-gqa").train(), config(tmp_path / "r"),
                                 prompt_completion(), peft_config=lora)
    assert served(ours)
    assert_same_training(ours_logs, ref_logs, ours_grads, ref_grads)


def _moe():
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    torch.manual_seed(0)
    cfg = Qwen3MoeConfig(vocab_size=96, hidden_size=32, intermediate_size=48, moe_intermediate_size=24,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                         num_experts=4, num_experts_per_tok=2, router_aux_loss_coef=0.05, use_cache=False,
                         attn_implementation="sdpa")
    return Qwen3MoeForCausalLM(cfg).float().train()


@pytest.mark.parametrize("patched", [True, False], ids=["grouped-experts", "unpatched"])
def test_fused_loss_with_the_moe_auxiliary_loss(tmp_path, caplog, patched):
    """The router's auxiliary loss beside the fused loss: patched (the experts on hf_accel's grouped path, the router
    logits handed to TRL's aux_loss as stock hands them) and unpatched (the fused loss is the trainer's, so it serves
    an unpatched model too)."""
    with caplog.at_level("INFO", logger="hf_accel"):
        ours, ours_logs, ours_grads = run(SFTTrainer, _moe(), config(tmp_path / "o", gradient_accumulation_steps=2,
                                                                     per_device_train_batch_size=2),
                                          prompt_completion(), accel=AccelArguments(**{**ACCEL, "patch": patched}))
    _, ref_logs, ref_grads = run(trl.SFTTrainer, _moe(), config(tmp_path / "r", gradient_accumulation_steps=2,
                                                                per_device_train_batch_size=2),
                                 prompt_completion())
    assert served(ours) and "router_aux_loss_coef=0.05" in caplog.text
    assert (ours.patch_report is not None and any("experts" in n for n in ours.patch_report.notes)) == patched, (
        ours.patch_report and ours.patch_report.notes)
    assert_same_training(ours_logs, ref_logs, ours_grads, ref_grads,
                         metrics=("entropy", "mean_token_accuracy", "num_tokens", "aux_loss"))


# ---- where TRL's own loss serves -----------------------------------------------------------------------------------

def test_a_compute_loss_func_takes_trls_path_and_says_so(tmp_path):
    def loss_func(outputs, labels, num_items_in_batch=None):
        return outputs.logits.float().logsumexp(-1).mean()

    trainer = SFTTrainer(model=make("llama-gqa").train(), args=config(tmp_path), train_dataset=prompt_completion(),
                         processing_class=build_tokenizer(), compute_loss_func=loss_func,
                         accel=AccelArguments(**ACCEL))
    assert any("loss: TRL's own (a compute_loss_func" in n for n in trainer.patch_report.notes)
    assert trainer.compute_loss.__func__ is SFTTrainer.compute_loss  # which defers to TRL's for every call


def test_auto_stands_down_off_cuda_and_false_opts_out(tmp_path):
    for fused_ce, said in (("auto", "serves CUDA only"), (False, "fused_ce=False")):
        trainer = SFTTrainer(model=make("llama-gqa").train(), args=config(tmp_path), train_dataset=prompt_completion(),
                             processing_class=build_tokenizer(),
                             accel=AccelArguments(backend="reference", fused_ce=fused_ce, print_summary=False))
        assert any(n.startswith("loss: TRL's own") and said in n for n in trainer.patch_report.notes)


@pytest.mark.slow  # two TRL runs
def test_a_wrapped_lm_head_falls_back_per_call_and_says_so(tmp_path):
    """PEFT's modules_to_save=["lm_head"] wraps the head (TRL refuses adapters on it, not this)."""
    from peft import LoraConfig

    lora = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj"], modules_to_save=["lm_head"],
                      init_lora_weights=False)
    torch.manual_seed(1)
    ours, ours_logs, ours_grads = run(SFTTrainer, make("llama-gqa").train(), config(tmp_path / "o"),
                                      prompt_completion(), peft_config=lora, accel=AccelArguments(**ACCEL))
    torch.manual_seed(1)
    _, ref_logs, ref_grads = run(trl.SFTTrainer, make("llama-gqa").train(), config(tmp_path / "r"),
                                 prompt_completion(), peft_config=lora)
    assert any("not a plain nn.Linear" in n for n in ours.patch_report.notes)
    assert_same_training(ours_logs, ref_logs, ours_grads, ref_grads)


def test_target_rows_are_listed_on_the_host_and_the_collator_pickles():
    """The rows the head computes: each flattened position whose shifted label is a target, listed by TRL's collator
    (its class kept, TRL checks it), which still pickles for worker processes."""
    import pickle

    from trl.trainer.sft_trainer import DataCollatorForLanguageModeling

    from hf_accel.fused.cross_entropy import TARGET_ROWS_KEY
    from hf_accel.training.trl_loss import add_target_rows

    collator = add_target_rows(DataCollatorForLanguageModeling(pad_token_id=0))
    assert isinstance(collator, DataCollatorForLanguageModeling)
    batch = pickle.loads(pickle.dumps(collator))([{"input_ids": [5, 6, 7, 8], "labels": [-100, -100, 7, 8]},
                                                  {"input_ids": [9, 10], "labels": [-100, 10]}])
    shifted = torch.nn.functional.pad(batch["labels"][:, 1:], (0, 1), value=-100).reshape(-1)
    assert batch[TARGET_ROWS_KEY].tolist() == shifted.ne(-100).nonzero().squeeze(1).tolist() == [1, 2, 4]
