"""patch(model, precision="fp8") on the GPU (issue 39d): torchao's float8 training of the decoder linears, with the
CUDA defaults around it (compiled layers, fused loss, liger's ops), tracks bf16 training of the same model on the same
packed batches: 30 steps, the loss gap within a few times bf16's own distance from fp32. The speed and the 200-step
loss curves are the bench's (`python scripts/bench.py --preset fp8-1b`, `--preset fp8-8b`)."""
from __future__ import annotations

import copy

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

import hf_accel
from packed_training import train

pytestmark = pytest.mark.gpu
pytest.importorskip("torchao.float8", reason="torchao not installed (pip install 'hf_accel[fp8]')")

STEPS = 30
LR = 1e-4


@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 9),
                    reason="float8 matmuls need compute capability 8.9+")
def test_fp8_defaults_track_bf16_training():
    torch.manual_seed(0)
    ref32 = LlamaForCausalLM(LlamaConfig(
        vocab_size=32000, hidden_size=2048, intermediate_size=8192, num_hidden_layers=4, num_attention_heads=32,
        num_key_value_heads=8, attn_implementation="sdpa")).cuda().train()
    bf16 = copy.deepcopy(ref32).to(torch.bfloat16)
    ours = copy.deepcopy(bf16)
    report = hf_accel.patch(ours, precision="fp8")
    assert report.compiled_layers and "fp8" in str(report.precision), report
    want, base, got = (train(m, STEPS, LR) for m in (ref32, bf16, ours))
    bf16_error = max(abs(a - b) for a, b in zip(base, want))
    fp8_error = max(abs(a - b) for a, b in zip(got, want))
    assert got != base
    assert fp8_error <= 4 * bf16_error + 2e-2, (fp8_error, bf16_error, report)
