"""The families added in issue 36 on the GPU: 20 bf16 training steps of each family's fast path (``patch(model)``'s
CUDA defaults: the fastest kernel that declares the family's window / soft-cap, fused loss with the final soft-cap,
liger's fused ops where installed, compiled layers) track the unpatched model's fp32 losses within the error the
unpatched bf16 model itself makes, on the same packed batches.

Real widths, head layouts and vocabularies, 4 layers (the math is per layer), windows shortened to 256 tokens so the
documents (up to 1,200 tokens) reach past them.
"""
from __future__ import annotations

import copy

import pytest
import torch
from transformers import (Gemma2Config, Gemma2ForCausalLM, Gemma3ForCausalLM, Gemma3TextConfig, MistralConfig,
                          MistralForCausalLM, Qwen2Config, Qwen2ForCausalLM, Qwen3Config, Qwen3ForCausalLM)

import hf_accel
from hf_accel.patches import family_of
from packed_training import train as train_steps

pytestmark = pytest.mark.gpu

LAYERS = 4
WINDOW = 256
STEPS = 20
LR = 1e-5
SHAPES = {
    "qwen2.5-1.5b": lambda: Qwen2ForCausalLM(Qwen2Config(
        vocab_size=151936, hidden_size=1536, intermediate_size=8960, num_hidden_layers=LAYERS,
        num_attention_heads=12, num_key_value_heads=2, tie_word_embeddings=True)),
    "qwen3-8b": lambda: Qwen3ForCausalLM(Qwen3Config(
        vocab_size=151936, hidden_size=4096, intermediate_size=12288, num_hidden_layers=LAYERS,
        num_attention_heads=32, num_key_value_heads=8, head_dim=128, tie_word_embeddings=False)),
    "mistral-7b": lambda: MistralForCausalLM(MistralConfig(
        vocab_size=32000, hidden_size=4096, intermediate_size=14336, num_hidden_layers=LAYERS,
        num_attention_heads=32, num_key_value_heads=8, sliding_window=WINDOW)),
    "gemma-2-9b": lambda: Gemma2ForCausalLM(Gemma2Config(
        vocab_size=256000, hidden_size=3584, intermediate_size=14336, num_hidden_layers=LAYERS,
        num_attention_heads=16, num_key_value_heads=8, head_dim=256, query_pre_attn_scalar=256,
        sliding_window=WINDOW, attn_logit_softcapping=50.0, final_logit_softcapping=30.0,
        attn_implementation="eager")),
    "gemma-3-1b": lambda: Gemma3ForCausalLM(Gemma3TextConfig(
        vocab_size=262144, hidden_size=1152, intermediate_size=6912, num_hidden_layers=LAYERS,
        num_attention_heads=4, num_key_value_heads=1, head_dim=256, query_pre_attn_scalar=256,
        sliding_window=WINDOW, layer_types=["sliding_attention"] * 3 + ["full_attention"])),
}
@pytest.mark.parametrize("name", list(SHAPES))
def test_fast_path_trains_like_the_unpatched_model(name):
    torch.manual_seed(0)
    ref32 = SHAPES[name]().cuda().float().train()
    for m in ref32.modules():  # dropout off: compare the math, not the random masks
        if isinstance(m, torch.nn.Dropout):
            m.p = 0.0
    ref16 = copy.deepcopy(ref32).to(torch.bfloat16)
    ours = copy.deepcopy(ref16)
    report = hf_accel.patch(ours)  # the CUDA defaults
    want, bf16, got = (train_steps(m, STEPS, LR) for m in (ref32, ref16, ours))
    base = max(abs(a - b) for a, b in zip(bf16, want))
    worst = max(abs(a - b) for a, b in zip(got, want))
    assert worst <= 2 * base + 5e-3, f"{name} via {report.backend}: {worst:.4f} vs bf16's own {base:.4f}\n{report}"
    family = family_of(ours)
    if any(layer.softcap for layer in family.layer_attentions(ours.config)):
        assert report.backend != "reference", report  # a fast kernel that declares soft-capping serves it
    del ref32, ref16, ours
    torch.cuda.empty_cache()
