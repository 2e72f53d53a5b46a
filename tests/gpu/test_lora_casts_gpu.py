"""PEFT LoRA under CUDA bf16 autocast without the input's fp32 round trip (hf_accel.fused.lora_casts): bit-identical loss
and gradients to PEFT's own casting on a Llama-shaped model (the CPU test's claim, on the GPU's kernels)."""
from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

import hf_accel
from test_models_gpu import PLAIN
from hf_accel.fused import lora_casts

pytestmark = pytest.mark.gpu


def test_lora_casts_bit_identical_under_cuda_autocast():
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(
        vocab_size=32000, hidden_size=1024, intermediate_size=4096, num_hidden_layers=4, num_attention_heads=16,
        num_key_value_heads=4, attn_implementation="sdpa")).cuda().to(torch.bfloat16).train()
    model = get_peft_model(model, LoraConfig(r=16, lora_alpha=32, init_lora_weights=False, target_modules=[
        "q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]))
    hf_accel.patch(model, backend="reference", **PLAIN)  # plain torch math: deterministic kernels, so bits compare
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 32000, (1, 2048), generator=g).cuda()
    pos = torch.cat([torch.arange(n) for n in (700, 1000, 348)])[None].cuda()

    def run():
        model.zero_grad(set_to_none=True)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = model(input_ids=ids, position_ids=pos, labels=ids).loss
        loss.backward()
        return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    loss, grads = run()
    lora_casts.unbind(model.get_base_model())
    ref_loss, ref_grads = run()
    assert torch.equal(loss, ref_loss)
    assert grads.keys() == ref_grads.keys() and len(grads) == 4 * 7 * 2
    for n in grads:
        assert torch.equal(grads[n], ref_grads[n]), n
