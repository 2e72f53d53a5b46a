"""FlashMHA in bf16 through flash-attn-4 and PyTorch's FA2 vs fp32 math, forward and backward, on a CUDA GPU.

Tolerance rule (flash-attn's own tests): the fast kernel's error against the fp32 reference may be at most twice the
error the bf16 baseline (the same module on SDPA in bf16) reaches, plus the rounding error at the output's magnitude.
Run with ``pytest -m gpu tests/gpu/test_flash_mha_gpu.py``.
"""
import copy

import pytest
import torch

from hf_accel.attention.flash_mha import FlashMHA
from hf_accel.attention.kernels import BACKENDS

pytestmark = pytest.mark.gpu

BASELINE_FACTOR = 2.0  # flash-attn's rule: at most 2x the low-precision baseline's error
E, H = 1024, 8  # head_dim 128
CASES = {
    # name: (FlashMHA options, packed input?)
    "padded-causal": ({"causal": True}, False),
    "padded-mqa-noncausal": ({"num_kv_heads": 1, "qkv_fused": True}, False),
    "packed-gqa-rope-causal": ({"num_kv_heads": 2, "causal": True, "rotary": "rope", "qkv_fused": True}, True),
}
DOC_LENGTHS = [512, 100, 300, 1, 77, 1024]


def make_inputs(packed: bool, device):
    """x (bf16-representable fp32) and the call's keyword arguments."""
    if packed:
        cu = torch.tensor([0] + DOC_LENGTHS, device=device).cumsum(0).to(torch.int32)
        x = torch.randn(sum(DOC_LENGTHS), E, device=device)
        kwargs = {"cu_seqlens": cu, "max_seqlen": max(DOC_LENGTHS)}
    else:
        x = torch.randn(4, 512, E, device=device)
        pad = torch.zeros(4, 512, dtype=torch.bool, device=device)
        pad[1, 300:] = True  # right padding
        pad[2, :200] = True  # left padding
        kwargs = {"key_padding_mask": pad}
    return x.to(torch.bfloat16).float(), kwargs


def forward_backward(module: FlashMHA, x, kwargs, grad_out):
    module.zero_grad(set_to_none=True)
    x = x.to(next(module.parameters()).dtype).detach().requires_grad_(True)
    out = module(x, **kwargs)[0]
    out.backward(grad_out.to(out.dtype))
    tensors = {"out": out, "grad_x": x.grad}
    tensors.update({f"grad_{n}": p.grad for n, p in module.named_parameters()})
    return {k: v.detach().float() for k, v in tensors.items()}


def compare(backend: str, case: str, device: str = "cuda", baseline: str = "sdpa") -> dict:
    """Max errors {tensor: (ours, baseline, allowed)} of ``backend`` in bf16 vs the fp32 reference."""
    options, packed = CASES[case]
    torch.manual_seed(0)
    reference = FlashMHA(E, H, backend="reference", device=device, **options)
    with torch.no_grad():
        for p in reference.parameters():
            p.copy_(p.to(torch.bfloat16))  # weights representable in bf16: only the compute differs
    x, kwargs = make_inputs(packed, device)
    grad_out = torch.randn_like(x).to(torch.bfloat16).float()
    expected = forward_backward(reference, x, kwargs, grad_out)
    low = copy.deepcopy(reference).to(torch.bfloat16)
    low.backend = baseline
    base = forward_backward(low, x, kwargs, grad_out)
    low.backend = backend
    ours = forward_backward(low, x, kwargs, grad_out)
    result = {}
    for name, ref in expected.items():
        ref_bf16 = ref.to(torch.bfloat16)
        rounding = (ref_bf16 + 0.3 - 0.3 - ref_bf16).abs().max().item()  # flash-attn's atol: bf16 rounding at this size
        base_err = (base[name] - ref).abs().max().item()
        our_err = (ours[name] - ref).abs().max().item()
        result[name] = (our_err, base_err, BASELINE_FACTOR * base_err + 2 * rounding)
    return result


@pytest.fixture(autouse=True)
def _exact_fp32_matmul():
    previous = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False  # the fp32 reference must be fp32
    yield
    torch.backends.cuda.matmul.allow_tf32 = previous


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("backend", ["fa4", "torch-fa2"])
def test_bf16_kernel_within_baseline_error(backend, case):
    reason = BACKENDS[backend].unavailable_reason()
    if reason:
        pytest.skip(f"{backend}: {reason}")
    errors = compare(backend, case)
    too_far = {name: e for name, e in errors.items() if not e[0] <= e[2]}
    assert not too_far, f"(ours, bf16 baseline, allowed) max abs errors: {too_far}"
