"""Issue 22 on the GPU: ALiBi through compiled flex vs fp32 math, a patched model at 32k tokens vs the unpatched one,
and offloaded checkpointing vs full checkpointing. Run: pytest -m gpu tests/gpu/test_long_context_gpu.py"""
from __future__ import annotations

import contextlib
import copy
from typing import NamedTuple

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

import hf_accel
from hf_accel.attention.kernels import AttnOptions, varlen_attention
from hf_accel.memory.checkpointing import applied_policy
from test_kernels_gpu import assert_within_bf16_rule, naive, run
from test_models_gpu import SHAPES, assert_within_bf16, step

pytestmark = pytest.mark.gpu
PLAIN = {"fused_ce": False, "fused_ops": False, "compile": False}


def _packed_qkv(lengths, heads, kv_heads, head_dim, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    total = sum(lengths)
    q, k, v = (torch.randn(total, h, head_dim, device="cuda", dtype=torch.bfloat16, generator=g)
               for h in (heads, kv_heads, kv_heads))
    dout = torch.randn(total, heads, head_dim, device="cuda", generator=g)
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
    return q, k, v, dout, cu


@pytest.mark.parametrize("head_dim", [64, 128])
def test_flex_alibi_matches_fp32_math(head_dim):
    """Compiled flex with the document mask_mod and the ALiBi score_mod (GQA 8/2, per-head slopes), forward and
    backward within flash-attn's rule of bf16 math's own error; a second batch padded to the same length reuses the
    compiled kernel (no recompile)."""
    heads, kv_heads = 8, 2
    slopes = torch.tensor([2 ** (-8 * (i + 1) / heads) for i in range(heads)], device="cuda")
    opts = AttnOptions(scale=head_dim ** -0.5, alibi_slopes=slopes)
    for lengths in ((700, 64, 1500, 1, 300, 2000), (2000, 1500, 1000, 60)):  # 4565 and 4560 tokens: one bucket
        q, k, v, dout, cu = _packed_qkv(lengths, heads, kv_heads, head_dim)
        ref = run(lambda a, b, c: naive(a, b, c, cu, opts, torch.float32), q.float(), k.float(), v.float(), dout)
        low = run(lambda a, b, c: naive(a, b, c, cu, opts, torch.bfloat16), q, k, v, dout)
        got = run(lambda a, b, c: varlen_attention(a, b, c, cu, cu, max(lengths), max(lengths), opts, "flex"),
                  q, k, v, dout)
        assert_within_bf16_rule(got, low, ref, f"flex alibi d={head_dim} {lengths}")
        if lengths[0] == 700:
            frames = dict(torch._dynamo.utils.counters["frames"])
    assert dict(torch._dynamo.utils.counters["frames"]) == frames, "a same-bucket batch recompiled flex"


def test_falcon_rw_packed_training_selects_flex():
    """Falcon-RW (ALiBi), packed, bf16 training on CUDA runs on flex (not SDPA's dense float bias), and the step
    matches the plain-math backend in fp32 within bf16's own error."""
    torch.manual_seed(0)
    ref32 = SHAPES["falcon-rw-small"]().cuda().float().train()
    ref16 = copy.deepcopy(ref32).to(torch.bfloat16)
    ours = copy.deepcopy(ref16)
    hf_accel.patch(ref32, backend="reference", **PLAIN)
    hf_accel.patch(ref16, backend="reference", **PLAIN)
    report = hf_accel.patch(ours, **PLAIN)
    from test_models_gpu import packed

    vocab = ref32.config.vocab_size
    ours_step = step(ours, packed(vocab))
    assert "flex" in str(report.backend), report
    assert_within_bf16(ours_step, step(ref16, packed(vocab)), step(ref32, packed(vocab)), str(report.backend))


def _small_llama_32k() -> LlamaForCausalLM:
    """A small Llama with Llama-3 rope scaling, long enough for 32k positions."""
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=4096, hidden_size=512, intermediate_size=1408, num_hidden_layers=4, num_attention_heads=8,
        num_key_value_heads=2, max_position_embeddings=131072, attn_implementation="sdpa", use_cache=False,
        rope_parameters={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                         "original_max_position_embeddings": 8192, "rope_theta": 500000.0})
    return LlamaForCausalLM(config).cuda().float().train()


def _one_document(tokens: int, vocab: int) -> dict:
    ids = torch.randint(0, vocab, (1, tokens), generator=torch.Generator().manual_seed(1))
    return dict(input_ids=ids, labels=ids.clone(), position_ids=torch.arange(tokens)[None])


@contextlib.contextmanager
def fp32_sdpa_without_score_matrix():
    """The unpatched fp32 model's own sdpa call, kept off SDPA's math backend: with GQA transformers passes
    enable_gqa, which sends fp32 to the math kernel and its (heads, T, T) scores (32 GiB per layer at 32k tokens: out
    of memory on the H200). Expanding the KV heads first (transformers' own repeat_kv path, the same numbers) lets
    the memory-efficient kernel take fp32; restricting SDPA to it makes a silent fallback an error instead."""
    from unittest import mock

    from torch.nn.attention import SDPBackend, sdpa_kernel

    with mock.patch("transformers.integrations.sdpa_attention.use_gqa_in_sdpa", lambda *a, **k: False), \
            sdpa_kernel([SDPBackend.EFFICIENT_ATTENTION]):
        yield


def test_patched_matches_unpatched_at_32k_tokens():
    """One 32k-token document: bf16 patched (auto backend) vs the unpatched model in fp32, within twice the unpatched
    bf16 model's own error (loss and every gradient)."""
    ref32 = _small_llama_32k()
    ref16 = copy.deepcopy(ref32).to(torch.bfloat16)
    ours = copy.deepcopy(ref16)
    report = hf_accel.patch(ours, **PLAIN)
    batch = _one_document(32768, ref32.config.vocab_size)
    ours_step, low = step(ours, batch), step(ref16, batch)
    del ours, ref16
    with fp32_sdpa_without_score_matrix():
        ref = step(ref32, batch)
    assert_within_bf16(ours_step, low, ref, str(report.backend))


class Measured(NamedTuple):
    loss: float
    grads: torch.Tensor
    peak: int  # bytes allocated at the step's peak over what was allocated before it
    policy: object  # the checkpoint policy applied
    report: str  # the PatchReport, as printed


def _measured_steps(base: torch.nn.Module, batch: dict, settings: dict[str, dict]) -> dict[str, Measured]:
    """Per name, a copy of `base` patched with those settings: a warm-up step (compile, allocator), then one measured
    step. Each copy is deleted before the next is built."""
    results = {}
    for name, kwargs in settings.items():
        model = copy.deepcopy(base)
        report = hf_accel.patch(model, **kwargs)
        step(model, batch)
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
        loss, grads = step(model, batch)
        results[name] = Measured(loss, grads, torch.cuda.max_memory_allocated() - before, applied_policy(model),
                                 str(report))
        del model
    return results


@pytest.mark.parametrize("compiled", [False, True])
def test_offload_matches_full_checkpointing_and_frees_device_memory(compiled):
    """Offloaded vs full checkpointing, bf16, 16k tokens: the same loss, gradients within the run-to-run noise of full
    checkpointing itself (flash backward kernels accumulate in nondeterministic order), every layer input in pinned
    host memory, all but the first prefetched, and a lower peak by about the layer inputs' size."""
    tokens = 16384
    base = _small_llama_32k().to(torch.bfloat16)
    settings = {**PLAIN, "compile": compiled}
    results = _measured_steps(base, _one_document(tokens, base.config.vocab_size), {
        "full": dict(settings, checkpointing="full"), "full-again": dict(settings, checkpointing="full"),
        "offload": dict(settings, checkpointing="offload")})
    loss_full, g_full, peak_full, _, _ = results["full"]
    loss_off, g_off, peak_off, policy, _ = results["offload"]
    noise = (results["full-again"].grads - g_full).abs().max().item()
    # compiled: the offload hooks may split the compiled graphs differently, so allow bf16-level differences
    floor = 1e-2 if compiled else 1e-6
    assert abs(loss_off - loss_full) <= floor * abs(loss_full)
    assert (g_off - g_full).abs().max().item() <= 2 * noise + floor * g_full.abs().max().item()
    layers, hidden = base.config.num_hidden_layers, base.config.hidden_size
    stats = policy.offloader.stats
    assert stats.packed == 2 * layers and stats.unpacked == 2 * layers  # two steps
    assert stats.prefetched == 2 * (layers - 1)
    layer_inputs = layers * tokens * hidden * 2
    assert peak_off <= peak_full - 0.25 * layer_inputs, (peak_off, peak_full, layer_inputs)  # a prefetch in flight


def test_offload_uses_pinned_host_memory():
    model = _small_llama_32k().to(torch.bfloat16)
    hf_accel.patch(model, checkpointing="offload", **PLAIN)
    offloader = applied_policy(model).offloader
    hosts = []
    pack = offloader.pack
    offloader.pack = lambda t: hosts.append(pack(t)) or hosts[-1]
    step(model, _one_document(2048, model.config.vocab_size))
    offloaded = [h for h in hosts if hasattr(h, "host")]  # pack keeps small saved tensors on the device as they are
    assert len(offloaded) == model.config.num_hidden_layers  # each layer's input, once
    assert all(h.host.device.type == "cpu" and h.host.is_pinned() for h in offloaded)


@pytest.mark.parametrize("compiled", [False, True])
def test_mlp_chunks_match_unchunked_and_lower_the_peak(compiled):
    """`patch(mlp_chunks=N)` on the GPU (bf16, one 32k-token document, full checkpointing, the fused loss so the
    logits are not the peak): the unchunked model's loss and gradients within bf16 differences (a chunk's GEMMs may
    round differently from the whole's) and within twice the unchunked run's own run-to-run noise, and a lower peak by
    at least one whole (tokens x intermediate) tensor: the MLP intermediates exist one chunk at a time."""
    tokens, chunk = 32768, 4096
    base = _small_llama_32k().to(torch.bfloat16)
    settings = {**PLAIN, "fused_ce": True, "compile": compiled, "checkpointing": "full"}
    results = _measured_steps(base, _one_document(tokens, base.config.vocab_size), {
        "off": dict(settings, mlp_chunks=False), "off-again": dict(settings, mlp_chunks=False),
        "chunked": dict(settings, mlp_chunks=chunk)})
    loss_off, g_off, peak_off, _, _ = results["off"]
    loss_chunked, g_chunked, peak_chunked, _, report = results["chunked"]
    assert "mlp_chunks" in report and str(chunk) in report, report
    noise = (results["off-again"].grads - g_off).abs().max().item()
    assert abs(loss_chunked - loss_off) <= 1e-2 * abs(loss_off)
    assert (g_chunked - g_off).abs().max().item() <= 2 * noise + 1e-2 * g_off.abs().max().item()
    intermediate = tokens * base.config.intermediate_size * 2  # one bf16 (tokens x intermediate) tensor
    assert peak_chunked <= peak_off - intermediate, (peak_chunked, peak_off, intermediate)
