"""patch(model) with no flags on CUDA takes the fast path by itself (issue 18a), and the attention kernel is chosen
for what attention receives under autocast, not for fp32 master weights (issue 20); a compiled model deleted or
unpatched leaves (almost) nothing allocated (issue 18e)."""
from __future__ import annotations

import gc
import importlib.util

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

import hf_accel
from test_models_gpu import SHAPES, packed, step

pytestmark = pytest.mark.gpu


def small_llama():
    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(vocab_size=32000, hidden_size=512, intermediate_size=1408, num_hidden_layers=4,
                                        num_attention_heads=8, num_key_value_heads=2, attn_implementation="sdpa"))


def test_no_flags_report_the_fast_path():
    model = small_llama().cuda().to(torch.bfloat16).train()
    report = hf_accel.patch(model)
    assert report.fused_ce and report.compiled_layers == 4
    liger = importlib.util.find_spec("liger_kernel") is not None
    assert report.fused_ops == liger
    lines = "\n".join(report.speedups)
    assert "fused_ce: on (auto:" in lines and "compile: on (auto:" in lines, str(report)
    loss, _ = step(model, packed(model.config.vocab_size))
    assert loss == loss  # trains (not NaN)
    off = hf_accel.patch(model, fused_ce=False, fused_ops=False, compile=False)
    assert not off.fused_ce and not off.fused_ops and off.compiled_layers == 0


def test_fp32_master_weights_under_autocast_use_the_half_precision_kernel():
    model = small_llama().cuda().float().train()  # fp32 weights, as kbit preparation / FSDP2 mixed precision keep
    report = hf_accel.patch(model, fused_ce=False, fused_ops=False, compile=False)
    assert report.backend != "flex", str(report)
    from hf_accel.attention.kernels import registry

    chosen = []
    real_select = registry.select

    def spy(request, backend="auto", installed=None):
        out = real_select(request, backend, installed)
        chosen.append((request.dtype, out.backend.name))
        return out

    import hf_accel.attention.kernels as kernels

    kernels.select = spy
    try:
        with torch.autocast("cuda", dtype=torch.bfloat16):
            step(model, packed(model.config.vocab_size))
    finally:
        kernels.select = real_select
    assert chosen and all(dtype == torch.bfloat16 and name == report.backend for dtype, name in chosen), chosen


@pytest.mark.parametrize("unpatch_first", [False, True])
def test_deleting_a_compiled_patched_model_frees_its_memory(unpatch_first):
    gc.collect()
    torch.cuda.empty_cache()
    before = torch.cuda.memory_allocated()
    model = SHAPES["llama-1b"]().cuda().to(torch.bfloat16).train()
    hf_accel.patch(model)
    step(model, packed(model.config.vocab_size))
    if unpatch_first:
        hf_accel.unpatch(model)
    del model
    gc.collect()
    torch.cuda.empty_cache()
    retained = (torch.cuda.memory_allocated() - before) / 1024**3
    assert retained <= 0.1, f"{retained:.2f} GiB still allocated"
