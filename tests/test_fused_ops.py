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


@pytest.mark.parametrize("variant, outside", [("llama-gqa", ["model.norm"]),
                                              ("neox-parallel", ["gpt_neox.final_layer_norm"]),
                                              ("falcon-mha", ["transformer.ln_f"])])
def test_compiled_layers_leave_liger_only_the_modules_outside_them(variant, outside):
    model = make(variant)
    every = fused_ops.fusable_modules(model)
    assert len(every) > len(outside)  # the layers' own norms (and Llama's MLPs) are fusable too
    assert [name for name, _, _ in fused_ops.fusable_modules(model, outside_decoder_layers=True)] == outside
