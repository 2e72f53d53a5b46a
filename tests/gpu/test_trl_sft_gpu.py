"""hf_accel.SFTTrainer on CUDA (issue 69): TRL's ``use_liger_kernel=True`` on full fine-tuning, LoRA and QLoRA (liger
binds its norms / SwiGLU / RoPE when ``train()`` starts, after ``patch()`` compiled the decoder layers: they must
train, hf_accel.fused.foreign_forwards deciding what the compiled layers do with liger's forwards), the loss from
hf_accel's fused loss (``hf_accel.training.trl_loss``) in TRL's loss forms, and the Triton statistics kernel against
its torch reference.

Each training case runs three times on the same data: plain ``trl.SFTTrainer`` in fp32 (the reference), plain TRL in
bf16 with liger, and hf_accel.SFTTrainer (defaults: compiled layers, fused loss) in bf16 with liger. Per-step losses
and TRL's logged metrics of ours stay within BF16_FACTOR times the bf16 stock run's own error against fp32 (flash-attn's
test rule). QLoRA's fp32 reference computes on the same NF4 base in fp32.

Needs trl, liger-kernel; QLoRA also bitsandbytes (`source .gpu/bnb/install.sh`)."""
from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.gpu
trl = pytest.importorskip("trl")

BF16_FACTOR = 2.0
LOSS_FLOOR = 2e-3  # relative: where the stock bf16 run's error happens to be ~0 at a step
METRIC_FLOOR = 2e-2  # absolute, entropy (nats) and accuracy of a few thousand tokens a step
STEPS = 6
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


@pytest.fixture(scope="module")
def saved_llama(tmp_path_factory):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=32000, hidden_size=512, intermediate_size=1408,
                                         num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=2,
                                         tie_word_embeddings=False)).to(torch.bfloat16)
    folder = tmp_path_factory.mktemp("trl-llama")
    model.save_pretrained(folder)
    return folder


def load(folder, kind: str, dtype: torch.dtype):
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    kwargs = dict(dtype=dtype, attn_implementation="sdpa", device_map={"": 0})
    if kind == "qlora":
        pytest.importorskip("bitsandbytes")
        kwargs["quantization_config"] = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4",
                                                           bnb_4bit_compute_dtype=dtype)
    model = AutoModelForCausalLM.from_pretrained(folder, **kwargs)
    model.config.use_cache = False
    return model


def data():
    from datasets import Dataset

    from hf_accel.data.default_task import make_examples

    return Dataset.from_list(make_examples(256, seed=0, min_len=8, max_len=40))


def sft_args(tmp, bf16: bool, liger: bool, **kw):
    return trl.SFTConfig(output_dir=str(tmp), per_device_train_batch_size=8, max_steps=STEPS, logging_steps=1,
                         save_strategy="no", report_to="none", seed=0, learning_rate=2e-4, bf16=bf16,
                         train_sampling_strategy="sequential", lr_scheduler_type="constant", packing=True,
                         max_length=1024, gradient_checkpointing=False, use_liger_kernel=liger, **kw)


def run(cls, folder, kind, tmp, bf16, liger, **kw):
    from peft import LoraConfig

    from hf_accel.data.default_task import build_tokenizer

    torch.manual_seed(1)
    peft_config = None
    if kind != "full":
        peft_config = LoraConfig(r=16, lora_alpha=32, lora_dropout=0.0, target_modules=TARGETS,
                                 init_lora_weights=False, task_type="CAUSAL_LM")
    extra = kw.pop("trainer_kwargs", {})
    trainer = cls(model=load(folder, kind, torch.bfloat16 if bf16 else torch.float32),
                  args=sft_args(tmp, bf16, liger, **kw), train_dataset=data(), processing_class=build_tokenizer(),
                  peft_config=peft_config, **extra)
    trainer.train()
    logs = [e for e in trainer.state.log_history if "loss" in e]
    return trainer, logs


def within_bf16_error(ours, stock16, fp32, key, floor, relative=True):
    """Each step's ``key`` of ours against fp32 within BF16_FACTOR times the stock bf16 run's largest error (relative
    for the loss; absolute for entropy and accuracy, which may be ~0 at random init) plus ``floor``."""
    def err(a, b):
        return abs(a - b) / max(abs(b), 1e-6) if relative else abs(a - b)

    baseline = max(err(a[key], b[key]) for a, b in zip(stock16, fp32))
    for step, (got, want) in enumerate(zip(ours, fp32)):
        assert err(got[key], want[key]) <= BF16_FACTOR * baseline + floor, (
            key, step, [e[key] for e in ours], [e[key] for e in stock16], [e[key] for e in fp32])


@pytest.mark.parametrize("which", ["trl-fp32", "trl-bf16-liger", "hf_accel-bf16-liger"])
def test_each_full_ft_run_alone_leaves_nothing_allocated(saved_llama, tmp_path, which):
    """The full-FT case below left 0.69 GiB allocated after its teardown in runs 40 and 41 (embedding-sized bf16
    tensors and two 4-D bool masks, held from outside Python). Each of its three runs alone, each checked by the
    conftest's retained-memory teardown: which run holds it (plain TRL + Liger's, or ours)."""
    pytest.importorskip("liger_kernel")
    from hf_accel.training.trainer import AccelArguments
    from hf_accel.training.trl_trainer import SFTTrainer

    if which == "trl-fp32":
        trainer, logs = run(trl.SFTTrainer, saved_llama, "full", tmp_path, bf16=False, liger=False)
    elif which == "trl-bf16-liger":
        trainer, logs = run(trl.SFTTrainer, saved_llama, "full", tmp_path, bf16=True, liger=True)
    else:
        trainer, logs = run(SFTTrainer, saved_llama, "full", tmp_path, bf16=True, liger=True,
                            trainer_kwargs=dict(accel=AccelArguments(print_summary=False)))
    assert len(logs) == STEPS
    del trainer


@pytest.mark.parametrize("kind", ["full", "lora", "qlora"])
def test_sft_trainer_with_liger_trains_like_trl(saved_llama, tmp_path, kind):
    pytest.importorskip("liger_kernel")
    from hf_accel.training.trainer import AccelArguments
    from hf_accel.training.trl_trainer import SFTTrainer

    _, fp32 = run(trl.SFTTrainer, saved_llama, kind, tmp_path / "fp32", bf16=False, liger=False)
    _, stock16 = run(trl.SFTTrainer, saved_llama, kind, tmp_path / "stock", bf16=True, liger=True)
    ours, mine = run(SFTTrainer, saved_llama, kind, tmp_path / "ours", bf16=True, liger=True,
                     trainer_kwargs=dict(accel=AccelArguments(print_summary=False)))
    report = ours.patch_report
    print(report, "\nfp32", [e["loss"] for e in fp32], "\nstock bf16 + liger", [e["loss"] for e in stock16],
          "\nours", [e["loss"] for e in mine])
    assert len(mine) == len(fp32) == STEPS
    within_bf16_error(mine, stock16, fp32, "loss", LOSS_FLOOR)
    for key in ("entropy", "mean_token_accuracy"):
        within_bf16_error(mine, stock16, fp32, key, METRIC_FLOOR, relative=False)
    assert [e["num_tokens"] for e in mine] == [e["num_tokens"] for e in fp32]
    assert report.compiled_layers == 4, str(report)
    assert any("liger-kernel forward on" in n for n in report.notes), report.notes  # what the layers did with it
    assert not any("run eagerly from now on" in n for n in report.notes), report.notes
    assert any(n.startswith("loss: TRL's SFT loss") for n in report.notes), report.notes


@pytest.mark.parametrize("options", [dict(loss_type="dft"), dict(label_smoothing_factor=0.1)], ids=["dft", "smooth"])
def test_fused_loss_options_on_cuda(saved_llama, tmp_path, options):
    """TRL's loss forms through the Triton statistics kernel, against plain TRL (no liger)."""
    from hf_accel.training.trainer import AccelArguments
    from hf_accel.training.trl_trainer import SFTTrainer

    _, fp32 = run(trl.SFTTrainer, saved_llama, "full", tmp_path / "fp32", bf16=False, liger=False, **options)
    _, stock16 = run(trl.SFTTrainer, saved_llama, "full", tmp_path / "stock", bf16=True, liger=False, **options)
    ours, mine = run(SFTTrainer, saved_llama, "full", tmp_path / "ours", bf16=True, liger=False,
                     trainer_kwargs=dict(accel=AccelArguments(print_summary=False)), **options)
    within_bf16_error(mine, stock16, fp32, "loss", LOSS_FLOOR)
    for key in ("entropy", "mean_token_accuracy"):
        within_bf16_error(mine, stock16, fp32, key, METRIC_FLOOR, relative=False)
    assert ours._hf_accel_loss is None  # served by hf_accel's fused loss (CUDA, "auto")


@pytest.mark.parametrize("vocab", [1000, 50304, 128256])
def test_triton_stats_kernel_matches_torch(vocab):
    from hf_accel.fused.ce_stats import LossForm, ce_grad_stats_
    from hf_accel.fused.ce_stats_kernel import ce_grad_stats_triton_

    torch.manual_seed(2)
    logits = (torch.randn(333, vocab, device="cuda") * 4).bfloat16()
    labels = torch.randint(0, vocab, (333,), device="cuda")
    labels[::7] = -100
    for form in (LossForm(), LossForm(dft=True), LossForm(label_smoothing=0.1)):
        mine, ref = logits.clone(), logits.clone()
        got = ce_grad_stats_triton_(mine, labels, form)
        want = ce_grad_stats_(ref, labels, form)
        for a, b in zip(got, want):
            torch.testing.assert_close(a.float(), b.float(), rtol=1e-5, atol=1e-3)
        torch.testing.assert_close(mine.float(), ref.float(), rtol=0, atol=2 ** -8)
        assert mine[::7].abs().sum() == 0
