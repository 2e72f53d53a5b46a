"""patch(compile=...) against live references on the CPU: the eager patched model and the unpatched transformers model
(fp32). Inductor itself runs for Llama (C++ code on the CPU); the other families use the aot_eager backend, which
captures the same graphs (dynamo + AOTAutograd, graph break at the attention seam, dynamic token dimension) without
code generation. The GPU run (tests/gpu/test_compile_gpu.py) covers inductor's Triton code in bf16."""
from __future__ import annotations

import copy

import pytest
import torch
from torch._dynamo.utils import counters

import hf_accel
from hf_accel.fused.compiling import checkpointed_body, compiled_layers
from hf_accel.errors import BackendUnavailable, ConfigurationError
import tiny_models
from tiny_models import VOCAB, loss_and_grads, make

pytestmark = pytest.mark.usefixtures("fresh_dynamo")

GRAD_RTOL = 1e-4  # fp32 both sides: only summation order differs
AOT_EAGER = {"backend": "aot_eager"}
STEPS = ([5, 9, 3], [7, 11], [4, 4, 6, 10, 2], [13])  # new token and document counts every step


def packed(lengths: list[int], seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (1, sum(lengths)), generator=g)
    pos = torch.cat([torch.arange(n) for n in lengths])[None]
    return dict(input_ids=ids, position_ids=pos, labels=ids.masked_fill(pos == 0, -100))


def assert_same_step(ours, ref, batch) -> None:
    tiny_models.assert_same_step(ours, ref, batch, loss_rtol=1e-5, grad_rtol=GRAD_RTOL)


def pair(variant: str, compile_options, **patch_kwargs):
    ref = make(variant).train()
    ours = copy.deepcopy(ref)
    hf_accel.patch(ref, backend="reference", **patch_kwargs)
    report = hf_accel.patch(ours, backend="reference", compile=compile_options, **patch_kwargs)
    assert report.compiled_layers == ref.config.num_hidden_layers
    return ours, ref




@pytest.mark.slow  # inductor / dynamo compiles or a multi-process launch: minutes on 2 cores
def test_no_automatic_full_collections_while_compiled_layers_are_bound():
    """Full collections scanning compilation's objects were 200-400 ms stalls on the H200: while compiled layers are
    bound the collector makes none by itself; unpatch restores its threshold."""
    import gc

    threshold = gc.get_threshold()[2]
    ours, _ = pair("llama-gqa", AOT_EAGER)
    other, _ = pair("llama-gqa", AOT_EAGER)
    loss_and_grads(ours, packed([5, 9, 3], 0))
    assert gc.get_threshold()[2] > 10**6
    hf_accel.unpatch(ours)
    assert gc.get_threshold()[2] > 10**6  # another compiled model is still bound
    hf_accel.unpatch(other)
    assert gc.get_threshold()[2] == threshold


@pytest.mark.slow
@pytest.mark.parametrize("unpatch_first", [False, True])
def test_a_deleted_compiled_model_is_freed(unpatch_first):
    """Nothing of hf_accel's keeps a deleted compiled, patched model alive (2.36 GiB stayed on the H200: gc.freeze
    had made the model's reference cycles permanent)."""
    import gc
    import weakref

    model = make("llama-gqa").train()
    hf_accel.patch(model, backend="reference", compile=AOT_EAGER)
    loss_and_grads(model, packed([5, 9, 3], 0))
    if unpatch_first:
        hf_accel.unpatch(model)
    alive = weakref.ref(model)
    del model
    gc.collect()
    assert alive() is None


@pytest.mark.slow  # inductor / dynamo compiles or a multi-process launch: minutes on 2 cores
def test_inductor_llama_matches_unpatched_and_reuses_graphs():
    ref = make("llama-gqa").train()  # unpatched transformers, SDPA, fp32
    ours = copy.deepcopy(ref)
    hf_accel.patch(ours, backend="reference", compile=True)
    graphs = []
    for seed, lengths in enumerate(STEPS):
        assert_same_step(ours, ref, packed(lengths, seed))
        graphs.append(counters["stats"]["unique_graphs"])
    # compiled with a dynamic token dimension from the first step: steps of new lengths and document counts reuse the
    # graphs (compiled static first, the pieces after the attention break compiled again at the second step)
    assert graphs[0] == graphs[1] == graphs[2] == graphs[3], graphs


# hf_accel's key: the layers trace under dynamo's nested graph breaks by default (issue 39c); False traces them as a
# frame per enclosing call (the layer, its attention module, transformers' attention function)
WITHOUT_NESTED = {**AOT_EAGER, "nested_graph_breaks": False}


@pytest.mark.parametrize("variant, options", [
    pytest.param("llama-rope-llama3", AOT_EAGER, id="llama-rope-llama3"),
    # every family under the default tracing (Falcon's seam is its attention module's forward; Gemma's layers
    # alternate windows and soft-caps), and a few without nested graph breaks
    *(pytest.param(v, AOT_EAGER, marks=pytest.mark.slow, id=v) for v in (
        "neox-parallel", "neox-sequential", "falcon-7b-mqa", "falcon-rw-alibi", "falcon-40b-newarch", "qwen3-qk-norm",
        "mistral-window", "gemma2-softcap", "gemma3-text")),
    *(pytest.param(v, WITHOUT_NESTED, marks=pytest.mark.slow, id=f"{v}-without-nested-breaks") for v in (
        "llama-rope-llama3", "neox-parallel", "falcon-rw-alibi")),
])
def test_compiled_graphs_match_eager(variant, options):
    ours, ref = pair(variant, options)
    for seed, lengths in enumerate(STEPS[:3]):
        assert_same_step(ours, ref, packed(lengths, seed))


@pytest.mark.parametrize("spec", ["full", pytest.param("every_2", marks=pytest.mark.slow),
                                  pytest.param("op", marks=pytest.mark.slow)])
def test_compiled_layers_under_checkpointing(spec):
    """Checkpointed layers train through compiled graphs, in forward and in the backward's recompute: from
    transformers 5.23 the checkpoint sits inside the layer's forward, where dynamo cannot trace it around the
    attention's graph break (it ran those layers eagerly, capturing nothing). Op-level layers run eagerly."""
    ours, ref = pair("llama-gqa", AOT_EAGER, checkpointing=spec)
    calls = []
    for layer in compiled_layers(ours):
        bound = layer._compiled_call_impl
        for attr in ("compiled", "compiled_body"):
            fn = getattr(bound, attr, None)
            if fn is not None:
                setattr(bound, attr, lambda *a, _c=fn, _n=attr, **k: calls.append(_n) or _c(*a, **k))
    for seed, lengths in enumerate(STEPS[:2]):
        assert_same_step(ours, ref, packed(lengths, seed))
    if spec == "op":  # their selective-checkpoint policy must see every op
        assert not calls and not counters["stats"]["unique_graphs"]
        return
    assert counters["stats"]["unique_graphs"] > 0
    checkpointed = sum(layer.gradient_checkpointing for layer in ours.model.layers)
    if checkpointed_body(ours.model.layers[0]) is not None:  # transformers >= 5.23: forward + recompute, per step
        assert calls.count("compiled_body") == 2 * 2 * checkpointed, calls
    else:  # the checkpoint wraps __call__ and calls the compiled layer
        assert calls.count("compiled") >= 2 * ours.config.num_hidden_layers, calls


@pytest.mark.slow  # inductor / dynamo compiles or a multi-process launch: minutes on 2 cores
def test_lora_adapters_get_the_same_gradients():
    peft = pytest.importorskip("peft")
    base = make("llama-gqa").train()
    lora = peft.LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=["q_proj", "v_proj", "down_proj"])
    ref = peft.get_peft_model(base, lora)
    for module in ref.modules():  # non-zero B, so A's gradient is non-zero too
        if hasattr(module, "lora_B"):
            for b in module.lora_B.values():
                torch.nn.init.normal_(b.weight, std=0.1)
    ours = copy.deepcopy(ref)
    hf_accel.patch(ref, backend="reference")
    hf_accel.patch(ours, backend="reference", compile=AOT_EAGER)
    batch = packed([6, 9, 4], 0)
    _, grads = loss_and_grads(ours, batch)
    assert grads and all("lora_" in name for name in grads)
    assert_same_step(ours, ref, batch)


@pytest.mark.slow  # inductor / dynamo compiles or a multi-process launch: minutes on 2 cores
def test_eval_and_generate_run_the_eager_layers():
    ref = make("llama-gqa")
    ours = copy.deepcopy(ref)
    hf_accel.patch(ours, backend="reference", compile=AOT_EAGER)
    ours.train()
    loss_and_grads(ours, packed([5, 7], 0))  # compiled training step first, as mid-training evaluation would follow
    before = counters["stats"]["unique_graphs"]
    ours.eval()
    prompt = torch.randint(0, VOCAB, (2, 6), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        assert torch.allclose(ours(input_ids=prompt).logits, ref.eval()(input_ids=prompt).logits, atol=1e-5, rtol=1e-4)
    kwargs = dict(max_new_tokens=6, do_sample=False, use_cache=True, pad_token_id=0)
    assert torch.equal(ours.generate(prompt, **kwargs), ref.generate(prompt, **kwargs))
    assert counters["stats"]["unique_graphs"] == before  # nothing compiled for eval or decoding


def test_unpatch_deepcopy_and_options():
    model = make("llama-gqa")
    report = hf_accel.patch(model, backend="reference", compile=AOT_EAGER)
    assert "compiled: 2 decoder layers" in str(report)
    assert hf_accel.patch(model, backend="reference", compile=AOT_EAGER) is report  # same settings: idempotent
    copied = copy.deepcopy(model)  # a reference / EMA copy: eager layers, still patched attention
    assert not compiled_layers(copied)
    hf_accel.patch(model, backend="reference", compile=False)  # other settings re-patch
    assert not compiled_layers(model)
    hf_accel.patch(model, backend="reference", compile=AOT_EAGER)
    hf_accel.unpatch(model)
    assert not compiled_layers(model)
    assert all(layer.__dict__.get("_compiled_call_impl") is None for layer in model.model.layers)
    with pytest.raises(ConfigurationError, match="compile must be True, False or a dict"):
        hf_accel.patch(model, backend="reference", compile="yes")


def test_refused_clearly_where_torch_compile_cannot_run(monkeypatch):
    model = make("llama-gqa")
    monkeypatch.setattr(torch._dynamo, "is_dynamo_supported", lambda: False)
    with pytest.raises(BackendUnavailable, match="compile=True needs torch.compile.*Pass compile=False"):
        hf_accel.patch(model, backend="reference", compile=True)
    assert hf_accel.patch_report(model) is None and not compiled_layers(model)
    assert model.config._attn_implementation == "sdpa"  # the attention seam was undone too


def _backward_copies_at_graph_entries(model, batch) -> int:
    """aten::contiguous calls made by AOTAutograd's runtime as gradients enter compiled graphs' backwards (a copy
    each where a gradient's strides are not its graph output's)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        loss_and_grads(model, batch)
    return sum(1 for e in prof.events() if e.name == "aten::contiguous" and e.cpu_parent is not None
               and e.cpu_parent.name == "CompiledFunctionBackward")


def test_nested_graph_breaks_match_eager_and_take_q_k_v_gradients_without_copies():
    """By default (hf_accel's compile key nested_graph_breaks, issue 39c) the layers traced with dynamo's nested graph
    breaks compute what the eager patched layers compute, and the gradients of q/k/v enter the graph before the
    attention without the copy the tracing without them makes (a frame per enclosing call: their graph's outputs are
    the (B, H, S, D) RoPE outputs, whose gradients come back (B, S, H, D)-laid out)."""
    ours, ref = pair("llama-gqa", AOT_EAGER)
    report = hf_accel.patch_report(ours)
    assert any("nested graph breaks" in note for note in report.notes), report.notes
    for seed, lengths in enumerate(STEPS[:3]):
        assert_same_step(ours, ref, packed(lengths, seed))
    without, _ = pair("llama-gqa", WITHOUT_NESTED)
    assert not any("nested graph breaks" in note for note in hf_accel.patch_report(without).notes)
    batch = packed(STEPS[0], 9)
    layers = ours.config.num_hidden_layers
    assert _backward_copies_at_graph_entries(without, batch) >= 3 * layers  # the test can tell the two apart
    assert _backward_copies_at_graph_entries(ours, batch) == 0


def test_nested_graph_breaks_trace_through_the_kernels_routing_wrapper():
    """transformers (5.25; 5.17 where `kernels` is installed) wraps Llama-like attention classes' forward in the
    `kernels` package's routing wrapper (a try/finally setting a ContextVar), from inside which nested graph breaks
    cannot resume: a layer then compiled as 4 graphs instead of 2. With no function kernelize()'d the wrapper routes
    each call to the function itself, so the compiled layers take the class's own forward there (and the same step
    as eager); the wrapper again once a function is kernelized; a deep copy's forward is the copy's; unpatch removes
    the per-instance forward."""
    from types import MethodType

    ours, ref = pair("llama-gqa", AOT_EAGER)
    assert_same_step(ours, ref, packed(STEPS[0], 0))
    assert counters["stats"]["unique_graphs"] == 2  # one graph before the attention seam, one after, every layer
    attention = ours.model.layers[0].self_attn
    funcs = attention.__dict__.get("_kernel_funcs")
    if not funcs:  # transformers before the wrapper, or without `kernels`: nothing was wrapped
        assert "forward" not in attention.__dict__
        return
    batch = packed(STEPS[1], 1)
    with torch.no_grad():
        hidden = torch.randn(1, batch["input_ids"].shape[1], ours.config.hidden_size)
        rope = ours.model.rotary_emb(hidden, batch["position_ids"])

    def attend(module):
        with torch.no_grad():
            return module(hidden, position_embeddings=rope, attention_mask=None, position_ids=batch["position_ids"])[0]

    clone = copy.deepcopy(ours).model.layers[0].self_attn  # a copy's forward is its own, not the original's
    torch.nn.init.zeros_(clone.o_proj.weight)
    assert attend(clone).abs().max() == 0 and attend(attention).abs().max() > 0
    called = []
    name, func = next(iter(funcs.items()))
    own = type(func).forward
    func.forward = MethodType(lambda self, *a, **k: called.append(name) or own(self, *a, **k), func)  # kernelize()'s way
    attend(attention)
    assert called == [name]  # routed to the kernelized function through the wrapper
    hf_accel.unpatch(ours)
    assert "forward" not in attention.__dict__


def test_nested_graph_breaks_are_asked_for_on_torch_2_10(monkeypatch):
    """torch 2.10 has the option, earlier in its development than the versions it was tested on: the layers compile
    without it unless the compile dict asks."""
    monkeypatch.setattr(torch, "__version__", "2.10.0+cpu")
    report = hf_accel.patch(make("llama-gqa"), backend="reference", compile=AOT_EAGER)
    assert report.compiled_layers and not any("nested graph breaks" in note for note in report.notes), report.notes
    report = hf_accel.patch(make("llama-gqa"), backend="reference", compile={**AOT_EAGER, "nested_graph_breaks": True})
    assert any("nested graph breaks" in note for note in report.notes), report.notes


def test_nested_graph_breaks_refused_where_dynamo_lacks_them_and_left_out_by_default(monkeypatch):
    model = make("llama-gqa")
    monkeypatch.delattr(torch._dynamo.config, "nested_graph_breaks")  # a torch before the option
    with pytest.raises(BackendUnavailable, match="nested_graph_breaks.*does not have. Leave the key out"):
        hf_accel.patch(model, backend="reference", compile={"nested_graph_breaks": True})
    assert hf_accel.patch_report(model) is None and not compiled_layers(model)
    # by default such a torch compiles the layers without them, and the report does not claim them
    report = hf_accel.patch(model, backend="reference", compile=AOT_EAGER)
    assert report.compiled_layers == model.config.num_hidden_layers
    assert not any("nested graph breaks" in note for note in report.notes), report.notes


@pytest.mark.slow  # inductor / dynamo compiles or a multi-process launch: minutes on 2 cores
@pytest.mark.parametrize("family", ["llama", "neox", "falcon"])
def test_layers_share_their_compiled_graphs(family):
    """Every decoder layer runs the same code: one set of graphs whatever the depth (a per-layer guard such as
    layer_idx would compile each layer and, past dynamo's recompile limit, leave the deeper layers eager)."""
    import tiny_models

    build = {"llama": tiny_models._llama, "neox": tiny_models._neox, "falcon": tiny_models._falcon}[family]
    graphs = []
    for depth in (2, 6):
        torch._dynamo.reset()
        counters.clear()
        torch.manual_seed(0)
        model = build(num_hidden_layers=depth).train()
        model.config.use_cache = False
        hf_accel.patch(model, backend="reference", compile=AOT_EAGER)
        for seed, lengths in enumerate(STEPS[:3]):
            loss_and_grads(model, packed(lengths, seed))
        graphs.append(counters["stats"]["unique_graphs"])
    assert graphs[0] == graphs[1], graphs


@pytest.mark.slow  # inductor / dynamo compiles or a multi-process launch: minutes on 2 cores
def test_lora_cast_skip_traces_without_new_graph_breaks():
    """hf_accel.fused.lora_casts' check (autocast state, adapter types) runs inside compiled layers: under bf16 autocast
    on a bf16 model with fp32 adapters, the only graph breaks are the attention seam's."""
    peft = pytest.importorskip("peft")
    model = make("llama-gqa").to(torch.bfloat16).train()
    model = peft.get_peft_model(model, peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj", "down_proj"]))
    hf_accel.patch(model, backend="reference", compile=AOT_EAGER)
    for seed, lengths in enumerate(STEPS[:2]):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = model(**packed(lengths, seed)).loss
        loss.backward()
    breaks = counters["graph_break"]
    assert breaks and all("hf_accel_attention" in reason for reason in breaks), list(breaks)


@pytest.mark.parametrize("variant", ["llama-gqa", "qwen3-qk-norm", "falcon-7b-mqa", "falcon-rw-alibi"])
def test_compiled_layers_hand_the_seam_qkv_as_the_kernels_read_them(variant, monkeypatch):
    """Inside a compiled layer, q/k/v leave the graph (B, S, H, D)-contiguous and in the autocast dtype, so inductor
    writes them so from RoPE's kernel; after the graph break the layout change and the cast were eager copies both
    ways (~40 ms of the 1.43 s Llama-3-8B QLoRA step, run 24's --op-sites profile). fp32 weights under bf16
    autocast (kbit preparation's case): the loss equals the eager patched model's and every gradient agrees to
    summation order (the same as without the layout change). Falcon's seam (its attention module's forward) too:
    there split_qkv's views of the fused projection were copied after the break."""
    from hf_accel.attention import hf_attention
    from hf_accel.patches import falcon as falcon_patch

    seen = []
    real = hf_attention.seam_attention

    def recording(module, q_bshd, k_bshd, v_bshd, **kw):
        seen.append([(t.is_contiguous(), t.dtype) for t in (q_bshd, k_bshd, v_bshd)])
        return real(module, q_bshd, k_bshd, v_bshd, **kw)

    monkeypatch.setattr(hf_attention, "seam_attention", recording)
    monkeypatch.setattr(falcon_patch, "seam_attention", recording)  # Falcon's seam calls it from its own module
    eager = make(variant).train()
    compiled = copy.deepcopy(eager)
    hf_accel.patch(eager, backend="reference")
    hf_accel.patch(compiled, backend="reference", compile=AOT_EAGER)
    for seed, lengths in enumerate(STEPS[:2]):
        batch = packed(lengths, seed)
        results = []
        for model in (eager, compiled):
            seen.clear()
            with torch.autocast("cpu", dtype=torch.bfloat16):
                results.append(loss_and_grads(model, batch))
            layouts = list(seen)
        assert layouts and all(x == (True, torch.bfloat16) for layer in layouts for x in layer), layouts
        (want_loss, want), (got_loss, got) = results
        assert got_loss == want_loss
        for name in want:  # fp32 weight gradients: only summation order differs (as before this layout)
            assert (got[name] - want[name]).abs().max() <= 1e-6 * want[name].abs().max(), name


@pytest.mark.parametrize("name", ["cache", "past_key_values", "layer_past"])
def test_a_training_call_given_a_kv_cache_runs_the_eager_layer(name):
    """A layer called with a KV cache (transformers 5.25 passes it as `cache=`, earlier versions as
    `past_key_values=`, Falcon as `layer_past=`) leaves the compiled path even in training mode: the cache's update
    would otherwise be traced into the training graph."""
    from transformers import DynamicCache

    from hf_accel.fused.compiling import TrainingCompiled

    layer = torch.nn.Linear(4, 4).train()
    compiled = TrainingCompiled(layer, AOT_EAGER)
    assert compiled.takes_compiled_path({})
    assert not compiled.takes_compiled_path({name: DynamicCache()})
