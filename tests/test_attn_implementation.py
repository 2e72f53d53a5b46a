"""A patched model reports and honours ``attn_implementation`` as transformers users (and transformers' own model tests)
expect, and generation is the same whatever the cache.

Each test reproduces a failure transformers' Llama / GPT-NeoX / Falcon model tests found with every model patched:
``config.output_attentions = True`` on an eager model raised, ``set_attn_implementation`` and the sdpa dispatch checks
read hf_accel's name, the GPT-NeoX cached-forward test asserted "sdpa", and a right-padded generate with a dynamic
cache (prefill through the seam) and with a static cache (stock) disagreed at the padded last position.
"""
from __future__ import annotations

import copy

import pytest
import torch
from transformers import AutoModelForCausalLM, DynamicCache

import hf_accel
from hf_accel.attention import varlen
from tiny_models import VOCAB, make

pytestmark = pytest.mark.usefixtures("one_torch_thread")

REGISTRY = ["llama-gqa", "neox-parallel"]  # families that go through transformers' AttentionInterface




def _eager(variant: str):
    model = make(variant)
    model.set_attn_implementation("eager")
    return model


def _seam_calls(monkeypatch) -> list:
    calls = []
    real = varlen.from_mask_and_positions
    monkeypatch.setattr(varlen, "from_mask_and_positions", lambda *a, **k: calls.append(1) or real(*a, **k))
    return calls


@pytest.mark.parametrize("variant", REGISTRY + ["falcon-mha"])
def test_config_reports_the_users_implementation(variant):
    """transformers' sdpa dispatch checks and GPT-NeoX's cached-forward test read config._attn_implementation."""
    model = make(variant)
    hf_accel.patch(model, backend="sdpa")
    assert model.config._attn_implementation == "sdpa"
    eager = _eager(variant) if variant in REGISTRY else None
    if eager is not None:
        hf_accel.patch(eager, backend="sdpa")
        assert eager.config._attn_implementation == "eager"


@pytest.mark.parametrize("variant", REGISTRY + ["gemma2-softcap"])
def test_config_output_attentions_on_a_patched_eager_model(variant):
    """transformers' test_attention_outputs sets config.output_attentions = True on a model built with eager: allowed,
    and the probabilities are eager's."""
    ref = _eager(variant)
    model = copy.deepcopy(ref)
    hf_accel.patch(model, backend="sdpa")
    model.config.output_attentions = True  # raised "not supported when using the attn_implementation set to hf_accel"
    ref.config.output_attentions = True
    ids = torch.randint(1, VOCAB, (2, 7), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        got, want = model(input_ids=ids).attentions, ref(input_ids=ids).attentions
    assert len(got) == len(want) == model.config.num_hidden_layers
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w)


@pytest.mark.parametrize("variant", REGISTRY)
def test_set_attn_implementation_after_patching_is_honoured(variant, monkeypatch):
    """transformers' test_can_set_attention_dynamically on a patched eager model: "sdpa" takes, "foo" is refused with
    transformers' own error, and training calls still take hf_accel's seam, equal to the unpatched model."""
    ref = _eager(variant)
    model = copy.deepcopy(ref)
    hf_accel.patch(model, backend="sdpa")
    assert model.config._attn_implementation == "eager"
    model.set_attn_implementation("sdpa")
    assert model.config._attn_implementation == "sdpa"
    with pytest.raises(ValueError, match='Specified `attn_implementation="foo"` is not supported'):
        model.set_attn_implementation("foo")
    assert model.config._attn_implementation == "sdpa"
    calls = _seam_calls(monkeypatch)
    ids = torch.randint(1, VOCAB, (2, 7), generator=torch.Generator().manual_seed(1))
    model.train(), ref.train()
    got, want = model(input_ids=ids, labels=ids).loss, ref(input_ids=ids, labels=ids).loss
    assert calls and model.config._attn_implementation == "sdpa"
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("variant", REGISTRY)
def test_a_patched_model_saved_and_loaded_reports_what_it_was_loaded_with(variant, tmp_path):
    """transformers' test_sdpa_can_dispatch_non_composite_models: save, load with sdpa and with eager, patch both."""
    model = make(variant)
    hf_accel.patch(model)
    model.save_pretrained(tmp_path)
    for implementation in ("sdpa", "eager"):
        loaded = AutoModelForCausalLM.from_pretrained(tmp_path, attn_implementation=implementation)
        hf_accel.patch(loaded)
        assert loaded.config._attn_implementation == implementation
    assert "hf_accel" not in (tmp_path / "config.json").read_text()


@pytest.mark.parametrize("variant", REGISTRY + ["falcon-mha"])
def test_cached_forward_with_and_without_a_full_mask(variant):
    """GPT-NeoX's test_cached_forward_with_and_without_attention_mask, patched: a prefill into a cache, then the rest,
    with a mask of ones or none, give the same outputs."""
    model = make(variant)
    hf_accel.patch(model)
    assert model.config._attn_implementation == "sdpa"
    ids = torch.randint(1, VOCAB, (2, 8), generator=torch.Generator().manual_seed(2))
    ones = torch.ones_like(ids)
    outs = []
    with torch.no_grad():
        for mask in (ones, None):
            cache = DynamicCache(config=model.config)
            model(input_ids=ids[:, :4], attention_mask=None if mask is None else mask[:, :4], past_key_values=cache,
                  use_cache=True)
            outs.append(model(input_ids=ids[:, 4:], attention_mask=mask, past_key_values=cache, use_cache=True).logits)
    torch.testing.assert_close(outs[0], outs[1])


@pytest.mark.parametrize("variant", REGISTRY + ["falcon-mha", "gemma2-softcap", "mistral-window"])
def test_right_padded_generation_is_the_same_with_dynamic_and_static_caches(variant):
    """Llama's test_generate_with_static_cache, deterministically: a right-padded row's next token comes from its
    padded last position; a prefill filling a cache from a padding mask runs stock, so the dynamic cache's prefill
    (queries as long as keys) and the static cache's (always stock) agree, and both equal the unpatched model; so
    does generation without a cache (every step a forward over a padded batch, outside training: stock)."""
    ref = make(variant)
    model = copy.deepcopy(ref)
    hf_accel.patch(model, backend="sdpa")
    ids = torch.randint(1, VOCAB, (2, 7), generator=torch.Generator().manual_seed(3))
    mask = torch.ones_like(ids)
    mask[0, 4:] = 0
    kwargs = dict(input_ids=ids, attention_mask=mask, max_new_tokens=3, do_sample=False, pad_token_id=0,
                  output_logits=True, return_dict_in_generate=True)
    logits = {}
    for name, m in (("stock", ref), ("patched", model)):
        for cache in ("dynamic", "static", None):
            logits[name, cache] = torch.stack(m.generate(cache_implementation=cache, use_cache=cache is not None,
                                                         **kwargs).logits)
    for key, value in logits.items():
        torch.testing.assert_close(value, logits["stock", "dynamic"], msg=str(key))


@pytest.mark.parametrize("variant", REGISTRY)
def test_packed_eval_with_a_cache_keeps_the_seam(variant, monkeypatch):
    """Only a cache filled from a padding mask runs stock: packed rows (no mask) keep hf_accel's document separation
    even with a cache (where stock transformers does not look for packed documents)."""
    model = make(variant)
    hf_accel.patch(model)
    calls = _seam_calls(monkeypatch)
    ids = torch.randint(1, VOCAB, (1, 8))
    pos = torch.tensor([[0, 1, 2, 0, 1, 2, 3, 4]])
    with torch.no_grad():
        packed = model(input_ids=ids, position_ids=pos, use_cache=True).logits
        alone = torch.cat([model(input_ids=ids[:, :3]).logits, model(input_ids=ids[:, 3:]).logits], dim=1)
    assert calls
    torch.testing.assert_close(packed, alone, rtol=1e-4, atol=1e-5)


def test_unpatch_leaves_a_pinned_name_as_it_was():
    """Sequence parallelism pins hf_accel's name in the config (DeepSpeed intercepts by it); unpatch restores."""
    from hf_accel.patching import pin_attention_name

    model = _eager("llama-gqa")
    hf_accel.patch(model)
    assert pin_attention_name(model) == model.config._attn_implementation == "hf_accel"
    ids = torch.randint(1, VOCAB, (1, 6))
    ref = _eager("llama-gqa")
    with torch.no_grad():
        cache = DynamicCache(config=model.config)
        model(input_ids=ids, past_key_values=cache, use_cache=True)
        step = model(input_ids=ids[:, :1], past_key_values=cache, use_cache=True).logits  # a stock decode step
        ref_cache = DynamicCache(config=ref.config)
        ref(input_ids=ids, past_key_values=ref_cache, use_cache=True)
        torch.testing.assert_close(step, ref(input_ids=ids[:, :1], past_key_values=ref_cache, use_cache=True).logits)
    hf_accel.unpatch(model)
    assert model.config._attn_implementation == "eager"
