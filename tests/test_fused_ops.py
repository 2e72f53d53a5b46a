"""fused_ops: refused clearly where liger cannot run; instance attribute changes undone exactly."""
from __future__ import annotations

import types

import pytest
import torch

import hf_accel
from hf_accel.fused import ops as fused_ops
from hf_accel.errors import BackendUnavailable
from hf_accel.patches import family_of
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


def _stand_in_binders(calls: list):
    """Stand-ins for liger's binders (its Triton kernels cannot run on CPU): each bound forward records its module
    and computes what the module's own forward computes."""
    def binder(m):
        own = type(m).forward
        m.forward = lambda *a, _m=m, **k: calls.append(_m) or own(_m, *a, **k)

    return dict.fromkeys(("rms_norm", "rms_norm_gemma", "rms_norm_fp32", "swiglu", "geglu", "layer_norm"), binder)


def test_inside_compiled_layers_liger_serves_only_eager_training_calls():
    """Compiled layers trace the module's own forward (inductor fuses it); op-level checkpointed layers, which run
    eagerly, get liger's; evaluation gets the module's own; the final norm liger's in training. Undo restores
    exactly."""
    from hf_accel.fused import compiling
    from hf_accel.memory.checkpointing import decoder_layers, policy_from_spec

    torch.manual_seed(0)
    model = make("llama-gqa").train()
    before = {n: dict(m.__dict__) for n, m in model.named_modules()}
    calls = []
    names, undo = fused_ops.bind(family_of(model).fusable(model), _stand_in_binders(calls))
    assert "model.norm" in names and len(names) > 1
    _, compile_undo = compiling.apply(model, {"backend": "eager"})
    inside = {id(m) for layer in decoder_layers(model) for m in layer.modules()}
    ids = torch.randint(0, 64, (1, 12))

    model(input_ids=ids, labels=ids).loss.backward()  # compiled training call
    assert calls and not any(id(m) in inside for m in calls)  # only model.norm

    calls.clear()
    policy = policy_from_spec("op")
    policy.apply(model)  # op-level checkpointing: the layers take their eager path
    model(input_ids=ids, labels=ids).loss.backward()
    assert any(id(m) in inside for m in calls)
    policy.remove(model)

    calls.clear()
    model.eval()
    with torch.no_grad():
        model(input_ids=ids)
    assert not calls  # evaluation computes what the unpatched model computes

    for action in reversed(compile_undo + undo):
        action()
    after = {n: dict(m.__dict__) for n, m in model.named_modules()}
    for name in before:
        assert before[name].keys() == after[name].keys(), name


def test_compiled_layers_trace_the_stock_op_where_someone_else_bound_a_kernel():
    """transformers' / TRL's use_liger_kernel binds liger's forwards on the model itself (not through fused_ops'
    eager-only wrapper), and dynamo then traced liger's Triton kernels inside compiled layers (dozens of logged
    CompilationErrors on the H200). A stand-in kernel bound the same way: the compiled layers' graphs must trace the
    stock op instead, while eager calls still run the kernel."""
    from hf_accel.fused import compiling
    from hf_accel.memory.checkpointing import decoder_layers

    calls = []

    def stand_in_forward(self, hidden_states):  # liger's "kernel": a call we can see, and a different result
        calls.append(torch.compiler.is_compiling())
        return type(self).forward(self, hidden_states) * 3.0

    fused_ops.trace_stock_instead(stand_in_forward, lambda self, hidden_states: type(self).forward(self, hidden_states))
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = make("llama-gqa").train()
    stock = make("llama-gqa").train()
    for layer in decoder_layers(model):
        layer.post_attention_layernorm.forward = types.MethodType(stand_in_forward, layer.post_attention_layernorm)
    _, undo = compiling.apply(model, {"backend": "aot_eager"})
    ids = torch.randint(0, 64, (1, 12))
    loss = model(input_ids=ids, labels=ids, use_cache=False).loss
    assert True not in calls  # never traced
    torch.testing.assert_close(loss, stock(input_ids=ids, labels=ids, use_cache=False).loss)
    model.eval()
    with torch.no_grad():
        model(input_ids=ids)
    assert calls and not any(calls)  # eager calls run the bound kernel
    for action in reversed(undo):
        action()
    torch._dynamo.reset()


@pytest.mark.parametrize("variant", ["llama-gqa", "neox-parallel", "falcon-mha"])
def test_fullgraph_compiled_eval_never_traces_liger(variant):
    """A user's torch.compile(model, fullgraph=True) of an evaluation / decode forward traces the stock norms and MLPs,
    never liger's bound forwards (liger's functional wrappers are compiler-disabled: a graph break), the final norm
    included; the outputs equal the unbound model's."""
    torch.manual_seed(0)
    model = make(variant).eval()
    ids = torch.randint(0, 64, (1, 12))
    with torch.no_grad():
        want = model(input_ids=ids).logits
    calls = []
    _, undo = fused_ops.bind(family_of(model).fusable(model), _stand_in_binders(calls))
    compiled = torch.compile(model, fullgraph=True, backend="eager")
    with torch.no_grad():
        got = compiled(input_ids=ids).logits
    assert not calls
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    for action in reversed(undo):
        action()


@pytest.mark.parametrize("variant, kinds", [
    ("llama-gqa", {"rms_norm": 5, "swiglu": 2}),
    ("qwen3-qk-norm", {"rms_norm": 9, "swiglu": 2}),  # q_norm / k_norm too, as liger's Qwen3 patch binds them
    ("mistral-window", {"rms_norm": 5, "swiglu": 2}),
    ("gemma2-softcap", {"rms_norm_gemma": 9, "geglu": 2}),  # four (1 + w) norms a layer, GELU-tanh gate
    ("gemma3-text", {"rms_norm_gemma": 13, "geglu": 2}),
    ("neox-parallel", {"layer_norm": 5}),
])
def test_each_family_names_what_liger_fuses_and_bound_forwards_serve_training(variant, kinds):
    """The family object says which modules liger fuses and as what (Gemma's norms with offset 1 and gemma casting,
    its MLP as GEGLU); the bound forwards serve the training calls and the result is unchanged (stand-in kernels)."""
    torch.manual_seed(0)
    model = make(variant).train()
    found = family_of(model).fusable(model)
    got = {}
    for _, _, kind in found:
        got[kind] = got.get(kind, 0) + 1
    assert got == kinds
    ids = torch.randint(0, 64, (1, 9))
    want = model(input_ids=ids, labels=ids).loss
    calls = []
    _, undo = fused_ops.bind(found, _stand_in_binders(calls))
    torch.testing.assert_close(model(input_ids=ids, labels=ids).loss, want)
    assert len({id(m) for m in calls}) == len(found)
    for action in reversed(undo):
        action()
