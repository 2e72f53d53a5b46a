"""hf_accel.patches.experts against the unpatched model with stock's eager experts (fp32, CPU, tiny configs built in
code): logits and every gradient (router included) on padded and packed batches, the load-balancing loss, LoRA on
the experts (PEFT's target_parameters) with attention and router LoRA, applied before or after get_peft_model, exact
undo, and the bytes the grouped path keeps for backward measured against saved_tensors_hooks.

Routing is made tie-free: router weights are scaled so that, on the test batches, the k-th and (k+1)-th router logits
of every token in every layer differ by at least ROUTING_MARGIN (checked on the reference), far above the ~1e-6
fp32 differences a different summation order leaves; so both models pick the same experts on every run.
"""
from __future__ import annotations

import copy

import pytest
import torch
import transformers
from transformers import AutoConfig, AutoModelForCausalLM

import hf_accel
import hf_accel.patches
from hf_accel.patches import experts

peft = pytest.importorskip("peft")

VOCAB = 64
ROUTING_MARGIN = 1e-3
LOGITS_ATOL = 2e-5  # fp32: the experts' sums in another order
GRAD_RTOL = 1e-4

_COMMON = dict(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
               head_dim=8, use_cache=False, router_aux_loss_coef=0.05)
# moe intermediate widths differ from hidden so a transposed layout would show; gpt-oss's sinks need eager attention
CONFIGS = {
    "qwen3_moe": (dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=24, intermediate_size=40,
                       norm_topk_prob=True), "sdpa"),
    "gpt_oss": (dict(num_local_experts=8, num_experts_per_tok=2, intermediate_size=24, sliding_window=4,
                     layer_types=["sliding_attention", "full_attention"]), "eager"),
    "mixtral": (dict(num_local_experts=8, num_experts_per_tok=3, intermediate_size=40), "sdpa"),
}
ROUTERS = {"qwen3_moe": "mlp.gate.weight", "gpt_oss": "mlp.router.weight", "mixtral": "mlp.gate.weight"}


def make(model_type: str, seed: int = 0, **overrides) -> torch.nn.Module:
    """The unpatched reference: stock's eager experts loop, experts and biases large enough to matter, router
    logits spread wide (the routing margin above)."""
    extra, attention = CONFIGS[model_type]
    config = AutoConfig.for_model(model_type, **{**_COMMON, **extra, **overrides})
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, experts_implementation="eager", attn_implementation=attention)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 3 or name.endswith("_bias"):
                p.normal_(0.0, 0.2)
            elif ".gate.weight" in name or ".router.weight" in name:
                p.normal_(0.0, 1.0)
    return model.train()


def padded_batch() -> dict:
    torch.manual_seed(1)
    ids = torch.randint(0, VOCAB, (3, 9))
    mask = torch.ones_like(ids)
    mask[0, :3] = 0  # left padding
    mask[1, 6:] = 0  # right padding
    labels = ids.masked_fill(mask == 0, -100)
    return dict(input_ids=ids, attention_mask=mask, labels=labels)


def packed_batch() -> dict:
    """Three documents in one row, apart by position_ids. Stock sdpa keeps them apart (Qwen3-MoE, Mixtral); stock
    gpt-oss (eager, sinks) lets them attend across (transformers 5.25), on both sides of the comparison alike: the
    experts act per token, so the reference is stock's own forward of the same packed row."""
    torch.manual_seed(2)
    lengths = [5, 8, 4]
    ids = torch.randint(0, VOCAB, (1, sum(lengths)))
    positions = torch.cat([torch.arange(n) for n in lengths]).unsqueeze(0)
    labels = ids.clone()
    labels[0, torch.tensor(lengths).cumsum(0)[:-1]] = -100  # each document's first token predicts nothing
    return dict(input_ids=ids, position_ids=positions, labels=labels)


def routing_margin(model, batch) -> float:
    """The smallest gap between the k-th and (k+1)-th router logits over every token and layer."""
    with torch.no_grad():
        out = model(**batch, output_router_logits=True)
    k = model.config.num_experts_per_tok
    return min((lg.sort(-1, descending=True).values[:, k - 1] - lg.sort(-1, descending=True).values[:, k]).min().item()
               for lg in out.router_logits)


def step(model, batch, **kw):
    model.zero_grad(set_to_none=True)
    out = model(**batch, **kw)
    out.loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return out, grads


def assert_same_step(ours, ref, batch, **kw):
    assert routing_margin(ref, batch) > ROUTING_MARGIN
    out_ref, grads_ref = step(ref, batch, **kw)
    out, grads = step(ours, batch, **kw)
    torch.testing.assert_close(out.logits, out_ref.logits, atol=LOGITS_ATOL, rtol=0)
    torch.testing.assert_close(out.loss, out_ref.loss, atol=LOGITS_ATOL, rtol=0)
    assert grads.keys() == grads_ref.keys() and len(grads) > 0
    for name, g in grads_ref.items():
        torch.testing.assert_close(grads[name], g, rtol=GRAD_RTOL, atol=GRAD_RTOL * g.abs().max().item(), msg=name)
    return out, out_ref, grads


@pytest.mark.parametrize("model_type", CONFIGS)
@pytest.mark.parametrize("batch", [padded_batch, packed_batch], ids=["padded", "packed"])
def test_logits_and_every_gradient(model_type, batch, one_torch_thread):
    ref = make(model_type)
    ours = copy.deepcopy(ref)
    names, _ = experts.apply(ours)
    assert names == [f"model.layers.{i}.mlp.experts" for i in range(2)]
    _, _, grads = assert_same_step(ours, ref, batch())
    assert any(ROUTERS[model_type].split(".")[-2] in n for n in grads)  # the router's weight got a gradient


@pytest.mark.parametrize("model_type", CONFIGS)
def test_auxiliary_loss(model_type, one_torch_thread):
    ref = make(model_type)
    ours = copy.deepcopy(ref)
    experts.apply(ours)
    out, out_ref, _ = assert_same_step(ours, ref, padded_batch(), output_router_logits=True)
    assert out_ref.aux_loss is not None and out_ref.aux_loss.item() > 0
    torch.testing.assert_close(out.aux_loss, out_ref.aux_loss, atol=1e-6, rtol=0)


def _lora_config(model_type: str) -> "peft.LoraConfig":
    # init_lora_weights=False: B is not zero, so every factor's gradient (and the delta) matters
    return peft.LoraConfig(r=4, lora_alpha=8, init_lora_weights=False, target_modules=["q_proj", "v_proj"],
                           target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj",
                                              ROUTERS[model_type]])


def _count_factor_folds():
    """Counts evaluations of PEFT's W + scaling * lhs @ rhs (``_LoraFactorsProxy``: a tensor the size of the whole
    expert stack each time)."""
    from peft.tuners.lora.layer import _LoraFactorsProxy

    calls = []
    handle = torch.nn.modules.module.register_module_forward_hook(
        lambda m, i, o: calls.append(1) if isinstance(m, _LoraFactorsProxy) else None)
    return calls, handle


def _tie_free_lora_seed(base, model_type: str) -> int:
    """The first seed from 3 whose random adapters (router LoRA included) keep the routing margin on the test batch:
    PEFT 0.22 draws them otherwise than 0.21, and seed 3 left gpt-oss a margin of 8e-4 there."""
    for seed in range(3, 30):
        torch.manual_seed(seed)
        if routing_margin(peft.get_peft_model(copy.deepcopy(base), _lora_config(model_type)),
                          padded_batch()) > ROUTING_MARGIN:
            return seed
    raise AssertionError("no seed in 3-29 gives adapters with a tie-free routing")


@pytest.mark.parametrize("model_type", CONFIGS)
@pytest.mark.parametrize("order", ["patch_then_peft", "peft_then_patch"])
def test_lora_on_experts_low_rank(model_type, order, one_torch_thread):
    base = make(model_type)
    seed = _tie_free_lora_seed(base, model_type)
    torch.manual_seed(seed)
    ref = peft.get_peft_model(copy.deepcopy(base), _lora_config(model_type))
    torch.manual_seed(seed)
    if order == "patch_then_peft":
        ours = copy.deepcopy(base)
        experts.apply(ours)
        ours = peft.get_peft_model(ours, _lora_config(model_type))
    else:
        ours = peft.get_peft_model(copy.deepcopy(base), _lora_config(model_type))
        experts.apply(ours)
    _, _, grads = assert_same_step(ours, ref, padded_batch())
    calls, handle = _count_factor_folds()
    try:
        step(ref, padded_batch())
        folds_ref = len(calls)
        calls.clear()
        step(ours, padded_batch())
    finally:
        handle.remove()
    assert folds_ref > 0 and len(calls) == 0  # PEFT folds each expert stack; the patched model never does
    assert any("lora_A" in n and "experts" in n for n in grads) and any("lora_B" in n and "experts" in n for n in grads)


def test_lora_disabled_adapter_and_two_adapters(one_torch_thread):
    """Where the low-rank path does not apply (adapters disabled, two active adapters) PEFT's own forward runs."""
    base = make("qwen3_moe")
    torch.manual_seed(3)
    ref = peft.get_peft_model(copy.deepcopy(base), _lora_config("qwen3_moe"))
    torch.manual_seed(3)
    ours = peft.get_peft_model(copy.deepcopy(base), _lora_config("qwen3_moe"))
    experts.apply(ours)
    with ref.disable_adapter(), ours.disable_adapter(), torch.no_grad():  # nothing trains: compare the logits
        torch.testing.assert_close(ours(**padded_batch()).logits, ref(**padded_batch()).logits, atol=LOGITS_ATOL,
                                   rtol=0)
    for model in (ref, ours):
        torch.manual_seed(4)
        model.add_adapter("second", _lora_config("qwen3_moe"))
        model.base_model.set_adapter(["default", "second"])
    assert_same_step(ours, ref, padded_batch())


def _state(model):
    return [(n, dict(m.__dict__), dict(m._forward_pre_hooks), dict(m._forward_hooks)) for n, m in model.named_modules()]


@pytest.mark.parametrize("with_peft", [False, True])
def test_undo_restores_exactly(with_peft, one_torch_thread):
    model = make("gpt_oss")
    if with_peft:
        model = peft.get_peft_model(model, _lora_config("gpt_oss"))
    before = _state(model)
    batch = packed_batch()
    with torch.no_grad():
        logits_before = model(**batch).logits
    names, undo = experts.apply(model)
    assert names and experts.apply(model)[0] == []  # a second apply binds nothing new
    with torch.no_grad():
        model(**batch)
    for u in reversed(undo):
        u()
    assert _state(model) == before
    with torch.no_grad():
        assert torch.equal(model(**batch).logits, logits_before)


def _liger_experts_forward(self, hidden_states, top_k_index, top_k_weights):
    """What liger's ``LigerExperts.forward`` does first, bound on a module that is not a ``LigerExperts`` (PEFT's
    ``ParamWrapper``: "'ParamWrapper' object has no attribute 'hidden_dim'", run 41); its Triton kernel needs CUDA."""
    hidden_states.view(-1, self.hidden_dim)
    raise AssertionError("liger's fused experts ran")


_liger_experts_forward.__module__ = "liger_kernel.transformers.swiglu"


@pytest.mark.parametrize("with_peft", [False, True])
def test_a_kernel_library_s_experts_forward_gives_way(with_peft, one_torch_thread):
    """``use_liger_kernel=True`` binds liger's fused experts on the module in the experts' place (after
    ``get_peft_model``: PEFT's wrapper, where it fails). ``patch()`` trains through the grouped path instead (the same
    step as the model without liger's binding), says so in the report, and ``unpatch`` puts liger's forward back."""
    base = make("qwen3_moe")
    torch.manual_seed(3)
    ref = peft.get_peft_model(copy.deepcopy(base), _lora_config("qwen3_moe")) if with_peft else copy.deepcopy(base)
    torch.manual_seed(3)
    ours = peft.get_peft_model(copy.deepcopy(base), _lora_config("qwen3_moe")) if with_peft else copy.deepcopy(base)
    layers = (ours.base_model.model if with_peft else ours).model.layers
    for layer in layers:  # liger's _patch_swiglu_module(decoder_layer.mlp.experts, LigerExperts)
        holder = layer.mlp.experts
        holder.__dict__["forward"] = _liger_experts_forward.__get__(holder, type(holder))
    report = hf_accel.patch(ours)
    assert any("liger-kernel's experts forward, bound on 2 modules, gives way" in n for n in report.notes), report
    assert_same_step(ours, ref, packed_batch())
    hf_accel.unpatch(ours)
    assert all(layer.mlp.experts.__dict__["forward"].__func__ is _liger_experts_forward for layer in layers)


def test_finds_experts_from_the_model():
    """Only the decorated experts modules: a Qwen3-MoE with a dense first layer keeps its plain MLP."""
    model = make("qwen3_moe", mlp_only_layers=[0])
    names, _ = experts.apply(model)
    assert names == ["model.layers.1.mlp.experts"]
    assert [n for n, _ in experts.find_experts(model)] == names


@pytest.mark.skipif(not hasattr(transformers.models, "qwen3_5_moe"), reason="no qwen3_5_moe in this transformers")
def test_qwen3_5_moe_experts(one_torch_thread):
    """Qwen3.5-MoE's experts (beside its shared expert and gated DeltaNet layers, left stock) are found and fused."""
    config = AutoConfig.for_model(
        "qwen3_5_moe_text", vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=16,
        shared_expert_intermediate_size=16, layer_types=["linear_attention", "full_attention"],
        linear_num_value_heads=4, linear_num_key_heads=2, linear_key_head_dim=8, linear_value_head_dim=8,
        use_cache=False)
    torch.manual_seed(0)
    ref = AutoModelForCausalLM.from_config(config, experts_implementation="eager", attn_implementation="sdpa")
    with torch.no_grad():
        for name, p in ref.named_parameters():
            if p.dim() == 3:
                p.normal_(0.0, 0.2)
            elif name.endswith("mlp.gate.weight"):
                p.normal_(0.0, 1.0)
    ours = copy.deepcopy(ref)
    assert len(experts.apply(ours)[0]) == 2
    assert_same_step(ours, ref, padded_batch())


def test_cpu_never_takes_the_cuda_kernel(monkeypatch):
    """torch 2.13's CPU wheel has _grouped_mm (fp32/bf16/fp16, with a backward), but the CUDA path is chosen only
    on CUDA: on CPU the per-expert fallback runs even in bf16 with aligned widths."""
    x, w = torch.randn(6, 16, dtype=torch.bfloat16), torch.randn(3, 16, 8, dtype=torch.bfloat16)
    assert not experts._cuda_grouped_mm_serves(x, w)

    def refuse(*args, **kwargs):
        raise AssertionError("grouped_mm called on CPU")

    monkeypatch.setattr(torch, "_grouped_mm", refuse)
    monkeypatch.setattr(torch.nn.functional, "grouped_mm", refuse, raising=False)
    groups = experts._Groups(torch.tensor([0, 0, 2, 2, 2, 2]), 3)
    out = experts.grouped_mm(x, w, groups)
    torch.testing.assert_close(out, torch.cat([x[:2] @ w[0], x[2:] @ w[2]]))


@pytest.mark.skipif(not hasattr(torch, "_grouped_mm"), reason="torch has no _grouped_mm")
def test_fallback_matches_torch_grouped_mm_on_cpu():
    """The exact fallback against torch's own grouped GEMM (CPU kernel), forward and backward, empty groups too."""
    torch.manual_seed(0)
    x = torch.randn(10, 16, requires_grad=True)
    w = torch.randn(4, 16, 8, requires_grad=True)
    groups = experts._Groups(torch.tensor([0, 0, 0, 2, 2, 2, 2, 3, 3, 3]), 4)
    grad = torch.randn(10, 8)
    ours = torch.autograd.grad(experts.grouped_mm(x, w, groups), (x, w), grad)
    theirs = torch.autograd.grad(torch._grouped_mm(x, w, offs=groups.offs), (x, w), grad)
    for a, b in zip(ours, theirs):
        torch.testing.assert_close(a, b)


@pytest.mark.skipif(not hasattr(torch, "_grouped_mm"), reason="torch has no _grouped_mm")
@pytest.mark.parametrize("model_type", ["qwen3_moe", "gpt_oss"])
def test_compiled_lora_experts_through_torch_grouped_mm(model_type, monkeypatch, one_torch_thread):
    """Run 41 (H100): in a compiled layer, inductor laid the copy of PEFT's permuted expert factor (``lora_B``,
    stored (out, r * E)) back out in its input's stride order, and torch's grouped GEMM refused it ("Invalid
    strides/sizes"). Torch's CPU grouped GEMM, which checks the same layout, stands in for the CUDA one here: the
    MoE block of a bf16 PEFT model (LoRA r=8 on both expert projections) compiled by inductor against the same block
    eager, output and every gradient."""
    monkeypatch.setattr(experts, "_cuda_grouped_mm_serves", lambda x, w: x.dtype == w.dtype == torch.bfloat16)
    model = make(model_type).to(torch.bfloat16)
    config = peft.LoraConfig(r=8, lora_alpha=16, init_lora_weights=False,
                             target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj"])
    torch.manual_seed(3)
    model = peft.get_peft_model(model, config)
    experts.apply(model)
    block = model.base_model.model.model.layers[0].mlp
    torch.manual_seed(4)
    hidden = torch.randn(1, 24, _COMMON["hidden_size"], dtype=torch.bfloat16)

    def run(fn):
        block.zero_grad(set_to_none=True)
        h = hidden.clone().requires_grad_()
        out = fn(h)
        out = out[0] if isinstance(out, tuple) else out
        out.float().square().sum().backward()
        grads = {n: p.grad for n, p in block.named_parameters() if p.grad is not None}
        return {"output": out.detach(), "input grad": h.grad, **grads}

    eager = run(block)
    compiled = run(torch.compile(block, backend="inductor"))
    hidden = hidden.float()
    exact = run(block.float())  # the same block in fp32: what both bf16 runs approximate
    assert any("lora_B" in n for n in exact) and exact.keys() == eager.keys() == compiled.keys()
    for what, want in exact.items():
        base = (eager[what].float() - want).abs().max().item()
        worst = (compiled[what].float() - want).abs().max().item()
        assert worst <= 2 * base + 1e-3 * want.abs().max().item(), f"{what}: {worst:.3g} vs eager bf16's {base:.3g}"


def _saved_bytes(model, module, tokens: int, shape: experts.ExpertsShape) -> int:
    """Bytes of every tensor the experts module's forward keeps for backward (unique storages, parameters aside)."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    kept: dict[int, int] = {}

    def pack(t):
        if t.untyped_storage().data_ptr() not in params:
            kept[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    torch.manual_seed(tokens)
    hidden = torch.randn(tokens, shape.hidden, requires_grad=True)
    index = torch.stack([torch.randperm(shape.num_experts)[:shape.top_k] for _ in range(tokens)])
    weights = torch.rand(tokens, shape.top_k, requires_grad=True)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        module(hidden, index, weights)
    return sum(kept.values())


@pytest.mark.parametrize("model_type", CONFIGS)
@pytest.mark.parametrize("setting", ["trainable", "frozen", "lora"])
def test_saved_bytes_per_token_measured(model_type, setting, one_torch_thread):
    model = make(model_type)
    if setting != "trainable":
        model.requires_grad_(False)
    lora_rank = 0
    if setting == "lora":
        config = peft.LoraConfig(r=8, target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj"])
        model, lora_rank = peft.get_peft_model(model, config), 8
    experts.apply(model)
    shape = experts.experts_shapes(model)[0]
    assert shape.top_k == model.config.num_experts_per_tok
    called = dict(model.named_modules())[shape.path.replace(".base_layer", "")]  # PEFT's outermost wrapper, if any
    per_token = (_saved_bytes(model, called, 24, shape) - _saved_bytes(model, called, 12, shape)) / 12
    assert per_token == shape.saved_bytes_per_token(4, lora_rank=lora_rank, trainable=setting == "trainable")


@pytest.mark.parametrize("model_type", CONFIGS)
def test_shapes_from_config_and_parameter_counts(model_type):
    """The meta-device shapes equal the built model's; total and active parameters count the experts' tensors."""
    model = make(model_type)
    from_config = experts.experts_shapes(model.config)
    assert from_config == experts.experts_shapes(model)
    for shape in from_config:
        module = dict(model.named_modules())[shape.path]
        assert shape.params == sum(p.numel() for p in module.parameters())
        assert shape.active_params * shape.num_experts == shape.params * shape.top_k


@pytest.mark.parametrize("model_type", CONFIGS)
def test_lora_target_parameters_found(model_type):
    """The names PEFT's target_parameters takes, read from the model, reach every experts parameter (LoRA on them
    then adds exactly two wrapped parameters per experts module)."""
    model = make(model_type)
    targets = experts.lora_target_parameters(model)
    assert targets == ("mlp.experts.down_proj", "mlp.experts.gate_up_proj")
    wrapped = peft.get_peft_model(model, peft.LoraConfig(r=2, target_parameters=list(targets)))
    assert experts.lora_target_parameters(wrapped) == targets
    lora_a = [n for n, _ in wrapped.named_parameters() if "lora_A" in n]
    assert len(lora_a) == 2 * len(experts.find_experts(wrapped))


def _per_token_layer(model, vocab: int) -> list[float]:
    """One decoder layer's none / op / full bytes per token, measured on the real model (two lengths, so what a
    layer keeps once, such as the router's per-expert counts, drops out), layer 1 (layer 0 also holds rotary
    tables). Eager attention (gpt-oss's sinks) measured through the facts probe's flash-like stand-in, which the
    estimate counts."""
    from hf_accel.facts.probe import PROBE_NAME, register
    from hf_accel.memory.plan import probe_layer_activations

    config = model.config
    if config._attn_implementation == "eager":
        register()
        config._attn_implementation_internal = PROBE_NAME
    figures = []
    for tokens in (64, 128):
        torch.manual_seed(tokens)
        ids = torch.randint(0, vocab, (1, tokens))
        layer = probe_layer_activations(model, {"input_ids": ids, "labels": ids})[1]
        figures.append([layer.retained(c) for c in ("none", "op", "full")])
    return [(long - short) / 64 for short, long in zip(*figures)]


@pytest.mark.parametrize("model_type", CONFIGS)
@pytest.mark.parametrize("setting", ["full", "lora", "lora-experts"])
def test_memory_estimate_counts_the_grouped_path(model_type, setting, one_torch_thread):
    """hf-accel estimate-memory from the config alone against the patched model measured: full fine-tuning's layer
    as the grouped path keeps it (its grouped GEMMs' outputs under op-level checkpointing), PEFT's trainable count
    with LoRA on attention and on the experts (target_parameters), what LoRA on the experts adds exactly, and under
    LoRA an upper bound of what the frozen layer keeps."""
    from hf_accel.memory.estimate import estimate_training_memory

    model = make(model_type)
    config = model.config
    lora_rank = None if setting == "full" else 4
    if lora_rank:
        targets = list(hf_accel.patches.family_of(model).lora_targets)
        parameters = list(experts.lora_target_parameters(model)) if setting == "lora-experts" else []
        model = peft.get_peft_model(model, peft.LoraConfig(r=lora_rank, target_modules=targets,
                                                           target_parameters=parameters))
    experts.apply(model)
    measured = _per_token_layer(model, VOCAB)

    def estimate(lora_experts: bool):
        return estimate_training_memory(config, dtype="fp32", batch_tokens=1, lora_rank=lora_rank,
                                        lora_experts=lora_experts)

    ours = estimate(setting == "lora-experts")
    assert ours.trainable_params == sum(p.numel() for p in model.parameters() if p.requires_grad)
    predicted = [ours.layer.retained(c) for c in ("none", "op", "full")]
    # gpt-oss's stand-in attention keeps a little more than its eager one; under op-level checkpointing LoRA's B
    # outputs (matmul outputs) are kept too, which the estimate leaves out
    op_tolerance = 0.25 * measured[1]
    assert abs(predicted[1] - measured[1]) <= op_tolerance and predicted[2] == measured[2], (predicted, measured)
    if setting == "full":
        assert predicted[0] == measured[0], (predicted, measured)
    else:  # the frozen base keeps less (norm and router inputs): counted as if it trained
        assert measured[0] <= predicted[0] <= 1.35 * measured[0], (predicted, measured)
    if setting == "lora-experts":  # against the same model without adapters on its experts
        base = make(model_type)
        base = peft.get_peft_model(base, peft.LoraConfig(r=lora_rank, target_modules=targets))
        experts.apply(base)
        without = _per_token_layer(base, VOCAB)
        alone = estimate(False)
        added = [ours.layer.retained(c) - alone.layer.retained(c) for c in ("none", "op")]
        assert added == [measured[0] - without[0], measured[1] - without[1]], (added, measured, without)


@pytest.mark.parametrize("model_type", CONFIGS)
def test_eval_runs_the_models_own_experts(model_type, monkeypatch, one_torch_thread):
    """Evaluation and generation behave as unpatched: in eval mode the experts run the class's own forward with the
    experts implementation the model was given (the same logits bit for bit, the grouped path never called), and a
    fullgraph compile of the forward (compiled decode) traces; training calls take the grouped path."""
    ref = make(model_type).eval()
    ref.set_experts_implementation("grouped_mm")  # transformers' own, which a fullgraph compile traces
    ours = copy.deepcopy(ref)
    experts.apply(ours)
    calls = []
    real = experts.grouped_mm
    monkeypatch.setattr(experts, "grouped_mm", lambda *a: calls.append(1) or real(*a))
    ids = torch.randint(0, VOCAB, (2, 7), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.equal(ours(input_ids=ids).logits, ref(input_ids=ids).logits)
        torch._dynamo.reset()
        compiled = torch.compile(ours, fullgraph=True, backend="eager")
        torch.testing.assert_close(compiled(input_ids=ids).logits, ref(input_ids=ids).logits)
        torch._dynamo.reset()
    assert not calls
    ours.train()(input_ids=ids)
    assert calls


@pytest.mark.parametrize("model_type", CONFIGS)
def test_mfu_counts_the_active_experts_and_the_router(model_type, one_torch_thread):
    """Live reference: torch's FLOP counter over one forward + backward of the patched model (eager attention, counted
    over the full square) equals the FLOP model's step, which counts each token's top-k experts and the router
    (MFU on active parameters); a model without them counted would be far below. gpt-oss's sliding layers: the
    formula counts the pairs their window attends, eager computes the whole square."""
    from torch.utils.flop_counter import FlopCounterMode

    from hf_accel.training.flops import FlopModel, attended

    model = make(model_type)
    model.set_attn_implementation("eager")
    experts.apply(model)
    seq = 24
    ids = torch.randint(0, VOCAB, (1, seq), generator=torch.Generator().manual_seed(0))
    with FlopCounterMode(display=False) as counter:
        model(input_ids=ids, labels=ids, use_cache=False).loss.backward()
    flops = FlopModel.from_model(model)
    # eager attention computes every (query, key) pair of the square; the formula, the causal ones a layer attends
    square = 6 * seq**2 * (2 * flops.num_layers * flops.attn_width + sum(2 * w for w, _, _ in flops.local_layers))
    counted = flops.step_flops([seq])
    attention = 6 * seq**2 * flops.num_layers * flops.attn_width + sum(
        6 * w * attended(seq, window, chunk) for w, window, chunk in flops.local_layers)
    # rel: transformers 5.17's rotary embedding is a tiny matmul too (inv_freq @ positions, ~200 FLOPs here), 5.25's not
    assert counted - attention + square == pytest.approx(counter.get_total_flops(), rel=1e-4)
