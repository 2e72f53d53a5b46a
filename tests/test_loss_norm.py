"""Loss normalisation: padded, packed and differently grouped batches of the same samples give the same loss and
gradients on a tiny Llama (fp32, CPU, stock HF sdpa, use_cache=False), equal to each document run alone."""
import pytest
import torch
import torch.distributed as dist
from transformers import LlamaConfig, LlamaForCausalLM

from hf_accel.data.collators import DataCollatorForPacking, DataCollatorForPadding
from hf_accel.training.loss import (
    causal_lm_loss,
    count_target_tokens,
    global_num_documents,
    global_num_items,
    per_document_loss_sum,
    summed_causal_lm_loss,
)

# fp32 on CPU: packed (block-diagonal mask from position_ids) and padded attention differ only in summation order.
FP32_RTOL, FP32_ATOL = 1e-4, 1e-5
PAD, VOCAB = 0, 128
LENGTHS = [5, 9, 3, 12, 7, 4, 10]


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, use_cache=False)
    return LlamaForCausalLM(config).eval()


@pytest.fixture(scope="module")
def features():
    gen = torch.Generator().manual_seed(1)
    out = []
    for i, n in enumerate(LENGTHS):
        ids = torch.randint(1, VOCAB, (n,), generator=gen).tolist()
        prompt = i % 3  # some documents have a masked prompt
        out.append({"input_ids": ids, "labels": [-100] * prompt + ids[prompt:]})
    return out


def to_model(batch):
    return {k: v for k, v in batch.items() if k not in ("labels",)}


def step(model, micro_batches):
    """One optimizer step over micro-batches with the global target count; returns (loss, grads)."""
    model.zero_grad()
    num_items = global_num_items(b["labels"] for b in micro_batches)
    total = 0.0
    for batch in micro_batches:
        logits = model(**to_model(batch)).logits
        loss = causal_lm_loss(logits, batch["labels"], num_items)
        loss.backward()
        total += loss.detach()
    return total, {n: p.grad.clone() for n, p in model.named_parameters()}


def reference(model, features):
    """Each document alone (no padding, no packing): sum of its token CE, and the number of targets."""
    model.zero_grad()
    n = sum(count_target_tokens(torch.tensor([f["labels"]])) for f in features)
    total = 0.0
    for f in features:
        logits = model(input_ids=torch.tensor([f["input_ids"]])).logits
        loss = summed_causal_lm_loss(logits, torch.tensor([f["labels"]])) / n
        loss.backward()
        total += loss.detach()
    return total, {name: p.grad.clone() for name, p in model.named_parameters()}


def groupings(features):
    pad = DataCollatorForPadding(PAD)
    left = DataCollatorForPadding(PAD, padding_side="left", pad_to_multiple_of=8)
    pack = DataCollatorForPacking(PAD)
    pack_rows = DataCollatorForPacking(PAD, max_tokens=16, pad_to_multiple_of=8)
    return {
        "padded, one batch": [pad(features)],
        "padded, 3 micro-batches": [pad(features[:2]), pad(features[2:5]), pad(features[5:])],
        # RoPE is relative, so left padding's shifted positions leave attention unchanged
        "left-padded to multiples of 8, 2 micro-batches": [left(features[:3]), left(features[3:])],
        "packed, one row": [pack(features)],
        "packed rows of 16 with tails, 2 micro-batches": [pack_rows(features[:4]), pack_rows(features[4:])],
        "packed, regrouped": [pack(features[::2]), pack(features[1::2])],
    }


def test_same_loss_and_grads_for_every_grouping(model, features):
    ref_loss, ref_grads = reference(model, features)
    for name, micro_batches in groupings(features).items():
        loss, grads = step(model, micro_batches)
        torch.testing.assert_close(loss, ref_loss, rtol=FP32_RTOL, atol=FP32_ATOL, msg=f"loss differs: {name}")
        for param, grad in grads.items():
            torch.testing.assert_close(
                grad, ref_grads[param], rtol=FP32_RTOL, atol=FP32_ATOL, msg=lambda m: f"{name}, {param}: {m}"
            )


def test_a_per_micro_batch_mean_would_differ(model, features):
    """The check above can fail: the naive mean of per-micro-batch means does not match the reference."""
    ref_loss, _ = reference(model, features)
    micro_batches = groupings(features)["padded, 3 micro-batches"]
    naive = sum(model(**to_model(b), labels=b["labels"]).loss.detach() for b in micro_batches) / len(micro_batches)
    assert not torch.allclose(naive, ref_loss, rtol=FP32_RTOL, atol=FP32_ATOL)


def test_agrees_with_transformers_num_items_in_batch(model, features):
    for name, micro_batches in groupings(features).items():
        num_items = global_num_items(b["labels"] for b in micro_batches)
        # the Trainer's count: labels[..., 1:] != -100 over the micro-batches of the step
        assert int(num_items) == sum(int(b["labels"][..., 1:].ne(-100).sum()) for b in micro_batches), name
        for batch in micro_batches:
            with torch.no_grad():
                out = model(**to_model(batch), labels=batch["labels"], num_items_in_batch=num_items)
                ours = causal_lm_loss(out.logits, batch["labels"], num_items)
            torch.testing.assert_close(ours, out.loss, rtol=FP32_RTOL, atol=FP32_ATOL)


def test_per_document_average_is_grouping_invariant(model, features):
    with torch.no_grad():
        per_doc = []
        for f in features:
            labels = torch.tensor([f["labels"]])
            logits = model(input_ids=torch.tensor([f["input_ids"]])).logits
            per_doc.append(summed_causal_lm_loss(logits, labels) / count_target_tokens(labels))
        expected = torch.stack(per_doc).mean()
        for name, micro_batches in groupings(features).items():
            docs = global_num_documents((b["labels"], b.get("position_ids")) for b in micro_batches)
            assert int(docs) == len(features), name
            total = sum(
                per_document_loss_sum(model(**to_model(b)).logits, b["labels"], b.get("position_ids"))[0]
                for b in micro_batches
            )
            torch.testing.assert_close(total / docs, expected, rtol=FP32_RTOL, atol=FP32_ATOL, msg=name)


def test_zero_targets_gives_zero_not_nan():
    logits = torch.randn(1, 4, VOCAB)
    labels = torch.full((1, 4), -100)
    assert causal_lm_loss(logits, labels, count_target_tokens(labels)).item() == 0.0


def test_global_count_sums_over_ranks(tmp_path):
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        labels = torch.tensor([[-100, 3, 4], [5, -100, 6]])
        assert int(global_num_items([labels, labels])) == 6
    finally:
        dist.destroy_process_group()
