"""fused_ops: refused clearly where liger cannot run; instance attribute changes undone exactly."""
from __future__ import annotations

import pytest
import torch

import hf_accel
from hf_accel import fused_ops
from hf_accel.errors import BackendUnavailable
from tiny_models import make


def test_refused_on_cpu_and_model_left_untouched():
    model = make("llama-gqa")
    before = {n: dict(m.__dict__) for n, m in model.named_modules()}
    with pytest.raises(BackendUnavailable, match="fused_ops=True needs liger-kernel on CUDA"):
        hf_accel.patch(model, fused_ops=True)
    assert hf_accel.patch_report(model) is None
    assert model.config._attn_implementation == "sdpa"
    after = {n: dict(m.__dict__) for n, m in model.named_modules()}
    assert before.keys() == after.keys()
    for name in before:
        assert before[name].keys() == after[name].keys(), name


def test_transaction_restores_instance_attributes_exactly():
    norm = torch.nn.LayerNorm(8)
    original = dict(norm.__dict__)

    def change(m):
        m.eps = 0.5
        m.extra = "added"
        m.forward = lambda x: x

    undo = fused_ops._transaction(norm, change)
    assert norm.eps == 0.5 and norm.extra == "added"
    undo()
    assert norm.__dict__.keys() == original.keys()
    assert all(norm.__dict__[k] is original[k] for k in original)


def _plain_rope(calls):
    """A stand-in for liger's Triton RoPE kernel (which cannot run on CPU): the same math, counting its calls.
    The real kernel is checked against fp32 math on the GPU in tests/gpu/test_fused_ops_gpu.py."""
    from transformers.models.llama.modeling_llama import rotate_half

    def rope(q, k, cos, sin):
        calls.append(q.shape)
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
        return q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin

    return rope


def test_fused_rope_is_scoped_to_the_bound_instances_and_undone_exactly():
    from transformers.models.llama import modeling_llama

    stock = modeling_llama.apply_rotary_pos_emb
    torch.manual_seed(0)
    bound, other = make("llama-gqa"), make("llama-gqa")
    other.load_state_dict(bound.state_dict())
    ids = torch.randint(0, bound.config.vocab_size, (2, 12))
    want = bound(input_ids=ids).logits
    calls = []
    undos = [fused_ops.bind_fused_rope(m, _plain_rope(calls)) for m in bound.modules()
             if fused_ops._is_stock_llama_attention(m)]
    layers = bound.config.num_hidden_layers
    assert len(undos) == layers
    torch.testing.assert_close(bound(input_ids=ids).logits, want, rtol=1e-5, atol=1e-5)
    assert len(calls) == layers  # every layer's RoPE went through the bound kernel
    torch.testing.assert_close(other(input_ids=ids).logits, want, rtol=1e-5, atol=1e-5)
    assert len(calls) == layers  # ... and the other model in the process never did
    extra = fused_ops.bind_fused_rope(other.model.layers[0].self_attn, _plain_rope(calls))
    for undo in undos:
        undo()
    assert modeling_llama.apply_rotary_pos_emb is not stock  # `other` still uses it
    extra()
    assert modeling_llama.apply_rotary_pos_emb is stock
    assert all("forward" not in m.__dict__ for m in list(bound.modules()) + list(other.modules())
               if fused_ops._is_stock_llama_attention(m))
    bound(input_ids=ids)
    assert len(calls) == layers


def test_fused_rope_backward_matches_stock():
    torch.manual_seed(0)
    model = make("llama-gqa")
    ids = torch.randint(0, model.config.vocab_size, (1, 10))
    model(input_ids=ids, labels=ids).loss.backward()
    want = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    undos = [fused_ops.bind_fused_rope(m, _plain_rope([])) for m in model.modules()
             if fused_ops._is_stock_llama_attention(m)]
    model(input_ids=ids, labels=ids).loss.backward()
    for undo in undos:
        undo()
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.grad, want[name], rtol=1e-5, atol=1e-6)
