"""hf_accel.patches.experts on the GPU: the grouped CUDA path (torch's grouped GEMM, bf16) against stock's eager
experts loop, at real per-layer expert shapes (Qwen3-30B-A3B, gpt-oss-20b, Mixtral-8x7B), one experts module on
fixed routing (so a bf16 routing flip cannot hide or fake a difference). Rule (flash-attn's): the patched bf16
module's error against the fp32 eager module is at most ERROR_RATIO times the eager bf16 module's own, for the
output and every gradient; with PEFT's experts LoRA (r=16), against PEFT's own forward (which folds W + B A).

The last test times one forward + backward of the LoRA'd module, patched vs stock's ``grouped_mm`` experts under
PEFT (the stack the issue's bench compares with), and prints both with the peak memory.
"""
from __future__ import annotations

import copy
import time

import pytest
import torch
from torch import nn
from transformers import GptOssConfig, MixtralConfig, Qwen3MoeConfig
from transformers.models.gpt_oss.modeling_gpt_oss import GptOssExperts
from transformers.models.mixtral.modeling_mixtral import MixtralExperts
from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeExperts

from hf_accel.patches import experts

pytestmark = pytest.mark.gpu

ERROR_RATIO = 2.0
TOKENS = 4096
DEVICE = "cuda"
SHAPES = {  # per-layer experts of the named checkpoints: (experts class, config, top_k)
    "qwen3-30b-a3b": lambda: (Qwen3MoeExperts, Qwen3MoeConfig(hidden_size=2048, moe_intermediate_size=768,
                                                              num_experts=128, num_experts_per_tok=8), 8),
    "gpt-oss-20b": lambda: (GptOssExperts, GptOssConfig(hidden_size=2880, intermediate_size=2880,
                                                        num_local_experts=32, num_experts_per_tok=4), 4),
    "mixtral-8x7b": lambda: (MixtralExperts, MixtralConfig(hidden_size=4096, intermediate_size=14336,
                                                           num_local_experts=8, num_experts_per_tok=2), 2),
}


class Holder(nn.Module):
    """The place an experts module sits in a model (PEFT puts its wrappers there)."""

    def __init__(self, module: nn.Module):
        super().__init__()
        self.experts = module

    def forward(self, hidden, index, weights):
        return self.experts(hidden, index, weights)


def build(name: str, implementation: str = "eager") -> tuple[Holder, int, int]:
    """The experts module (fp32, weights ~N(0, 0.02)) in its holder, its top_k and hidden size."""
    cls, config, top_k = SHAPES[name]()
    config._experts_implementation = implementation
    torch.manual_seed(0)
    module = cls(config)
    with torch.no_grad():
        for p in module.parameters():
            p.normal_(0.0, 0.02)
    return Holder(module).to(DEVICE), top_k, config.hidden_size


def routing(num_experts: int, top_k: int, hidden: int):
    """Fixed inputs: hidden states (T, H), distinct experts per token (T, k), softmax weights (T, k) fp32."""
    torch.manual_seed(1)
    x = torch.randn(TOKENS, hidden, device=DEVICE)
    index = torch.rand(TOKENS, num_experts, device=DEVICE).topk(top_k, dim=-1).indices
    weights = torch.randn(TOKENS, top_k, device=DEVICE).softmax(-1)
    return x, index, weights


def run(holder: Holder, x, index, weights, dtype) -> dict[str, torch.Tensor]:
    """Output and gradients (inputs, routing weights, every trainable parameter) of one forward + backward, fp32."""
    x = x.detach().to(dtype).requires_grad_(True)
    w = weights.detach().to(dtype).requires_grad_(True)
    out = holder(x, index, w)
    torch.manual_seed(2)
    out.backward(torch.randn_like(out))
    found = {"out": out.float(), "d_hidden": x.grad.float(), "d_weights": w.grad.float()}
    found.update({n: p.grad.float() for n, p in holder.named_parameters() if p.grad is not None})
    return found


def assert_within_bf16_error(ours: dict, bf16: dict, fp32: dict) -> None:
    assert ours.keys() == fp32.keys()
    for key, want in fp32.items():
        base = (bf16[key] - want).abs().max().item()
        worst = (ours[key] - want).abs().max().item()
        assert worst <= ERROR_RATIO * base + 1e-6 * want.abs().max().item(), (key, worst, base)


def counting_grouped_mm(monkeypatch) -> list[int]:
    calls = []
    for owner, attr in ((torch.nn.functional, "grouped_mm"), (torch, "_grouped_mm")):
        original = getattr(owner, attr, None)
        if original is not None:
            def counted(*args, _original=original, **kwargs):
                calls.append(1)
                return _original(*args, **kwargs)
            monkeypatch.setattr(owner, attr, counted)
    return calls


@pytest.mark.parametrize("name", list(SHAPES))
def test_grouped_cuda_path_matches_eager(name, monkeypatch):
    ref32, top_k, hidden = build(name)
    ref16 = copy.deepcopy(ref32).to(torch.bfloat16)
    ours = copy.deepcopy(ref16)
    assert experts.apply(ours)[0] == ["experts"]
    inputs = routing(ref32.experts.num_experts, top_k, hidden)
    want, bf16 = run(ref32, *inputs, torch.float32), run(ref16, *inputs, torch.bfloat16)
    calls = counting_grouped_mm(monkeypatch)
    got = run(ours, *inputs, torch.bfloat16)
    assert len(calls) >= 2  # the up and down projections went through torch's grouped GEMM
    assert_within_bf16_error(got, bf16, want)


def _peft(holder: Holder) -> nn.Module:
    import peft

    torch.manual_seed(3)
    config = peft.LoraConfig(r=16, lora_alpha=32, init_lora_weights=False,
                             target_parameters=["experts.gate_up_proj", "experts.down_proj"])
    return peft.get_peft_model(holder, config)


@pytest.mark.parametrize("name", list(SHAPES))
def test_lora_on_experts_matches_peft(name, monkeypatch):
    base, top_k, hidden = build(name)
    ref32 = _peft(copy.deepcopy(base))
    ref16 = _peft(copy.deepcopy(base).to(torch.bfloat16))
    ours = _peft(copy.deepcopy(base).to(torch.bfloat16))
    experts.apply(ours)
    inputs = routing(base.experts.num_experts, top_k, hidden)
    want, bf16 = run(ref32, *inputs, torch.float32), run(ref16, *inputs, torch.bfloat16)
    calls = counting_grouped_mm(monkeypatch)
    got = run(ours, *inputs, torch.bfloat16)
    assert len(calls) >= 6  # base and both low-rank products of two projections
    assert any("lora_A" in k for k in got) and any("lora_B" in k for k in got)
    assert_within_bf16_error(got, bf16, want)


def _timed(holder: nn.Module, inputs, steps: int = 10) -> tuple[float, float]:
    """Median ms of forward + backward, and peak GiB above what was allocated before."""
    x, index, weights = inputs
    x = x.detach().to(torch.bfloat16).requires_grad_(True)
    w = weights.detach().to(torch.bfloat16).requires_grad_(True)
    torch.manual_seed(2)
    grad = torch.randn_like(x)
    times = []
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    start_mem = torch.cuda.memory_allocated()
    for _ in range(steps + 3):
        start = time.perf_counter()
        holder(x, index, w).backward(grad)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    peak = (torch.cuda.max_memory_allocated() - start_mem) / 2**30
    return sorted(times[3:])[steps // 2] * 1e3, peak


def test_lora_speed_against_stock_grouped_mm():
    """Qwen3-30B-A3B's experts layer, LoRA r=16, 4,096 tokens: patched vs stock grouped_mm under PEFT."""
    base, top_k, hidden = build("qwen3-30b-a3b", implementation="grouped_mm")
    base = base.to(torch.bfloat16)
    stock = _peft(copy.deepcopy(base))
    ours = _peft(copy.deepcopy(base))
    experts.apply(ours)
    inputs = routing(base.experts.num_experts, top_k, hidden)
    stock_ms, stock_gib = _timed(stock, inputs)
    ours_ms, ours_gib = _timed(ours, inputs)
    print(f"\nqwen3-30b-a3b experts, LoRA r=16, {TOKENS} tokens: stock grouped_mm + PEFT {stock_ms:.2f} ms "
          f"{stock_gib:.2f} GiB; hf_accel {ours_ms:.2f} ms {ours_gib:.2f} GiB")
    assert ours_ms < stock_ms and ours_gib <= stock_gib
