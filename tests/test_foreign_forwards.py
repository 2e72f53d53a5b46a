"""Forwards liger-kernel or the hub ``kernels`` bound to a model's modules, inside hf_accel's compiled decoder layers
(hf_accel.fused.foreign_forwards), on the CPU with stand-ins.

liger-kernel needs Triton on CUDA, so the stand-ins mimic what it binds: a forward declared in a ``liger_kernel...``
module, bound on a model's own RMSNorm instances the way ``_patch_rms_norm_module`` binds it (or a module of a class
declared there), computing through a custom ``autograd.Function`` whose op dynamo cannot trace: a custom op without a
fake implementation, for which dynamo raises while tracing, as it raised on liger's ``LigerRMSNormFunction`` on the
GPU. Each compiled training step is held to the same model run eagerly (fp32, same stand-ins bound); on the code
before foreign_forwards every compiled case raised. tests/gpu/test_trl_liger_gpu.py runs the real liger.
"""
from __future__ import annotations

import copy
import types

import pytest
import torch
from torch import nn

import hf_accel
from hf_accel.fused import foreign_forwards as ff
from hf_accel.memory.targets import decoder_layers
from tiny_models import VOCAB, loss_and_grads, make

pytestmark = pytest.mark.usefixtures("fresh_dynamo")
EAGER = {"backend": "eager"}  # dynamo alone: the tracing is what fails, no code generation needed
GRAD_RTOL = 1e-5  # fp32 on both sides, the same ops


@torch.library.custom_op("hf_accel_test::scale_untraceable", mutates_args=())
def scale_untraceable(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """An op with no fake implementation: dynamo cannot trace it (a kernel launched outside torch's dispatcher)."""
    return x * w


def _setup(ctx, inputs, output):
    ctx.save_for_backward(*inputs)


def _backward(ctx, grad):
    x, w = ctx.saved_tensors
    return grad * w, (grad * x).flatten(0, -2).sum(0)


scale_untraceable.register_autograd(_backward, setup_context=_setup)
calls = {"eager": 0}


class ScaleFunction(torch.autograd.Function):
    """What liger's LigerRMSNormFunction is to dynamo: a custom autograd.Function over an op it cannot trace."""

    @staticmethod
    def forward(ctx, x, w):
        calls["eager"] += 1
        ctx.save_for_backward(x, w)
        return scale_untraceable(x, w)

    @staticmethod
    def backward(ctx, grad):
        return _backward(ctx, grad)


def _normed(hidden_states: torch.Tensor, eps: float) -> torch.Tensor:
    x = hidden_states.float()
    return (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)).to(hidden_states.dtype)


def liger_style_forward(self, hidden_states):
    return ScaleFunction.apply(_normed(hidden_states, self.variance_epsilon), self.weight)


liger_style_forward.__module__ = "liger_kernel.transformers.rms_norm"  # where liger's LigerRMSNorm.forward lives


class StandInLigerRMSNorm(nn.Module):
    """A module of liger's own classes (what apply_liger_kernel_to_llama() before loading a model leaves)."""

    def __init__(self, norm: nn.Module):
        super().__init__()
        self.weight, self.variance_epsilon = norm.weight, norm.variance_epsilon

    def forward(self, hidden_states):
        return ScaleFunction.apply(_normed(hidden_states, self.variance_epsilon), self.weight)


StandInLigerRMSNorm.__module__ = "liger_kernel.transformers.rms_norm"


def custom_function_forward(self, hidden_states):
    """A forward of no known library that calls a custom autograd.Function dynamo cannot trace."""
    return ScaleFunction.apply(_normed(hidden_states, self.variance_epsilon), self.weight)


def direct_op_forward(self, hidden_states):
    """A forward that calls the untraceable op with no autograd.Function in between: nothing to single out."""
    return torch.ops.hf_accel_test.scale_untraceable(_normed(hidden_states, self.variance_epsilon), self.weight)


def norms(model: nn.Module) -> list[nn.Module]:
    return [m for layer in decoder_layers(model) for m in layer.modules() if type(m).__name__.endswith("RMSNorm")]


def bind(model: nn.Module, forward) -> None:
    """What liger's ``_bind_method_to_module`` does to each norm of the decoder layers."""
    for norm in norms(model):
        norm.__dict__["forward"] = forward.__get__(norm, type(norm))


def replace_norms(model: nn.Module) -> None:
    for layer in decoder_layers(model):
        for name in ("input_layernorm", "post_attention_layernorm"):
            setattr(layer, name, StandInLigerRMSNorm(getattr(layer, name)))


def packed(lengths: list[int], seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (1, sum(lengths)), generator=g)
    pos = torch.cat([torch.arange(n) for n in lengths])[None]
    return dict(input_ids=ids, position_ids=pos, labels=ids.masked_fill(pos == 0, -100))


def assert_same_steps(ours: nn.Module, ref: nn.Module, steps: int = 2) -> None:
    for step, lengths in enumerate(([5, 9, 3], [7, 11])[:steps]):
        loss, grads = loss_and_grads(ours, packed(lengths, step))
        ref_loss, ref_grads = loss_and_grads(ref, packed(lengths, step))
        assert loss == pytest.approx(ref_loss, rel=1e-6)
        assert grads.keys() == ref_grads.keys()
        for name, g in ref_grads.items():
            assert ((grads[name] - g).abs().max() / g.abs().max().clamp_min(1e-12)).item() < GRAD_RTOL, name


def pair(prepare, when: str = "before"):
    """The same tiny Llama twice with ``prepare`` applied: the reference patched eagerly, ours compiled; ``when``
    "after" prepares ours after patch() (transformers binds liger when train() starts)."""
    ref = make("llama-gqa").train()
    prepare(ref)
    ours = make("llama-gqa").train()
    if when == "before":
        prepare(ours)
    hf_accel.patch(ref, backend="reference")
    report = hf_accel.patch(ours, backend="reference", compile=EAGER)
    if when == "after":
        prepare(ours)
    return ours, ref, report


@pytest.mark.parametrize("when", ["before", "after"])
def test_a_liger_forward_bound_on_the_models_norms_trains_compiled(when):
    ours, ref, _ = pair(lambda m: bind(m, liger_style_forward), when)
    assert_same_steps(ours, ref)
    notes = ff.compile_notes(ours)
    assert any("liger-kernel forward on 4 LlamaRMSNorm" in n and "own forward" in n for n in notes), notes
    ours.eval()
    with torch.no_grad():  # eager calls still run the bound forward (the kernel)
        before = calls["eager"]
        ours(**packed([5, 4], 3))
        assert calls["eager"] == before + 4


def test_modules_of_a_liger_class_run_opaque():
    ours, ref, _ = pair(replace_norms)
    assert_same_steps(ours, ref)
    notes = ff.compile_notes(ours)
    assert any("StandInLigerRMSNorm" in n and "runs eagerly between" in n for n in notes), notes


def test_a_custom_autograd_function_dynamo_cannot_trace_is_made_opaque_after_the_failure():
    ours, ref, _ = pair(lambda m: bind(m, custom_function_forward))
    assert not ff.compile_notes(ours)  # nothing foreign to see before tracing
    assert_same_steps(ours, ref)
    notes = ff.compile_notes(ours)
    assert any("dynamo failed to trace" in n and "LlamaRMSNorm x4" in n for n in notes), notes
    assert all(layer.__dict__["_compiled_call_impl"].foreign.eager_reason is None for layer in decoder_layers(ours))


def test_a_layer_that_cannot_be_traced_at_all_runs_eagerly():
    ours, ref, _ = pair(lambda m: bind(m, direct_op_forward))
    assert_same_steps(ours, ref)
    notes = ff.compile_notes(ours)
    assert any("run eagerly from now on" in n for n in notes), notes
    call = decoder_layers(ours)[0].__dict__["_compiled_call_impl"]
    assert not call.takes_compiled_path({})


def test_unpatch_restores_the_bound_forwards():
    model = make("llama-gqa").train()
    bind(model, liger_style_forward)
    before = {id(n): n.__dict__["forward"] for n in norms(model)}
    hf_accel.patch(model, backend="reference", compile=EAGER)
    assert all(n.__dict__["forward"] is not before[id(n)] for n in norms(model))
    hf_accel.unpatch(model)
    assert all(n.__dict__["forward"] is before[id(n)] for n in norms(model))
    assert all(ff._PREVIOUS not in n.__dict__ for n in norms(model))
    assert ff.NOTES_ATTR not in model.__dict__


def test_a_deep_copy_keeps_its_own_bound_forward():
    model = make("llama-gqa").train()
    bind(model, liger_style_forward)
    hf_accel.patch(model, backend="reference", compile=EAGER)
    copied = copy.deepcopy(model)
    for norm in norms(copied):
        assert norm.forward.__self__ is norm and norm.__dict__[ff._PREVIOUS].__self__ is norm


# ---- classification alone (no tracing) ---------------------------------------------------------------------------

def _hub_layer(can_compile: bool):
    """A hub kernel layer class as ``kernels`` loads it (its own module, ``can_torch_compile`` as declared)."""
    module = types.ModuleType("kernels_community_rmsnorm_standin.layers")
    ns: dict = {}
    exec("import torch\nclass RMSNorm(torch.nn.Module):\n    def forward(self, hidden_states):\n"
         "        return hidden_states\n", ns)
    cls = ns["RMSNorm"]
    cls.__module__ = module.__name__
    cls.forward.__module__ = module.__name__
    cls.can_torch_compile = can_compile
    setattr(module, "RMSNorm", cls)
    import sys

    sys.modules[module.__name__] = module
    return cls


@pytest.mark.parametrize("can_compile, decision", [(True, ff.TRACED), (False, ff.TRACE_OWN)])
def test_a_hub_kernel_layer_is_traced_only_where_it_declares_compile_support(can_compile, decision):
    norm = norms(make("llama-gqa"))[0]
    cls = _hub_layer(can_compile)
    norm.forward = types.MethodType(cls.forward, norm)  # what kernels' _replace_forward binds
    norm.__dict__["_kernel_repo"] = "kernels-community/rmsnorm-standin"
    finding = ff.classify(norm)
    assert finding.decision == decision and "kernels-community/rmsnorm-standin" in finding.source


def test_the_models_own_and_hf_accels_forwards_are_not_foreign():
    model = make("llama-gqa")
    assert all(ff.classify(m) is None for m in model.modules())
    hf_accel.patch(model, backend="reference")
    assert all(ff.classify(m) is None for m in model.modules())


def test_a_forward_calling_a_foreign_function_by_module_name_is_opaque(monkeypatch):
    """liger's apply_liger_kernel_to_llama(rope=True) swaps modeling_llama.apply_rotary_pos_emb for its own."""
    from transformers.models.llama import modeling_llama

    def liger_rotary_pos_emb(q, k, cos, sin, position_ids=None, unsqueeze_dim=1):
        return q, k

    liger_rotary_pos_emb.__module__ = "liger_kernel.transformers.rope"
    monkeypatch.setattr(modeling_llama, "apply_rotary_pos_emb", liger_rotary_pos_emb)
    attention = decoder_layers(make("llama-gqa"))[0].self_attn
    finding = ff.classify(attention)
    assert finding.decision == ff.OPAQUE and "apply_rotary_pos_emb" in finding.why
    torch.compiler.substitute_in_graph(liger_rotary_pos_emb, skip_signature_check=True)(
        lambda q, k, cos, sin, position_ids=None, unsqueeze_dim=1: (q, k))
    assert ff.classify(attention).decision == ff.TRACED


def test_compile_failures_are_told_from_the_models_own_errors():
    from torch._dynamo.exc import TorchRuntimeError

    def traced(x):
        return ScaleFunction.apply(x, torch.ones(3))

    with pytest.raises(TorchRuntimeError) as dynamo_error:
        torch.compile(traced, backend="eager", fullgraph=True)(torch.ones(2, 3))
    assert ff.is_compile_failure(dynamo_error.value)

    def user_error(x):
        raise ValueError("the model's own error")

    with pytest.raises(ValueError) as own:
        torch.compile(user_error, backend="eager")(torch.ones(2))
    assert not ff.is_compile_failure(own.value)
