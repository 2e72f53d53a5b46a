"""Hybrid linear-attention models (Qwen3.5, Qwen3.5-MoE, Qwen3-Next) on packed batches: with
``hf_accel.patches.linear_attention`` each packed document computes what it computes alone (logits and gradients),
padded rows what they compute unpadded, and generation with the model's cache what the unpatched model computes.
Tiny fp32 models built from configs here; the reference is always the unpatched model, run on each document alone.

The full-attention layers go through hf_accel's registered attention function (the seam ``patch()`` gives them):
with the forward record that ``patch()`` installs, transformers' own search for packed documents in position_ids is
skipped (the seam does it), so stock SDPA would attend across documents there (Qwen3-Next passes the record's very
position_ids to its mask).
"""
from __future__ import annotations

import copy

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM
from transformers.models.auto.configuration_auto import CONFIG_MAPPING

from hf_accel import DataCollatorForPacking, DataCollatorForPadding
from hf_accel.attention.hf_attention import forward_batch_hooks, register
from hf_accel.attention.routing import ATTN_NAME
from hf_accel.errors import BackendUnavailable, ConfigurationError
from hf_accel.patches import linear_attention as la

VOCAB = 61
LAYERS = ["linear_attention", "full_attention", "linear_attention"]
MODEL_TYPES = ("qwen3_5_text", "qwen3_5_moe_text", "qwen3_next")
DOC_LENGTHS = (70, 1, 13, 5, 9)  # one longer than the delta rule's chunk (64), one of a single token
ATOL, RTOL = 3e-5, 1e-4  # fp32: packed and alone differ only in summation order (the chunked rule's padding)
# Gradients sum every position's contribution (the decay parameters' with cancellation: A_log's came out 5e-5 apart
# on values of 0.05 in fp32); a document leaking into the next moves logits by >1e-2 and gradients far more.
GRAD_ATOL, GRAD_RTOL = 1e-4, 1e-3
LORA_TARGETS = {
    "qwen3_5_text": ["in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a", "out_proj"],
    "qwen3_next": ["in_proj_qkvz", "in_proj_ba", "out_proj"],
}


def tiny(model_type: str, seed: int = 0):
    kw = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=len(LAYERS),
              layer_types=LAYERS, num_attention_heads=2, num_key_value_heads=1, head_dim=16, linear_num_key_heads=2,
              linear_num_value_heads=4, linear_key_head_dim=8, linear_value_head_dim=8, linear_conv_kernel_dim=4,
              use_cache=False, tie_word_embeddings=False, initializer_range=0.1)
    if model_type != "qwen3_5_text":
        kw.update(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16, shared_expert_intermediate_size=16)
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(AutoConfig.for_model(model_type, **kw), attn_implementation="sdpa")


# Other hybrids whose recurrent layers ``apply`` finds (Mamba and Mamba-2 mixers, a short conv, other Gated DeltaNets
# and Kimi's delta attention): the per-document backend serves them. Granite-MoE-hybrid's attention layers are not
# given position_ids (its packed documents there are the attention seam's to separate), so its tiny model here is
# recurrent layers only.
_MAMBA = dict(mamba_n_heads=4, mamba_d_head=8, mamba_n_groups=1, mamba_d_state=8, mamba_d_conv=4, mamba_chunk_size=16,
              mamba_expand=1)
OTHER_HYBRIDS = {
    "nemotron_h": dict(layers_block_type=["mamba", "attention", "mamba"], mamba_num_heads=4, mamba_head_dim=8,
                       n_groups=1, ssm_state_size=8, conv_kernel=4, mamba_chunk_size=16, expand=1),
    "falcon_h1": dict(_MAMBA, num_hidden_layers=2, mamba_d_ssm=32),  # every layer attention and Mamba-2 in parallel
    "lfm2": dict(layer_types=["conv", "full_attention", "conv"], conv_L_cache=3),
    "granitemoehybrid": dict(_MAMBA, num_hidden_layers=2, layer_types=["mamba", "mamba"], num_local_experts=0),
    "bamba": dict(_MAMBA, attn_layer_indices=[1]),
    "olmo_hybrid": dict(layer_types=LAYERS, pad_token_id=0),
    "kimi_linear": dict(layer_types=LAYERS, linear_num_heads=2, linear_head_dim=16, num_key_value_heads=2,
                        pad_token_id=0),
    "jamba": dict(num_hidden_layers=2, attn_layer_period=2, attn_layer_offset=1, expert_layer_period=100,
                  num_experts=1, mamba_d_state=8, mamba_d_conv=4, mamba_expand=1, mamba_dt_rank=4, pad_token_id=0),
    "zamba2": dict(num_hidden_layers=2, layers_block_type=["mamba", "hybrid"], num_mem_blocks=1, mamba_d_state=8,
                   mamba_d_conv=4, mamba_expand=1, mamba_headdim=8, mamba_ngroups=1, n_mamba_heads=4,
                   attention_head_dim=16, pad_token_id=0),
}


def tiny_other(model_type: str, seed: int = 0):
    kw = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=3, num_attention_heads=2,
              num_key_value_heads=1, head_dim=16, use_cache=False, tie_word_embeddings=False,
              initializer_range=0.2)  # at 0.02 the short conv's leak is ~1e-4, near the tolerance
    torch.manual_seed(seed)
    if model_type not in CONFIG_MAPPING:
        pytest.skip(f"this transformers has no {model_type}")
    config = AutoConfig.for_model(model_type, **{**kw, **OTHER_HYBRIDS[model_type]})
    return AutoModelForCausalLM.from_config(config, attn_implementation="sdpa")


def patch_linear(model, backend: str = "auto") -> list:
    """What patch() will do for these models: the linear layers by ``apply``, the forward record, and the full-attention
    layers through hf_accel's attention function. Returns the undo actions."""
    register()
    names, undo = la.apply(model, backend=backend)
    assert names, "no linear-attention module found"
    undo += forward_batch_hooks(model)
    reported = model.config._attn_implementation
    model.set_attn_implementation(ATTN_NAME)
    return [*undo, lambda: model.set_attn_implementation(reported)]


def documents(lengths=DOC_LENGTHS, seed: int = 1) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(1, VOCAB, (n,), generator=g) for n in lengths]


def packed_row(docs):
    ids = torch.cat(docs)[None]
    positions = torch.cat([torch.arange(len(d)) for d in docs])[None]
    return ids, positions


def alone(model, docs) -> list[torch.Tensor]:
    return [model(d[None]).logits[0] for d in docs]


def probe(logits: torch.Tensor, seed: int = 2) -> torch.Tensor:
    """A scalar reading every position's logits (its gradient reaches every position)."""
    g = torch.Generator().manual_seed(seed)
    return (logits * torch.randn(logits.shape, generator=g)).sum()


def assert_close(actual, expected, what="", atol: float = ATOL, rtol: float = RTOL):
    torch.testing.assert_close(actual, expected, atol=atol, rtol=rtol, msg=lambda m: f"{what}: {m}")


def split(logits_t: torch.Tensor, docs) -> list[torch.Tensor]:
    return list(torch.split(logits_t, [len(d) for d in docs]))


def assert_grads_close(model, reference):
    grads = {n: p.grad for n, p in model.named_parameters() if p.requires_grad}
    expected = {n: p.grad for n, p in reference.named_parameters() if p.requires_grad}
    assert grads.keys() == expected.keys() and grads
    for name, grad in grads.items():
        assert grad is not None and expected[name] is not None, name
        scale = max(1.0, expected[name].abs().max().item())
        assert_close(grad, expected[name], name, atol=GRAD_ATOL * scale, rtol=GRAD_RTOL)


@pytest.mark.parametrize("model_type", MODEL_TYPES)
def test_packed_row_equals_each_document_alone(model_type, one_torch_thread):
    """Logits and every parameter's gradient of a row packed by position_ids alone (TRL's padding-free rows)."""
    model = tiny(model_type)
    reference = copy.deepcopy(model)
    patch_linear(model)
    docs = documents()
    ids, positions = packed_row(docs)
    logits = model(ids, position_ids=positions).logits[0]
    for i, (got, want) in enumerate(zip(split(logits, docs), alone(reference, docs))):
        assert_close(got, want, f"document {i}")
    probe(logits).backward()
    probe(torch.cat([reference(d[None]).logits[0] for d in docs])).backward()
    assert_grads_close(model, reference)


@pytest.mark.parametrize("model_type", sorted(OTHER_HYBRIDS))
def test_other_hybrids_packed_row_equals_each_document_alone(model_type, one_torch_thread):
    """Stock packing leaks through these hybrids' recurrent layers; patched (checkpointing on), logits and gradients
    of each document are its own."""
    model = tiny_other(model_type)
    if not la.linear_attention_modules(model):  # transformers 5.17's LFM2 short conv takes no **kwargs
        pytest.skip(f"this transformers' {model_type} recurrent layers do not take the documents (no **kwargs)")
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()  # checkpointed: the recompute in backward must get the documents again
    reference = copy.deepcopy(model)
    patch_linear(model)
    docs = documents((37, 1, 13, 6))
    ids, positions = packed_row(docs)
    with torch.no_grad():
        stock = split(reference(ids, position_ids=positions).logits[0], docs)
    expected = alone(reference, docs)
    assert max((a - b).abs().max() for a, b in zip(stock[1:], expected[1:])) > 10 * ATOL, "stock does not leak"
    logits = model(ids, position_ids=positions).logits[0]
    for i, (got, want) in enumerate(zip(split(logits, docs), expected)):
        assert_close(got, want, f"document {i}")
    probe(logits).backward()
    probe(torch.cat(expected)).backward()
    assert_grads_close(model, reference)


def test_stock_packing_leaks_across_documents(one_torch_thread):
    """The bug this module fixes: unpatched, a packed document's linear layers start from the previous document's
    conv window and state (transformers' SDPA keeps documents apart in the full-attention layer)."""
    model = tiny("qwen3_5_text")
    docs = documents()
    ids, positions = packed_row(docs)
    with torch.no_grad():
        logits = model(ids, position_ids=positions).logits[0]
        expected = alone(model, docs)
    got = split(logits, docs)
    assert_close(got[0], expected[0], "first document")  # nothing before it
    for i in range(1, len(docs)):
        assert (got[i] - expected[i]).abs().max() > 100 * ATOL, f"document {i} unchanged by its predecessor"


@pytest.mark.parametrize("source", ["hf_accel", "trl"])
def test_collator_rows_equal_each_document_alone(source, one_torch_thread):
    """cu_seq_lens_q from hf_accel's packing collator (two rows with padding tails) and TRL's padding-free collator
    (cu_seq_lens_q, seq_idx): stock on CPU refuses both (5.25's torch fallback), patched computes each alone."""
    model = tiny("qwen3_5_text")
    reference = copy.deepcopy(model)
    patch_linear(model)
    features = [{"input_ids": d.tolist()} for d in documents()]
    if source == "hf_accel":
        batch = DataCollatorForPacking(pad_token_id=0, max_tokens=72, all_masked="keep")(features)
    else:
        from trl.trainer.sft_trainer import DataCollatorForLanguageModeling

        batch = DataCollatorForLanguageModeling(pad_token_id=0, padding_free=True, return_position_ids=True)(features)
    batch.pop("labels")
    logits_t = model(**batch).logits.reshape(-1, VOCAB)
    ids_t = batch["input_ids"].reshape(-1)
    cu = batch["cu_seq_lens_q"].tolist()
    assert len(cu) - 1 >= len(features)
    with torch.no_grad():
        for start, end in zip(cu, cu[1:]):
            assert_close(logits_t[start:end], reference(ids_t[start:end][None]).logits[0], f"tokens {start}:{end}")


@pytest.mark.parametrize("side", ["right", "left"])
def test_padded_rows_equal_unpadded(side, one_torch_thread):
    """One document per row, padded, with a 2D mask: the stock forward serves it, as unpatched."""
    model = tiny("qwen3_5_text")
    reference = copy.deepcopy(model)
    patch_linear(model)
    docs = documents((9, 3, 14))
    batch = DataCollatorForPadding(pad_token_id=0, padding_side=side)([{"input_ids": d.tolist()} for d in docs])
    mask = batch["attention_mask"]
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    with torch.no_grad():
        logits = model(batch["input_ids"], attention_mask=mask, position_ids=positions).logits
        for row, (doc, want) in enumerate(zip(docs, alone(reference, docs))):
            assert_close(logits[row][mask[row].bool()], want, f"row {row}")


@pytest.mark.parametrize("side", ["right", "left"])
def test_packed_and_padded_rows_equal_each_document_alone(side, one_torch_thread):
    """Rows holding several documents and padding, given a 2D mask and position_ids restarting per document."""
    model = tiny("qwen3_next")
    reference = copy.deepcopy(model)
    patch_linear(model)
    rows = [documents((6, 11), seed=3), documents((2, 4, 5), seed=4)]
    width = max(sum(len(d) for d in row) for row in rows) + 3
    ids, mask, positions = (torch.zeros(len(rows), width, dtype=torch.long) for _ in range(3))
    for r, row in enumerate(rows):
        real = sum(len(d) for d in row)
        span = slice(0, real) if side == "right" else slice(width - real, width)
        ids[r, span], mask[r, span] = torch.cat(row), 1
        positions[r, span] = torch.cat([torch.arange(len(d)) for d in row])
    logits = model(ids, attention_mask=mask, position_ids=positions).logits
    for r, row in enumerate(rows):
        got = split(logits[r][mask[r].bool()], row)
        for i, want in enumerate(alone(reference, row)):
            assert_close(got[i], want.detach(), f"row {r} document {i}")


@pytest.mark.parametrize("model_type", ["qwen3_5_text", "qwen3_next"])
def test_lora_with_checkpointing_gradients_equal_each_document_alone(model_type, one_torch_thread):
    """LoRA on the linear layers' projections and the attention's, gradient checkpointing on (the recompute in
    backward receives the documents again): every LoRA gradient equals the sum over documents run alone."""
    from peft import LoraConfig, get_peft_model

    targets = LORA_TARGETS[model_type] + ["q_proj", "k_proj", "v_proj", "o_proj"]
    model = get_peft_model(tiny(model_type), LoraConfig(r=4, lora_alpha=8, target_modules=targets,
                                                        init_lora_weights=False))
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    reference = copy.deepcopy(model)
    patch_linear(model)
    docs = documents()
    ids, positions = packed_row(docs)
    probe(model(ids, position_ids=positions).logits[0]).backward()
    probe(torch.cat([reference(d[None]).logits[0] for d in docs])).backward()
    lora = [n for n, p in model.named_parameters() if p.requires_grad]
    assert any("in_proj" in n for n in lora) and any("out_proj" in n for n in lora)
    assert_grads_close(model, reference)


def test_recompute_gets_its_own_forwards_documents(one_torch_thread):
    """Two checkpointed forwards of differently packed rows, then the first one's backward: its recompute gets the
    first forward's documents (the decoder layer's keyword arguments carry them), not the latest ones."""
    model = tiny("qwen3_5_text")
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    reference = copy.deepcopy(model)
    patch_linear(model)
    first, second = documents((30, 11, 7)), documents((12, 36), seed=8)
    logits = model(*packed_row(first)[:1], position_ids=packed_row(first)[1]).logits[0]
    model(*packed_row(second)[:1], position_ids=packed_row(second)[1])
    probe(logits).backward()
    probe(torch.cat([reference(d[None]).logits[0] for d in first])).backward()
    assert_grads_close(model, reference)


def test_one_layout_per_step(monkeypatch, one_torch_thread):
    """The documents are read once per training step: by the first linear layer, then shared by the other layers
    and by every checkpoint recompute in backward."""
    calls = []
    real = la.from_mask_and_positions
    monkeypatch.setattr(la, "from_mask_and_positions", lambda *a, **k: calls.append(1) or real(*a, **k))
    model = tiny("qwen3_5_text")
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    patch_linear(model)
    ids, positions = packed_row(documents())
    probe(model(ids, position_ids=positions).logits).backward()
    assert len(calls) == 1


def test_apply_finds_the_linear_layers_and_undo_restores_exactly(one_torch_thread):
    model = tiny("qwen3_5_moe_text")
    reference = copy.deepcopy(model)
    before = {name: (dict(m.__dict__), dict(m._forward_pre_hooks), dict(m._forward_pre_hooks_with_kwargs))
              for name, m in model.named_modules()}
    undo = patch_linear(model)
    names = [n for n, _, _ in la.linear_attention_modules(model)]
    assert names == [f"model.layers.{i}.linear_attn" for i, t in enumerate(LAYERS) if t == "linear_attention"]
    assert la.apply(model)[0] == []  # already patched: left as it is
    for action in undo:
        action()
    after = {name: (dict(m.__dict__), dict(m._forward_pre_hooks), dict(m._forward_pre_hooks_with_kwargs))
             for name, m in model.named_modules()}
    assert after.keys() == before.keys()
    for name in before:
        assert after[name][0].keys() == before[name][0].keys(), name
        assert after[name][1:] == before[name][1:], name
    ids, positions = packed_row(documents())
    with torch.no_grad():  # the unpatched model's (leaking) values, to the bit
        assert torch.equal(model(ids, position_ids=positions).logits, reference(ids, position_ids=positions).logits)


@pytest.mark.parametrize("model_type", ["qwen3_5_text", "qwen3_next"])
def test_generation_with_cache_unchanged(model_type, one_torch_thread):
    """Greedy generation from a left-padded batch (prefill and decoding go through the model's cache): the patched
    model's tokens and scores are the unpatched model's."""
    model = tiny(model_type).eval()
    reference = copy.deepcopy(model)
    patch_linear(model)
    docs = documents((5, 9), seed=5)
    batch = DataCollatorForPadding(pad_token_id=0, padding_side="left")([{"input_ids": d.tolist()} for d in docs])
    kwargs = dict(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], max_new_tokens=6,
                  do_sample=False, use_cache=True, pad_token_id=0, output_scores=True, return_dict_in_generate=True)
    got, want = model.generate(**kwargs), reference.generate(**kwargs)
    assert torch.equal(got.sequences, want.sequences)
    for step, (a, b) in enumerate(zip(got.scores, want.scores)):
        assert_close(a, b, f"step {step}")


# ---- the fla backend's plumbing, on the CPU with reference ops of fla-core's signatures ----

def _segments(cu_seqlens: torch.Tensor) -> list[tuple[int, int]]:
    cu = cu_seqlens.tolist()
    return list(zip(cu, cu[1:]))


def reference_conv(x, weight, bias=None, activation=None, cu_seqlens=None, cu_seqlens_cpu=None, **_):
    """fla-core's causal_conv1d, from its definition: x (1, T, C), weight (C, W); each segment from zeros."""
    parts = []
    for start, end in _segments(cu_seqlens):
        seg = torch.nn.functional.conv1d(x[:, start:end].transpose(1, 2), weight[:, None], bias,
                                         padding=weight.shape[1] - 1, groups=weight.shape[0])[..., :end - start]
        parts.append(seg.transpose(1, 2))
    y = torch.cat(parts, 1)
    return (torch.nn.functional.silu(y) if activation in ("silu", "swish") else y), None


def reference_rule(q, k, v, g, beta, scale=None, use_qk_l2norm_in_kernel=False, cu_seqlens=None, **_):
    """fla-core's gated delta rule, token by token from its definition (GVA: v heads share q/k heads in order)."""
    dtype, repeat = v.dtype, v.shape[2] // q.shape[2]
    q, k = (t.float().repeat_interleave(repeat, dim=2) for t in (q, k))
    if use_qk_l2norm_in_kernel:
        q, k = (t * torch.rsqrt((t * t).sum(-1, keepdim=True) + 1e-6) for t in (q, k))
    q = q * (scale or q.shape[-1] ** -0.5)
    v, g, beta = v.float(), g.float(), beta.float()
    outs = []
    for start, end in _segments(cu_seqlens):
        state = q.new_zeros(v.shape[2], q.shape[-1], v.shape[-1])  # (HV, K, V)
        for t in range(start, end):
            state = state * g[0, t].exp()[:, None, None]
            delta = (v[0, t] - (state * k[0, t][:, :, None]).sum(-2)) * beta[0, t][:, None]
            state = state + k[0, t][:, :, None] * delta[:, None, :]
            outs.append((state * q[0, t][:, :, None]).sum(-2))
    return torch.stack(outs)[None].to(dtype), None


@pytest.fixture
def fla_on_cpu(monkeypatch):
    """The fla backend selected on the CPU (a faked device description) with the reference ops."""
    monkeypatch.setattr(la, "FLA_DEVICES", ("cpu",))
    monkeypatch.setattr(la, "fla_ops", lambda: la._FlaOps(reference_conv, reference_rule))
    runs = []
    real = la._BACKENDS["fla"]
    monkeypatch.setitem(la._BACKENDS, "fla", la._Backend(real.refusal, lambda *a: runs.append(1) or real.run(*a)))
    return runs


@pytest.mark.parametrize("model_type", ["qwen3_5_text", "qwen3_next"])
def test_fla_backend_equals_each_document_alone(model_type, fla_on_cpu, one_torch_thread):
    """The fla backend's projections, flattening and segments (packed and padded rows, two rows): logits and
    gradients of each document equal the unpatched model's on it alone."""
    model = tiny(model_type)
    reference = copy.deepcopy(model)
    patch_linear(model, backend="fla")
    rows = [documents((6, 11, 1), seed=6), documents((4, 9), seed=7)]
    width = max(sum(len(d) for d in row) for row in rows) + 2
    ids, mask, positions = (torch.zeros(len(rows), width, dtype=torch.long) for _ in range(3))
    for r, row in enumerate(rows):
        real = sum(len(d) for d in row)
        ids[r, :real], mask[r, :real] = torch.cat(row), 1
        positions[r, :real] = torch.cat([torch.arange(len(d)) for d in row])
    logits = model(ids, attention_mask=mask, position_ids=positions).logits
    assert fla_on_cpu, "the fla backend did not run"
    got = [split(logits[r][mask[r].bool()], row) for r, row in enumerate(rows)]
    for r, row in enumerate(rows):
        for i, want in enumerate(alone(reference, row)):
            assert_close(got[r][i], want, f"row {r} document {i}")
    probe(torch.cat([t for row in got for t in row])).backward()
    probe(torch.cat([reference(d[None]).logits[0] for row in rows for d in row])).backward()
    assert_grads_close(model, reference)


def test_backend_choice_names_each_refusal(monkeypatch):
    model = tiny("qwen3_5_text")
    module = model.model.layers[0].linear_attn
    hidden = torch.zeros(1, 4, 32)
    assert la.choose_backend(module, hidden) == "per_document"
    with pytest.raises(BackendUnavailable, match="tensors on cpu"):
        la.choose_backend(module, hidden, "fla")
    monkeypatch.setattr(la, "FLA_DEVICES", ("cpu",))  # a device fla-core runs on, without fla-core
    monkeypatch.setattr(la, "fla_ops", lambda: "fla-core is not importable (ImportError: ...)")
    with pytest.raises(BackendUnavailable, match="fla-core is not importable"):
        la.choose_backend(module, hidden, "fla")
    monkeypatch.setattr(la, "fla_ops", lambda: la._FlaOps(reference_conv, reference_rule))
    assert la.choose_backend(module, hidden) == "fla"
    assert la.choose_backend(model.model.layers[2].linear_attn, hidden, "per_document") == "per_document"
    # fla-core's own guard (Hopper with Triton < 3.7.1): its backward raises, so a call that may train takes the
    # other backend, and evaluation (no grad) keeps fla-core
    monkeypatch.setattr(la, "fla_backward_refusal", lambda: "fla-core refuses its gated delta rule's backward")
    assert la.choose_backend(module, hidden) == "per_document"
    with pytest.raises(BackendUnavailable, match="refuses its gated delta rule's backward"):
        la.choose_backend(module, hidden, "fla")
    with torch.no_grad():
        assert la.choose_backend(module, hidden) == "fla"
    with pytest.raises(ConfigurationError, match="allowed: 'auto'"):
        la.apply(model, backend="triton")


def test_compiled_decode_traces_in_one_graph(one_torch_thread):
    """A fullgraph compile of the eval-mode forward with a cache (transformers' compiled decode) traces the patched
    model as it traces the unpatched one: the decoder layers' pre-hook adds no graph break outside training."""
    model = tiny("qwen3_5_text").eval()
    reference = copy.deepcopy(model)
    patch_linear(model)
    ids = documents((6,), seed=3)[0][None]
    with torch.no_grad():
        want = reference(ids, use_cache=True).logits
        torch._dynamo.reset()
        got = torch.compile(model, fullgraph=True, backend="eager")(ids, use_cache=True).logits
        torch._dynamo.reset()
    assert torch.equal(got, want)


def test_patch_says_before_training_where_fla_core_refuses_its_backward(monkeypatch, caplog):
    """Where fla-core is installed but refuses its backward (Hopper with Triton < 3.7.1, run 39), the unpatched model
    cannot train either: patch() says so, and what to do, in its report and log, not at the first backward."""
    import logging

    import hf_accel

    why = "fla-core refuses its gated delta rule's backward on Hopper GPUs with Triton 3.6.0"
    assert not any("refuses" in n for n in hf_accel.patch(tiny("qwen3_5_text")).notes)
    monkeypatch.setattr(la, "fla_backward_refusal", lambda: why)
    with caplog.at_level(logging.WARNING, logger="hf_accel"):
        report = hf_accel.patch(tiny("qwen3_5_text"))
    assert f"linear attention: {why}" in report.notes and why in caplog.text
    from tiny_models import make

    assert not any(why in n for n in hf_accel.patch(make("llama-gqa")).notes)  # no recurrent layers: nothing to say
