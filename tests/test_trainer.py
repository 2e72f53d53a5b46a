"""hf_accel's Trainer and SFTTrainer vs stock transformers.Trainer / trl.SFTTrainer on the same samples per step.

The references run unpatched fp32 models on padded batches; ours run patched models on packed batches. The same
examples form each optimizer step (sequential sampling, or the reference is fed our sampler's groups), and both
normalise the loss by num_items_in_batch, so per-step losses and final weights must agree to fp32 round-off.
"""
from __future__ import annotations

import random

import pytest
import torch
import transformers

import hf_accel
from hf_accel.memory.checkpointing import decoder_layers
from hf_accel.data.collators import DataCollatorForPadding
from hf_accel.errors import ConfigurationError
from hf_accel.data.sampling import TokenBudgetBatchSampler
from hf_accel.training.trainer import AccelArguments, Trainer
from tests.tiny_models import VOCAB, make

LOSS_RTOL = 1e-4  # packed vs padded fp32: summation order only
PARAM_ATOL = 1e-4  # lr 0.05 times fp32 gradient round-off, over a few steps
# Through TRL, LoRA A-matrices pick up more round-off: stock TRL padding-free vs stock TRL padded (NeoX, LoRA, same
# settings) already differ by up to 4e-4 there, so ours is held to the same order.
TRL_LORA_PARAM_ATOL = 1e-3
TRL_LORA_LOSS_RTOL = 1e-3  # later steps' losses inherit that weight round-off (the first step is held to LOSS_RTOL)
# Plain SGD: Adam's first steps divide by sqrt(g^2) and would blow fp32 round-off of near-zero grads up to ~lr.
OPTIM = dict(optim="sgd", learning_rate=0.05)
FAMILIES = ["llama-gqa", "neox-parallel", "falcon-40b-newarch"]


def examples(n: int = 16, seed: int = 0) -> list[dict]:
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        length = rng.randint(4, 20)
        ids = [rng.randrange(3, VOCAB) for _ in range(length)]
        prompt = rng.randint(1, length - 2)
        out.append({"input_ids": ids, "labels": [-100] * prompt + ids[prompt:]})
    return out


def model_for(name: str, lora: bool):
    model = make(name).train()
    if lora:
        from peft import LoraConfig, get_peft_model

        targets = ["q_proj", "v_proj", "down_proj"] if name.startswith("llama") else ["query_key_value", "dense"]
        torch.manual_seed(1)
        model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=targets, init_lora_weights=False))
    return model


def targs(tmp_path, **kw):
    base = dict(output_dir=str(tmp_path), per_device_train_batch_size=4, gradient_accumulation_steps=2,
                max_steps=2, logging_steps=1, save_strategy="no", report_to="none",
                use_cpu=True, train_sampling_strategy="sequential", disable_tqdm=True, seed=0,
                dataloader_num_workers=0, lr_scheduler_type="constant", weight_decay=0.0, **OPTIM)
    base.update(kw)
    return transformers.TrainingArguments(**base)


def losses(trainer) -> list[float]:
    return [log["loss"] for log in trainer.state.log_history if "loss" in log]


def assert_same_params(a, b, atol: float = PARAM_ATOL):
    for (name, p), (_, q) in zip(a.named_parameters(), b.named_parameters()):
        if p.requires_grad:
            torch.testing.assert_close(p, q, atol=atol, rtol=0, msg=name)


@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
@pytest.mark.parametrize("name", FAMILIES)
def test_trainer_matches_stock_trainer(tmp_path, name, lora):
    data = examples()
    ours = Trainer(model=model_for(name, lora), args=targs(tmp_path / "ours"), train_dataset=data,
                   accel=AccelArguments(backend="reference", print_summary=False))
    ours.train()
    ref = transformers.Trainer(model=model_for(name, lora), args=targs(tmp_path / "ref"), train_dataset=data,
                               data_collator=DataCollatorForPadding(pad_token_id=0))
    ref.train()
    assert "position_ids" in ours.data_collator([data[0], data[1]])  # ours really trained on packed rows
    torch.testing.assert_close(losses(ours), losses(ref), rtol=LOSS_RTOL, atol=0)
    assert_same_params(ours.model, ref.model)


def test_fused_ce_trains_like_the_model_loss(tmp_path):
    """fused_ce=True (loss from hidden states inside the forward, no logits) gives the same steps as the full-logits
    loss of the same patched, packed Trainer."""
    data = examples()
    runs = []
    for fused in (False, True):
        trainer = Trainer(model=model_for("llama-gqa", lora=True), args=targs(tmp_path / str(fused)),
                          train_dataset=data, accel=AccelArguments(backend="reference", fused_ce=fused,
                                                                   print_summary=False))
        trainer.train()
        runs.append(trainer)
    assert runs[1].patch_report.fused_ce
    torch.testing.assert_close(losses(runs[1]), losses(runs[0]), rtol=LOSS_RTOL, atol=0)
    assert_same_params(runs[1].model, runs[0].model)


def test_token_budget_sampler_steps_match_stock(tmp_path):
    """Token-budget micro-batches: the reference Trainer gets our sampler's groups as its (padded) batches."""
    data = examples(20)
    budget = 48
    ours = Trainer(model=model_for("llama-gqa", False), args=targs(tmp_path / "o", max_steps=-1, num_train_epochs=1,
                   gradient_accumulation_steps=1), train_dataset=data,
                   accel=AccelArguments(max_tokens_per_batch=budget, print_summary=False))
    ours.train()
    sampler = TokenBudgetBatchSampler([len(x["input_ids"]) for x in data], budget, seed=0)
    groups = [{"group": [data[i] for i in batch]} for batch in sampler]
    pad = DataCollatorForPadding(pad_token_id=0)
    ref = transformers.Trainer(model=model_for("llama-gqa", False), train_dataset=groups,
                               args=targs(tmp_path / "r", per_device_train_batch_size=1, max_steps=-1,
                                          num_train_epochs=1, gradient_accumulation_steps=1,
                                          remove_unused_columns=False),
                               data_collator=lambda feats: pad(feats[0]["group"]))
    ref.train()
    assert len(losses(ours)) == len(groups)
    torch.testing.assert_close(losses(ours), losses(ref), rtol=LOSS_RTOL, atol=0)
    # every real token of the epoch was counted once, none of the padding
    summary = ours.throughput_summary
    assert summary["tokens"] == sum(len(x["input_ids"]) for x in data)
    assert summary["padding_fraction"] == 0.0


def test_logged_metrics_count_real_tokens(tmp_path):
    data = examples(16)
    trainer = Trainer(model=model_for("llama-gqa", False), args=targs(tmp_path, max_steps=-1, num_train_epochs=1,
                      gradient_accumulation_steps=1, logging_steps=2), train_dataset=data,
                      accel=AccelArguments(packing=False, print_summary=False))
    trainer.train()
    logs = [log for log in trainer.state.log_history if "loss" in log]
    real = sum(len(x["input_ids"]) for x in data)
    assert sum(log["tokens"] for log in logs) == real  # per interval, not cumulative
    slots = sum(4 * max(len(x["input_ids"]) for x in data[s:s + 4]) for s in range(0, 16, 4))
    assert trainer.throughput_summary["padding_fraction"] == pytest.approx(1 - real / slots)
    for log in logs:
        assert log["tokens_per_s"] > 0 and 0 <= log["data_wait_fraction"] <= 1
        assert "mfu" not in log  # no known peak on CPU: not reported rather than made up


def test_failed_run_raises_its_own_error_not_the_summarys(tmp_path, monkeypatch):
    """A run that fails mid-training surfaces its own exception: the end-of-run throughput summary (which reads device
    counters) is not computed then, so it cannot replace the error (on the GPU a sync-debug error did exactly that)."""
    from hf_accel.training import metrics as trainer_metrics

    class Boom(transformers.TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            if state.global_step == 1:
                raise ValueError("boom at step 1")

    def summary_fails(self):
        raise RuntimeError("the summary ran after a failed run")

    monkeypatch.setattr(trainer_metrics.ThroughputMeter, "summary", summary_fails)
    trainer = Trainer(model=model_for("llama-gqa", False), args=targs(tmp_path), train_dataset=examples(16),
                      accel=AccelArguments(print_summary=False), callbacks=[Boom()])
    with pytest.raises(ValueError, match="boom at step 1"):
        trainer.train()
    assert trainer.state.global_step == 1


def test_checkpoint_policy_survives_trainer_enable(tmp_path):
    model = model_for("llama-gqa", False)
    trainer = Trainer(model=model, args=targs(tmp_path, max_steps=1, gradient_checkpointing=True),
                      train_dataset=examples(8), accel=AccelArguments(checkpointing="every_2", print_summary=False))
    trainer.train()  # Trainer.train() turns checkpointing on for every layer; the policy must win
    assert [layer.gradient_checkpointing for layer in decoder_layers(model)] == [True, False]


def test_raw_prompt_completion_dataset_is_tokenized(tmp_path):
    from hf_accel.data.default_task import build_tokenizer, make_examples

    tok = build_tokenizer()
    trainer = Trainer(model=make("llama-gqa").train(), args=targs(tmp_path, max_steps=1),
                      train_dataset=make_examples(8, seed=0), processing_class=tok,
                      accel=AccelArguments(print_summary=False))
    first = trainer.train_dataset[0]
    prompt_len = len(tok(make_examples(1, seed=0)[0]["prompt"])["input_ids"])
    assert first["labels"][:prompt_len] == [-100] * prompt_len and first["labels"][-1] == tok.eos_token_id
    trainer.train()


# ---- TRL ---------------------------------------------------------------------------------------------------------

def sft_config(tmp_path, **kw):
    trl = pytest.importorskip("trl")
    base = dict(output_dir=str(tmp_path), per_device_train_batch_size=4, gradient_accumulation_steps=1,
                max_steps=3, logging_steps=1, save_strategy="no", report_to="none",
                use_cpu=True, train_sampling_strategy="sequential", disable_tqdm=True, seed=0,
                dataloader_num_workers=0, lr_scheduler_type="constant", weight_decay=0.0,
                gradient_checkpointing=False, max_length=None, dataset_num_proc=None, **OPTIM)
    base.update(kw)
    return trl.SFTConfig(**base)


def sft_data():
    from datasets import Dataset

    return Dataset.from_list([{"input_ids": x["input_ids"]} for x in examples(12)])


@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
@pytest.mark.parametrize("name", FAMILIES)
def test_sft_trainer_padding_free_matches_stock_padded(tmp_path, name, lora):
    trl = pytest.importorskip("trl")
    from hf_accel.data.default_task import build_tokenizer
    from hf_accel.training.trainer import SFTTrainer

    ours = SFTTrainer(model=model_for(name, lora), args=sft_config(tmp_path / "o", padding_free=True),
                      train_dataset=sft_data(), processing_class=build_tokenizer(),
                      accel=AccelArguments(backend="reference", print_summary=False))
    ours.train()
    ref = trl.SFTTrainer(model=model_for(name, lora), args=sft_config(tmp_path / "r"), train_dataset=sft_data(),
                         processing_class=build_tokenizer())
    ref.train()
    torch.testing.assert_close(losses(ours)[0], losses(ref)[0], rtol=LOSS_RTOL, atol=0)
    torch.testing.assert_close(losses(ours), losses(ref), rtol=TRL_LORA_LOSS_RTOL if lora else LOSS_RTOL, atol=0)
    assert_same_params(ours.model, ref.model, TRL_LORA_PARAM_ATOL if lora else PARAM_ATOL)


def test_sft_trainer_bfd_packing_falcon_keeps_documents_apart(tmp_path):
    """TRL's BFD packing puts all 12 examples into one row; stock Falcon would let them attend to each other."""
    trl = pytest.importorskip("trl")
    from hf_accel.data.default_task import build_tokenizer
    from hf_accel.training.trainer import SFTTrainer

    total = sum(len(x["input_ids"]) for x in examples(12))
    ours = SFTTrainer(model=model_for("falcon-7b-mqa", False), train_dataset=sft_data(),
                      args=sft_config(tmp_path / "o", packing=True, max_length=total, per_device_train_batch_size=1),
                      processing_class=build_tokenizer(), accel=AccelArguments(print_summary=False))
    ours.train()
    ref = trl.SFTTrainer(model=model_for("falcon-7b-mqa", False), processing_class=build_tokenizer(),
                         args=sft_config(tmp_path / "r", per_device_train_batch_size=12), train_dataset=sft_data())
    ref.train()
    torch.testing.assert_close(losses(ours), losses(ref), rtol=LOSS_RTOL, atol=0)
    assert ours.throughput_summary["tokens"] == 3 * total


@pytest.mark.slow  # dynamo compiles
def test_compiled_layers_train_like_the_stock_trainer(tmp_path):
    """AccelArguments(compile=...) through the Trainer: the same steps as stock transformers on padded fp32 batches
    (aot_eager captures the same graphs as inductor without generating code; tests/test_compile.py runs inductor)."""
    torch._dynamo.reset()
    data = examples()
    ours = Trainer(model=model_for("llama-gqa", False), args=targs(tmp_path / "ours"), train_dataset=data,
                   accel=AccelArguments(backend="reference", compile={"backend": "aot_eager"}, print_summary=False))
    ours.train()
    ref = transformers.Trainer(model=model_for("llama-gqa", False), args=targs(tmp_path / "ref"), train_dataset=data,
                               data_collator=DataCollatorForPadding(pad_token_id=0))
    ref.train()
    assert ours.patch_report.compiled_layers == 2
    torch.testing.assert_close(losses(ours), losses(ref), rtol=LOSS_RTOL, atol=0)
    assert_same_params(ours.model, ref.model)
    with pytest.raises(ConfigurationError, match="use one"):
        Trainer(model=model_for("llama-gqa", False), args=targs(tmp_path / "both", torch_compile=True),
                train_dataset=data, accel=AccelArguments(backend="reference", compile=True))
    import gc

    gc.unfreeze()
    torch._dynamo.reset()


def test_throughput_counts_match_the_document_lengths_without_reading_them_back():
    """The meter's per-batch counts (kept as tensors where the batch lives, read back at logging) equal the FLOP
    model applied to the batch's document lengths, for padded, cu_seq_lens and position_ids batches."""
    from hf_accel.training.flops import FlopModel, doc_lengths_from_batch
    from hf_accel.training.metrics import batch_counts

    config = transformers.LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                                      num_attention_heads=2, num_key_value_heads=1)
    model = transformers.LlamaForCausalLM(config)
    flop_model = FlopModel.from_model(model)
    ids = torch.zeros(1, 12, dtype=torch.long)
    positions = torch.tensor([[0, 1, 2, 3, 4, 0, 1, 0, 1, 2, 3, 4]])
    batches = [
        {"input_ids": torch.zeros(3, 6, dtype=torch.long),
         "attention_mask": torch.tensor([[1] * 6, [1] * 4 + [0] * 2, [0] * 5 + [1]])},
        {"input_ids": ids, "cu_seq_lens_q": torch.tensor([0, 5, 7, 12], dtype=torch.int32)},
        {"input_ids": ids, "position_ids": positions},
    ]
    for batch in batches:
        tokens, slots, squared = batch_counts(batch)
        lengths = doc_lengths_from_batch(batch)
        assert float(tokens) == sum(lengths) and slots == batch["input_ids"].numel()
        assert float(flop_model.flops_from_sums(tokens, squared)) == pytest.approx(flop_model.step_flops(lengths))
        assert torch.is_tensor(squared)  # stays a tensor (on the GPU there): no host read per step


@pytest.mark.parametrize("non_blocking", [True, False])
def test_batches_reach_the_device_without_blocking(tmp_path, non_blocking):
    """hf_accel's Trainer prepares its dataloaders with accelerate's non_blocking transfers (transformers' default is
    a blocking copy, which waits for the previous step on the GPU); AccelArguments(non_blocking=False) opts out."""
    model = make("llama-gqa")
    args = transformers.TrainingArguments(output_dir=str(tmp_path), max_steps=1, report_to="none",
                                          dataloader_pin_memory=True)  # use_cpu=True would turn pinning off
    data = [{"input_ids": list(range(1, 9))} for _ in range(4)]
    trainer = Trainer(model=model, args=args, train_dataset=data, accel=AccelArguments(non_blocking=non_blocking))
    assert trainer.accelerator.non_blocking is non_blocking
    assert trainer.get_train_dataloader()._non_blocking is non_blocking


@pytest.mark.parametrize("wrapper, expected", [
    (dict(), "auto"),  # a single process: patch()'s own choice (on with CUDA)
    (dict(is_fsdp_enabled=True, is_fsdp2=True), "auto"),  # FSDP2: measured on 2×H200 (docs/MULTI_GPU.md)
    (dict(is_fsdp_enabled=True, is_fsdp2=False), False),  # FSDP1: not measured, stands down
    (dict(is_deepspeed_enabled=True), False),  # DeepSpeed: not measured, stands down
    (dict(torch_compile=True), False),  # TrainingArguments(torch_compile=True) compiles the whole model instead
])
def test_auto_compile_under_each_wrapper(wrapper, expected):
    from types import SimpleNamespace

    from hf_accel.training.trainer import AccelMixin

    trainer = SimpleNamespace(
        accel=AccelArguments(), args=SimpleNamespace(torch_compile=wrapper.get("torch_compile", False)),
        is_fsdp_enabled=wrapper.get("is_fsdp_enabled", False),
        is_deepspeed_enabled=wrapper.get("is_deepspeed_enabled", False),
        accelerator=SimpleNamespace(is_fsdp2=wrapper.get("is_fsdp2", False)))
    trainer._accel_compile_stands_down = lambda: AccelMixin._accel_compile_stands_down(trainer)
    assert AccelMixin._accel_compile(trainer) == expected
    reason = AccelMixin._accel_compile_stands_down(trainer)
    assert (reason is None) == (expected == "auto")
    if reason:  # the patch report's compile line gives the reason, not "compile=False"
        options = AccelArguments(backend="reference").patch_options(compile=AccelMixin._accel_compile(trainer),
                                                                    compile_stand_down=reason)
        model = make("llama-gqa")
        report = hf_accel.patch(model, options=options)
        hf_accel.unpatch(model)
        assert report.speedups[1:] == ["fused_ops: off (auto: liger-kernel's Triton kernels run on CUDA only; this "
                                       "model is on cpu)", f"compile: off (auto: {reason})"]
    trainer.accel.compile = True  # an explicit choice is kept everywhere
    assert AccelMixin._accel_compile(trainer) is True
    assert AccelMixin._accel_compile_stands_down(trainer) is None
