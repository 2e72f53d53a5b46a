"""Issue 16 on the GPU: masks with holes through the fast kernels, and decode steps compiled with inductor and
fullgraph=True (static cache), against the unpatched model. Run: pytest -m gpu tests/gpu/test_equivalence_gpu.py"""
from __future__ import annotations

import copy

import pytest
import torch
from transformers import StaticCache

import hf_accel
from tiny_models import VOCAB, make

pytestmark = pytest.mark.gpu
HOLES = [[1, 1, 0, 0, 0, 1, 1, 1], [1, 0, 1, 1, 0, 1, 1, 1], [0, 0, 1, 1, 1, 1, 1, 1]]
VARIANTS = ["llama-gqa", "neox-parallel", "falcon-40b-newarch", "falcon-rw-alibi"]


def _err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).abs().max() / b.float().abs().max()).item()


@pytest.mark.parametrize("variant", VARIANTS)
def test_holes_through_the_fast_kernel(variant):
    """bf16 patched (backend auto: FA4 / PyTorch FA2 / ...) vs fp32 unpatched, at real tokens: no worse than the
    unpatched bf16 model's own error (flash-attn's test rule), with a hole in two rows."""
    ref32 = make(variant).cuda()
    ref16 = copy.deepcopy(ref32).to(torch.bfloat16)
    model = copy.deepcopy(ref16)
    report = hf_accel.patch(model)
    mask = torch.tensor(HOLES, device="cuda")
    ids = torch.randint(1, VOCAB, mask.shape, device="cuda", generator=torch.Generator("cuda").manual_seed(0))
    real = mask.bool()
    with torch.no_grad():
        want = ref32(input_ids=ids, attention_mask=mask).logits[real]
        baseline = _err(ref16(input_ids=ids, attention_mask=mask).logits[real], want)
        got = _err(model(input_ids=ids, attention_mask=mask).logits[real], want)
    assert got <= 2 * baseline + 1e-3, (report.backend, got, baseline)


@pytest.mark.parametrize("variant", ["llama-gqa", "neox-sequential", "falcon-40b-newarch"])
def test_compiled_static_cache_decoding_with_inductor(variant):
    """torch.compile(model, fullgraph=True) with inductor on CUDA: greedy tokens as the unpatched eager model's."""
    ref = make(variant).cuda()
    model = copy.deepcopy(ref)
    hf_accel.patch(model)
    mask = torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1]], device="cuda")
    ids = torch.randint(1, VOCAB, mask.shape, device="cuda", generator=torch.Generator("cuda").manual_seed(0))
    torch._dynamo.reset()
    compiled = torch.compile(model, fullgraph=True)
    tokens = []
    for forward, m in ((ref, ref), (compiled, model)):
        cache = StaticCache(config=m.config, max_cache_len=16)
        step_mask, step_ids, out_tokens = mask, ids, []
        with torch.no_grad():
            for _ in range(4):
                positions = (step_mask.cumsum(-1) - 1).clamp_min(0)[:, -step_ids.shape[1]:]
                logits = forward(input_ids=step_ids, attention_mask=step_mask, position_ids=positions,
                                 past_key_values=cache, use_cache=True).logits[:, -1]
                step_ids = logits.argmax(-1, keepdim=True)
                out_tokens.append(step_ids)
                step_mask = torch.cat([step_mask, torch.ones_like(step_ids)], 1)
        tokens.append(torch.cat(out_tokens, 1))
    torch._dynamo.reset()
    assert torch.equal(tokens[0], tokens[1])
