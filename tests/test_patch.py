"""patch() against the live reference: the unpatched transformers model (SDPA, fp32, CPU).

Every family variant: logits at real tokens and every parameter gradient, for no / right / left padding; packed rows
(one and several) against each document run alone; generate, unpatch, two-models-in-one-process, LoRA, checkpointing.
"""
from __future__ import annotations

import copy

import pytest
import torch

import hf_accel
from hf_accel.errors import BackendUnavailable, UnsupportedModel
from tiny_models import (FAMILIES_2026, NEW_FAMILIES, VARIANTS, VOCAB, gemma3_multimodal, gemma4_multimodal, make,
                         slow_2026)

LOGITS_RTOL = 2e-4  # relative to the logits' scale (issue 2's bar)
GRAD_RTOL = 1e-3  # relative to each gradient's scale
BACKENDS = ["sdpa", "reference"]


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-12)).item()


def batch(padding: str, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (3, 11), generator=g)
    mask = torch.ones_like(ids)
    if padding == "right":
        mask[1, 7:] = 0
        mask[2, 4:] = 0
    elif padding == "left":
        mask[1, :3] = 0
        mask[2, :6] = 0
    # A target counts only when the token predicting it is real: what a model computes at padding is undefined.
    predictor_real = torch.nn.functional.pad(mask[:, :-1], (1, 0), value=0).bool()
    labels = ids.masked_fill(~(mask.bool() & predictor_real), -100)
    return ids, mask, labels


def loss_and_grads(model, ids, mask, labels):
    model.zero_grad()
    out = model(input_ids=ids, attention_mask=mask, labels=labels)
    out.loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return out.logits.detach(), grads


@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("padding", ["none", "right", "left"])
def test_patched_matches_unpatched(variant, padding):
    ref_model = make(variant)
    model = copy.deepcopy(ref_model)
    hf_accel.patch(model, backend="sdpa")
    ids, mask, labels = batch(padding)
    ref_logits, ref_grads = loss_and_grads(ref_model, ids, mask, labels)
    logits, grads = loss_and_grads(model, ids, mask, labels)
    real = mask.bool()
    assert rel_err(logits[real], ref_logits[real]) < LOGITS_RTOL
    assert grads.keys() == ref_grads.keys()
    for name in ref_grads:
        assert rel_err(grads[name], ref_grads[name]) < GRAD_RTOL, name


def _docs(seed=2, lengths=(5, 3, 7, 2, 6)):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, VOCAB, (n,), generator=g) for n in lengths]


@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("backend", BACKENDS)
def test_packed_rows_equal_documents_alone(variant, backend):
    model = make(variant)
    docs = _docs()
    alone = [model(input_ids=d[None]).logits[0] for d in docs]
    hf_accel.patch(model, backend=backend)
    # One row holding every document, then two rows (docs never span rows; row 2 padded by a dummy document).
    rows = [docs, docs[:2], docs[2:]]
    one_row = torch.cat(docs)[None]
    pos = torch.cat([torch.arange(len(d)) for d in docs])[None]
    packed = model(input_ids=one_row, position_ids=pos).logits[0]
    torch.testing.assert_close(packed, torch.cat(alone), rtol=1e-4, atol=1e-5)

    r1, r2 = torch.cat(docs[:2]), torch.cat(docs[2:])
    width = max(len(r1), len(r2))
    pad1 = width - len(r1)
    ids2 = torch.stack([torch.cat([r1, torch.zeros(pad1, dtype=torch.long)]), r2])
    pos2 = torch.stack([
        torch.cat([torch.arange(len(d)) for d in docs[:2]] + [torch.arange(pad1)]),
        torch.cat([torch.arange(len(d)) for d in docs[2:]]),
    ])
    two_rows = model(input_ids=ids2, position_ids=pos2).logits
    torch.testing.assert_close(two_rows[0, : len(r1)], torch.cat(alone[:2]), rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(two_rows[1], torch.cat(alone[2:]), rtol=1e-4, atol=1e-5)
    del rows


@pytest.mark.parametrize("variant", ["llama-gqa", "falcon-7b-mqa", "falcon-rw-alibi"])
def test_collator_metadata_equals_position_ids(variant):
    """cu_seq_lens / max_length from a collator give the same result as deriving documents from position_ids."""
    model = make(variant)
    hf_accel.patch(model)
    docs = _docs()
    ids = torch.cat(docs)[None]
    pos = torch.cat([torch.arange(len(d)) for d in docs])[None]
    cu = torch.tensor([0] + torch.tensor([len(d) for d in docs]).cumsum(0).tolist(), dtype=torch.int32)
    a = model(input_ids=ids, position_ids=pos).logits
    from hf_accel.attention import varlen

    derived = []
    original = varlen.from_mask_and_positions
    varlen.from_mask_and_positions = lambda *a, **k: derived.append(1) or original(*a, **k)
    try:
        b = model(input_ids=ids, position_ids=pos, cu_seq_lens_q=cu, cu_seq_lens_k=cu,
                  max_length_q=max(map(len, docs)), max_length_k=max(map(len, docs))).logits
    finally:
        varlen.from_mask_and_positions = original
    torch.testing.assert_close(a, b)
    assert derived == []  # the collator's metadata was used (Falcon: through the model-level record), no host read


@pytest.mark.parametrize("variant", ["llama-gqa", "neox-parallel", "falcon-7b-mqa"])
def test_packed_forward_skips_transformers_packed_search(variant, monkeypatch):
    """transformers looks for packed documents in position_ids and reads the answer back to the host (a GPU sync per
    forward) although hf_accel's seam never uses it: a patched forward skips that search for its own position_ids and
    still equals the documents run alone; an unpatched model given the very same tensor still runs it."""
    from hf_accel.attention import hf_attention

    ref = make(variant)
    model = copy.deepcopy(ref)
    hf_accel.patch(model, backend="reference")
    calls = []
    original = hf_attention._transformers_find_packed
    monkeypatch.setattr(hf_attention, "_transformers_find_packed", lambda pos: calls.append(pos) or original(pos))
    docs = _docs()
    ids = torch.cat(docs)[None]
    pos = torch.cat([torch.arange(len(d)) for d in docs])[None]
    packed = model(input_ids=ids, position_ids=pos).logits[0]
    assert calls == []
    alone = torch.cat([ref(input_ids=d[None]).logits[0] for d in docs])
    torch.testing.assert_close(packed, alone, rtol=1e-4, atol=1e-5)
    calls.clear()
    ref(input_ids=ids, position_ids=pos)  # not patched: transformers' own search
    assert all(p is pos for p in calls)
    if not variant.startswith("falcon"):  # stock Falcon builds a packed mask only from transformers 5.24
        assert calls
    searched = len(calls)
    model(input_ids=ids, position_ids=pos)
    assert len(calls) == searched  # patched again: still skipped


def test_stock_falcon_packing_leaks_and_ours_does_not():
    """The bug we fix: stock Falcon before transformers 5.24 attends across packed documents (5.24 builds its mask
    from position_ids). Patched Falcon keeps documents apart on every supported version."""
    import transformers
    from packaging.version import Version

    model = make("falcon-mha")
    docs = _docs()
    alone = torch.cat([model(input_ids=d[None]).logits[0] for d in docs])
    ids, pos = torch.cat(docs)[None], torch.cat([torch.arange(len(d)) for d in docs])[None]
    stock = model(input_ids=ids, position_ids=pos).logits[0]
    if Version(Version(transformers.__version__).base_version) < Version("5.24"):
        assert rel_err(stock, alone) > 1e-2
    hf_accel.patch(model)
    assert rel_err(model(input_ids=ids, position_ids=pos).logits[0], alone) < LOGITS_RTOL


def _stock_remaps_packed_positions() -> bool:
    """transformers counts a packed document's mask positions (Llama 4's chunks) from the document's start."""
    from transformers import masking_utils

    return hasattr(masking_utils, "remap_positions_for_packed_sequence")


def test_stock_chunked_layers_cut_a_packed_row_from_its_start_and_ours_per_document():
    """Llama 4's chunked layers: stock before transformers' packed-position remapping (5.17, the GPU image; 5.25 has
    it) cuts a packed row into chunks counted from the row's start, so a document that starts mid-chunk computes what
    it would not alone; the same documents right-padded, one a row, compute what each does alone, and so does the
    patched packed row on every version (the GPU families test's references train padded: run 42)."""
    model = make("llama4-text")
    assert model.config.attention_chunk_size < max(len(d) for d in _docs())
    docs = _docs()
    alone = torch.cat([model(input_ids=d[None]).logits[0] for d in docs])
    ids, pos = torch.cat(docs)[None], torch.cat([torch.arange(len(d)) for d in docs])[None]
    stock = rel_err(model(input_ids=ids, position_ids=pos).logits[0], alone)
    assert stock < LOGITS_RTOL if _stock_remaps_packed_positions() else stock > 1e-2
    width = max(len(d) for d in docs)
    rows = torch.stack([torch.nn.functional.pad(d, (0, width - len(d))) for d in docs])
    mask = torch.stack([torch.arange(width) < len(d) for d in docs]).long()
    padded = model(input_ids=rows, attention_mask=mask).logits[mask.bool()]
    assert rel_err(padded, alone) < LOGITS_RTOL
    hf_accel.patch(model)
    assert rel_err(model(input_ids=ids, position_ids=pos).logits[0], alone) < LOGITS_RTOL


@pytest.mark.parametrize("variant", ["llama-gqa", "llama4-text"])
def test_gpu_families_padded_reference_averages_the_packed_targets(variant):
    """tests/gpu/packed_training.py's right-padded batch averages the loss over the same targets as its packed row:
    equal losses where stock keeps packed documents apart (Llama), different ones where it does not (Llama 4's chunks
    before transformers' packed-position remapping)."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).parent / "gpu"))
    try:
        from packed_training import train
    finally:
        sys.path.pop(0)
    model = make(variant)
    packed, padded = (train(model, 1, 0.0, padded_rows=rows, device="cpu")[0] for rows in (False, True))
    if variant == "llama-gqa" or _stock_remaps_packed_positions():
        assert packed == pytest.approx(padded, rel=1e-5)
    else:
        assert abs(packed - padded) > 1e-4  # fp32 noise on this loss: ~1e-7


@pytest.mark.parametrize("variant", slow_2026(["llama-gqa", "neox-parallel", "falcon-40b-newarch", "falcon-rw-alibi",
                                                "mistral-window", "gemma2-softcap", "gemma3-text", *FAMILIES_2026]))
def test_generate_unchanged(variant):
    model = make(variant)
    model.config.use_cache = True
    ids, mask, _ = batch("left")
    kwargs = dict(max_new_tokens=6, do_sample=False, pad_token_id=0, use_cache=True)
    before = model.generate(input_ids=ids, attention_mask=mask, **kwargs)
    hf_accel.patch(model)
    after = model.generate(input_ids=ids, attention_mask=mask, **kwargs)
    assert torch.equal(before, after)


@pytest.mark.parametrize("variant", ["llama-gqa", "neox-sequential", "falcon-7b-mqa", *NEW_FAMILIES, *FAMILIES_2026])
def test_unpatch_restores_bit_identical(variant):
    model = make(variant)
    ids, mask, _ = batch("right")
    before = model(input_ids=ids, attention_mask=mask).logits
    impl = model.config._attn_implementation
    hf_accel.patch(model, backend="reference")
    assert hf_accel.patch(model, backend="reference") is hf_accel.patch_report(model)  # idempotent
    hf_accel.unpatch(model)
    assert model.config._attn_implementation == impl
    assert torch.equal(model(input_ids=ids, attention_mask=mask).logits, before)


def test_two_models_are_independent():
    a, b = make("llama-gqa"), make("llama-gqa")
    hf_accel.patch(a, backend="reference")
    assert b.config._attn_implementation == "sdpa"
    assert hf_accel.patch_report(b) is None
    assert all(not hasattr(m, "_hf_accel_backend") for m in b.modules())


def test_training_defaults_use_cache_off():
    model = make("llama-gqa")
    model.config.use_cache = True
    hf_accel.patch(model)
    model.train()
    out = model(input_ids=torch.randint(0, VOCAB, (1, 6)))
    assert out.past_key_values is None


def test_a_model_outside_the_attention_interface_is_refused_saying_so():
    """GPT-Neo builds its own attention (no transformers AttentionInterface) and no patches/ module types it: refused
    before anything changes, naming the interface."""
    from transformers import GPTNeoConfig, GPTNeoForCausalLM

    model = GPTNeoForCausalLM(GPTNeoConfig(num_layers=2, attention_types=[[["global", "local"], 1]], hidden_size=32,
                                           num_heads=2, vocab_size=50))
    before = {n: type(m) for n, m in model.named_modules()}
    with pytest.raises(UnsupportedModel, match="does not reach attention through transformers' AttentionInterface"):
        hf_accel.patch(model)
    assert {n: type(m) for n, m in model.named_modules()} == before and hf_accel.patch_report(model) is None


def test_a_model_outside_the_interface_whose_probe_fails_is_refused_for_the_interface():
    """XLNet's probe forward fails on fake tensors (a dtype mismatch), and its attention is its own: the refusal says
    it does not reach the interface (it said only that the probe failed, and to "pass the model itself", which the
    user had done)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(
        "xlnet", vocab_size=64, d_model=32, n_layer=2, n_head=2, d_inner=64))
    with pytest.raises(UnsupportedModel, match="XLNetLMHeadModel .* does not reach attention through transformers'"):
        hf_accel.patch(model)
    assert hf_accel.patch_report(model) is None


def test_a_vision_tower_is_refused_as_not_a_causal_lm():
    """A multimodal model's vision tower (Gemma 3's Siglip) is not a causal LM: patch() refuses it with
    UnsupportedModel before building anything (transformers' own tests patch every model they build, towers too)."""
    from transformers import SiglipVisionConfig, SiglipVisionModel

    tower = SiglipVisionModel(SiglipVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                                 num_attention_heads=2, image_size=28, patch_size=14))
    with pytest.raises(UnsupportedModel, match="not encoders or vision / audio towers"):
        hf_accel.patch(tower)
    assert hf_accel.patch_report(tower) is None


def test_dynamic_rope_scaling_patches_and_trains_as_unpatched():
    """Dynamic RoPE reads the longest position of each forward back to the host, which the facts probe's fake
    tensors cannot give: its copy takes the default RoPE (same shapes); the patched model computes the unpatched
    one's dynamic frequencies."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    ref_model = LlamaForCausalLM(LlamaConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=8, use_cache=False,
        rope_parameters={"rope_type": "dynamic", "factor": 4.0, "rope_theta": 10000.0}))
    model = copy.deepcopy(ref_model)
    hf_accel.patch(model, backend="sdpa")
    ids, mask, labels = batch("right")  # 11 tokens: past max_position_embeddings, where dynamic scaling acts
    ref_logits, ref_grads = loss_and_grads(ref_model, ids, mask, labels)
    logits, grads = loss_and_grads(model, ids, mask, labels)
    real = mask.bool()
    assert rel_err(logits[real], ref_logits[real]) < LOGITS_RTOL
    assert all(rel_err(grads[n], g) < GRAD_RTOL for n, g in ref_grads.items())
    # the probe ran (not the fallback for a probe that failed): the memory estimate, which needs it, answers
    from hf_accel.memory.estimate import estimate_training_memory

    assert estimate_training_memory(ref_model.config, dtype="fp32", batch_tokens=64).layer.none_bytes > 0


@pytest.mark.parametrize("build", [gemma3_multimodal, gemma4_multimodal], ids=["gemma3", "gemma4"])
def test_a_multimodal_model_is_refused_and_its_text_model_computes_the_same_patched(build):
    """AutoModelForCausalLM builds Gemma 3 4B-27B and Gemma 4 as ...ForConditionalGeneration: patch() refuses it,
    naming hf_accel.text_model. text_model() holds the same modules (no weight copied), gives the full model's
    text-only logits exactly, and patched with its defaults trains like the unpatched multimodal model on a text
    batch (loss and every gradient, fp32) and keeps packed documents apart as the full model computes each alone."""
    full = build().train()
    with pytest.raises(UnsupportedModel, match=r"multimodal.*_text'.*hf_accel.text_model\(model\)"):
        hf_accel.patch(full)
    assert hf_accel.patch_report(full) is None
    text = hf_accel.text_model(full)
    assert text.training and type(text).__name__.endswith("ForCausalLM")
    shared = {id(p) for p in full.parameters()}
    assert all(id(p) in shared for p in text.parameters())
    ids = torch.randint(3, VOCAB, (1, 20), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        assert torch.equal(text.eval()(input_ids=ids).logits, full.eval()(input_ids=ids).logits)
    full.train()
    text.train()
    loss_ref = full(input_ids=ids, labels=ids).loss
    loss_ref.backward()
    ref_grads = {n: p.grad.clone() for n, p in text.named_parameters() if p.grad is not None}
    positions = torch.cat([torch.arange(11), torch.arange(9)])[None]
    with torch.no_grad():
        alone = torch.cat([full(input_ids=ids[:, :11]).logits, full(input_ids=ids[:, 11:]).logits], dim=1)
    full.zero_grad(set_to_none=True)
    hf_accel.patch(text)
    loss = text(input_ids=ids, labels=ids).loss
    loss.backward()
    assert loss.item() == pytest.approx(loss_ref.item(), rel=1e-5)
    grads = dict(text.named_parameters())
    for name, g in ref_grads.items():
        assert rel_err(grads[name].grad, g) < GRAD_RTOL, name
    with torch.no_grad():
        packed = text(input_ids=ids, position_ids=positions).logits
    assert rel_err(packed, alone) < LOGITS_RTOL


def test_text_model_refuses_what_it_cannot_take_apart():
    """A text model, a PEFT model and a module that is no transformers model each get a ConfigurationError saying
    what to pass instead."""
    from hf_accel.errors import ConfigurationError

    with pytest.raises(ConfigurationError, match="has no text sub-config: it is a text model already"):
        hf_accel.text_model(make("llama-gqa"))
    peft = pytest.importorskip("peft")
    lora = peft.get_peft_model(gemma3_multimodal(), peft.LoraConfig(r=2, target_modules=["q_proj"]))
    with pytest.raises(ConfigurationError, match="not a PEFT model.*before get_peft_model"):
        hf_accel.text_model(lora)
    with pytest.raises(ConfigurationError, match="takes a transformers model; got Linear"):
        hf_accel.text_model(torch.nn.Linear(2, 2))


def test_forced_backend_that_cannot_serve_raises():
    model = make("llama-gqa")
    with pytest.raises(BackendUnavailable, match="fa4.*not installed|fa4.*device"):
        hf_accel.patch(model, backend="fa4")
    with pytest.raises(BackendUnavailable, match="unknown attention backend 'nope'"):
        hf_accel.patch(model, backend="nope")
    assert hf_accel.patch_report(model) is None  # a failed patch leaves nothing behind


def _attention_calls(model):
    calls = []
    for module in model.modules():
        if type(module).__name__.endswith("Attention"):
            module.register_forward_hook(lambda *a: calls.append(1))
    return calls


@pytest.mark.parametrize("variant", ["llama-gqa", "falcon-mha", "neox-parallel", "gemma2-softcap"])
def test_checkpointed_layers_still_recompute(variant):
    model = make(variant).train()
    hf_accel.patch(model)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    calls = _attention_calls(model)
    ids = torch.randint(0, VOCAB, (2, 8))
    loss = model(input_ids=ids, labels=ids).loss
    forward_calls = len(calls)
    loss.backward()
    assert forward_calls == model.config.num_hidden_layers
    assert len(calls) == 2 * model.config.num_hidden_layers  # each layer's attention ran again in backward


@pytest.mark.parametrize("variant", ["llama-gqa", "falcon-40b-newarch", "neox-parallel", *NEW_FAMILIES,
                                     *FAMILIES_2026])
def test_lora_grads_equal_patch_before_or_after_peft(variant):
    from peft import LoraConfig, get_peft_model

    from hf_accel.patches import family_of

    ids, mask, labels = batch("right")
    targets = list(family_of(make(variant)).lora_targets)
    cfg = LoraConfig(r=4, lora_alpha=8, target_modules=targets, init_lora_weights=False)

    def lora_grads(order):
        torch.manual_seed(5)
        model = make(variant)
        if order == "before":
            hf_accel.patch(model)
        model = get_peft_model(model, cfg)
        if order == "after":
            hf_accel.patch(model)
        model(input_ids=ids, attention_mask=mask, labels=labels).loss.backward()
        return {n: p.grad for n, p in model.named_parameters() if p.requires_grad}

    unpatched, before, after = lora_grads("none"), lora_grads("before"), lora_grads("after")
    assert unpatched and all(g.abs().sum() > 0 for g in unpatched.values())
    for name, ref in unpatched.items():
        assert rel_err(before[name], ref) < GRAD_RTOL, name
        assert rel_err(after[name], ref) < GRAD_RTOL, name


def test_report_predicts_the_backend_training_calls_use():
    """Attention dropout in training rules out kernels without dropout; the report must say which serves."""
    from hf_accel.attention.kernels import DeviceInfo
    from hf_accel.kernel_choice import training_request
    from hf_accel.patches import family_of

    model = make("llama-gqa")
    model.config.attention_dropout = 0.1
    request = training_request(model, family_of(model), DeviceInfo("cuda", (9, 0)))
    assert request.dropout and request.device.capability == (9, 0)
    rw = make("falcon-rw-alibi")
    rw.config.attention_dropout = 0.1
    assert training_request(rw, family_of(rw), None).dropout
    from hf_accel.patches.falcon import TAKES_ALIBI

    rotary = make("falcon-mha")
    rotary.config.attention_dropout = 0.1
    # Falcon's rotary path has dropout from transformers 5.25 on (its attention-interface forward), none before
    assert training_request(rotary, family_of(rotary), None).dropout == (not TAKES_ALIBI)


@pytest.mark.parametrize("variant", ["falcon-40b-newarch", "falcon-mha", "falcon-rw-alibi", "llama-gqa"])
def test_attention_dropout_in_training_is_the_unpatched_model_s(variant):
    """With attention dropout in training, the patched model draws what the unpatched one draws: the same loss for a
    seed, and another for another seed (dropout applied). Falcon's rotary path had none patched, though
    transformers 5.25 applies it there (the loss never moved with the seed)."""
    import copy

    import hf_accel
    from hf_accel.patches.falcon import TAKES_ALIBI

    config = make(variant).config  # (modules read their dropout when built: a model of the edited config)
    config.attention_dropout, config.hidden_dropout = 0.2, 0.0
    torch.manual_seed(0)
    ref = type(make(variant))(config).train()
    ours = copy.deepcopy(ref)
    hf_accel.patch(ours, backend="sdpa")
    ids = torch.randint(0, 96, (2, 12), generator=torch.Generator().manual_seed(0))

    def loss(model, seed):
        torch.manual_seed(seed)
        return model(input_ids=ids, labels=ids).loss.item()

    for seed in (1, 2):
        assert loss(ours, seed) == pytest.approx(loss(ref, seed), rel=1e-6, abs=1e-6)
    applies = variant in ("falcon-rw-alibi", "llama-gqa") or not TAKES_ALIBI  # (5.17's rotary Falcon: none)
    assert (loss(ours, 1) != loss(ours, 2)) == applies


# ---- defaults: "auto" resolves to the fast path on CUDA, to today's behaviour elsewhere -------------------------
def _h200():
    """A faked device description (no CUDA here), as in tests/test_kernels.py."""
    from hf_accel.attention.kernels import DeviceInfo

    return DeviceInfo("cuda", (9, 0))


def test_auto_speedups_on_a_faked_cuda_device():
    from hf_accel.patching import resolve_speedups

    model = make("llama-gqa")
    got = resolve_speedups(model, _h200(), liger_installed=True)
    assert {name: s.on for name, s in got.items()} == {"fused_ce": True, "fused_ops": True, "compile": True}
    assert all(s.why.startswith("auto: ") for s in got.values())
    no_liger = resolve_speedups(model, _h200(), liger_installed=False)["fused_ops"]
    assert not no_liger.on and "not installed" in no_liger.why
    off = resolve_speedups(model, _h200(), fused_ce=False, fused_ops=False, compile=False, liger_installed=True)
    assert not any(s.on for s in off.values())
    assert [s.line() for s in off.values()] == ["fused_ce: off (fused_ce=False)", "fused_ops: off (fused_ops=False)",
                                                "compile: off (compile=False)"]


@pytest.mark.parametrize("quantizer", ["Bnb4BitHfQuantizer", "Bnb8BitHfQuantizer", "TorchAoHfQuantizer"])
def test_auto_compile_is_on_for_bitsandbytes_4bit_and_stands_down_for_other_quantizers(quantizer):
    from hf_accel.patching import resolve_speedups

    model = make("llama-gqa")
    model.hf_quantizer = type(quantizer, (), {})()  # stand-in; tests/test_qlora.py runs real 4-bit layers
    got = resolve_speedups(model, _h200(), liger_installed=True)
    assert got["fused_ce"].on
    if quantizer == "Bnb4BitHfQuantizer":
        assert got["compile"].on, got["compile"]
    else:
        assert not got["compile"].on and quantizer in got["compile"].why and "4-bit" in got["compile"].why


def test_auto_on_cpu_is_todays_behaviour():
    model = make("llama-gqa").train()
    ref = make("llama-gqa").train()
    report = hf_accel.patch(model)
    assert not report.fused_ce and not report.fused_ops and report.compiled_layers == 0
    assert any(line.startswith("compile: off (auto: on CUDA only") for line in report.speedups)
    assert "fused_ce: off" in str(report)
    ids = torch.randint(0, VOCAB, (1, 10))
    out = model(input_ids=ids, labels=ids)
    assert out.logits is not None  # the stock loss path: logits returned
    torch.testing.assert_close(out.loss, ref(input_ids=ids, labels=ids).loss)
    assert hf_accel.patch(model) is report  # "auto" resolves the same again: idempotent


def test_fp32_master_weights_pick_the_half_precision_kernel():
    """kbit preparation / FSDP2 keep fp32 weights while attention receives bf16 (issue 20): fa4 must not be passed
    over for "cannot do dtype torch.float32"."""
    from hf_accel.attention.kernels import select
    from hf_accel.kernel_choice import training_request
    from hf_accel.patches import family_of

    model = make("llama-gqa")  # fp32 weights
    request = training_request(model, family_of(model), _h200())
    assert request.dtype == torch.bfloat16
    installed = frozenset({"fa4", "torch-fa2", "flex", "sdpa", "reference"})
    assert select(request, "auto", installed).backend.name == "fa4"
    cpu = training_request(model, family_of(model), None)
    assert cpu.dtype == torch.float32  # CPU: unchanged


@pytest.mark.parametrize("variant, feature", [
    ("gemma2-softcap", dict(attn_logit_softcapping=None)),
    ("gemma2-softcap", dict(final_logit_softcapping=None)),
    ("mistral-window", dict(sliding_window=None)),
    ("gemma3-text", dict(query_pre_attn_scalar=16)),
])
def test_the_tiny_configs_exercise_each_family_feature(variant, feature):
    """The equivalence tests can fail: each family feature the seam or the fused loss must honour changes the tiny
    model's logits by far more than the tests' tolerance (soft-capping barely changes random-init scores, hence the
    configs' scale and caps)."""
    ref = make(variant)
    other = copy.deepcopy(ref)
    for key, value in feature.items():
        setattr(other.config, key, value)
    for module in other.modules():  # attention modules copy these at construction
        if "attn_logit_softcapping" in feature and hasattr(module, "attn_logit_softcapping"):
            module.attn_logit_softcapping = feature["attn_logit_softcapping"]
        if "query_pre_attn_scalar" in feature and hasattr(module, "scaling"):
            module.scaling = feature["query_pre_attn_scalar"] ** -0.5
    ids, mask, _ = batch("none")
    with torch.no_grad():
        assert rel_err(other(input_ids=ids).logits, ref(input_ids=ids).logits) > 100 * LOGITS_RTOL


@pytest.mark.parametrize("variant", ["gemma2-softcap", "mistral-window"])
def test_a_named_backend_that_cannot_softcap_hands_those_layers_on_and_says_so(variant):
    """backend="sdpa" cannot soft-cap: Gemma 2's layers go to a backend that can (reference on CPU), named in the
    report; Mistral's window sdpa can do, so nothing is handed on."""
    model = make(variant)
    report = hf_accel.patch(model, backend="sdpa")
    tags = {m._hf_accel_backend for m in model.modules() if hasattr(m, "_hf_accel_backend")}
    if variant.startswith("gemma2"):
        assert report.backend == "reference" and tags == {"auto"}
        assert any("backend 'sdpa' cannot do" in note and "softcap" in note for note in report.notes)
    else:
        assert report.backend == "sdpa" and tags == {"sdpa"} and not report.notes


@pytest.mark.parametrize("built_with", ["sdpa", "eager"])
def test_a_soft_capped_model_built_on_sdpa_is_told_its_unpatched_attention_drops_the_cap(built_with):
    """transformers 5.17 builds Gemma 2 on SDPA by default, which drops the attention soft-cap; the patched model
    applies it. The report says so for such a model (and not for one built with eager, nor for a model without a
    soft-cap)."""
    model = make("gemma2-softcap")
    model.config._attn_implementation = built_with  # what 5.17's default gives; 5.25 refuses to build it so
    report = hf_accel.patch(model)
    said = [n for n in report.notes if "drops the attention soft-cap" in n]
    assert len(said) == (built_with == "sdpa"), report.notes
    assert not any("drops the attention soft-cap" in n for n in hf_accel.patch(make("mistral-window")).notes)


# ---- patch()'s options: one validated object -----------------------------------------------------------------------
def test_keyword_arguments_and_patch_options_are_the_same_call():
    """patch(model, compile=False, ...) builds the PatchOptions that patch(model, options=...) is given: the same
    patch (an equal report; re-patching with the other form keeps it), and the same forward."""
    from hf_accel.patch_options import PatchOptions

    ids = torch.randint(0, VOCAB, (1, 12))
    by_keywords, by_options = make("llama-gqa").train(), make("llama-gqa").train()
    keywords = dict(backend="reference", checkpointing="full", fused_ce=False, compile=False, mlp_chunks=8)
    report = hf_accel.patch(by_keywords, **keywords)
    options = PatchOptions(**keywords)
    assert options.policy is not None and options.policy.describe().startswith("full checkpointing")
    assert hf_accel.patch(by_options, options=options) == report
    assert hf_accel.patch(by_options, **keywords) is hf_accel.patch_report(by_options)  # the same settings: kept
    torch.testing.assert_close(by_options(input_ids=ids, labels=ids).loss, by_keywords(input_ids=ids, labels=ids).loss)


@pytest.mark.parametrize("settings, message", [
    (dict(fused_ce="yes"), "fused_ce must be True, False or 'auto'; got 'yes'"),
    (dict(fused_ops=1), "fused_ops must be True, False or 'auto'; got 1"),
    (dict(compile="yes"), "compile must be True, False or a dict of torch.compile options"),
    (dict(compile={"nested_graph_breaks": "false"}), "'nested_graph_breaks': ...} must be True or False .*got 'false'"),
    (dict(mlp_chunks=-8), "mlp_chunks must be 'auto', a chunk size in tokens"),
    (dict(checkpointing="every_other"), "checkpointing spec"),
    (dict(compile=True, compile_stand_down="DeepSpeed"), "needs compile=False"),
])
def test_patch_options_refuse_bad_settings_when_made(settings, message):
    """Each setting's "auto" / spec form is checked once, when the options are made (before any model is touched),
    with the message patch() gives for it."""
    from hf_accel.errors import ConfigurationError
    from hf_accel.patch_options import PatchOptions

    with pytest.raises(ConfigurationError, match=message):
        PatchOptions(**settings)
    model = make("llama-gqa")
    if "compile_stand_down" not in settings:
        with pytest.raises(ConfigurationError, match=message):
            hf_accel.patch(model, backend="reference", **settings)
    assert hf_accel.patch_report(model) is None


def test_options_and_keyword_arguments_together_are_refused():
    from hf_accel.errors import ConfigurationError
    from hf_accel.patch_options import PatchOptions

    with pytest.raises(ConfigurationError, match="not both .*compile"):
        hf_accel.patch(make("llama-gqa"), compile=False, options=PatchOptions(backend="reference"))


def test_a_stand_down_reason_is_the_reports_compile_line():
    """A caller that turns "auto" compile off for its run (a Trainer under DeepSpeed) passes why; the report is built
    with that line, not edited afterwards."""
    from hf_accel.patch_options import PatchOptions

    reason = "stands down under DeepSpeed"
    report = hf_accel.patch(make("llama-gqa"), options=PatchOptions(backend="reference", compile=False,
                                                                    compile_stand_down=reason))
    assert report.speedups[-1] == f"compile: off (auto: {reason})" and report.compiled_layers == 0


@pytest.mark.parametrize("variant", ["qwen3-moe", "gpt-oss", "mixtral"])
def test_patch_runs_mixture_of_experts_layers_grouped_and_unpatch_restores_them(variant):
    """patch() binds the grouped experts forward (hf_accel.patches.experts) to every experts module, says so, and
    unpatch() restores the stock forward; the step equals the unpatched model's (the eager experts)."""
    from hf_accel.patches import experts

    ref = make(variant)
    ours = copy.deepcopy(ref)
    report = hf_accel.patch(ours)
    found = experts.find_experts(ours)
    assert found and all("forward" in m.__dict__ for _, m in found)
    assert any(f"experts: {len(found)} mixture-of-experts modules" in note for note in report.notes)
    ids, mask, labels = batch("right")
    _, grads = loss_and_grads(ours, ids, mask, labels)
    _, ref_grads = loss_and_grads(ref, ids, mask, labels)
    assert grads.keys() == ref_grads.keys()
    for name, g in ref_grads.items():
        assert rel_err(grads[name], g) < GRAD_RTOL, name
    hf_accel.unpatch(ours)
    assert not any("forward" in m.__dict__ for _, m in experts.find_experts(ours))


def test_a_gemma4_body_patched_on_its_own_takes_a_padding_mask():
    """Gemma 4's text model (the body, called without logits_to_keep: its default int 0) slices its queries for the
    KV-shared layers by that int, indexing the masks as 4D; the seam's 2D padding mask is handed a slice instead, so
    the body computes the unpatched body's hidden states at real tokens (transformers' own
    test_resize_tokens_embeddings hit this)."""
    ref = make("gemma4-text").model.train()
    ours = copy.deepcopy(ref)
    hf_accel.patch(ours)
    ids, mask, _ = batch("left")
    got = ours(input_ids=ids, attention_mask=mask).last_hidden_state
    want = ref(input_ids=ids, attention_mask=mask).last_hidden_state
    assert rel_err(got[mask.bool()], want[mask.bool()]) < LOGITS_RTOL
