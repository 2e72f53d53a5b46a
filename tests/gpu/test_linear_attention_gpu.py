"""The fla backend of ``hf_accel.patches.linear_attention`` on the GPU (needs fla-core: ``pip install
'hf_accel[hybrid]'``).

Packed bf16 rows through fla-core's varlen conv and chunked gated delta rule, against the CPU fp32 reference: the
unpatched model run on each document alone. The tolerance is the error the unpatched model itself makes in bf16 on
the GPU on each document alone (flash-attn's test rule), so the packed fast path is held to stock bf16's precision.
Widths of the published Qwen3.5 / Qwen3-Next linear-attention layers (16 key / 32 value heads of 128, conv kernel 4,
full attention 16 / 2 heads of 256), 4 layers (3 linear, 1 full), a small vocabulary.
"""
from __future__ import annotations

import contextlib
import copy
import inspect
import sys
import time

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from hf_accel import DataCollatorForPacking
from hf_accel.patches import linear_attention as la
from test_linear_attention import patch_linear

pytest.importorskip("fla", reason="needs fla-core: pip install 'hf_accel[hybrid]'")


def fla_backward_refused() -> str | None:
    """fla-core's own guard (0.6.0): its gated chunk backward raises on Hopper GPUs with Triton 3.4 to 3.7.0 (wrong
    results there) unless tilelang serves it. Stock transformers calls fla-core too, so neither the unpatched model
    nor the patched one trains there (run 39: torch 2.11's Triton on an H100)."""
    import importlib.util

    try:
        from fla.utils import IS_NVIDIA_HOPPER, TRITON_ABOVE_3_4_0, TRITON_ABOVE_3_7_1
    except ImportError:
        return None
    if IS_NVIDIA_HOPPER and TRITON_ABOVE_3_4_0 and not TRITON_ABOVE_3_7_1 and not importlib.util.find_spec("tilelang"):
        import triton

        return (f"fla-core refuses its gated delta rule's backward on Hopper with Triton {triton.__version__}: "
                "needs Triton >= 3.7.1 or tilelang")
    return None


pytestmark = [pytest.mark.gpu, pytest.mark.skipif(bool(fla_backward_refused()), reason=str(fla_backward_refused()))]

VOCAB = 4096
LAYERS = ["linear_attention"] * 3 + ["full_attention"]
WIDTHS = dict(hidden_size=2048, intermediate_size=6144, num_attention_heads=16, num_key_value_heads=2, head_dim=256,
              linear_num_key_heads=16, linear_num_value_heads=32, linear_key_head_dim=128, linear_value_head_dim=128,
              linear_conv_kernel_dim=4)
MOE = dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=512, shared_expert_intermediate_size=512)
DOC_LENGTHS = (1, 17, 63, 64, 65, 300, 1000, 1500)  # around fla-core's 64-token chunks, 3,010 tokens in all
SLACK = 1e-3  # absolute slack over twice the baseline's error (a bf16 ulp of the values compared)


def build(model_type: str):
    kw = dict(WIDTHS, vocab_size=VOCAB, num_hidden_layers=len(LAYERS), layer_types=LAYERS, use_cache=False,
              tie_word_embeddings=False, **(MOE if model_type != "qwen3_5_text" else {}))
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(AutoConfig.for_model(model_type, **kw), attn_implementation="sdpa")


def documents(lengths=DOC_LENGTHS, seed: int = 1) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(1, VOCAB, (n,), generator=g) for n in lengths]


def probe_weights(docs, seed: int = 2) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(len(d), VOCAB, generator=g) for d in docs]


@contextlib.contextmanager
def torch_implementations(model):
    """The model's modeling module calls its plain torch functions (chunked and recurrent delta rule, causal conv)
    instead of transformers' wrappers that may route to fla-core's kernels (which run on CUDA only)."""
    module = sys.modules[type(model).__module__]
    swapped = {name: value for name, value in vars(module).items()
               if inspect.isfunction(value) and hasattr(value, "__wrapped__")}
    try:
        for name, value in swapped.items():
            setattr(module, name, inspect.unwrap(value))
        yield
    finally:
        for name, value in swapped.items():
            setattr(module, name, value)


def each_alone(model, docs, weights, device):
    """Logits of each document run alone (fp32 on the host: the plain torch implementations) and the gradient of the
    probe over all of them."""
    with torch_implementations(model) if device == "cpu" else contextlib.nullcontext():
        logits = [model(d[None].to(device)).logits[0] for d in docs]
    sum((l.float() * w.to(device)).sum() for l, w in zip(logits, weights)).backward()
    return [l.detach().float().cpu() for l in logits], grads(model)


def grads(model) -> torch.Tensor:
    return torch.cat([p.grad.float().cpu().reshape(-1) for p in model.parameters() if p.grad is not None])


def packed(model, batch, cu, docs, weights, device):
    """Logits of each document out of the packed batch (found by the collator's cu_seq_lens ``cu``), and the probe's
    gradient."""
    batch = {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in batch.items()}
    logits_t = model(**batch).logits.reshape(-1, VOCAB)
    cu = cu.tolist()
    ids_t = batch["input_ids"].reshape(-1).cpu()
    found = {}
    for start, end in zip(cu, cu[1:]):
        for i, d in enumerate(docs):
            if i not in found and end - start == len(d) and torch.equal(ids_t[start:end], d):
                found[i] = logits_t[start:end]
                break
    assert sorted(found) == list(range(len(docs))), "a document is missing from the packed batch"
    ordered = [found[i] for i in range(len(docs))]
    sum((l.float() * w.to(device)).sum() for l, w in zip(ordered, weights)).backward()
    return [l.detach().float().cpu() for l in ordered], grads(model)


@pytest.mark.parametrize("model_type", ["qwen3_5_text", "qwen3_next"])
@pytest.mark.parametrize("layout", ["collator", "position_ids"])
@pytest.mark.parametrize("precision", ["bf16", "autocast"])  # bf16 weights; fp32 weights under bf16 autocast
def test_fla_backend_within_bf16_error_of_each_document_alone(model_type, layout, precision):
    docs, cuda = documents(), torch.device("cuda")
    weights = probe_weights(docs)
    ref = build(model_type).float()
    base = copy.deepcopy(ref).to(cuda, torch.bfloat16 if precision == "bf16" else torch.float32)
    ours = copy.deepcopy(base)
    autocast = torch.autocast("cuda", dtype=torch.bfloat16, enabled=precision == "autocast")
    want, want_grad = each_alone(ref, docs, weights, "cpu")
    with autocast:
        base_logits, base_grad = each_alone(base, docs, weights, cuda)
    patch_linear(ours, backend="fla")  # raises where fla-core cannot serve a call
    collate = DataCollatorForPacking(pad_token_id=0, max_tokens=2048, all_masked="keep")
    batch = collate([{"input_ids": d.tolist()} for d in docs])
    batch.pop("labels")
    cu = batch["cu_seq_lens_q"]
    if layout == "position_ids":  # TRL's padding-free rows: documents from position_ids alone
        batch = {"input_ids": batch["input_ids"], "position_ids": batch["position_ids"]}
    with autocast:
        got, got_grad = packed(ours, batch, cu, docs, weights, cuda)
    for i, (g, b, w) in enumerate(zip(got, base_logits, want)):
        base_err, err = (b - w).abs().max().item(), (g - w).abs().max().item()
        sys.stderr.write(f"[{model_type} {layout} {precision}] document {i} ({len(docs[i])} tokens): logits error "
                         f"{err:.3e} (stock bf16 alone {base_err:.3e})\n")
        assert err <= 2 * base_err + SLACK, f"document {i}"
    base_err = ((base_grad - want_grad).norm() / want_grad.norm()).item()
    err = ((got_grad - want_grad).norm() / want_grad.norm()).item()
    sys.stderr.write(f"[{model_type} {layout} {precision}] gradient relative error {err:.3e} "
                     f"(stock bf16 alone {base_err:.3e})\n")
    assert err <= 2 * base_err + SLACK


def test_fla_backend_faster_than_per_document():
    """One training step's forward and backward on a 16k-token packed row of 40 documents, bf16: tokens/s of each
    backend, for the record (fla must be the faster)."""
    cuda = torch.device("cuda")
    g = torch.Generator().manual_seed(3)
    lengths = torch.randint(64, 800, (40,), generator=g).tolist()
    docs = documents(lengths)
    ids = torch.cat(docs)[None].to(cuda)
    positions = torch.cat([torch.arange(n) for n in lengths])[None].to(cuda)
    model = build("qwen3_5_text").to(cuda, torch.bfloat16)
    speeds = {}
    for backend in ("per_document", "fla"):
        candidate = copy.deepcopy(model)
        undo = patch_linear(candidate, backend=backend)
        for step in range(5):
            if step == 2:
                torch.cuda.synchronize()
                start = time.perf_counter()
            candidate(ids, position_ids=positions).logits.float().square().mean().backward()
        torch.cuda.synchronize()
        speeds[backend] = 3 * ids.numel() / (time.perf_counter() - start)
        for action in undo:
            action()
        del candidate
    sys.stderr.write(f"[linear attention] {ids.numel()} tokens, {len(lengths)} documents: "
                     + ", ".join(f"{b} {s:,.0f} tokens/s" for b, s in speeds.items()) + "\n")
    assert speeds["fla"] > speeds["per_document"]
    assert la.choose_backend(model.model.layers[0].linear_attn, torch.zeros(1, 1, 2048, device=cuda)) == "fla"
