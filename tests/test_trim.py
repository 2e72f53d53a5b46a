"""Trimmed recompute (hf_accel.memory.trim): a checkpointed layer's recompute skips the output projections' matmuls.
Every family variant, with LoRA on every projection and fully fine-tuned, takes the same step, bit for bit, as with
the untrimmed recompute, while the skipped outputs are NaN (any use of them would show), and the skips are counted;
where a trim could change a result (a projection the layer reads again, DoRA, reentrant or spaced checkpointing, no
grad) it does not happen. The QLoRA case is in tests/test_qlora.py, the GPU run in tests/gpu/test_qlora_gpu.py."""
from __future__ import annotations

import pytest
import torch
from peft import LoraConfig, get_peft_model

import hf_accel
from hf_accel.memory import trim
from hf_accel.memory.checkpointing import FullCheckpointing, PerLayer
from hf_accel.patches import family_of

from tiny_models import VARIANTS, loss_and_grads, loss_and_grads_hook_in_forward, make, slow_2026

pytestmark = pytest.mark.usefixtures("one_torch_thread")

# variants whose every output projection can be trimmed (Falcon-RW's have biases, which FalconLinear adds apart;
# Gemma's down_proj feeds a norm)
UNTRIMMED = {"falcon-rw-alibi", "gemma2-softcap", "gemma3-text"}
AOT_EAGER = {"backend": "aot_eager"}  # dynamo + AOTAutograd without code generation: the graphs inductor would get


@pytest.fixture(autouse=True)
def _nan_fill(monkeypatch):
    monkeypatch.setattr(trim, "FILL", float("nan"))


def batch(lengths=(5, 9, 3), seed=0) -> dict:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, 96, (1, sum(lengths)), generator=g)
    pos = torch.cat([torch.arange(n) for n in lengths])[None]
    return dict(input_ids=ids, position_ids=pos, labels=ids.masked_fill(pos == 0, -100))


def lora_model(name: str, policy, *, patch_first: bool = True, compile=False, **lora):
    """A tiny family variant with LoRA (random B) on every projection, patched with ``policy`` before or after
    PEFT wraps it (the bench patches first)."""
    model = make(name).train()
    targets = list(family_of(model).lora_targets)
    if patch_first:
        hf_accel.patch(model, backend="reference", checkpointing=policy, compile=compile)
    torch.manual_seed(1)
    model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=targets, init_lora_weights=False,
                                             **lora))
    if not patch_first:
        hf_accel.patch(model, backend="reference", checkpointing=policy, compile=compile)
    return model


def trimmed_step(model, data) -> tuple[float, dict, int]:
    skipped = trim.STATS.skipped
    loss, grads = loss_and_grads(model, data)
    return loss, grads, trim.STATS.skipped - skipped


def assert_equal_steps(a, b) -> None:
    assert a[0] == b[0] and a[1].keys() == b[1].keys() and a[1]
    bad = [n for n in a[1] if not torch.equal(a[1][n], b[1][n])]
    assert not bad, bad


def full_ft_model(name: str, policy, *, compile=False):
    model = make(name).train()
    hf_accel.patch(model, backend="reference", checkpointing=policy, compile=compile)
    return model


@pytest.mark.parametrize("training", ["lora", "full"])
@pytest.mark.parametrize("name", slow_2026(sorted(VARIANTS)))
def test_trimmed_recompute_takes_the_untrimmed_step_bit_for_bit(name, training):
    """LoRA (frozen base projections) and full fine-tuning (trained projections, GPT-NeoX's biases too: their
    gradients need the recomputed input, never the output)."""
    build = lora_model if training == "lora" else full_ft_model
    model = make(name)
    projections = family_of(model).output_projections(model.config)
    expected = 0 if name in UNTRIMMED else len(projections)
    ours = trimmed_step(build(name, FullCheckpointing()), batch())
    plain = trimmed_step(build(name, FullCheckpointing(trim_recompute=False)), batch())
    assert_equal_steps(ours, plain)
    assert ours[2] == expected * model.config.num_hidden_layers and plain[2] == 0
    if training == "full" and projections:  # the trimmed projections' own gradients are among those compared
        assert any(n.endswith(f"{projections[0]}.weight") for n in ours[1])


@pytest.mark.parametrize("name,paths", [("llama-gqa", ("self_attn.o_proj",)), ("gemma2-softcap", ("mlp.down_proj",)),
                                        ("neox-sequential", ("attention.dense",))])
def test_a_projection_the_layer_reads_again_must_not_be_declared(name, paths, monkeypatch):
    """The check above can fail: declare a projection whose output the layer reads again (the post-attention norm,
    Gemma's post-MLP norm, the sequential residual) and the recompute's NaN reaches the gradients."""
    monkeypatch.setattr(trim, "output_projections", lambda model: paths)
    loss, grads, skipped = trimmed_step(lora_model(name, FullCheckpointing()), batch())
    assert skipped == 2 and any(g.isnan().any() for g in grads.values())


def test_lora_added_before_patch_and_the_second_step_trim_too():
    ours = lora_model("llama-gqa", FullCheckpointing(), patch_first=False)
    plain = lora_model("llama-gqa", FullCheckpointing(trim_recompute=False), patch_first=False)
    for seed, lengths in enumerate([(5, 9, 3), (7, 11, 4, 6)]):
        a, b = trimmed_step(ours, batch(lengths, seed)), trimmed_step(plain, batch(lengths, seed))
        assert_equal_steps(a, b)
        assert a[2] == 2


def test_compiled_layers_trim_at_run_time_in_one_graph(fresh_dynamo):
    """Under torch.compile the op stays one opaque call in the layer's graph (no graph break of its own): the forward
    and the recompute run the same graph and the op decides at run time."""
    from torch._dynamo.utils import counters

    ours = trimmed_step(lora_model("llama-gqa", FullCheckpointing(), compile=AOT_EAGER), batch())
    assert ours[2] == 2 and counters["stats"]["unique_graphs"] > 0
    assert counters["graph_break"] and all("hf_accel_attention" in r for r in counters["graph_break"])
    plain = trimmed_step(lora_model("llama-gqa", FullCheckpointing(trim_recompute=False)), batch())
    assert ours[0] == pytest.approx(plain[0], rel=1e-6)
    for n, g in plain[1].items():
        assert ((ours[1][n] - g).abs().max() / g.abs().max()).item() < 1e-5, n


def test_full_fine_tuning_under_bf16_autocast_trims_bit_for_bit():
    """Under autocast the op gets the weight cast to bf16; its gradient flows back through the cast to the fp32
    weight as the stock linear's does."""
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ours = trimmed_step(full_ft_model("neox-parallel", FullCheckpointing()), batch())
        plain = trimmed_step(full_ft_model("neox-parallel", FullCheckpointing(trim_recompute=False)), batch())
    assert_equal_steps(ours, plain)
    assert ours[2] > 0 and all(g.dtype == torch.float32 for g in ours[1].values())


def test_compiled_full_fine_tuning_trims(fresh_dynamo):
    ours = trimmed_step(full_ft_model("llama-gqa", FullCheckpointing(), compile=AOT_EAGER), batch())
    plain = trimmed_step(full_ft_model("llama-gqa", FullCheckpointing(trim_recompute=False)), batch())
    assert ours[2] == 2 and ours[0] == pytest.approx(plain[0], rel=1e-6)
    for n, g in plain[1].items():
        assert ((ours[1][n] - g).abs().max() / g.abs().max()).item() < 1e-5, n


@pytest.mark.parametrize("case", ["dora", "reentrant", "spaced", "op-level"])
def test_no_trim_where_it_could_change_a_result(case):
    """DoRA scales the base output (its backward reads it), a reentrant recompute's output is backpropagated, a
    spaced span rebuilds the layer above from this one's output, op-level layers keep matmul outputs by their own
    policy. The same steps as unpatched checkpointing there, and no skip."""
    policy = {"reentrant": FullCheckpointing(use_reentrant=True), "spaced": PerLayer(choices=["full", "spaced"]),
              "op-level": PerLayer(choices=["op", "op"])}.get(case, FullCheckpointing())
    plain = {"reentrant": FullCheckpointing(use_reentrant=True, trim_recompute=False),
             "spaced": PerLayer(choices=["full", "spaced"], trim_recompute=False),
             "op-level": PerLayer(choices=["op", "op"], trim_recompute=False)}.get(
        case, FullCheckpointing(trim_recompute=False))
    lora = {"use_dora": True} if case == "dora" else {}
    ours, ref = lora_model("llama-gqa", policy, **lora), lora_model("llama-gqa", plain, **lora)
    a, b = trimmed_step(ours, batch()), trimmed_step(ref, batch())
    assert_equal_steps(a, b)
    assert a[2] == 0


def test_a_forward_of_someone_else_s_is_left_alone():
    """A base layer whose instance forward is already someone else's (accelerate's device hooks wrap it so) keeps it:
    that layer's recompute is not trimmed."""
    import functools

    ours = lora_model("llama-gqa", FullCheckpointing())
    base = ours.get_base_model().model.layers[1].mlp.down_proj.get_base_layer()
    calls = []

    def hooked(module, x):
        calls.append(1)
        return torch.nn.Linear.forward(module, x)

    base.forward = functools.partial(hooked, base)
    a = trimmed_step(ours, batch())
    b = trimmed_step(lora_model("llama-gqa", FullCheckpointing(trim_recompute=False)), batch())
    assert_equal_steps(a, b)
    assert a[2] == 1 and len(calls) == 2  # layer 0 trimmed; layer 1's forward and recompute ran the hook
    assert base.__dict__["forward"].func is hooked


def test_a_partial_plan_trims_its_fully_checkpointed_layers_only():
    a = trimmed_step(lora_model("llama-gqa", PerLayer(choices=["full", "none"])), batch())
    b = trimmed_step(lora_model("llama-gqa", PerLayer(choices=["full", "none"], trim_recompute=False)), batch())
    assert_equal_steps(a, b)
    assert a[2] == 1


def test_evaluation_and_unpatch_leave_the_stock_forward():
    model = lora_model("llama-gqa", FullCheckpointing())
    trimmed_step(model, batch())
    bases = [layer.mlp.down_proj.get_base_layer() for layer in model.get_base_model().model.layers]
    assert all("forward" in base.__dict__ for base in bases)
    computed = trim.STATS.computed
    with torch.no_grad():
        model.eval()(**batch())
    assert trim.STATS.computed == computed  # the stock forward ran
    hf_accel.unpatch(model)
    assert not any("forward" in base.__dict__ for base in bases)


def test_the_defaults_take_over_the_model_s_own_checkpointing():
    """patch(model) with no checkpointing argument on a model checkpointing every layer (non-reentrant): the trimmed
    policy, the report says so, and the step is the unpatched model's."""
    from hf_accel.memory.checkpointing import applied_policy

    ref = make("llama-gqa").train()
    ours = make("llama-gqa").train()
    for model in (ref, ours):
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    report = hf_accel.patch(ours, backend="reference", compile=False)
    assert isinstance(applied_policy(ours), FullCheckpointing) and "skips the mlp.down_proj" in report.checkpointing
    targets = list(family_of(ours).lora_targets)
    peft_models = []
    for model in (ours, ref):
        torch.manual_seed(1)
        peft_models.append(get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=targets,
                                                            init_lora_weights=False)))
    a, b = trimmed_step(peft_models[0], batch()), trimmed_step(peft_models[1], batch())
    assert a[2] == 2 and a[0] == pytest.approx(b[0], rel=1e-6)
    for n, g in b[1].items():
        assert ((a[1][n] - g).abs().max() / g.abs().max()).item() < 1e-5, n


@pytest.mark.slow
def test_inductor_compiled_layers_trim(fresh_dynamo):
    """The same through inductor's generated code (CPU): the op is an extern call in the layer's kernel graph."""
    ours = trimmed_step(lora_model("llama-gqa", FullCheckpointing(), compile=True), batch())
    plain = trimmed_step(lora_model("llama-gqa", FullCheckpointing(trim_recompute=False), compile=True), batch())
    assert ours[2] == 2 and plain[2] == 0
    assert ours[0] == pytest.approx(plain[0], rel=1e-6)
    for n, g in plain[1].items():
        assert ((ours[1][n] - g).abs().max() / g.abs().max()).item() < 1e-5, n


def test_the_defaults_leave_reentrant_checkpointing_alone():
    """A reentrant recompute's output is backpropagated (nothing to trim) and reentrant may be a launcher's
    requirement (DeepSpeed ZeRO-3 with PEFT): patch() keeps the model's own."""
    from hf_accel.memory.checkpointing import applied_policy

    model = make("llama-gqa").train()
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": True})
    report = hf_accel.patch(model, backend="reference", compile=False)
    assert applied_policy(model) is None and report.checkpointing is None


@pytest.mark.parametrize("spec,trims", [("full", True), ("offload", True), ("op", False), ("none", False),
                                        (FullCheckpointing(trim_recompute=False), False),
                                        (FullCheckpointing(use_reentrant=True), False)])
def test_the_report_says_whether_the_recompute_is_trimmed(spec, trims):
    report = hf_accel.patch(make("llama-gqa").train(), backend="reference", compile=False, checkpointing=spec)
    assert ("recompute skips mlp.down_proj (memory.trim)" in report.checkpointing) == trims, report.checkpointing
    if trims:  # a family with no output projection to skip (Gemma's MLP output goes through a norm)
        report = hf_accel.patch(make("gemma2-softcap").train(), backend="reference", compile=False,
                                checkpointing=spec)
        assert "recompute skips" not in report.checkpointing, report.checkpointing


@pytest.mark.parametrize("policy", ["full", "offload", "chunks"])
def test_a_second_backward_recomputes_again(policy):
    """torch enters a checkpoint's recompute context at every recompute (a second backward through the graph:
    retain_graph, or autograd.grad then backward): the trimmed recompute's context was a one-shot generator and
    crashed there, for the default policies and for chunked MLPs. Both backwards now equal untrimmed ones."""
    def run(trim_recompute):
        model = make("llama-gqa").train()
        checkpointing = FullCheckpointing(trim_recompute=trim_recompute) if policy == "full" else (
            "offload" if policy == "offload" else "none")
        hf_accel.patch(model, backend="reference", checkpointing=checkpointing,
                       mlp_chunks=4 if policy == "chunks" else False)
        if policy == "offload" and not trim_recompute:
            from hf_accel.memory.checkpointing import OffloadedCheckpointing

            hf_accel.unpatch(model)
            hf_accel.patch(model, backend="reference", checkpointing=OffloadedCheckpointing(trim_recompute=False))
        loss = model(**batch()).loss
        weight = model.model.layers[1].mlp.down_proj.weight
        first = torch.autograd.grad(loss, weight, retain_graph=True)[0]
        loss.backward()
        return first, {n: p.grad for n, p in model.named_parameters()}

    (first, grads), (first_ref, grads_ref) = run(True), run(False)
    torch.testing.assert_close(first, first_ref, rtol=1e-5, atol=1e-7)
    for name, grad in grads_ref.items():
        torch.testing.assert_close(grads[name], grad, rtol=1e-5, atol=1e-7, msg=name)


@pytest.mark.parametrize("where", ["down_proj", "mlp", "lora wrapper", "global"])
def test_a_forward_hook_that_could_see_the_fill_stops_the_trim(where):
    """A forward hook on an output projection, on a module between the layer and it, or a global one, would run on
    the recompute's fill and may save it (a soft clamp of down_proj's output took gradients 100% off): such a
    layer's recompute is not trimmed, and the step is the untrimmed one."""
    def clamp(module, args, out):
        return torch.tanh(300 * out) / 300

    def model_with_hook(trim_recompute):
        model = lora_model("llama-gqa", FullCheckpointing(trim_recompute=trim_recompute))
        mlp = model.get_base_model().model.layers[1].mlp
        target = {"down_proj": mlp.down_proj.get_base_layer(), "mlp": mlp, "lora wrapper": mlp.down_proj}.get(where)
        handle = (torch.nn.modules.module.register_module_forward_hook(
            lambda module, args, out: clamp(module, args, out) if module is mlp.down_proj.get_base_layer() else out)
            if target is None else target.register_forward_hook(clamp))
        return model, handle

    model, handle = model_with_hook(True)
    try:
        a = trimmed_step(model, batch())
    finally:
        handle.remove()
    reference, handle = model_with_hook(False)
    try:
        b = trimmed_step(reference, batch())
    finally:
        handle.remove()
    assert_equal_steps(a, b)
    assert a[2] == (0 if where == "global" else 1)  # layer 0 still trims, but not under a global hook


def test_functorch_transforms_after_a_trimmed_step():
    """The trimmed forward stays bound between steps; under functorch's transforms (vmap(grad): per-sample
    gradients) it takes the stock forward (its custom op was refused there)."""
    from torch.func import functional_call, grad, vmap

    model = full_ft_model("llama-gqa", FullCheckpointing())
    trimmed_step(model, batch())
    down = model.model.layers[1].mlp.down_proj
    assert "forward" in down.__dict__
    params = dict(down.named_parameters())
    x = torch.randn(3, 2, down.in_features)

    def loss(p, xi):
        return functional_call(down, p, (xi,)).square().sum()

    per_sample = vmap(grad(loss), in_dims=(None, 0))(params, x)
    expected = torch.stack([torch.func.grad(loss)(params, xi)["weight"] for xi in x])
    torch.testing.assert_close(per_sample["weight"], expected)
    torch.testing.assert_close(per_sample["weight"][0], 2 * torch.einsum("so,si->oi", down(x[0]), x[0]))


@pytest.mark.parametrize("plan", ["full", "offload-spaced"])
@pytest.mark.parametrize("training", ["lora", "full"])
def test_a_hook_in_forward_only_leaves_the_recompute_as_the_forward_ran(plan, training):
    """A hook stops the trim, and stopped it before binding: the forward ran the stock projections, then a chunked
    MLP's call inside its layer's recompute (no hook by then) bound the trimmed forward, which saves other tensors,
    and the recompute of the forward's chunks failed torch's check (CheckpointError; the same failure ended a 344k
    QLoRA step on the GPU). The step equals one without the hook, bit for bit."""
    def model():
        m = make("llama-gqa").train()
        layers = len(m.model.layers)
        choices = ["full"] * layers if plan == "full" else (["offload", "spaced"] * layers)[:layers]
        hf_accel.patch(m, backend="reference", compile=False, checkpointing=PerLayer(choices=choices), mlp_chunks=4)
        if training == "lora":
            torch.manual_seed(1)
            m = get_peft_model(m, LoraConfig(r=4, target_modules=list(family_of(m).lora_targets),
                                             init_lora_weights=False))
        return m

    assert_equal_steps(loss_and_grads_hook_in_forward(model(), batch()), loss_and_grads(model(), batch()))
