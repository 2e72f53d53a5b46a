"""fused_ops (liger-kernel norms / SwiGLU) on the GPU: a bf16 train step within the bf16 error of the unfused model,
measured against fp32; unpatch restores the unfused forward exactly."""
from __future__ import annotations

import copy

import pytest
import torch

import hf_accel
from test_models_gpu import EQUIVALENCE_LAYERS, FP32_MATH, PLAIN, SHAPES, assert_within_bf16, packed, step

pytestmark = pytest.mark.gpu


def _assert_within_bf16_error(name: str, **patch_kwargs):
    """A bf16 train step of a model patched with ``patch_kwargs`` against fp32: loss and gradients within twice the
    error of the plain patched bf16 model. Returns the patched bf16 model, the batch and the plain bf16 loss."""
    pytest.importorskip("liger_kernel")
    torch.manual_seed(0)
    ref32 = SHAPES[name](EQUIVALENCE_LAYERS).cuda().float().train()
    ref16 = copy.deepcopy(ref32).to(torch.bfloat16)
    fused = copy.deepcopy(ref16)
    hf_accel.patch(ref32, **FP32_MATH)
    hf_accel.patch(ref16, **PLAIN)
    report = hf_accel.patch(fused, **{**PLAIN, **patch_kwargs})
    assert report.fused_ops
    batch = packed(ref32.config.vocab_size)
    ref16_step = step(ref16, batch)
    assert_within_bf16(step(fused, batch), ref16_step, step(ref32, batch), f"{name} {patch_kwargs}")
    return fused, batch, ref16_step[0]


@pytest.mark.parametrize("checkpointing", [None, "op"])
@pytest.mark.parametrize("name", ["llama-1b", "neox-1.4b"])
def test_fused_ops_train_step(name, checkpointing):
    """checkpointing="op": liger's SwiGLU backward writes its gradients into its saved inputs (the matmul outputs that
    op-level checkpointing caches for recompute), so the combination is checked on its own."""
    fused, batch, loss16 = _assert_within_bf16_error(name, fused_ops=True, checkpointing=checkpointing)
    if checkpointing:
        return
    hf_accel.unpatch(fused)
    hf_accel.patch(fused, **PLAIN)
    loss_again, _ = step(fused, batch)
    assert loss_again == pytest.approx(loss16, rel=1e-6, abs=1e-6)


def test_fused_ops_with_compiled_layers_and_op_checkpointing():
    """compile=True with op-level checkpointing: the layers run eagerly (the compiled path skips op-level
    checkpointed layers) and train through liger's kernels; within the bf16 error, like the other combinations."""
    _assert_within_bf16_error("llama-1b", fused_ops=True, compile=True, checkpointing="op")
