"""Issues 22 and 40 on the GPU: ALiBi through compiled flex vs fp32 math, a patched model at 32k tokens vs the unpatched
one, a 128k-token packed row vs each of its documents alone, offloaded and spaced checkpointing vs full
checkpointing, and a Llama-3-8B LoRA budget plan split between device, host and spacing that holds its budget.
Run: pytest -m gpu tests/gpu/test_long_context_gpu.py"""
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
    # in power-of-two pieces (torch's pinned allocator rounds each block up to one): 2048 x 512 x 2 bytes, one piece
    assert all(all(p.device.type == "cpu" and p.is_pinned() for p in h.host) for h in offloaded)
    assert all(sum(p.numel() for p in h.host) == 2048 * 512 * 2 for h in offloaded)
    assert offloader.stats.host_peak_bytes == model.config.num_hidden_layers * 2048 * 512 * 2


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


# ----------------------------------------------------------------------------------------------- issue 40
PACKED_LENGTHS = (65536, 32768, 16384, 8192, 4096, 2048, 1024, 1024)  # 131,072 tokens


def _documents(vocab: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    return [torch.randint(0, vocab, (n,), generator=g) for n in PACKED_LENGTHS]


def _alone(model, documents) -> tuple[float, torch.Tensor, list[torch.Tensor]]:
    """Each document in its own forward and backward: (mean loss over all targets, summed gradients, each document's
    final hidden states). The summed loss is what one packed row of them computes."""
    targets = sum(len(d) - 1 for d in documents)
    model.zero_grad(set_to_none=True)
    total, hidden = 0.0, []
    for doc in documents:
        ids = doc[None].cuda()
        out = model(input_ids=ids, labels=ids, use_cache=False, output_hidden_states=True)
        (out.loss * (len(doc) - 1) / targets).backward()
        total += out.loss.item() * (len(doc) - 1) / targets
        hidden.append(out.hidden_states[-1][0].float())
        del out
    grads = torch.cat([p.grad.float().flatten() for p in model.parameters() if p.grad is not None])
    return total, grads, hidden


def _packed(model, documents) -> tuple[float, torch.Tensor, list[torch.Tensor]]:
    ids = torch.cat(documents)[None].cuda()
    pos = torch.cat([torch.arange(len(d)) for d in documents])[None].cuda()
    labels = ids.masked_fill(pos == 0, -100)  # no document predicts the next one's first token
    model.zero_grad(set_to_none=True)
    out = model(input_ids=ids, position_ids=pos, labels=labels, use_cache=False, output_hidden_states=True)
    out.loss.backward()
    grads = torch.cat([p.grad.float().flatten() for p in model.parameters() if p.grad is not None])
    hidden = list(out.hidden_states[-1][0].float().split(list(PACKED_LENGTHS)))
    return out.loss.item(), grads, hidden


def test_packed_128k_row_equals_each_document_alone():
    """Issue 40d: one 131,072-token packed row of eight documents (64k down to 1k tokens; bf16, patched, the auto
    backend) computes what each document alone does: every document's final hidden states, the loss over all targets
    and the summed gradients match the unpatched fp32 model run on each document alone, within twice the error of
    the unpatched bf16 model (also each document alone) against it."""
    ref32 = _small_llama_32k()
    ref16 = copy.deepcopy(ref32).to(torch.bfloat16)
    ours = copy.deepcopy(ref16)
    report = hf_accel.patch(ours, **PLAIN)
    documents = _documents(ref32.config.vocab_size)
    loss, g, hidden = _packed(ours, documents)
    del ours
    loss16, g16, hidden16 = _alone(ref16, documents)
    del ref16
    with fp32_sdpa_without_score_matrix():
        loss32, g32, hidden32 = _alone(ref32, documents)
    assert_within_bf16((loss, g), (loss16, g16), (loss32, g32), f"packed 128k row, {report.backend}")
    for n, h, h16, h32 in zip(PACKED_LENGTHS, hidden, hidden16, hidden32):
        err, base = ((h - h32).norm() / h32.norm()).item(), ((h16 - h32).norm() / h32.norm()).item()
        assert err <= 2 * base + 1e-3, f"document of {n} tokens: hidden error {err:.3e} vs bf16 alone {base:.3e}"


def test_spaced_and_offloaded_plan_matches_full_checkpointing():
    """A plan with offloaded span heads and spaced layers on CUDA (16k tokens, bf16): the loss of full checkpointing,
    gradients within its own run-to-run noise, each spaced layer's input rebuilt from its head (fetched back from
    pinned host memory), the host copies gone after backward."""
    from hf_accel.memory.checkpointing import PerLayer

    tokens = 16384
    base = _small_llama_32k().to(torch.bfloat16)
    results = _measured_steps(base, _one_document(tokens, base.config.vocab_size), {
        "full": dict(PLAIN, checkpointing="full"), "full-again": dict(PLAIN, checkpointing="full"),
        "spaced": dict(PLAIN, checkpointing=PerLayer(choices=["offload", "spaced", "full", "spaced"]))})
    loss_full, g_full = results["full"].loss, results["full"].grads
    loss, g, _, policy, _ = results["spaced"]
    noise = (results["full-again"].grads - g_full).abs().max().item()
    assert abs(loss - loss_full) <= 1e-6 * abs(loss_full)
    assert (g - g_full).abs().max().item() <= 2 * noise + 1e-6 * g_full.abs().max().item()
    assert policy.spacer.stats.rebuilt == 2 * 2 and policy.spacer.stats.kept == 0  # two steps, two spaced layers
    assert policy.offloader.stats.host_peak_bytes == tokens * base.config.hidden_size * 2
    assert policy.offloader.stats.host_bytes == 0


def test_budget_split_with_spacing_holds_for_llama_8b_lora(capsys):
    """Llama-3-8B LoRA (random init, bf16 autocast, fused loss), one 64k-token document, a 36 GiB budget with only 2
    GiB of host memory: all layer inputs (16 GiB) fit neither, so the plan keeps some on the device, offloads 2 GiB of
    them and spaces the rest; it prints that split, and two training steps peak within the budget."""
    from transformers import AutoModelForCausalLM

    from benchlib.train import add_lora
    from benchlib.workloads import WORKLOADS, build_config
    from hf_accel.memory.budget import MemoryBudget

    tokens, budget_gib, host_gib = 65536, 36, 2
    torch.manual_seed(0)
    workload = WORKLOADS["llama-8b-lora-long"]
    with torch.device("cuda"):
        model = AutoModelForCausalLM.from_config(build_config(workload), dtype=torch.bfloat16)
    model = add_lora(model.train(), workload)
    policy = MemoryBudget(budget=f"{budget_gib}GiB", batch_tokens=tokens, grads_freed=True,
                          host_budget=f"{host_gib}GiB")
    torch.cuda.reset_peak_memory_stats()
    hf_accel.patch(model, checkpointing=policy)
    printed = capsys.readouterr().out
    plan = policy.plan
    assert "| split |" in printed and "rebuilt in backward" in printed, printed
    assert plan.fits and {"full", "offload", "spaced"} <= set(plan.choices), plan.choices
    assert plan.host_bytes <= host_gib * GIB_
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-5, fused=True)
    batch = {k: v.cuda() for k, v in _one_document(tokens, model.config.vocab_size).items()}
    for _ in range(2):
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = model(**batch, use_cache=False).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() / GIB_
    print(f"llama-8b-lora 64k, budget {budget_gib} GiB, host {host_gib} GiB: {plan.split()}; predicted "
          f"{plan.predicted_peak_bytes / GIB_:.2f} GiB, measured {peak:.2f} GiB, host peak "
          f"{policy.offloader.stats.host_peak_bytes / GIB_:.2f} GiB")
    assert torch.isfinite(loss) and policy.spacer.stats.rebuilt > 0
    assert policy.offloader.stats.host_peak_bytes <= host_gib * GIB_
    assert peak <= budget_gib, f"peak {peak:.2f} GiB over the {budget_gib} GiB budget ({plan.split()})"


GIB_ = 1024**3
