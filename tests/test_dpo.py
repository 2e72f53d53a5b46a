"""hf_accel.DPOTrainer against plain trl.DPOTrainer on the same tiny fp32 models and preference pairs: every logged
step's loss, rewards (chosen, rejected, margins, accuracies), log-probs and TRL's other metrics, and every gradient of
the first optimizer step; packed and padded, a separate reference model and a PEFT adapter disabled as the reference,
TRL's loss variants. The packed forward is also held to the padded one directly (bind_packed_forward)."""
from __future__ import annotations

import pytest
import torch
import transformers

from hf_accel.data.default_task import build_tokenizer, make_examples
from hf_accel.errors import ConfigurationError
from hf_accel.facts import stock_keeps_documents_apart
from hf_accel.training.trainer import AccelArguments
from tests.tiny_models import make
from tests.trl_runs import FirstGrads, lora_policy, lora_policy_recording_checkpointing, trl_config

trl = pytest.importorskip("trl")
from hf_accel.training.dpo import DPOTrainer, bind_packed_forward  # noqa: E402

LOSS_RTOL = 1e-5  # fp32 on both sides; packed vs padded attention: summation order only
GRAD_RTOL = 1e-4  # of each gradient's largest entry
METRIC_ATOL = 1e-5
OPTIM = dict(optim="sgd", learning_rate=0.5, max_grad_norm=0.0)  # no clipping; a rate that moves the rewards
METRICS = ("rewards/chosen", "rewards/rejected", "rewards/margins", "rewards/accuracies", "logps/chosen",
           "logps/rejected", "entropy", "mean_token_accuracy", "logits/chosen", "logits/rejected")


def config(tmp_path, **kw):
    return trl_config(trl.DPOConfig, tmp_path, dict(per_device_train_batch_size=4, gradient_accumulation_steps=1,
                      max_steps=3, train_sampling_strategy="sequential", max_length=None, dataset_num_proc=None,
                      **OPTIM), **kw)


def pairs(n: int = 12):
    """Prompt / chosen / rejected: the task's answer against another example's (lengths differ: padding)."""
    from datasets import Dataset

    ex = make_examples(n + 1, seed=0, max_len=8)
    return Dataset.from_list([{"prompt": a["prompt"], "chosen": a["completion"], "rejected": b["completion"]}
                              for a, b in zip(ex, ex[1:])])


def run(trainer_cls, model, args, ref_model=None, **kw):
    grads = FirstGrads()
    trainer = trainer_cls(model=model, ref_model=ref_model, args=args, train_dataset=pairs(),
                          processing_class=build_tokenizer(), callbacks=[grads], **kw)
    trainer.train()
    logs = [entry for entry in trainer.state.log_history if "loss" in entry]
    return trainer, logs, grads.grads


def assert_same_training(ours, ref, metrics=METRICS):
    (_, ours_logs, ours_grads), (_, ref_logs, ref_grads) = ours, ref
    assert len(ours_logs) == len(ref_logs) > 1
    assert {"rewards/chosen", "rewards/rejected", "rewards/margins"} <= ref_logs[0].keys()
    for mine, theirs in zip(ours_logs, ref_logs):
        assert mine["loss"] == pytest.approx(theirs["loss"], rel=LOSS_RTOL)
        for key in metrics:
            if key in theirs:
                assert mine[key] == pytest.approx(theirs[key], rel=LOSS_RTOL, abs=METRIC_ATOL), key
    assert ours_grads.keys() == ref_grads.keys() and ref_grads
    for name, g in ref_grads.items():
        err = ((ours_grads[name] - g).abs().max() / g.abs().max().clamp_min(1e-12)).item()
        assert err < GRAD_RTOL, (name, err)


def _models(name="llama-gqa"):
    return make(name, seed=0).train(), make(name, seed=1)  # a reference unlike the policy: rewards non-zero at once


def against_trl(tmp_path, accel: AccelArguments, family: str = "llama-gqa", watch=None, **kw):
    """(ours, theirs): ``run`` of hf_accel.DPOTrainer with ``accel`` and of trl.DPOTrainer, each on a fresh policy /
    reference pair of ``family`` and ``config(**kw)``; ``watch(policy)`` runs on ours before it trains (its result
    returned third)."""
    policy, ref = _models(family)
    watched = watch(policy) if watch is not None else None
    ours = run(DPOTrainer, policy, config(tmp_path / "a", **kw), ref_model=ref, accel=accel)
    policy, ref = _models(family)
    theirs = run(trl.DPOTrainer, policy, config(tmp_path / "b", **kw), ref_model=ref)
    return ours, theirs, watched


class RowShapes:
    """The (rows, length) of every input_ids the embedding sees during training (``grad_only``: in forwards that
    record gradients, not the no-grad checks and references)."""

    def __init__(self, model, grad_only: bool = False):
        self.shapes: list[tuple[int, ...]] = []

        def record(module, args, out):
            if torch.is_grad_enabled() or not grad_only:
                self.shapes.append(tuple(args[0].shape))

        model.get_input_embeddings().register_forward_hook(record)


@pytest.mark.parametrize("packing,patched", [(True, True), (False, True), (True, False)],
                         ids=["packed", "padded", "packed-unpatched"])
def test_matches_trl_with_reference_model(tmp_path, packing, patched):
    """Unpatched, stock attention tells the packed pairs apart by position_ids restarting at 0."""
    ours, theirs, _ = against_trl(tmp_path, AccelArguments(packing=packing, patch=patched, print_summary=False))
    assert_same_training(ours, theirs)
    assert (ours[0].patch_report is not None and ours[0].ref_patch_report is not None) == patched


@pytest.mark.parametrize("family", ["llama-gqa", "falcon-rw-alibi"])
def test_unpatched_packs_only_where_stock_keeps_documents_apart(tmp_path, family):
    """Unpatched, the pairs pack only where stock attention keeps packed documents apart (stock Falcon before
    transformers 5.24 builds its mask without position_ids: its rows stay padded); training equals TRL's either way."""
    ours, theirs, (apart, seen) = against_trl(
        tmp_path, AccelArguments(patch=False, print_summary=False), family, max_steps=2,
        watch=lambda policy: (stock_keeps_documents_apart(policy), RowShapes(policy, grad_only=True)))
    assert_same_training(ours, theirs)
    assert seen.shapes and all((rows == 1) == apart for rows, _ in seen.shapes), (apart, seen.shapes)


@pytest.mark.slow  # ~2 s each; test_packed_forward_equals_padded_call holds the packed call on families in the fast suite
@pytest.mark.parametrize("family", ["qwen3-qk-norm", "gemma3-text", "falcon-rw-alibi", "gpt2", "qwen3.5-text",
                                    "qwen3-moe", "gpt-oss"])
def test_families_match_trl(tmp_path, family):
    """Families beyond Llama through the generic seam or their own patch: q/k norms, sliding windows shorter than
    the pairs (Gemma 3), ALiBi (Falcon), absolute positions and Conv1D linears (GPT-2), hybrid linear attention
    (Qwen3.5: the separate reference's packed call too), experts (Qwen3-MoE, gpt-oss). (Llama 4 fails in plain TRL
    1.16: its fused LM head reads ``last_hidden_state`` from the text model's MoE output, which has none.)"""
    ours, theirs, _ = against_trl(tmp_path, AccelArguments(print_summary=False), family, max_steps=2)
    assert_same_training(ours, theirs)


def test_packs_policy_and_reference_into_one_row(tmp_path, monkeypatch):
    """Both forwards of a step packed; the layout read from the device once a step (the reference's forward gets the
    policy's attention mask)."""
    from hf_accel.training import dpo

    layouts, real = [], dpo._Layout
    monkeypatch.setattr(dpo, "_Layout", lambda *a: layouts.append(a) or real(*a))
    policy, ref = _models()
    seen_policy, seen_ref = RowShapes(policy), RowShapes(ref)
    run(DPOTrainer, policy, config(tmp_path, max_steps=2), ref_model=ref, accel=AccelArguments(print_summary=False))
    assert len(seen_policy.shapes) == len(seen_ref.shapes) == 2
    assert all(rows == 1 for rows, _ in seen_policy.shapes + seen_ref.shapes)
    assert len(layouts) == 2  # one per step, not one per forward


def test_logged_padding_is_what_the_policy_forwards_compute(tmp_path):
    """Packed, the logged padding is none and the tokens are the packed rows'; padded, the padding is the padded
    rows' empty slots: both read off what the policy's embedding saw."""
    logged = {}
    for packing in (True, False):
        policy, ref = _models()
        seen = RowShapes(policy, grad_only=True)
        trainer, _, _ = run(DPOTrainer, policy, config(tmp_path / str(packing), max_steps=2), ref_model=ref,
                            accel=AccelArguments(packing=packing, print_summary=False))
        logs = [e for e in trainer.state.log_history if "padding_fraction" in e]
        logged[packing] = (sum(e["tokens"] for e in logs), [e["padding_fraction"] for e in logs], seen.shapes)
    (tokens, padding, shapes), (padded_tokens, padded_padding, padded_shapes) = logged[True], logged[False]
    assert all(rows == 1 for rows, _ in shapes) and padding == [0.0] * len(padding) and padding
    assert tokens == padded_tokens == sum(n for _, n in shapes)
    slots = sum(rows * n for rows, n in padded_shapes)
    assert all(rows > 1 for rows, _ in padded_shapes) and slots > tokens
    assert sum(padded_padding) / len(padded_padding) == pytest.approx(1 - tokens / slots, rel=0.2)


@pytest.mark.parametrize("loss_type", [["ipo"], ["sigmoid", "sft"], *(  # the others in the slow suite (~2 s each)
    pytest.param(t, marks=pytest.mark.slow) for t in (["hinge"], ["sigmoid_norm"], ["apo_zero"]))],
    ids=lambda t: "+".join(t))
def test_loss_variants_match_trl(tmp_path, loss_type):
    kw = dict(loss_type=loss_type, max_steps=2)
    if len(loss_type) > 1:
        kw["loss_weights"] = [1.0, 0.5]
    ours, theirs, _ = against_trl(tmp_path, AccelArguments(print_summary=False), **kw)
    assert_same_training(ours, theirs)


def test_length_desensitised_and_weighted_match_trl(tmp_path):
    """ld_alpha (shared vs tail tokens by position in the completion) and WPO weights (log_sum_sq_probs)."""
    kw = dict(ld_alpha=0.5, use_weighting=True, max_steps=2)
    ours, theirs, _ = against_trl(tmp_path, AccelArguments(print_summary=False), **kw)
    assert_same_training(ours, theirs)


def test_lora_adapter_disabled_as_reference_matches_trl(tmp_path):
    pytest.importorskip("peft")  # lora_policy: non-zero B, the policy differs from its reference at step 1
    model = lora_policy()
    seen = RowShapes(model.get_base_model())
    ours = run(DPOTrainer, model, config(tmp_path / "a"), accel=AccelArguments(print_summary=False))
    theirs = run(trl.DPOTrainer, lora_policy(), config(tmp_path / "b"))
    assert_same_training(ours, theirs)
    assert ours[0].ref_model is None and all(rows == 1 for rows, _ in seen.shapes)
    assert any(n.startswith("reference: the policy with its PEFT adapter disabled") for n in ours[0].patch_report.notes)


@pytest.mark.parametrize("left", [False, True], ids=["right-padded", "left-and-right-padded"])
@pytest.mark.parametrize("patched", [True, False], ids=["patched", "stock"])
@pytest.mark.parametrize("family", ["llama-gqa", "gpt2", "falcon-rw-alibi"])
def test_packed_forward_equals_padded_call(family, patched, left):
    """One fused call: log-probs and their gradients from the packed row against TRL's padded call (stock attention),
    patched or stock, rotary, absolute (GPT-2) and ALiBi positions; rows padded right (DPO's) or on both sides
    (GRPO's left-padded prompts): each token keeps its column as its position. Stock attention tells the packed
    documents apart by position_ids restarting at 0: it packs right-padded rows only."""
    import hf_accel
    from trl.trainer.utils import add_fused_lm_head

    torch.manual_seed(0)
    seq = 9
    firsts = torch.tensor([0, 2, 1, 5] if left else [0, 0, 0, 0])
    lengths = torch.tensor([9, 5, 7, 2]) - firsts * (torch.tensor([1, 0, 1, 0]))
    columns = torch.arange(seq)
    mask = ((columns >= firsts[:, None]) & (columns < (firsts + lengths)[:, None])).long()
    ids = torch.randint(3, 90, (4, seq)) * mask
    # right-padded row 2 has no prompt: its first token is a label no row scores (left-padded, the padded forward
    # would score it from a padding position: a label there is no DPO or GRPO batch's)
    prompt = (firsts + torch.tensor([2, 1, int(left), 1]))[:, None]
    labels = ids.masked_fill(columns < prompt, -100).masked_fill(mask == 0, -100)
    outs = []
    for packed in (False, True):
        model = make(family, seed=0).train()
        if packed and not patched and not stock_keeps_documents_apart(model):
            pytest.skip(f"stock {family} of transformers {transformers.__version__} lets packed documents attend to "
                        "each other: the trainers keep its rows padded (test_unpatched_packs_only_where_stock_keeps_"
                        "documents_apart)")
        add_fused_lm_head(model, outputs=("log_probs", "entropy", "is_top1"))
        if packed:
            if patched:
                hf_accel.patch(model, fused_ce=False, compile=False)
            bind_packed_forward(model, seam_reads_cu_seqlens=patched)
            seen = RowShapes(model)
        out = model(input_ids=ids, attention_mask=mask, labels=labels, fused_lm_head=True)
        (out.log_probs.sum(1) * torch.arange(1.0, 5.0)).sum().backward()
        outs.append((out, {n: p.grad for n, p in model.named_parameters()}))
    (ref, ref_grads), (ours, grads) = outs
    assert seen.shapes == ([(4, seq)] if left and not patched else [(1, int(lengths.sum()))])
    assert ours.log_probs.shape == ref.log_probs.shape == (4, seq - 1)
    torch.testing.assert_close(ours.log_probs, ref.log_probs, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ours.loss, ref.loss, rtol=1e-5, atol=1e-6)  # TRL's mean over the scored labels
    torch.testing.assert_close(ours.entropy * ref.label_mask, ref.entropy, rtol=1e-5, atol=1e-5)
    assert torch.equal(ours.is_top1, ref.is_top1) and torch.equal(ours.label_mask, ref.label_mask)
    for name, g in ref_grads.items():
        err = ((grads[name] - g).abs().max() / g.abs().max().clamp_min(1e-12)).item()
        assert err < GRAD_RTOL, (name, err)


def test_packed_scoring_call_skips_transformers_packed_search(monkeypatch):
    """The packed call runs under a record of the packed row: transformers' search for packed documents in its
    position_ids (a host read each call) is skipped, as in any patched forward (before, the record was the padded
    call's, and the search ran once per scoring forward)."""
    import hf_accel
    from trl.trainer.utils import add_fused_lm_head

    from hf_accel.attention import hf_attention

    model = make("llama-gqa", seed=0).train()
    add_fused_lm_head(model, outputs=("log_probs",))
    hf_accel.patch(model, fused_ce=False, compile=False)
    bind_packed_forward(model)
    searched, search = [], hf_attention._transformers_find_packed
    monkeypatch.setattr(hf_attention, "_transformers_find_packed", lambda pos: searched.append(pos) or search(pos))
    mask = torch.tensor([[1] * 9, [1] * 5 + [0] * 4])
    ids = torch.randint(3, 90, (2, 9)) * mask
    seen = RowShapes(model)
    model(input_ids=ids, attention_mask=mask, labels=ids.masked_fill(mask == 0, -100), fused_lm_head=True)
    assert seen.shapes == [(1, 14)] and searched == []


@pytest.mark.parametrize("left", [False, True], ids=["right-padded", "left-and-right-padded"])
def test_reference_scoring_call_keeps_hybrid_documents_apart(left):
    """The reference's call (eval mode, no grad: TRL's separate reference model) on a hybrid model: its linear-attention
    layers read the documents from the patched forward's record, which must be the packed row's, not the padded
    call's that came in (before the fix, Qwen3.5's packed reference log-probs leaked one document's state into the
    next: 0.026 off)."""
    import hf_accel
    from trl.trainer.utils import add_fused_lm_head

    torch.manual_seed(0)
    seq = 9
    firsts = torch.tensor([0, 2, 1, 5] if left else [0, 0, 0, 0])
    lengths = torch.tensor([9, 5, 7, 2]) - firsts * torch.tensor([1, 0, 1, 0])
    columns = torch.arange(seq)
    mask = ((columns >= firsts[:, None]) & (columns < (firsts + lengths)[:, None])).long()
    ids = torch.randint(3, 90, (4, seq)) * mask
    labels = ids.masked_fill(columns < (firsts + 1)[:, None], -100).masked_fill(mask == 0, -100)
    outs = []
    for packed in (False, True):
        model = make("qwen3.5-text", seed=0).eval()
        add_fused_lm_head(model, outputs=("log_probs", "entropy", "is_top1"))
        if packed:
            hf_accel.patch(model, fused_ce=False, compile=False)
            bind_packed_forward(model)
            seen = RowShapes(model)
        with torch.no_grad():
            outs.append(model(input_ids=ids, attention_mask=mask, labels=labels, fused_lm_head=True))
    assert seen.shapes == [(1, int(lengths.sum()))]
    torch.testing.assert_close(outs[1].log_probs, outs[0].log_probs, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("accel", [AccelArguments(fused_ce=True), AccelArguments(max_tokens_per_batch=256)],
                         ids=["fused_ce", "max_tokens_per_batch"])
def test_refuses_what_it_does_not_serve(tmp_path, accel):
    policy, ref = _models()
    with pytest.raises(ConfigurationError, match="not served by hf_accel.DPOTrainer"):
        DPOTrainer(model=policy, ref_model=ref, args=config(tmp_path), train_dataset=pairs(),
                   processing_class=build_tokenizer(), accel=accel)


def test_refuses_a_trl_without_the_fused_head(tmp_path, monkeypatch):
    from trl.trainer import utils as trl_utils

    from hf_accel.errors import UnsupportedVersion

    policy, ref = _models()
    monkeypatch.delattr(trl_utils, "add_fused_lm_head")  # (TRL's trainer module keeps its own reference to it)
    with pytest.raises(UnsupportedVersion, match="packing=False"):
        DPOTrainer(model=policy, ref_model=ref, args=config(tmp_path), train_dataset=pairs(),
                   processing_class=build_tokenizer(), accel=AccelArguments(print_summary=False))


def test_lazy_name():
    import hf_accel

    assert hf_accel.DPOTrainer is DPOTrainer


def test_checkpoint_policy_survives_the_adapter_disabled_reference(tmp_path):
    """TRL turns checkpointing off and on again (with its own arguments) around the reference forward of a PEFT
    policy: the policy's per-layer choice must hold at every training forward, and the numbers stay TRL's."""
    pytest.importorskip("peft")
    model, seen, layers = lora_policy_recording_checkpointing()
    trainer, _, _ = run(DPOTrainer, model, config(tmp_path, max_steps=3),
                        accel=AccelArguments(checkpointing="every_2", print_summary=False))
    assert len(seen) == 3 and len(set(seen)) == 1 and seen[0] != (True,) * layers, seen
