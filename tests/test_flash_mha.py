"""FlashMHA against live references: nn.MultiheadAttention with copied weights, a plain-torch attention that calls the
same projection modules (repeated KV heads, transformers' RoPE, Bloom's ALiBi slopes), packed vs padded, PEFT LoRA."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn
from transformers import LlamaConfig
from transformers.models.bloom.modeling_bloom import build_alibi_tensor
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb

from hf_accel.errors import BackendUnavailable, ConfigurationError, InvalidBatch
from hf_accel.attention.flash_mha import FlashMHA, alibi_slopes

ROOT = Path(__file__).resolve().parents[1]
FP32 = {"atol": 2e-5, "rtol": 1e-4}  # fp32 CPU: different summation orders only
E, H = 32, 4
BACKENDS = ["sdpa", "reference"]  # the CPU backends with a backward pass


def padding_mask(batch_lengths, seq_len, left=()):
    """(B, S) bool, True = pad; rows listed in ``left`` are left-padded."""
    pad = torch.ones(len(batch_lengths), seq_len, dtype=torch.bool)
    for row, n in enumerate(batch_lengths):
        if row in left:
            pad[row, seq_len - n:] = False
        else:
            pad[row, :n] = False
    return pad


def reference_attention(mha: FlashMHA, x_bse, pad_bs=None, causal=False):
    """Plain-torch attention over padded input, calling ``mha``'s (possibly LoRA-wrapped) projections."""
    batch, seq, _ = x_bse.shape
    hq, hkv, d = mha.num_heads, mha.num_kv_heads, mha.head_dim
    if mha.qkv_fused:
        q, k, v = mha.Wqkv(x_bse).split([hq * d, hkv * d, hkv * d], dim=-1)
    else:
        q, k, v = mha.q_proj(x_bse), mha.k_proj(x_bse), mha.v_proj(x_bse)
    q_bhsd = q.reshape(batch, seq, hq, d).transpose(1, 2)
    k_bhsd, v_bhsd = (t.reshape(batch, seq, hkv, d).transpose(1, 2).repeat_interleave(hq // hkv, 1) for t in (k, v))
    real_bs = torch.ones(batch, seq, dtype=torch.bool) if pad_bs is None else ~pad_bs
    pos_bs = real_bs.long().cumsum(1) - 1  # rank among real tokens
    if mha.rotary:
        config = LlamaConfig(hidden_size=hq * d, num_attention_heads=hq, rope_theta=mha.rotary_base)
        cos, sin = LlamaRotaryEmbedding(config)(x_bse, pos_bs)
        q_bhsd, k_bhsd = apply_rotary_pos_emb(q_bhsd, k_bhsd, cos, sin)
    scores = q_bhsd @ k_bhsd.transpose(-1, -2) / d**0.5
    rel = pos_bs[:, None, :] - pos_bs[:, :, None]  # (B, Q, K) key minus query position
    if mha.alibi:
        slopes = build_alibi_tensor(torch.ones(1, 2), hq, torch.float32).view(hq, 2)[:, 1]  # Bloom's slopes
        scores = scores + slopes[None, :, None, None] * (rel if causal else -rel.abs())[:, None].float()
    allowed = real_bs[:, None, :] & ((rel <= 0) if causal else torch.ones_like(rel, dtype=torch.bool))
    scores = scores.masked_fill(~allowed[:, None], float("-inf"))
    out = (scores.softmax(-1).nan_to_num(0.0) @ v_bhsd).transpose(1, 2).reshape(batch, seq, hq * d)
    return mha.out_proj(out)


def grads(module: nn.Module, x, loss_fn):
    module.zero_grad()
    x = x.detach().clone().requires_grad_(True)
    loss_fn(x).backward()
    named = {n: p.grad.clone() for n, p in module.named_parameters() if p.grad is not None}
    return x.grad, named


def assert_close(a, b, tol=FP32):
    torch.testing.assert_close(a, b, **tol)


# --- nn.MultiheadAttention equivalence -----------------------------------------------------------------------------


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("batch_first", [True, False])
@pytest.mark.parametrize("padded", [False, True, "holes"])
@pytest.mark.parametrize("causal", [False, True])
def test_matches_torch_mha_outputs_and_grads(backend, batch_first, padded, causal):
    torch.manual_seed(0)
    seq = 7
    torch_mha = nn.MultiheadAttention(E, H, batch_first=batch_first)
    ours = FlashMHA.from_torch(torch_mha, backend=backend)
    # Causal + left padding leaves nn.MultiheadAttention's pad queries with no key (NaN), so left rows only non-causal.
    pad = padding_mask([5, 7, 3], seq, left=() if causal else (2,)) if padded else None
    if padded == "holes":  # padding inside rows: only those keys are hidden, the row stays one sequence
        pad = torch.zeros(3, seq, dtype=torch.bool)
        pad[0, 2:4], pad[1, [1, 5]], pad[2, 3:5] = True, True, True
    real = torch.ones(3, seq, dtype=torch.bool) if pad is None else ~pad
    causal_mask = torch.ones(seq, seq, dtype=torch.bool).triu(1) if causal else None
    x = torch.randn(3, seq, E) if batch_first else torch.randn(seq, 3, E)
    weight = torch.randn_like(x)
    real_x = real[..., None] if batch_first else real.T[..., None]  # compare real positions only

    def torch_loss(x):
        out = torch_mha(x, x, x, key_padding_mask=pad, attn_mask=causal_mask, need_weights=False)[0]
        return (out * weight * real_x).sum(), out

    def our_loss(x):
        out, attn = ours(x, key_padding_mask=pad, is_causal=causal)
        assert attn is None
        return (out * weight * real_x).sum(), out

    assert_close(our_loss(x)[1] * real_x, torch_loss(x)[1] * real_x)
    gx_torch, g_torch = grads(torch_mha, x, lambda x: torch_loss(x)[0])
    gx_ours, g_ours = grads(ours, x, lambda x: our_loss(x)[0])
    assert_close(gx_ours, gx_torch)
    in_proj = torch.cat([g_ours[f"{n}_proj.weight"] for n in "qkv"])
    assert_close(in_proj, g_torch["in_proj_weight"])
    assert_close(torch.cat([g_ours[f"{n}_proj.bias"] for n in "qkv"]), g_torch["in_proj_bias"])
    assert_close(g_ours["out_proj.weight"], g_torch["out_proj.weight"])


@pytest.mark.parametrize("mask_dtype", [torch.bool, torch.float32])
def test_causal_attn_mask_is_honoured_and_others_refused(mask_dtype):
    torch.manual_seed(0)
    ours = FlashMHA(E, H, qkv_fused=True)
    x = torch.randn(2, 6, E)
    causal_mask = torch.ones(6, 6, dtype=torch.bool).triu(1)
    if mask_dtype is torch.float32:
        causal_mask = torch.zeros(6, 6).masked_fill(causal_mask, float("-inf"))
    assert_close(ours(x, attn_mask=causal_mask)[0], ours(x, is_causal=True)[0])
    assert not torch.allclose(ours(x, attn_mask=causal_mask)[0], ours(x)[0])
    with pytest.raises(ConfigurationError, match="causal mask"):
        ours(x, attn_mask=causal_mask.T.contiguous())
    with pytest.raises(ConfigurationError, match="causal mask"):
        ours(x, attn_mask=torch.randn(6, 6))
    with pytest.raises(ConfigurationError, match="need_weights"):
        ours(x, x, x, need_weights=True)


def test_cross_attention_matches_torch_mha():
    torch.manual_seed(0)
    torch_mha = nn.MultiheadAttention(E, H, batch_first=True)
    ours = FlashMHA.from_torch(torch_mha)
    query, memory = torch.randn(2, 5, E), torch.randn(2, 8, E)
    pad = padding_mask([8, 4], 8, left=(1,))
    expected = torch_mha(query, memory, memory, key_padding_mask=pad, need_weights=False)[0]
    assert_close(ours(query, memory, memory, key_padding_mask=pad)[0], expected)
    with pytest.raises(ConfigurationError, match="cross-attention"):
        ours(query, memory, memory, is_causal=True)
    fused = FlashMHA.from_torch(torch_mha, qkv_fused=True)
    with pytest.raises(ConfigurationError, match="qkv_fused"):
        fused(query, memory, memory)


def test_from_torch_to_torch_round_trip_and_refusals():
    torch.manual_seed(0)
    torch_mha = nn.MultiheadAttention(E, H, batch_first=False, bias=False, dropout=0.1)
    for fused in (False, True):
        back = FlashMHA.from_torch(torch_mha, qkv_fused=fused).to_torch()
        assert (back.batch_first, back.dropout, back.in_proj_bias) == (False, 0.1, None)
        assert torch.equal(back.in_proj_weight, torch_mha.in_proj_weight)
        assert torch.equal(back.out_proj.weight, torch_mha.out_proj.weight)
    with pytest.raises(ConfigurationError, match="kdim"):
        FlashMHA.from_torch(nn.MultiheadAttention(E, H, kdim=16, vdim=16))
    with pytest.raises(ConfigurationError, match="add_bias_kv"):
        FlashMHA.from_torch(nn.MultiheadAttention(E, H, add_bias_kv=True))
    with pytest.raises(ConfigurationError, match="num_kv_heads"):
        FlashMHA(E, H, num_kv_heads=2).to_torch()
    with pytest.raises(ConfigurationError, match="multiple of num_kv_heads"):
        FlashMHA(E, H, num_kv_heads=3)
    with pytest.raises(ConfigurationError, match="rotary"):
        FlashMHA(E, H, rotary="yarn")


# --- features against the plain-torch reference ---------------------------------------------------------------------

FEATURES = {
    "mha": {},
    "gqa": {"num_kv_heads": 2},
    "mqa": {"num_kv_heads": 1, "qkv_fused": True},
    "rope": {"rotary": "rope", "rotary_base": 500.0},
    "rope-gqa-fused": {"rotary": "rope", "num_kv_heads": 2, "qkv_fused": True},
    "alibi": {"alibi": True},
    "alibi-gqa": {"alibi": True, "num_kv_heads": 2},
}


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("feature", list(FEATURES))
def test_features_match_plain_torch_reference(feature, causal, backend):
    torch.manual_seed(0)
    ours = FlashMHA(E, H, causal=causal, backend=backend, **FEATURES[feature])
    pad = padding_mask([6, 3, 4], 6, left=(1,))
    x, weight = torch.randn(3, 6, E), torch.randn(3, 6, E) * (~pad)[..., None]
    assert_close(ours(x, key_padding_mask=pad)[0] * (~pad)[..., None],
                 reference_attention(ours, x, pad, causal) * (~pad)[..., None])
    gx_ours, g_ours = grads(ours, x, lambda x: (ours(x, key_padding_mask=pad)[0] * weight).sum())
    gx_ref, g_ref = grads(ours, x, lambda x: (reference_attention(ours, x, pad, causal) * weight).sum())
    assert_close(gx_ours, gx_ref)
    assert g_ours.keys() == g_ref.keys()
    for name in g_ref:
        assert_close(g_ours[name], g_ref[name])


def test_alibi_slopes_match_bloom():
    for heads in (4, 6, 12, 16):
        expected = build_alibi_tensor(torch.ones(1, 2), heads, torch.float32).view(heads, 2)[:, 1]
        assert_close(alibi_slopes(heads), expected, tol={"atol": 0.0, "rtol": 1e-6})


@pytest.mark.parametrize("fused", [False, True])
def test_packed_equals_padded_and_padding_side_does_not_matter(fused):
    torch.manual_seed(0)
    ours = FlashMHA(E, H, num_kv_heads=2, causal=True, rotary="rope", qkv_fused=fused)
    lengths = [5, 2, 7]
    docs = [torch.randn(n, E) for n in lengths]
    packed = torch.cat(docs)
    cu = torch.tensor([0, 5, 7, 14], dtype=torch.int32)
    out_packed = ours(packed, cu_seqlens=cu, max_seqlen=7)[0]
    assert_close(ours(packed, cu_seqlens=cu)[0], out_packed)  # max_seqlen computed when omitted
    for side in ((), (0, 1, 2)):
        pad = padding_mask(lengths, 7, left=side)
        x = torch.zeros(3, 7, E)
        x[~pad] = packed
        out_padded = ours(x, key_padding_mask=pad)[0]
        assert_close(out_padded[~pad], out_packed)
        assert torch.all(out_padded[pad] == 0)  # padded positions are never computed
    with pytest.raises(ConfigurationError, match="packed input"):
        ours(packed, key_padding_mask=torch.zeros(14, dtype=torch.bool), cu_seqlens=cu)
    with pytest.raises(ConfigurationError, match="attn_mask"):
        ours(packed, attn_mask=torch.zeros(14, 14), cu_seqlens=cu)
    with pytest.raises(InvalidBatch, match="key_padding_mask must be bool"):
        ours(torch.randn(3, 7, E), key_padding_mask=torch.zeros(3, 7))


def test_dropout_is_unbiased_in_training_and_off_in_eval():
    torch.manual_seed(0)
    torch_mha = nn.MultiheadAttention(E, H, dropout=0.3, batch_first=True).eval()
    ours = FlashMHA.from_torch(torch_mha).eval()
    x = torch.randn(1, 6, E)
    expected = torch_mha(x, x, x, need_weights=False)[0]
    assert_close(ours(x)[0], expected)
    ours.train()
    with torch.no_grad():
        samples = torch.stack([ours(x)[0] for _ in range(400)])
    assert not torch.allclose(samples[0], expected)
    # E[dropout(P)] = P and out_proj is linear, so the mean converges to the eval output (~1/sqrt(400) noise).
    assert (samples.mean(0) - expected).abs().max() < 0.1 * expected.abs().max()


def test_dropout_is_requested_from_the_backend_only_in_training():
    torch.manual_seed(0)
    ours = FlashMHA(E, H, dropout=0.1, backend="flex")  # flex has no dropout: training must refuse it
    x = torch.randn(1, 6, E)
    with pytest.raises(BackendUnavailable, match="dropout"):
        with torch.no_grad():
            ours.train()(x)
    with torch.no_grad():
        assert_close(ours.eval()(x)[0], reference_attention(ours, x))


def test_state_dict_round_trip_reproduces_outputs():
    torch.manual_seed(0)
    ours = FlashMHA(E, H, num_kv_heads=2, alibi=True, qkv_fused=True)
    state = ours.state_dict()
    assert set(state) == {"Wqkv.weight", "Wqkv.bias", "out_proj.weight", "out_proj.bias"}
    torch.manual_seed(1)
    fresh = FlashMHA(E, H, num_kv_heads=2, alibi=True, qkv_fused=True)
    x = torch.randn(2, 5, E)
    assert not torch.allclose(fresh(x)[0], ours(x)[0])
    fresh.load_state_dict(state)
    assert torch.equal(fresh(x)[0], ours(x)[0])


# --- PEFT LoRA --------------------------------------------------------------------------------------------------------

TARGETS = {False: ["q_proj", "k_proj", "v_proj", "out_proj"], True: ["Wqkv", "out_proj"]}


def lora_base(fused: bool, seed: int) -> FlashMHA:
    torch.manual_seed(seed)
    return FlashMHA(E, H, num_kv_heads=2, causal=True, rotary="rope", qkv_fused=fused)


def lora_model(fused: bool, seed: int = 0):
    from peft import LoraConfig, get_peft_model

    # init_lora_weights=False: random A and B, so both get a non-zero gradient at step 0.
    config = LoraConfig(r=4, lora_alpha=8, target_modules=TARGETS[fused], init_lora_weights=False)
    return get_peft_model(lora_base(fused, seed), config)


@pytest.mark.parametrize("fused", [False, True])
def test_lora_gradients_match_reference_and_training_lowers_loss(fused):
    model = lora_model(fused)
    attn = model.get_base_model()
    pad = padding_mask([6, 4], 6, left=(1,))
    x, target = torch.randn(2, 6, E), torch.randn(2, 6, E)
    real = (~pad)[..., None]

    def loss_ours(x):
        return (((model(x, key_padding_mask=pad)[0] - target) * real) ** 2).mean()

    def loss_ref(x):
        return (((reference_attention(attn, x, pad, causal=True) - target) * real) ** 2).mean()

    _, g_ours = grads(model, x, loss_ours)
    _, g_ref = grads(model, x, loss_ref)
    lora_names = [n for n, p in model.named_parameters() if p.requires_grad]
    assert lora_names and all("lora_" in n for n in lora_names)
    assert set(g_ours) == set(lora_names)  # frozen base weights get no gradient
    for name in lora_names:
        assert g_ours[name].abs().sum() > 0, f"{name} got a zero gradient"
        assert_close(g_ours[name], g_ref[name])

    optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.05)
    first = loss_ours(x).item()
    for _ in range(5):
        optimizer.zero_grad()
        loss_ours(x).backward()
        optimizer.step()
    assert loss_ours(x).item() < first


@pytest.mark.parametrize("fused", [False, True])
def test_lora_state_dict_round_trip(fused, tmp_path):
    from peft import PeftModel

    base_state = {k: v.clone() for k, v in lora_base(fused, seed=0).state_dict().items()}
    model = lora_model(fused, seed=0)
    x = torch.randn(2, 5, E)
    model.save_pretrained(tmp_path)
    fresh = lora_base(fused, seed=1)
    assert not torch.allclose(fresh(x)[0], model(x)[0])
    # A custom module's base weights travel as a plain state_dict, the adapters through PEFT's own files.
    fresh.load_state_dict(base_state)
    reloaded = PeftModel.from_pretrained(fresh, tmp_path)
    assert torch.equal(reloaded(x)[0], model(x)[0])
    merged = reloaded.merge_and_unload()
    assert isinstance(merged, FlashMHA)
    assert_close(merged(x)[0], model(x)[0])


# --- the example and the benchmark run offline on the CPU ------------------------------------------------------------


def _run_script(*args: str) -> str:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


def test_example_custom_transformer_lora_trains():
    out = _run_script("examples/custom_transformer_lora.py", "--steps", "30")
    last_line = out.strip().splitlines()[-1]
    first, last = (float(part.split("=")[1]) for part in last_line.split()[1:])
    assert last < first - 0.1, last_line


@pytest.mark.slow
def test_bench_flash_mha_tiny_smoke(tmp_path):
    out_json = tmp_path / "bench.json"
    stdout = _run_script("scripts/bench_flash_mha.py", "--tiny", "--out", str(out_json))
    rows = {r["name"]: r for r in json.loads(out_json.read_text())["rows"]}
    assert rows["nn.MultiheadAttention"]["status"] == rows["FlashMHA auto"]["status"] == "ok"
    assert rows["FlashMHA auto"]["ms"] > 0
    assert stdout.strip().splitlines()[-1].startswith("| FlashMHA auto |")  # the markdown table comes last
