"""The fused loss over target rows only (issue 39a): the packing collator lists, on the host, the flattened positions
whose shifted label is a target (``hf_accel_target_rows``); the fused loss bound into the model's forward takes the key
out and runs the LM head on those rows only. The reference is the same fused loss over every row (which
tests/test_fused_ce.py holds to the stock full-logits loss): loss and every gradient must agree, for every family
variant of tests/tiny_models.py, LoRA on lm_head, tied embeddings, a batch without any target. The collator's list is
checked against the documents it packed (which tokens are targets), not against the formula that builds it."""
from __future__ import annotations

import copy

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

import hf_accel
from hf_accel.data.collators import (TARGET_ROWS_KEY, DataCollatorForPacking, DataCollatorForPadding,
                                     target_positions)
from hf_accel.errors import InvalidBatch
from hf_accel.fused import cross_entropy
from hf_accel.fused.cross_entropy import causal_lm_loss_from_hidden
from tiny_models import VARIANTS, VOCAB, make, slow_2026

LOSS_RTOL = 1e-5  # fp32: fewer rows in the chunks reorder sums only
GRAD_RTOL = 1e-5  # per parameter, relative to the reference gradient's largest entry


def prompt_masked(lengths, prompt_share=0.6, seed=0, start=3):
    """Documents of these lengths, the first ``prompt_share`` of each masked (a prompt), ids >= start."""
    gen = torch.Generator().manual_seed(seed)
    features = []
    for n in lengths:
        ids = torch.randint(start, VOCAB, (n,), generator=gen).tolist()
        prompt = max(1, int(prompt_share * n))
        features.append({"input_ids": ids, "labels": [-100] * prompt + ids[prompt:]})
    return features


@pytest.fixture(scope="module")
def batch():
    """Several prompt-masked documents packed into several rows (token budget 32), with padding tails."""
    out = DataCollatorForPacking(0, max_tokens=32, target_rows=True)(prompt_masked([9, 14, 5, 20, 11, 7, 16]))
    assert out["input_ids"].shape[0] >= 3 and len(out["cu_seq_lens_q"]) > out["input_ids"].shape[0] + 2
    return out


def without_rows(batch):
    return {k: v for k, v in batch.items() if k != TARGET_ROWS_KEY}


def step(model, batch, num_items=None):
    """Loss and every gradient of one training forward + backward; also how many hidden rows reached the head."""
    rows = []
    head = model.get_output_embeddings()
    hook = head.register_forward_pre_hook(lambda module, args: rows.append(args[0].shape[0]))
    try:
        model.zero_grad(set_to_none=True)
        loss = model(**batch, num_items_in_batch=num_items).loss
        loss.backward()
    finally:
        hook.remove()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return loss.detach(), grads, rows


def assert_same(got, want):
    (loss, grads, _), (ref_loss, ref_grads, _) = got, want
    torch.testing.assert_close(loss, ref_loss, rtol=LOSS_RTOL, atol=1e-7)
    assert grads.keys() == ref_grads.keys() and grads
    for name, g in ref_grads.items():
        err = ((grads[name] - g).abs().max() / g.abs().max().clamp_min(1e-12)).item()
        assert err < GRAD_RTOL, (name, err)


def n_targets(batch) -> int:
    return int((batch["labels"][:, 1:] != -100).sum())


# ---- the collator's list -------------------------------------------------------------------------------------------
def targets_of(features):
    """The tokens each document is trained to predict: its labels after the first, where not -100."""
    return sorted(t for f in features for t in f["labels"][1:] if t != -100)


def predicted_at(batch):
    """The token each listed position is trained to predict: the flattened label one position later."""
    flat = batch["labels"].flatten()
    return sorted(flat[batch[TARGET_ROWS_KEY] + 1].tolist())


@settings(max_examples=120, deadline=None)
@given(lengths=st.lists(st.integers(1, 30), min_size=1, max_size=10), share=st.floats(0.0, 1.0),
       max_tokens=st.one_of(st.none(), st.integers(30, 70)), multiple=st.sampled_from([None, 8]))
def test_packed_rows_list_exactly_the_positions_that_predict_a_target(lengths, share, max_tokens, multiple):
    """Token ids unique over the batch, so each target names its document and place: the listed positions must
    predict every target of every document once, and nothing else (no document's first token, no padding, never
    across a document or row boundary), for one row or several, with or without padding tails."""
    features = prompt_masked(lengths, share)
    start = 1
    for f in features:  # unique ids: 1, 2, 3, ... over the batch, the labels following them
        n = len(f["input_ids"])
        f["labels"] = [lab if lab == -100 else start + i for i, lab in enumerate(f["labels"])]
        f["input_ids"] = list(range(start, start + n))
        start += n
    collator = DataCollatorForPacking(0, max_tokens=max_tokens, pad_to_multiple_of=multiple, all_masked="keep",
                                      target_rows=True)
    batch = collator(features)
    rows = batch[TARGET_ROWS_KEY]
    assert rows.dtype == torch.int64 and rows.dim() == 1
    assert predicted_at(batch) == targets_of(features)
    seq = batch["input_ids"].shape[1]
    assert bool((rows % seq != seq - 1).all())  # a row's last position predicts nothing (not the next row)
    flat_ids = batch["input_ids"].flatten()
    for p in rows.tolist():  # the listed position and its target are consecutive tokens of one document
        assert flat_ids[p + 1] == flat_ids[p] + 1
    padded = DataCollatorForPadding(0, all_masked="keep", target_rows=True)(features)
    assert predicted_at(padded) == targets_of(features)
    assert torch.equal(target_positions(batch["labels"]), rows)


def test_rows_only_when_asked_and_never_under_sequence_parallelism():
    features = prompt_masked([6, 9, 4])
    assert TARGET_ROWS_KEY not in DataCollatorForPacking(0)(features)
    assert TARGET_ROWS_KEY not in DataCollatorForPadding(0)(features)
    sharded = DataCollatorForPacking(0, target_rows=True)
    sharded.sequence_parallel(2, row_length=32)  # DeepSpeed's loader shards every tensor along the sequence
    assert TARGET_ROWS_KEY not in sharded(features)
    fallback = DataCollatorForPacking(0, target_rows=True, fallback_to_padding=True)(features)
    assert predicted_at(fallback) == targets_of(features)


def test_a_batch_without_targets_lists_no_row():
    features = [{"input_ids": [5, 6, 7], "labels": [-100] * 3}, {"input_ids": [8, 9], "labels": [8, -100]}]
    batch = DataCollatorForPacking(0, all_masked="keep", target_rows=True)(features)
    assert batch[TARGET_ROWS_KEY].shape == (0,) and batch[TARGET_ROWS_KEY].dtype == torch.int64


def test_the_key_names_agree():
    assert cross_entropy.TARGET_ROWS_KEY == TARGET_ROWS_KEY  # data/ and fused/ do not import each other


# ---- the model: target rows vs every row ---------------------------------------------------------------------------
@pytest.mark.parametrize("variant", slow_2026(sorted(VARIANTS)))
def test_every_family_trains_the_same_on_target_rows_only(variant, batch):
    """patch(model, fused_ce=True): the batch with the collator's rows gives the loss and gradients of the same batch
    without them, and the head really saw only the target rows (fewer than half the positions here)."""
    model = make(variant).train()
    report = hf_accel.patch(model, fused_ce=True)
    if not report.fused_ce:
        pytest.skip(f"{variant}: patch() did not bind the fused loss ({report.speedups})")
    num_items = torch.tensor(n_targets(batch) + 5)  # a device-style count over more micro-batches than this one
    got, want = step(model, batch, num_items), step(model, without_rows(batch), num_items)
    assert_same(got, want)
    assert got[2] == [n_targets(batch)] and want[2] == [batch["input_ids"].numel()]
    assert n_targets(batch) < batch["input_ids"].numel() / 2


def test_tied_embeddings(batch):
    """The tied head's weight is the embedding: its gradient sums the head's (target rows only) and the lookup's."""
    from tiny_models import _llama

    torch.manual_seed(0)
    model = _llama(tie_word_embeddings=True).float().train()
    model.config.use_cache = False
    hf_accel.patch(model, fused_ce=True)
    assert model.get_output_embeddings().weight is model.get_input_embeddings().weight
    assert_same(step(model, batch), step(model, without_rows(batch)))


def test_lora_on_lm_head(batch):
    """LoRA on lm_head takes the chunked module path (the adapters train through the head's own forward): on the
    target rows it gives the adapters, and every other trainable weight, the gradients of every row."""
    from peft import LoraConfig, get_peft_model

    model = make("llama-gqa").train()
    torch.manual_seed(1)
    model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "lm_head"],
                                             init_lora_weights=False))
    hf_accel.patch(model, fused_ce=True)
    got, want = step(model, batch), step(model, without_rows(batch))
    assert_same(got, want)
    assert any("lm_head.lora_A" in n for n in got[1]) and got[2] == [n_targets(batch)]


@pytest.mark.parametrize("lora_head", [False, True], ids=["linear-head", "lora-head"])
def test_a_batch_without_any_target(lora_head):
    """No row to compute: the loss is 0 and every gradient the all-rows path's (zero for the head; nothing left
    unwritten), and the backward runs (the loss stays on the graph), as in a micro-batch of prompts only."""
    features = [{"input_ids": [5, 6, 7, 9], "labels": [-100] * 4}, {"input_ids": [8, 9, 4], "labels": [8, -100, -100]}]
    empty = DataCollatorForPacking(0, all_masked="keep", target_rows=True)(features)
    assert empty[TARGET_ROWS_KEY].numel() == 0
    model = make("llama-gqa").train()
    if lora_head:
        from peft import LoraConfig, get_peft_model

        model = get_peft_model(model, LoraConfig(r=4, target_modules=["lm_head"], init_lora_weights=False))
    hf_accel.patch(model, fused_ce=True)
    got, want = step(model, empty, torch.tensor(7)), step(model, without_rows(empty), torch.tensor(7))
    assert got[0].item() == 0.0 and got[2] == [0]
    assert_same_or_zero(got[1], want[1])


def assert_same_or_zero(grads, ref_grads):
    assert grads.keys() == ref_grads.keys() and grads
    for name, g in ref_grads.items():
        torch.testing.assert_close(grads[name], g, rtol=0, atol=1e-7, msg=name)


@pytest.mark.parametrize("method", ["inline", "recompute"])
@pytest.mark.parametrize("chunk_size", [1, 5, None])
@pytest.mark.parametrize("bias", [False, True])
def test_loss_from_hidden_on_target_rows(method, chunk_size, bias):
    """causal_lm_loss_from_hidden with the rows vs without, for each method and several chunkings (the rows change
    how many chunks there are), a bias included: loss and the gradients of hidden states, weight and bias."""

    class Tiny(nn.Module):
        def __init__(self):
            super().__init__()
            self.lm_head = nn.Linear(16, 40, bias=bias)

        def get_output_embeddings(self):
            return self.lm_head

    torch.manual_seed(0)
    model = Tiny()
    labels = torch.randint(0, 40, (3, 11))
    labels[torch.rand(3, 11) < 0.6] = -100
    rows = target_positions(labels)
    hidden = torch.randn(3, 11, 16, requires_grad=True)
    params = [hidden, *model.parameters()]
    results = []
    for given_rows in (rows, None):
        loss = causal_lm_loss_from_hidden(model, hidden, labels, num_items_in_batch=9, target_rows=given_rows,
                                          chunk_size=chunk_size, method=method)
        results.append((loss, torch.autograd.grad(loss, params)))
    (loss, grads), (ref_loss, ref_grads) = results
    torch.testing.assert_close(loss, ref_loss, rtol=LOSS_RTOL, atol=1e-7)
    for g, ref in zip(grads, ref_grads):
        torch.testing.assert_close(g, ref, rtol=1e-5, atol=1e-7)


# ---- the key's way through the forward ----------------------------------------------------------------------------
def test_the_key_never_reaches_transformers_code(batch):
    """Training, evaluation (the stock forward) and a call with pre-shifted ``shift_labels`` all take the key out
    before transformers' own forward or decoder sees it; with ``shift_labels`` every row is computed (the rows were
    listed from ``labels``, the targets come from elsewhere)."""
    model = make("llama-gqa").train()
    hf_accel.patch(model, fused_ce=True)
    seen = []
    model.model.register_forward_pre_hook(lambda m, args, kwargs: seen.append(sorted(kwargs)), with_kwargs=True)
    step(model, batch)
    shift = torch.nn.functional.pad(batch["labels"][:, 1:], (0, 1), value=-100)
    *_, rows = step(model, {**batch, "shift_labels": shift})
    assert rows == [batch["input_ids"].numel()]
    model.eval()
    with torch.no_grad():
        assert model(**batch).logits is not None
    assert len(seen) == 3 and not any(TARGET_ROWS_KEY in keys for keys in seen)


def test_rows_that_do_not_match_the_labels_are_a_typed_error(batch):
    model = make("llama-gqa").train()
    hf_accel.patch(model, fused_ce=True)
    rows = batch[TARGET_ROWS_KEY]
    for bad, match in ((rows[1:], "1 target positions missing"), (torch.cat([rows, rows[:1]]), "listed twice"),
                       (torch.cat([rows, rows.new_tensor([10**6])]), "outside"),
                       (rows.float(), "1-D int64")):
        with pytest.raises(InvalidBatch, match=match):
            model(**{**batch, TARGET_ROWS_KEY: bad})


def test_a_superset_of_the_target_rows_is_harmless(batch):
    """Rows without a target add nothing: listing every position equals the all-rows path."""
    model = make("neox-parallel").train()
    hf_accel.patch(model, fused_ce=True)
    every = torch.arange(batch["input_ids"].numel())
    assert_same(step(model, {**batch, TARGET_ROWS_KEY: every}), step(model, without_rows(batch)))


# ---- the Trainer ---------------------------------------------------------------------------------------------------
def _trainer(tmp_path, fused_ce, data, **accel_kw):
    import transformers
    from datasets import Dataset

    from hf_accel.training.trainer import AccelArguments, Trainer

    args = transformers.TrainingArguments(
        output_dir=str(tmp_path), per_device_train_batch_size=4, gradient_accumulation_steps=2, max_steps=2,
        logging_steps=1, save_strategy="no", report_to="none", use_cpu=True, disable_tqdm=True, seed=0,
        dataloader_num_workers=0, lr_scheduler_type="constant", weight_decay=0.0, optim="sgd", learning_rate=0.05)
    return Trainer(model=make("llama-gqa").train(), args=args, train_dataset=Dataset.from_list(data),
                   accel=AccelArguments(backend="reference", fused_ce=fused_ce, print_summary=False, **accel_kw))


def test_trainer_turns_the_rows_on_with_the_fused_loss_and_trains_the_same(tmp_path):
    """hf_accel.Trainer with the fused loss: its collator lists the rows, they survive the Trainer's column removal
    (a datasets.Dataset, the token-budget sampler) and reach the loss, and two optimizer steps of 2 accumulated
    micro-batches each (num_items_in_batch over both) end with the weights of the same run over every row. Without
    the fused loss the collator lists nothing (a stock forward must not receive the key)."""
    data = prompt_masked([9, 14, 5, 20, 11, 7, 16, 12, 6, 18, 10, 13, 8, 15, 9, 11], seed=3)
    runs = []
    for rows in (True, False):
        trainer = _trainer(tmp_path / str(rows), True, data, max_tokens_per_batch=48)
        assert trainer.data_collator.target_rows
        trainer.data_collator.target_rows = rows
        head_rows = []
        trainer.model.lm_head.register_forward_pre_hook(lambda m, args: head_rows.append(args[0].shape[0]))
        trainer.train()
        runs.append((trainer, head_rows))
    (ours, ours_rows), (ref, ref_rows) = runs
    assert len(ours_rows) == len(ref_rows) == 4 and sum(ours_rows) < sum(ref_rows) / 2
    losses = [[log["loss"] for log in t.state.log_history if "loss" in log] for t in (ours, ref)]
    torch.testing.assert_close(losses[0], losses[1], rtol=1e-5, atol=0)
    for (name, p), (_, q) in zip(ours.model.named_parameters(), ref.model.named_parameters()):
        torch.testing.assert_close(p, q, rtol=0, atol=1e-6, msg=name)
    assert not _trainer(tmp_path / "plain", False, data).data_collator.target_rows


def test_the_trainer_lists_no_rows_for_data_parallel(tmp_path, monkeypatch):
    """Several GPUs in one process: transformers' Trainer runs nn.DataParallel, which splits every tensor of the batch
    along dim 0, the (T,) list of flattened positions too (each replica would gather rows of another's part): the
    collator lists none there."""
    import transformers

    monkeypatch.setattr(transformers.TrainingArguments, "n_gpu", property(lambda self: 2))
    data = prompt_masked([9, 14, 5, 20], seed=3)
    assert not _trainer(tmp_path, True, data).data_collator.target_rows


# ---- what MFU counts ------------------------------------------------------------------------------------------------
def test_mfu_counts_the_lm_head_on_target_tokens_only():
    """The FLOP model charges the LM head for the tokens that have a target (the head's work a masked position needs
    is none); torch's FLOP counter over the fused loss on the target rows of a frozen head (logits and the hidden
    states' gradient: 4 FLOPs per weight and row; the counter does not see the in-place addmm_ that accumulates a
    trainable head's weight gradient) counts the same head FLOPs."""
    from torch.utils.flop_counter import FlopCounterMode

    from hf_accel.training.flops import FlopModel

    model = make("llama-gqa")
    fm = FlopModel.from_model(model)
    head = model.lm_head.weight.numel()
    assert fm.head_trainable_params == head and fm.head_frozen_params == 0
    docs, targets = [10, 6], 7
    assert fm.step_flops(docs) - fm.step_flops(docs, targets=targets) == 6 * head * (16 - targets)
    labels = torch.randint(0, VOCAB, (1, 16))
    labels[:, :9] = -100
    rows = target_positions(labels)
    hidden = torch.randn(1, 16, 64, requires_grad=True)
    frozen = copy.deepcopy(model).requires_grad_(False)
    frozen_fm = FlopModel.from_model(frozen)
    assert frozen_fm.head_frozen_params == head and frozen_fm.head_trainable_params == 0
    counted = []
    for given in (rows, None):
        with FlopCounterMode(display=False) as counter:
            causal_lm_loss_from_hidden(frozen, hidden, labels, target_rows=given, method="inline").backward()
        counted.append(counter.get_total_flops())
    assert counted == [4 * head * rows.numel(), 4 * head * 16]
    assert frozen_fm.step_flops(docs) - frozen_fm.step_flops(docs, targets=rows.numel()) == counted[1] - counted[0]


def test_the_trainers_meter_counts_the_head_on_target_tokens(batch):
    """ThroughputMeter (the Trainer's MFU) takes the batch's targets from its labels, as the bench's FLOP model does."""
    from hf_accel.training.flops import FlopModel, doc_lengths_from_batch
    from hf_accel.training.metrics import ThroughputMeter

    model = make("llama-gqa")
    meter = ThroughputMeter(model, torch.device("cpu"))
    meter.add_batch(batch)
    lengths = doc_lengths_from_batch(batch)
    want = FlopModel.from_model(model).step_flops(lengths, targets=n_targets(batch))
    assert float(meter.total.flops) == pytest.approx(want, rel=1e-12)
    assert want < FlopModel.from_model(model).step_flops(lengths)
