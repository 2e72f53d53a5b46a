"""hf_accel.foreign's stock stand-ins for liger's functions, against transformers' own (fp32, CPU): the RoPE of Llama,
of a partial-rotary Phi-4-mini-style head (the leading cos-width entries rotated, the rest passed through) and of
gpt-oss (half-width cos / sin), and liger's RMSNorm forward on a stock norm and on a norm of liger's class. Dynamo
traces these where it meets liger's kernels in a compiled layer, and the facts probe runs them on fake tensors."""
from __future__ import annotations

import pytest
import torch

from hf_accel import foreign


def _qk_cos_sin(head_dim: int, width: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    q, k = torch.randn(2, 4, 7, head_dim, generator=g), torch.randn(2, 2, 7, head_dim, generator=g)
    angles = torch.randn(2, 7, width, generator=g)
    return q, k, angles.cos(), angles.sin()


@pytest.mark.parametrize("family, head_dim, width", [("llama", 16, 16), ("phi3", 16, 12)])
def test_rotary_stand_in_is_the_models_own_rope(family, head_dim, width):
    import importlib

    stock = importlib.import_module(f"transformers.models.{family}.modeling_{family}").apply_rotary_pos_emb
    q, k, cos, sin = _qk_cos_sin(head_dim, width)
    # each frequency in both halves of cos / sin, as their rotary embeddings make them
    cos, sin = torch.cat([cos[..., : width // 2]] * 2, -1), torch.cat([sin[..., : width // 2]] * 2, -1)
    for got, want in zip(foreign.stock_rotary(q, k, cos, sin), stock(q, k, cos, sin)):
        torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_gpt_oss_rotary_stand_in_is_gpt_oss_rope():
    from transformers.models.gpt_oss.modeling_gpt_oss import apply_rotary_pos_emb

    q, k, cos, sin = _qk_cos_sin(16, 8)
    for got, want in zip(foreign.stock_rotary_gpt_oss(q, k, cos, sin), apply_rotary_pos_emb(q, k, cos, sin)):
        torch.testing.assert_close(got, want, rtol=0, atol=0)


@pytest.mark.parametrize("casting, offset", [("llama", 0.0), ("gemma", 1.0)])
def test_rms_norm_stand_in(casting, offset):
    """On a stock norm it runs the norm's own forward; on a norm of liger's class, liger's formula with the norm's
    casting mode and offset (Llama's: cast back, then the weight; Gemma's: (offset + w) in fp32)."""
    from transformers.models.gemma.modeling_gemma import GemmaRMSNorm
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    stock = (LlamaRMSNorm if casting == "llama" else GemmaRMSNorm)(32, eps=1e-6)
    with torch.no_grad():
        stock.weight.normal_(generator=torch.Generator().manual_seed(1))
    x = torch.randn(3, 5, 32, generator=torch.Generator().manual_seed(2)).to(torch.bfloat16)
    stock = stock.to(torch.bfloat16)
    torch.testing.assert_close(foreign.stock_rms_norm(stock, x), stock(x), rtol=0, atol=0)

    class KernelNorm(torch.nn.Module):  # liger's class: weight, variance_epsilon, offset, casting_mode
        def forward(self, hidden_states):
            raise AssertionError("a kernel")

    KernelNorm.__module__ = KernelNorm.forward.__module__ = "liger_kernel.transformers.rms_norm"
    norm = KernelNorm()
    norm.weight = torch.nn.Parameter(stock.weight.detach().clone())
    norm.variance_epsilon, norm.offset, norm.casting_mode = 1e-6, offset, casting
    torch.testing.assert_close(foreign.stock_rms_norm(norm, x), stock(x), rtol=0, atol=0)


def test_scale_free_norm_and_fused_swiglu_stand_ins():
    """Gemma 4's scale-free value norm (no weight) and Phi-3's fused gate / up projection."""
    from transformers import Phi3Config
    from transformers.models.gemma4.modeling_gemma4 import Gemma4RMSNorm
    from transformers.models.phi3.modeling_phi3 import Phi3MLP

    x = torch.randn(3, 5, 32, generator=torch.Generator().manual_seed(3))

    class KernelNorm(torch.nn.Module):
        def forward(self, hidden_states):
            raise AssertionError("a kernel")

    KernelNorm.__module__ = KernelNorm.forward.__module__ = "liger_kernel.transformers.rms_norm"
    norm = KernelNorm()
    norm.weight, norm.variance_epsilon = None, 1e-6
    torch.testing.assert_close(foreign.stock_rms_norm(norm, x), Gemma4RMSNorm(32, with_scale=False)(x))
    torch.manual_seed(0)
    mlp = Phi3MLP(Phi3Config(hidden_size=32, intermediate_size=48))
    torch.testing.assert_close(foreign.stock_fused_swiglu(mlp, x), mlp(x), rtol=0, atol=0)
