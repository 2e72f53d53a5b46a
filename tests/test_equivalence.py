"""A patched model computes what the unpatched transformers model computes, for every input transformers accepts.

Live reference: the same tiny model unpatched (fp32, CPU, SDPA unless said otherwise). Logits at real tokens and every
parameter gradient, over each family's variants: masks with holes, attention probabilities (``output_attentions``),
each way a batch can enter (4D masks, inputs_embeds, logits_to_keep, batch size 1, an all-zero row, positions not
starting at 0, left padding with a KV cache), and decode steps traced by ``torch.compile(fullgraph=True)``.
"""
from __future__ import annotations

import copy

import pytest
import torch
from transformers import DynamicCache, StaticCache

import hf_accel
from hf_accel.attention import varlen
from hf_accel.patches.falcon import TAKES_ALIBI as FALCON_TAKES_ALIBI
from tiny_models import FAMILIES_2026, NEW_FAMILIES, VOCAB, make, slow_2026

pytestmark = pytest.mark.usefixtures("one_torch_thread")

LOGITS_RTOL = 2e-4  # relative to the logits' scale, as in test_patch
GRAD_RTOL = 1e-3  # relative to each gradient's scale
ATTN_ATOL = 1e-5  # attention probabilities lie in [0, 1]

VARIANTS = [
    "llama-gqa", "llama-mqa",
    "neox-parallel", "neox-sequential",  # partial rotary (rotary_pct 0.25), both residual layouts
    "falcon-40b-newarch", "falcon-7b-mqa", "falcon-rw-alibi", "falcon-mha",
    *NEW_FAMILIES,  # qkv bias, q/k norm, sliding window, soft-capping with sliding + global layers
    *FAMILIES_2026,  # found from the model (hf_accel.facts): sinks, chunked layers, per-layer head_dim, MoE, ...
]
# Falcon: rotary and ALiBi; Gemma 2: soft-capping, a sliding layer and a global one
ENTRY_VARIANTS = ["llama-gqa", "neox-sequential", "falcon-mha", "falcon-rw-alibi", "gemma2-softcap"]

# Holes: zeros inside a row, not only at its ends (the repro), plus plain left padding in a third row.
HOLES = torch.tensor([[1, 1, 0, 0, 0, 1, 1], [1, 0, 1, 1, 0, 1, 1], [0, 0, 1, 1, 1, 1, 1]])




def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-12)).item()


def set_implementation(model, implementation: str) -> None:
    if model.config.model_type == "falcon":  # Falcon's set_attn_implementation is a no-op; its forward reads the config
        model.config._attn_implementation = implementation
    else:
        model.set_attn_implementation(implementation)


def pair(variant: str, implementation: str | None = None, **config):
    """(unpatched reference, patched copy): same weights."""
    ref = make(variant)
    if implementation == "sdpa" and not ref._supports_sdpa:
        pytest.skip(f"transformers refuses SDPA for {ref.config.model_type} (its eager attention is the reference)")
    if implementation is not None:
        set_implementation(ref, implementation)
    for key, value in config.items():
        setattr(ref.config, key, value)
    model = copy.deepcopy(ref)
    report = hf_accel.patch(model, backend="sdpa")
    return ref, model, report


def ids_for(mask: torch.Tensor, seed: int = 1) -> torch.Tensor:
    return torch.randint(1, VOCAB, tuple(mask.shape), generator=torch.Generator().manual_seed(seed))


def labels_for(ids: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    """A target counts only when it and the token predicting it are real (what a model computes at a masked slot is
    undefined)."""
    if mask is None:
        return ids.clone()
    predictor_real = torch.nn.functional.pad(mask[:, :-1], (1, 0), value=0).bool()
    return ids.masked_fill(~(mask.bool() & predictor_real), -100)


def run(model, real: torch.Tensor | None, **inputs):
    """Logits at real tokens and every parameter gradient of one training-style step (the loss from the labels in
    ``inputs``, else from the logits at real tokens)."""
    model.zero_grad()
    out = model(**inputs)
    logits = out.logits if real is None else out.logits[real]
    loss = out.loss if out.loss is not None else logits.square().mean()
    loss.backward()
    return logits.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def assert_same_step(ref, model, real: torch.Tensor | None = None, **inputs) -> None:
    """Same logits at real tokens and same gradients; where stock refuses the input, the patched model refuses it
    the same way."""
    try:
        ref_logits, ref_grads = run(ref, real, **inputs)
    except Exception as stock_error:
        with pytest.raises(type(stock_error)):
            run(model, real, **inputs)
        return
    logits, grads = run(model, real, **inputs)
    assert logits.shape == ref_logits.shape
    assert rel_err(logits, ref_logits) < LOGITS_RTOL
    assert grads.keys() == ref_grads.keys()
    for name in ref_grads:
        assert rel_err(grads[name], ref_grads[name]) < GRAD_RTOL, name


# 1. masks with holes -------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("variant", slow_2026(VARIANTS))
@pytest.mark.parametrize("positions", ["default", "continuing"])
def test_mask_with_holes_hides_keys_only(variant, positions):
    """A hole hides its keys and changes nothing else: real tokens after it still see the real tokens before it."""
    ref, model, _ = pair(variant)
    mask, ids = HOLES, ids_for(HOLES)
    inputs = dict(input_ids=ids, attention_mask=mask, labels=labels_for(ids, mask))
    if positions == "continuing":  # what generate() passes: positions count real tokens, so they run on across a hole
        inputs["position_ids"] = (mask.cumsum(-1) - 1).clamp_min(0)
    assert_same_step(ref, model, real=mask.bool(), **inputs)


# 2. attention probabilities ------------------------------------------------------------------------------------------

@pytest.mark.parametrize("variant", slow_2026(VARIANTS))
@pytest.mark.parametrize("implementation", ["eager", "sdpa"])
def test_output_attentions_returns_probabilities(variant, implementation):
    """output_attentions=True gives the unpatched eager model's probabilities, logits and gradients; the report says
    which implementation was replaced and what serves these calls; the next call takes the seam again."""
    ref, model, report = pair(variant, implementation)
    assert report.replaced_attn_implementation == implementation
    assert report.attentions and "output_attentions" in str(report) and repr(implementation) in str(report)
    # stock SDPA returns no probabilities (with a warning); eager is the reference. Falcon's original forward up to
    # transformers 5.24 kept the configured math and returned them
    if not (variant.startswith("falcon") and FALCON_TAKES_ALIBI):
        set_implementation(ref, "eager")
    mask = HOLES
    ids = ids_for(mask)
    inputs = dict(input_ids=ids, attention_mask=mask, labels=labels_for(ids, mask), output_attentions=True)
    ref_out, out = ref(**inputs), model(**inputs)
    # one per attention layer (a hybrid model's linear-attention layers return none)
    types = getattr(ref.config, "layer_types", None) or ["full_attention"] * ref.config.num_hidden_layers
    assert len(out.attentions) == len(ref_out.attentions) == sum(t != "linear_attention" for t in types)
    real = mask.bool()
    for got, want in zip(out.attentions, ref_out.attentions):
        assert got.shape == want.shape
        # probabilities of real queries (a masked query's row is undefined)
        assert (got - want).abs().permute(0, 2, 1, 3)[real].max() < ATTN_ATOL
    assert rel_err(out.logits[real], ref_out.logits[real]) < LOGITS_RTOL
    out.attentions[0].retain_grad()  # transformers' own attention-gradient test
    out.loss.backward()
    assert out.attentions[0].grad is not None
    if not variant.startswith("falcon"):
        assert model.config._attn_implementation == implementation  # switched for that call only


@pytest.mark.parametrize("variant", ["llama-gqa", "neox-parallel"])
def test_output_attentions_from_config_then_seam_again(variant, monkeypatch):
    """config.output_attentions=True (set before patching: transformers refuses it for non-eager names) is honoured
    like the argument; a training call with output_attentions=False then takes hf_accel's seam (outside training a
    padded batch runs stock)."""
    ref, model, _ = pair(variant, "eager", output_attentions=True)
    ids = ids_for(HOLES)
    want = ref(input_ids=ids, attention_mask=HOLES).attentions
    got = model(input_ids=ids, attention_mask=HOLES).attentions
    assert len(got) == len(want) == 2 and all(g.shape == w.shape for g, w in zip(got, want))
    calls = []
    real = varlen.from_mask_and_positions
    monkeypatch.setattr(varlen, "from_mask_and_positions", lambda *a, **k: calls.append(1) or real(*a, **k))
    model.train(), ref.train()
    out = model(input_ids=ids, attention_mask=HOLES, output_attentions=False)
    assert calls == [1] and not out.attentions
    ref_logits = ref(input_ids=ids, attention_mask=HOLES).logits
    assert rel_err(out.logits[HOLES.bool()], ref_logits[HOLES.bool()]) < LOGITS_RTOL


@pytest.mark.parametrize("variant", ["llama-mqa", "neox-sequential", "falcon-mha"])
def test_output_attentions_on_packed_rows_as_stock(variant):
    """A packed row (position_ids restarting, no mask, no cache) asking for probabilities: transformers' own mask
    preparation sees the packing (hf_accel's skip of its packed search is off for that call)."""
    ref, model, _ = pair(variant, "eager")
    ids = ids_for(torch.ones(1, 9))
    positions = torch.tensor([[0, 1, 2, 3, 0, 1, 2, 0, 1]])
    inputs = dict(input_ids=ids, position_ids=positions, output_attentions=True, use_cache=False)
    want, got = ref(**inputs), model(**inputs)
    for g, w in zip(got.attentions, want.attentions):
        assert (g - w).abs().max() < ATTN_ATOL
    assert rel_err(got.logits, want.logits) < LOGITS_RTOL


@pytest.mark.parametrize("variant", ["neox-parallel", "falcon-mha"])
def test_deep_copy_of_a_patched_model_switches_itself(variant):
    """A deep copy (a reference or EMA model) asks its own hooks: probabilities, and a caller's 4D mask on Falcon."""
    ref, model, _ = pair(variant, "eager")
    twin = copy.deepcopy(model)
    ids = ids_for(HOLES)
    got = twin(input_ids=ids, attention_mask=HOLES, output_attentions=True).attentions
    want = ref(input_ids=ids, attention_mask=HOLES, output_attentions=True).attentions
    assert len(got) == len(want) and all((g - w).abs().max() < 1 for g, w in zip(got, want))
    assert model.config._attn_implementation == twin.config._attn_implementation
    mask4d = _prefix_lm_mask(3, 7, prefix=3, float_mask=True)  # eager adds a bool mask as numbers
    with torch.no_grad():
        assert rel_err(twin(input_ids=ids, attention_mask=mask4d).logits,
                       ref(input_ids=ids, attention_mask=mask4d).logits) < LOGITS_RTOL


# 3. every entry point of a batch -------------------------------------------------------------------------------------

def _prefix_lm_mask(batch: int, seq: int, prefix: int, float_mask: bool) -> torch.Tensor:
    """A 4D mask transformers passes through unchanged: bidirectional over a prefix, causal after it."""
    allowed = torch.ones(seq, seq, dtype=torch.bool).tril()
    allowed[:prefix, :prefix] = True
    allowed = allowed[None, None].expand(batch, 1, seq, seq).clone()
    allowed[1, :, :, :2] = False  # and some hidden keys
    allowed[1, :, :2, :2] = torch.eye(2, dtype=torch.bool)  # every query still sees something
    if not float_mask:
        return allowed
    return torch.zeros(allowed.shape).masked_fill(~allowed, torch.finfo(torch.float32).min)


ENTRY_POINTS = ["4d-bool", "4d-float", "inputs-embeds", "logits-to-keep", "batch1-no-mask", "zero-row",
                "positions-offset", "positions-offset-masked"]


@pytest.mark.parametrize("variant", ENTRY_VARIANTS)
@pytest.mark.parametrize("entry", ENTRY_POINTS)
def test_batch_entry_points(variant, entry):
    ref, model, _ = pair(variant)
    mask = torch.ones(3, 7, dtype=torch.long)
    mask[1, 5:] = 0
    ids = ids_for(mask)
    inputs = dict(input_ids=ids, attention_mask=mask, labels=labels_for(ids, mask))
    real = mask.bool()
    if entry.startswith("4d"):
        inputs["attention_mask"] = _prefix_lm_mask(3, 7, prefix=3, float_mask=entry == "4d-float")
        inputs["labels"], real = labels_for(ids, None), None
    elif entry == "inputs-embeds":
        inputs["inputs_embeds"] = ref.get_input_embeddings()(inputs.pop("input_ids")).detach()
    elif entry == "logits-to-keep":
        del inputs["labels"]  # stock's loss needs full-length logits; the loss then comes from the kept logits
        inputs["logits_to_keep"], real = 3, real[:, -3:]
    elif entry == "batch1-no-mask":
        inputs = dict(input_ids=ids[:1], labels=ids[:1])
        real = None
    elif entry == "zero-row":
        mask[2] = 0
        inputs["labels"], real = labels_for(ids, mask), mask.bool()
    elif entry == "positions-offset":  # a continuation: positions start at 5, no mask
        del inputs["attention_mask"]
        inputs.update(position_ids=torch.arange(5, 12)[None], labels=ids.clone())
        real = None
    elif entry == "positions-offset-masked":
        inputs["position_ids"] = torch.arange(5, 12)[None].expand(3, 7)
    assert_same_step(ref, model, real=real, **inputs)


@pytest.mark.parametrize("variant", slow_2026(VARIANTS))
def test_left_padding_with_kv_cache(variant):
    """Prefill a left-padded batch (one row with a hole) into a KV cache, then decode: every step's logits as stock."""
    ref, model, _ = pair(variant)
    mask = torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1], [1, 0, 0, 1, 1]])
    ids = ids_for(mask)
    with torch.no_grad():
        steps = [_decode(m, m, DynamicCache(config=m.config), ids, mask, steps=3) for m in (ref, model)]
    for want, got in zip(*steps):
        assert rel_err(got, want) < LOGITS_RTOL


# 4. torch.compile(fullgraph=True) of evaluation / decoding -----------------------------------------------------------

def _decode(model, forward, cache, ids, mask, steps: int) -> list[torch.Tensor]:
    """Greedy decoding through ``forward`` (prefill included): last-position logits of every step."""
    positions = (mask.cumsum(-1) - 1).clamp_min(0)
    out = forward(input_ids=ids, attention_mask=mask, position_ids=positions, past_key_values=cache, use_cache=True)
    logits = [out.logits[:, -1]]
    for _ in range(steps):
        token = logits[-1].argmax(-1, keepdim=True)
        mask = torch.cat([mask, torch.ones_like(token)], dim=1)
        positions = mask.sum(-1, keepdim=True) - 1
        out = forward(input_ids=token, attention_mask=mask, position_ids=positions, past_key_values=cache,
                      use_cache=True)
        logits.append(out.logits[:, -1])
    return logits


def _cache(model, kind: str):
    return StaticCache(config=model.config, max_cache_len=8) if kind == "static" else DynamicCache(config=model.config)


_SLOW = pytest.mark.slow  # each case compiles a decode step (dynamo, fullgraph): ~10 s on 2 cores


@pytest.mark.parametrize("variant, cache", [
    ("llama-gqa", "static"), pytest.param("llama-mqa", "dynamic", marks=_SLOW),
    pytest.param("neox-parallel", "static", marks=_SLOW), pytest.param("neox-sequential", "dynamic", marks=_SLOW),
    pytest.param("falcon-40b-newarch", "static", marks=_SLOW),
    pytest.param("falcon-rw-alibi", "dynamic", marks=_SLOW),  # stock ALiBi Falcon has no static cache path
    pytest.param("gemma2-softcap", "static", marks=_SLOW),  # soft-capping, a sliding and a global layer
])
def test_compiled_decoding_traces_with_fullgraph(variant, cache, monkeypatch):
    """The whole module (forward hooks included) compiles with fullgraph=True for prefill and decode steps, and gives
    the unpatched model's logits; the eager training path still takes the seam afterwards."""
    ref, model, _ = pair(variant)
    mask = torch.tensor([[0, 1, 1, 1], [1, 1, 1, 1]])
    ids = ids_for(mask)
    torch._dynamo.reset()
    compiled = torch.compile(model, fullgraph=True, backend="eager")  # tracing is what breaks; no codegen needed
    with torch.no_grad():
        want = _decode(ref, ref, _cache(ref, cache), ids, mask, steps=1)
        got = _decode(model, compiled, _cache(model, cache), ids, mask, steps=1)
    torch._dynamo.reset()
    for w, g in zip(want, got):
        assert rel_err(g, w) < LOGITS_RTOL
    calls = []
    real = varlen.from_mask_and_positions
    monkeypatch.setattr(varlen, "from_mask_and_positions", lambda *a, **k: calls.append(1) or real(*a, **k))
    model.train()
    model(input_ids=ids, attention_mask=mask, labels=ids).loss.backward()
    assert calls == [1]  # training still runs hf_accel's kernels


def test_a_global_layer_that_keeps_the_config_window_on_its_module_attends_to_everything():
    """EXAONE 4 keeps ``config.sliding_window`` on every attention module and passes ``sliding_window`` only from its
    sliding layers (``None`` from the global ones, as transformers' flash path reads it). The seam took the module's
    attribute first, so the global layers got the window too: patched logits were off by ~3 on rows longer than the
    window. The call's own keyword decides; padded left and right, packed, and the gradients equal the unpatched
    model's."""
    from transformers import Exaone4Config, Exaone4ForCausalLM

    config = Exaone4Config(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                           num_attention_heads=4, num_key_value_heads=2, head_dim=16, sliding_window=4,
                           layer_types=["sliding_attention", "full_attention"], pad_token_id=0)
    torch.manual_seed(0)
    ref = Exaone4ForCausalLM(config).train()
    ours = copy.deepcopy(ref)
    hf_accel.patch(ours)
    ids = torch.randint(1, VOCAB, (2, 14), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    mask[0, :3] = 0  # left padding
    mask[1, -2:] = 0  # right padding
    out_ref = ref(input_ids=ids, attention_mask=mask, labels=ids.masked_fill(mask == 0, -100))
    out_ours = ours(input_ids=ids, attention_mask=mask, labels=ids.masked_fill(mask == 0, -100))
    real = mask.bool()
    torch.testing.assert_close(out_ours.logits[real], out_ref.logits[real], rtol=1e-4, atol=1e-5)
    out_ref.loss.backward()
    out_ours.loss.backward()
    for (name, a), b in zip(ref.named_parameters(), ours.parameters()):
        torch.testing.assert_close(b.grad, a.grad, rtol=1e-4, atol=1e-6, msg=name)
    with torch.no_grad():  # packed: each document as it computes alone (two longer than the window)
        pos = torch.cat([torch.arange(6), torch.arange(8)])[None]
        packed = ours(input_ids=ids[:1], position_ids=pos).logits
        alone = torch.cat([ref(input_ids=ids[:1, :6]).logits, ref(input_ids=ids[:1, 6:]).logits], dim=1)
    torch.testing.assert_close(packed, alone, rtol=1e-4, atol=1e-5)


def test_a_model_that_computes_its_own_positions_reads_no_documents_from_position_ids():
    """BART's decoder as a causal LM takes no position_ids: its positions never restart, and stock SDPA builds a plain
    causal mask, so position_ids that reach its attention through **kwargs tell stock nothing. The seam took them as
    document starts, so a packed row computed neither what stock computes nor each document alone (0.03 off on this
    tiny config). Patched, it computes what stock computes for every layout, and its report says packed documents
    are not kept apart (tests/test_packing_safety.py: what the Trainers do then)."""
    from transformers import BartConfig, BartForCausalLM

    config = BartConfig(vocab_size=VOCAB, d_model=64, decoder_layers=2, decoder_attention_heads=4,
                        decoder_ffn_dim=128, encoder_layers=1, encoder_attention_heads=4, encoder_ffn_dim=128,
                        max_position_embeddings=64, dropout=0.0, attention_dropout=0.0, activation_dropout=0.0,
                        pad_token_id=0, is_decoder=True, add_cross_attention=False, use_cache=False)
    torch.manual_seed(0)
    ref = BartForCausalLM(config).train()
    ours = copy.deepcopy(ref)
    hf_accel.patch(ours)
    ids = torch.randint(1, VOCAB, (1, 14), generator=torch.Generator().manual_seed(0))
    pos = torch.cat([torch.arange(6), torch.arange(8)])[None]
    with torch.no_grad():
        torch.testing.assert_close(ours(input_ids=ids, position_ids=pos).logits,
                                   ref(input_ids=ids, position_ids=pos).logits, rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(ours(input_ids=ids).logits, ref(input_ids=ids).logits, rtol=1e-4, atol=1e-5)
    from hf_accel.patching import STATE_ATTR

    assert "computes its own positions" in ours.__dict__[STATE_ATTR].report.packing


def test_position_ids_passed_down_to_a_decoder_that_takes_them_start_documents():
    """Whisper's decoder as a causal LM: its forward and its wrapper's take no position_ids but pass **kwargs on to
    the decoder, which takes them (its positions restart, and stock SDPA keeps packed documents apart). Read from
    the outer forwards alone it looked like BART's, and the seam computed the packed row as if the positions ran on
    (0.33 off each document alone on this tiny config)."""
    from transformers import WhisperConfig, WhisperForCausalLM

    config = WhisperConfig(vocab_size=VOCAB, d_model=64, decoder_layers=2, decoder_attention_heads=4,
                           decoder_ffn_dim=128, encoder_layers=1, encoder_attention_heads=4, encoder_ffn_dim=128,
                           max_target_positions=64, dropout=0.0, attention_dropout=0.0, activation_dropout=0.0,
                           pad_token_id=0, decoder_start_token_id=1, use_cache=False)
    torch.manual_seed(0)
    ref = WhisperForCausalLM(config).train()
    ours = copy.deepcopy(ref)
    hf_accel.patch(ours)
    ids = torch.randint(3, VOCAB, (1, 14), generator=torch.Generator().manual_seed(0))
    pos = torch.cat([torch.arange(6), torch.arange(8)])[None]
    with torch.no_grad():
        alone = torch.cat([ref(input_ids=ids[:, :6]).logits, ref(input_ids=ids[:, 6:]).logits], dim=1)
        torch.testing.assert_close(ours(input_ids=ids, position_ids=pos).logits, alone, rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(ref(input_ids=ids, position_ids=pos).logits, alone, rtol=1e-4, atol=1e-5)
    from hf_accel.patching import STATE_ATTR

    # (5.17's probe sees no attention call in its decoder layers: the report says packing is not kept apart there,
    # and hf_accel's Trainers pad it; never for its positions)
    assert "computes its own positions" not in (ours.__dict__[STATE_ATTR].report.packing or "")


def test_a_causal_training_call_with_keys_of_its_own_is_refused_not_computed():
    """DeepSeek V4's attention appends compressed slots to its keys inside the layer and masks them from the mask
    transformers builds; under the seam that mask is hf_accel's, so the call ran with no causal mask at all (its
    patched logits were off by ~4; its probe forward fails on fake tensors, so patch() could not see it). A causal
    training call with more keys than queries and the seam's mask now raises UnsupportedModel; a cross-attention
    (not causal) call still runs transformers' attention."""
    from hf_accel.attention.hf_attention import hf_accel_attention
    from hf_accel.errors import UnsupportedModel

    class Attention(torch.nn.Module):
        def __init__(self, causal):
            super().__init__()
            self.is_causal, self.config = causal, type("C", (), {"_attn_implementation": "sdpa"})()

    q, k = torch.randn(1, 2, 5, 8), torch.randn(1, 2, 7, 8)
    with pytest.raises(UnsupportedModel, match="7 keys for 5 queries"):
        hf_accel_attention(Attention(True).train(), q, k, k, None, scaling=0.3)
    out, _ = hf_accel_attention(Attention(False).train(), q, k, k, None, scaling=0.3)
    torch.testing.assert_close(out, torch.nn.functional.scaled_dot_product_attention(q, k, k, scale=0.3).transpose(1, 2))
    with torch.no_grad():  # outside training: a decode step behind a cache, transformers' own attention
        hf_accel_attention(Attention(True).eval(), q, k, k, None, scaling=0.3)
