"""Memory estimate and budget planner against live references: real models' parameter counts, the saved-tensor
probe, and a brute-force search over every per-layer plan."""
import itertools
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import (FalconConfig, FalconForCausalLM, Gemma2Config, Gemma2ForCausalLM, Gemma3ForCausalLM,
                          Gemma3TextConfig, GPTNeoXConfig, GPTNeoXForCausalLM, LlamaConfig, LlamaForCausalLM,
                          MistralConfig, MistralForCausalLM, Qwen2Config, Qwen2ForCausalLM, Qwen3Config,
                          Qwen3ForCausalLM)

import hf_accel
from hf_accel.memory.budget import MemoryBudget
from hf_accel.memory.checkpointing import decoder_layers
from hf_accel.errors import ConfigurationError
from hf_accel.memory.estimate import (KNOWN_SHAPES, estimate_training_memory, gradient_bytes, loss_bytes,
                                      training_state_bytes)
from hf_accel.memory.plan import (GradientBytes, LayerActivation, plan_checkpointing, plan_cost, plan_peak_bytes,
                                  probe_layer_activations, probe_training_memory)

# The formula counts the big per-token tensors a decoder layer saves for a flash-style kernel; HF's CPU reference
# path adds or drops a few (Falcon's broadcast K/V and its seq x seq mask, layout copies), which for these tiny
# widths are up to ~15% of a layer. 25% leaves room for that and still catches a missing or double-counted tensor
# (the smallest one the formula counts, e.g. an MLP intermediate, is >= 25% of a layer here).
ACTIVATION_RTOL = 0.25
TOKENS = 64

_LLAMA_LIKE = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
                   num_key_value_heads=2, use_cache=False)
CONFIGS = {
    "llama": (LlamaForCausalLM, lambda: LlamaConfig(
        vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=2, use_cache=False)),
    "llama-tied": (LlamaForCausalLM, lambda: LlamaConfig(
        vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, use_cache=False, tie_word_embeddings=True)),
    "gpt_neox": (GPTNeoXForCausalLM, lambda: GPTNeoXConfig(
        vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
        use_cache=False)),
    "falcon": (FalconForCausalLM, lambda: FalconConfig(
        vocab_size=128, hidden_size=64, num_hidden_layers=3, num_attention_heads=4, new_decoder_architecture=True,
        num_kv_heads=2, alibi=False, use_cache=False)),
    **{name: (cls, lambda config_cls=config_cls, extra=extra: config_cls(**_LLAMA_LIKE, **extra))
       for name, cls, config_cls, extra in [
           ("qwen2", Qwen2ForCausalLM, Qwen2Config, {}),
           ("qwen3", Qwen3ForCausalLM, Qwen3Config, dict(head_dim=16)),
           ("mistral", MistralForCausalLM, MistralConfig, {}),
           # Gemma 2 measured on eager (transformers refuses SDPA): its seq x seq probabilities are in the probe
           ("gemma2", Gemma2ForCausalLM, Gemma2Config, dict(head_dim=16, attn_implementation="eager")),
           ("gemma3_text", Gemma3ForCausalLM, Gemma3TextConfig, dict(head_dim=16, sliding_window=TOKENS)),
       ]},
}


def build(name):
    cls, make_config = CONFIGS[name]
    torch.manual_seed(0)
    return cls(make_config()).train()


@pytest.mark.parametrize("name", list(CONFIGS))
def test_parameter_count_matches_real_model(name):
    model = build(name)
    real = sum(p.numel() for p in model.parameters())
    assert estimate_training_memory(model.config, dtype="fp32").params == real


def test_lora_parameter_count_matches_peft():
    peft = pytest.importorskip("peft")
    model = build("llama")
    targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    estimate = estimate_training_memory(model.config, lora_rank=4, lora_targets=targets)
    lora_model = peft.get_peft_model(model, peft.LoraConfig(r=4, target_modules=targets))
    trainable = sum(p.numel() for p in lora_model.parameters() if p.requires_grad)
    assert estimate.trainable_params == trainable
    assert estimate.params == sum(p.numel() for p in lora_model.parameters())


@pytest.mark.parametrize("name", ["llama", "gpt_neox", "falcon", "qwen2", "qwen3", "mistral", "gemma2", "gemma3_text"])
def test_activation_estimate_close_to_saved_tensor_measurement(name):
    """The estimate counts flash-style attention (no seq x seq tensor). A model built on eager attention (Gemma 2,
    which transformers refuses SDPA for) keeps its probabilities: measured through the facts probe's flash-like
    stand-in attention instead (real tensors; it saves q, k, v, out and the log-sum-exp as a flash kernel does)."""
    model = build(name)
    if model.config._attn_implementation == "eager":
        from hf_accel.facts.probe import PROBE_NAME, register

        register()
        model.config._attn_implementation_internal = PROBE_NAME
    ids = torch.randint(0, 128, (1, TOKENS))
    measured = probe_layer_activations(model, {"input_ids": ids, "labels": ids})
    estimate = estimate_training_memory(model.config, dtype="fp32", batch_tokens=TOKENS).layer
    for layer in measured[1:]:  # layer 0 also holds the model-wide rotary tables
        for choice in ("none", "op", "full"):
            predicted, real = estimate.retained(choice), layer.retained(choice)
            assert abs(predicted - real) <= ACTIVATION_RTOL * real, (choice, predicted, real)


def _probe_variants():
    """Models whose decoder layers come in one kind or several: every family; Gemma 3 with sliding and full layers;
    LoRA on some layers only; compiled layers; chunked MLPs."""
    def gemma3_mixed():
        torch.manual_seed(0)
        config = Gemma3TextConfig(**{**_LLAMA_LIKE, "num_hidden_layers": 6}, head_dim=16, sliding_window=16,
                                  layer_types=["sliding_attention", "sliding_attention", "full_attention"] * 2)
        return Gemma3ForCausalLM(config).train()

    def lora_some_layers():
        peft = pytest.importorskip("peft")
        model = build("llama")
        return peft.get_peft_model(model, peft.LoraConfig(r=4, target_modules=["q_proj", "down_proj"],
                                                          layers_to_transform=[0, 2]))

    def lora_middle_layers():
        # frozen layers below the adapted ones get an input that needs no gradient (they save nothing), those above
        # one that does: one kind, two ways of saving (no input-grads hook: non-reentrant checkpointing adds none)
        peft = pytest.importorskip("peft")
        torch.manual_seed(0)
        model = LlamaForCausalLM(LlamaConfig(**{**_LLAMA_LIKE, "num_hidden_layers": 8})).train()
        return peft.get_peft_model(model, peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"],
                                                          layers_to_transform=[3, 4]))

    def patched(**options):
        def make():
            model = build("llama")
            hf_accel.patch(model, backend="reference", **options)
            return model
        return make

    variants = {name: (lambda name=name: build(name)) for name in CONFIGS}
    variants.update({"gemma3-mixed": gemma3_mixed, "lora-some-layers": lora_some_layers,
                     "lora-middle-layers": lora_middle_layers,
                     "compiled": patched(compile={"backend": "aot_eager"}), "mlp-chunks": patched(mlp_chunks=16)})
    return variants


@pytest.mark.parametrize("variant", [pytest.param(v, marks=pytest.mark.slow) if v == "compiled" else v  # compiles
                                     for v in _probe_variants()])
def test_probe_runs_one_layer_of_each_kind_and_measures_what_running_all_does(variant):
    """The probe's forwards run the first two layers of each kind and pass the others through (at long context most of
    its time): every figure, and the loss tail's peak, equals what running every layer measures, also where layers
    of one kind get inputs that need a gradient and inputs that do not."""
    from hf_accel.memory.layer_kinds import kind_ids

    torch._dynamo.reset()
    model = _probe_variants()[variant]()
    compiled = variant == "compiled"
    ids = torch.randint(0, 128, (1, TOKENS))
    batch = {"input_ids": ids, "labels": ids}
    expected = {"gemma3-mixed": [0, 0, 2, 0, 0, 2],  # two kinds: sliding (0, 1, 3, 4) and full (2, 5)
                "lora-some-layers": [0, 1, 0],  # layers 0 and 2 adapted, 1 not
                "lora-middle-layers": [0, 0, 0, 3, 3, 0, 0, 0],  # by kind alone (the forward tells inputs apart)
                "gemma2": [0, 1, 0], "llama-tied": [0, 0]}  # alternating kinds; two layers
    assert kind_ids(decoder_layers(model)) == expected.get(variant, [0, 0, 0])
    fast = probe_training_memory(model, batch, compiled=compiled)
    every = probe_training_memory(model, batch, compiled=compiled, every_layer=True)
    assert fast == every
    torch._dynamo.reset()


def _measured_layers():
    model = build("llama")
    ids = torch.randint(0, 128, (1, TOKENS))
    return model, probe_layer_activations(model, {"input_ids": ids, "labels": ids})


def test_planner_picks_cheapest_plan_that_fits():
    model, layers = _measured_layers()
    fixed, extra = training_state_bytes(model), 10_000
    lowest = plan_peak_bytes(layers, ["full"] * len(layers), fixed, extra)
    highest = plan_peak_bytes(layers, ["none"] * len(layers), fixed, extra)
    every = list(itertools.product(("none", "op", "full"), repeat=len(layers)))
    for fraction in (0.0, 0.1, 0.3, 0.5, 0.7, 0.9, 1.0):
        budget = int(lowest + fraction * (highest - lowest))
        plan = plan_checkpointing(layers, fixed_bytes=fixed, budget_bytes=budget, extra_bytes=extra)
        assert plan.fits and plan.predicted_peak_bytes <= budget
        assert plan.predicted_peak_bytes == plan_peak_bytes(layers, plan.choices, fixed, extra)
        cheapest = min(plan_cost(c) for c in every if plan_peak_bytes(layers, c, fixed, extra) <= budget)
        assert plan.recompute_cost == pytest.approx(cheapest), (fraction, plan.choices)
    over = plan_checkpointing(layers, fixed_bytes=fixed, budget_bytes=lowest - 1, extra_bytes=extra)
    assert not over.fits and over.predicted_peak_bytes == lowest == min(
        plan_peak_bytes(layers, c, fixed, extra) for c in every)  # the lowest peak there is: full layers
    assert "does NOT fit" in over.table()


def test_planner_on_uneven_layers_matches_brute_force():
    layers = [LayerActivation(1000, 600, 100), LayerActivation(3000, 1000, 100), LayerActivation(2000, 1500, 50)]
    every = list(itertools.product(("none", "op", "full"), repeat=3))
    for budget in range(1500, 6200, 250):
        plan = plan_checkpointing(layers, fixed_bytes=0, budget_bytes=budget)
        feasible = [plan_cost(c) for c in every if plan_peak_bytes(layers, c, 0) <= budget]
        if feasible:
            assert plan.fits and plan.recompute_cost == pytest.approx(min(feasible)), budget


def test_compiled_layers_price_op_level_as_leaving_the_compiled_path():
    """Op-level saves 20% of a layer's activations and full 90%: eagerly op on many layers is the cheapest way to a
    budget; with compiled layers (where op also gives up the compiled layer) full checkpointing of a few is."""
    from hf_accel.memory.plan import RECOMPUTE_COST_COMPILED

    layers = [LayerActivation(1000, 800, 100)] * 8
    budget = plan_peak_bytes(layers, ["none"] * 8, 0) - 1000  # needs 1000 bytes of savings
    eager = plan_checkpointing(layers, fixed_bytes=0, budget_bytes=budget)
    compiled = plan_checkpointing(layers, fixed_bytes=0, budget_bytes=budget, costs=RECOMPUTE_COST_COMPILED)
    assert eager.fits and compiled.fits
    # the forward's end is the peak (a layer's rebuild comes after the loss tail, under fewer layers' activations)
    assert eager.choices.count("op") == 5 and "full" not in eager.choices  # 5 x 200 saved
    assert compiled.choices.count("full") == 1 and compiled.choices.count("op") == 1  # 900 + 200 saved
    assert compiled.recompute_cost == plan_cost(compiled.choices, RECOMPUTE_COST_COMPILED)
    every = list(itertools.product(("none", "op", "full"), repeat=4))  # brute force on fewer layers
    few = layers[:4]
    for budget in range(2000, 4000, 100):
        plan = plan_checkpointing(few, fixed_bytes=0, budget_bytes=budget, costs=RECOMPUTE_COST_COMPILED)
        feasible = [plan_cost(c, RECOMPUTE_COST_COMPILED) for c in every if plan_peak_bytes(few, c, 0) <= budget]
        if feasible:
            assert plan.recompute_cost == pytest.approx(min(feasible)), budget


def test_patch_tells_a_memory_budget_whether_layers_are_compiled(monkeypatch):
    seen = []
    monkeypatch.setattr(MemoryBudget, "apply", lambda self, model, context=None: seen.append(context.compiled))
    monkeypatch.setattr(MemoryBudget, "remove", lambda self, model: None, raising=False)
    for compiled in (False, True):
        model = build("llama")
        policy = MemoryBudget(budget="1GiB")
        hf_accel.patch(model, backend="reference", compile=compiled, checkpointing=policy)
        hf_accel.unpatch(model)
    assert seen == [False, True]


def test_budget_probes_under_the_autocast_training_runs_under():
    """Training under bf16 autocast saves bf16 activations (and may meet other kernels) where an fp32 probe saves fp32
    ones: the budget's probe forward runs under the autocast its run context names, whatever autocast (none here) is
    in effect when it is applied, and plans what the same budget planned inside that autocast."""
    from hf_accel.memory.context import RunContext

    model = build("llama")
    ids = torch.randint(0, 128, (1, TOKENS))
    batch = {"input_ids": ids, "labels": ids}
    with torch.autocast("cpu", dtype=torch.bfloat16):
        under_autocast = probe_training_memory(model, batch)
        reference = MemoryBudget(budget="1GiB", sample_batch=batch, verbose=False)
        reference.apply(model)
    fp32 = probe_training_memory(model, batch)
    assert under_autocast.layers != fp32.layers  # the test can fail: autocast changes what a forward saves
    policy = MemoryBudget(budget="1GiB", sample_batch=batch, verbose=False)
    policy.apply(model, RunContext(autocast=torch.bfloat16))
    assert policy.probe == under_autocast and policy.autocast == torch.bfloat16
    assert policy.plan == reference.plan
    policy.apply(model, RunContext())  # no autocast in the run: fp32, as the forward trains
    assert policy.probe == fp32


def test_trainer_budget_probes_under_the_trainers_mixed_precision(tmp_path):
    """hf_accel's Trainer under bf16 mixed precision (accelerate autocasts every forward: on CPU too) hands the budget
    that autocast: its probe measures bf16 activations, not the fp32 ones of the model's weights (on the GPU a QLoRA
    model probed in fp32 met another attention kernel than training did)."""
    import transformers

    from hf_accel.memory.budget import _synthetic_batch
    from hf_accel.memory.checkpointing import applied_policy
    from hf_accel.training.trainer import AccelArguments, Trainer

    data = [{"input_ids": list(range(3, 3 + n)), "labels": list(range(3, 3 + n))} for n in (9, 14, 20, 7)]
    args = transformers.TrainingArguments(output_dir=str(tmp_path), per_device_train_batch_size=2, max_steps=1,
                                          report_to="none", use_cpu=True, save_strategy="no", bf16=True)
    model = build("llama")
    trainer = Trainer(model=model, args=args, train_dataset=data,
                      accel=AccelArguments(backend="reference", checkpointing="budget:1GiB", max_tokens_per_batch=40))
    policy = applied_policy(model)
    assert trainer.accelerator.native_amp and policy.autocast == torch.bfloat16
    batch = _synthetic_batch(model, 40, torch.device("cpu"))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        under_autocast = probe_training_memory(model, batch)
    assert policy.probe == under_autocast != probe_training_memory(model, batch)


def test_memory_budget_policy_applies_the_plan_and_keeps_grads():
    model = build("llama")
    ids = torch.randint(0, 128, (1, TOKENS))
    batch = {"input_ids": ids, "labels": ids}
    model.zero_grad()
    model(**batch).loss.backward()
    reference = {n: p.grad.clone() for n, p in model.named_parameters()}
    probe = probe_training_memory(model, batch)
    layers = probe.layers
    fixed = training_state_bytes(model)
    # what op-level on every layer needs: must not fit with no checkpointing, must fit with some
    budget = plan_peak_bytes(layers, ["op"] * len(layers), fixed, probe.tail_peak_bytes)
    policy = MemoryBudget(budget=budget, sample_batch=batch, headroom=0.0)
    policy.apply(model)
    assert policy.plan.fits and policy.plan.predicted_peak_bytes <= budget
    assert 0 < policy.plan.recompute_cost <= plan_cost(["op"] * len(layers))
    # the default keeps 3% of the budget free for what the probe cannot see, so it recomputes more than all-op
    cautious = MemoryBudget(budget=budget, sample_batch=batch)
    cautious.apply(model)
    assert cautious.plan.fits and cautious.plan.predicted_peak_bytes <= 0.97 * budget
    assert cautious.plan.recompute_cost > policy.plan.recompute_cost
    policy.apply(model)
    assert [layer.gradient_checkpointing for layer in decoder_layers(model)] == \
        [c != "none" for c in policy.plan.choices]
    model.zero_grad()
    model(**batch).loss.backward()
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.grad, reference[name], atol=1e-6, rtol=1e-5)
    assert policy.describe().startswith("memory budget")
    with pytest.raises(ConfigurationError, match="device"):
        MemoryBudget(budget=0.5).apply(model)


@pytest.mark.parametrize("shape", KNOWN_SHAPES)
def test_known_shapes_estimate_offline(shape):
    full = estimate_training_memory(shape, checkpointing="full")
    none = estimate_training_memory(shape, checkpointing="none")
    assert full.peak_bytes < none.peak_bytes and full.params == none.params > 10**9
    assert shape in full.table()


def test_estimate_rejects_unknown_inputs():
    with pytest.raises(ConfigurationError, match="llama-3-8b"):
        estimate_training_memory("no-such-model")
    with pytest.raises(ConfigurationError, match="dtype"):
        estimate_training_memory("llama-3.2-1b", dtype="int3")


@pytest.mark.slow
def test_estimate_cli_runs():
    script = Path(__file__).resolve().parents[1] / "scripts" / "estimate_memory.py"
    result = subprocess.run([sys.executable, str(script), "llama-3-8b", "--lora-rank", "16", "--checkpointing",
                             "budget:60GiB", "--batch-tokens", "8192"], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
    assert "| peak |" in result.stdout


def test_probe_frees_its_forward():
    """The probe's forward must leave nothing alive: a pack hook that hands autograd back the tensor itself ties each
    saved output to its own grad_fn in a cycle Python cannot collect, and the whole probe graph (a full
    no-checkpointing forward's activations) stayed allocated for the rest of training (seen on the H200)."""
    import gc
    import weakref

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2)
    config._attn_implementation = "eager"  # its softmax output (returned as attn_weights) is saved by its own node
    model = LlamaForCausalLM(config)
    ids = torch.randint(0, 64, (1, 24))
    outputs = []
    handle = model.model.layers[0].self_attn.register_forward_hook(
        lambda m, a, out: outputs.append(weakref.ref(out[1])))
    probe_layer_activations(model, {"input_ids": ids, "labels": ids})
    handle.remove()
    gc.collect()
    assert outputs and outputs[0]() is None, "the probe's activations are still alive after it returned"


def test_probe_sees_the_loss_the_forward_computes(monkeypatch):
    """The plan's loss term is measured from the forward training runs: the stock loss's full logits, or the fused
    loss's chunks (the stock formula says 19.6 GiB for 16k Llama-3 tokens; the fused loss took ~1.5 GiB on the H200).
    Here a vocabulary much wider than the hidden size, as in real LMs, and 16 chunks, as 16k Llama-3 tokens get."""
    import hf_accel
    from hf_accel.fused import cross_entropy

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=2048, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, attn_implementation="sdpa")
    model = LlamaForCausalLM(config).train()
    tokens = 512
    ids = torch.randint(0, 2048, (1, tokens))
    batch = {"input_ids": ids, "labels": ids, "use_cache": False}
    stock = probe_training_memory(model, batch).tail_peak_bytes
    assert stock >= 0.9 * loss_bytes(tokens, 2048, 4)  # logits + log-softmax, fp32
    monkeypatch.setattr(cross_entropy, "auto_chunk_size", lambda *args, **kwargs: tokens // 16)
    hf_accel.patch(model, backend="reference", fused_ce=True)
    fused = probe_training_memory(model, batch).tail_peak_bytes
    assert 0 < fused < stock / 4


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_estimate_fused_loss_bounds_the_probed_tail(dtype, monkeypatch):
    """estimate-memory's loss row for patch()'s fused loss against the tail the probe measures for it (torch's path,
    the one that holds most): at or above it, within 25%. It counted the full logits instead: 334 GiB for a 344k-token
    Llama-3-8B QLoRA step that ran within an 80 GiB cap on the H200 (tests/gpu/RESULTS.md, run 30)."""
    import hf_accel
    from hf_accel.fused import cross_entropy
    from hf_accel.memory import chunks
    from hf_accel.memory.estimate import fused_loss_bytes

    torch.manual_seed(0)
    vocab, hidden, tokens = 4096, 64, 2048
    config = LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=128, num_hidden_layers=1,
                         num_attention_heads=4, num_key_value_heads=2, attn_implementation="sdpa")
    model = LlamaForCausalLM(config).to(dtype).train()
    model.lm_head.weight.requires_grad_(False)  # a frozen head, as under LoRA: no head gradient in the tail
    for module in (cross_entropy, chunks):  # the loss's and the estimate's chunk
        monkeypatch.setattr(module, "auto_chunk_size", lambda *args, **kwargs: tokens // 8)
    hf_accel.patch(model, backend="reference", fused_ce=True, compile=False)
    ids = torch.randint(0, vocab, (1, tokens))
    measured = probe_training_memory(model, {"input_ids": ids, "labels": ids, "use_cache": False}).tail_peak_bytes
    size = torch.finfo(dtype).bits // 8
    estimated = fused_loss_bytes(tokens, vocab, hidden, size, size)
    assert measured <= estimated <= 1.25 * measured, (measured, estimated)


def _chunk_tiny_mlps(monkeypatch, chunk: int) -> None:
    """mlp_chunks="auto" sized for tiny models: calls over `chunk` tokens run in chunks of `chunk` tokens."""
    from hf_accel.memory import mlp_chunks

    for name, value in (("AUTO_MIN_TOKENS", chunk), ("AUTO_TRIGGER_BYTES", 0), ("AUTO_CHUNK_BYTES", 0),
                        ("AUTO_MIN_CHUNK", chunk)):
        monkeypatch.setattr(mlp_chunks, name, value)


@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
@pytest.mark.parametrize("name", ["llama", "gpt_neox", "falcon", "qwen3", "gemma2"])
def test_estimate_counts_chunked_mlps_as_the_probe_measures_them(name, lora, monkeypatch):
    """Where patch()'s mlp_chunks="auto" runs a length's MLPs in chunks, each family's formula drops the MLP's
    intermediates (``LayerBytes.mlp``, with the adapted MLP linears' LoRA saves) from what a layer keeps, and counts
    one chunk's in its backward (rebuilt there, as a checkpointed layer's are). Against the saved-tensor probe of the
    same model with and without chunks bound: the drop is what the probe sees drop (a wrong MLP share is off by a
    tensor or more). The figures without chunks are the previous test's."""
    from hf_accel.memory import mlp_chunks
    from hf_accel.patches import family_of

    chunk = TOKENS // 4
    _chunk_tiny_mlps(monkeypatch, chunk)
    ids = torch.randint(0, 128, (1, TOKENS))
    probed, targets = {}, None
    for chunked in (False, True):
        model = build(name)
        config = model.config
        family = family_of(config)
        if lora:
            peft = pytest.importorskip("peft")
            targets = list(family.lora_targets)  # attention and MLP projections
            model = peft.get_peft_model(model, peft.LoraConfig(r=4, target_modules=targets))
        if chunked:  # what patch()'s default binds (patch() would also swap in its CPU attention, which keeps scores)
            mlp_chunks.apply(model, mlp_chunks.resolve("auto", family.mlp_width(config), 4),
                             family.output_projections(config))
        probed[chunked] = probe_training_memory(model, {"input_ids": ids, "labels": ids}).layers[1]  # (0: rotary)
    kwargs = dict(dtype="fp32", batch_tokens=TOKENS, lora_rank=4 if lora else None, lora_targets=targets)
    estimate = {chunked: estimate_training_memory(config, mlp_chunks="auto" if chunked else False, **kwargs)
                for chunked in (False, True)}
    whole, chunks = estimate[False].layer, estimate[True].layer
    share = whole.none_bytes - chunks.none_bytes  # every token's MLP intermediates
    grads = 2 * config.hidden_size * 4 * TOKENS  # the layer input's and output's gradients (fp32)
    assert share > 0 and chunks.backward_bytes == share * chunk // TOKENS + grads
    assert share == pytest.approx(probed[False].none_bytes - probed[True].none_bytes, rel=0.02)
    # unchunked, an upper bound of what the layer's backward makes on top of its saves (it counted none of it)
    assert whole.backward_bytes == share + grads
    assert probed[False].backward_bytes <= whole.backward_bytes <= 2.5 * probed[False].backward_bytes
    assert (chunks.full_bytes, chunks.op_bytes) == (whole.full_bytes, whole.op_bytes)
    assert any("mlp_chunks='auto'" in note for note in estimate[True].notes)
    assert not any("mlp_chunks" in note for note in estimate[False].notes)


def test_infeasible_budget_raises_naming_the_smallest_that_fits(capsys):
    import re

    model = build("llama").train()
    ids = torch.randint(0, 128, (1, TOKENS))
    fixed = training_state_bytes(model)
    with pytest.raises(ConfigurationError, match=r"smallest feasible budget is 'budget:[0-9.]+MiB'") as err:
        MemoryBudget(budget=fixed, sample_batch={"input_ids": ids, "labels": ids}).apply(model)
    assert not any(layer.gradient_checkpointing for layer in decoder_layers(model))  # nothing applied
    smallest = float(re.search(r"budget:([0-9.]+)MiB", str(err.value)).group(1)) * 1024**2
    fits = MemoryBudget(budget=int(smallest), sample_batch={"input_ids": ids, "labels": ids})
    fits.apply(model)  # the named budget is feasible
    assert fits.plan.fits
    printed = capsys.readouterr().out
    assert "checkpointing plan for budget" in printed and "| predicted peak |" in printed  # visible by default


def test_estimate_table_counts_offloaded_layers():
    """`estimate_memory.py --checkpointing offload`: the table says how many layers are offloaded (it printed an empty
    "activations ()" row) and counts none of their inputs on the device."""
    from hf_accel.memory.estimate import estimate_training_memory

    est = estimate_training_memory("llama-3.2-1b", batch_tokens=1024, checkpointing="offload")
    assert est.choices == ("offload",) * 16 and est.activation_bytes == 0
    assert "| activations (16 offload) | 0.0 MiB |" in est.table()


def test_op_level_layers_rebuild_the_eager_set_when_figures_come_from_compiled_layers():
    """A compiled layer saves less than its eager ops (none_bytes); an op-level layer runs eagerly, so its backward
    rebuilds the eager set (eager_none_bytes) on top of what it retained."""
    layer = LayerActivation(600, 300, 100, eager_none_bytes=1000)
    assert [layer.rebuilt(c) for c in ("none", "op", "full", "offload")] == [0, 700, 500, 600]
    # the forward's end (both layers' retained bytes, the top one's output) or the op layer's backward (its own 300
    # and the 700 it rebuilds; the layer above has freed its 600 by then)
    assert plan_peak_bytes([layer, layer], ["op", "none"], 10) == 10 + max(300 + 600 + 100, 300 + 700)
    assert LayerActivation(600, 300, 100).rebuilt("op") == 300  # eager figures: the same set either way
    layers = [LayerActivation(600, 300, 100, eager_none_bytes=1000), LayerActivation(900, 200, 100),
              LayerActivation(500, 450, 50, eager_none_bytes=2000)]
    every = list(itertools.product(("none", "op", "full"), repeat=3))
    for budget in range(900, 3000, 50):
        plan = plan_checkpointing(layers, fixed_bytes=0, budget_bytes=budget)
        feasible = [plan_cost(c) for c in every if plan_peak_bytes(layers, c, 0) <= budget]
        assert plan.fits == bool(feasible), budget
        if feasible:
            assert plan.recompute_cost == pytest.approx(min(feasible)) and plan.predicted_peak_bytes <= budget


@pytest.mark.slow  # inductor / dynamo compiles or a multi-process launch: minutes on 2 cores
def test_budget_probes_compiled_layers_through_their_graphs():
    """patch(compile=True) with a memory budget: the probe counts what the compiled graphs save (less than the eager
    ops: the H200 plans over-predicted by 4-7 GiB when compiled layers were probed eagerly), keeps the eager figures
    for op-level layers, restores each layer's compiled call, and the run then trains with the plan's gradients."""
    from torch._dynamo.utils import counters

    from hf_accel.fused.compiling import TrainingCompiled

    model = build("llama")
    ids = torch.randint(0, 128, (1, TOKENS))
    batch = {"input_ids": ids, "labels": ids, "use_cache": False}
    hf_accel.patch(model, backend="reference", compile=True)
    calls = [layer.__dict__["_compiled_call_impl"] for layer in decoder_layers(model)]
    assert all(isinstance(call, TrainingCompiled) for call in calls)
    eager = probe_training_memory(model, batch)
    probed = probe_training_memory(model, batch, compiled=True)
    assert [layer.__dict__["_compiled_call_impl"] for layer in decoder_layers(model)] == calls
    assert counters["stats"]["unique_graphs"] > 0  # the second forward ran the compiled graphs
    for e, c in zip(eager.layers, probed.layers):
        assert 0 < c.none_bytes < e.none_bytes  # inductor keeps less than the eager ops
        assert (c.op_bytes, c.full_bytes, c.eager_none_bytes) == (e.op_bytes, e.full_bytes, e.none_bytes)
    assert probed.tail_peak_bytes == eager.tail_peak_bytes
    # a budget between the compiled and the eager no-checkpointing peaks: no recompute with the compiled figures,
    # where the eager ones would have checkpointed
    fixed = training_state_bytes(model)
    none = ["none"] * len(probed.layers)
    budget = (plan_peak_bytes(probed.layers, none, fixed, probed.tail_peak_bytes)
              + plan_peak_bytes(eager.layers, none, fixed, eager.tail_peak_bytes)) // 2
    for compiled, expect_recompute in ((True, False), (False, True)):
        policy = MemoryBudget(budget=budget, sample_batch=batch, headroom=0.0, verbose=False, compiled=compiled)
        policy.apply(model)
        assert policy.plan.fits and (policy.plan.recompute_cost > 0) == expect_recompute, compiled
    reference = build("llama")
    hf_accel.patch(reference, backend="reference")
    for m in (model, reference):
        m.zero_grad()
        m(**batch).loss.backward()
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        torch.testing.assert_close(p.grad, q.grad, atol=1e-5, rtol=1e-4, msg=lambda m: f"{name}: {m}")
    hf_accel.unpatch(model)


def test_freed_gradients_peak_follows_backward():
    """Gradients freed before each forward: the peak is the forward's end (the loss tail, every layer's retained bytes
    and the top layer's output) or a layer's backward, whichever is larger; never above counting every gradient on
    top of everything."""
    layers = [LayerActivation(none_bytes=100, op_bytes=50, full_bytes=10)] * 3
    none = ["none"] * 3
    # big gradients in the first layer: its backward (last) holds them all, with its own activations only
    big_first = GradientBytes(per_layer=(1000, 10, 10), other=5)
    assert plan_peak_bytes(layers, none, 0, 7, big_first) == 5 + max(7 + 300 + 10, 0 + 100 + 1020, 100 + 100 + 20,
                                                                     200 + 100 + 10)
    # small gradients: the forward's end (with the head's gradients) is the peak
    small = GradientBytes(per_layer=(1, 1, 1), other=5)
    assert plan_peak_bytes(layers, none, 0, 7, small) == 5 + 7 + 300 + 10
    # a recomputed layer rebuilds in its own backward, under the layers below it, after the loss tail is gone
    full_top = ["none", "none", "full"]
    assert plan_peak_bytes(layers, full_top, 0, 7, small) == 5 + max(7 + 210 + 10, 200 + 10 + 90 + 1)
    with pytest.raises(ValueError, match="2 layers of gradient bytes for 3"):
        plan_peak_bytes(layers, none, 0, 0, GradientBytes(per_layer=(1, 1), other=0))
    gen = torch.Generator().manual_seed(0)
    for _ in range(200):
        n = int(torch.randint(1, 6, (1,), generator=gen))
        sizes = torch.randint(0, 1000, (n, 4), generator=gen).tolist()
        some = [LayerActivation(none_bytes=a + b + c, op_bytes=a + b, full_bytes=a) for a, b, c, _ in sizes]
        grads = GradientBytes(per_layer=tuple(g for *_, g in sizes), other=int(torch.randint(0, 500, (1,), generator=gen)))
        choices = [("none", "op", "full", "offload")[int(i)] for i in torch.randint(0, 4, (n,), generator=gen)]
        assert plan_peak_bytes(some, choices, 0, 50, grads) <= plan_peak_bytes(some, choices, grads.total, 50)


def _step_peak_bytes(model, batch, optimizer, keep_grads: bool) -> int:
    """The real peak of live CPU tensor bytes over one training step (torch.profiler's memory timeline), after a
    warm-up step made the optimizer states; gradients kept through the next forward or freed before it."""
    from torch.profiler import ProfilerActivity, profile
    from torch.profiler._memory_profiler import MemoryProfileTimeline

    def one_step():
        model(**batch).loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=not keep_grads)

    one_step()
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True, record_shapes=True, with_stack=True) as prof:
        one_step()
    _, sizes = MemoryProfileTimeline(prof._memory_profile())._coalesce_timeline("cpu")
    return max(sum(s) for s in sizes)


@pytest.mark.slow  # inductor / dynamo compiles or a multi-process launch: minutes on 2 cores
def test_gradients_a_plan_stops_counting_are_not_held_at_the_real_peak():
    """Live reference (torch.profiler's memory timeline of a real CPU training step): the bytes a plan with
    ``grads_freed`` stops counting are bytes the step really does not hold at its peak when the loop frees gradients
    (zero_grad(set_to_none=True)) rather than keeping them. A planner that dropped gradients the step still holds
    would let the measured peak pass the budget."""
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=256, hidden_size=128, intermediate_size=512, num_hidden_layers=4,
                                         num_attention_heads=4, num_key_value_heads=2, use_cache=False)).train()
    ids = torch.randint(0, 256, (1, 256))
    batch = {"input_ids": ids, "labels": ids}
    probe = probe_training_memory(model, batch)
    grads = gradient_bytes(model, decoder_layers(model))
    assert grads.total == sum(p.numel() * p.element_size() for p in model.parameters())
    assert grads.other == sum(p.numel() * p.element_size() for n, p in model.named_parameters() if ".layers." not in n)
    none = ["none"] * len(probe.layers)
    counted = plan_peak_bytes(probe.layers, none, training_state_bytes(model), probe.tail_peak_bytes)
    freed = plan_peak_bytes(probe.layers, none, training_state_bytes(model, grads=False), probe.tail_peak_bytes, grads)
    claimed = counted - freed
    assert claimed > 0.5 * grads.total  # activations are small here: the forward's end is the peak, gradients drop out
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    saved = _step_peak_bytes(model, batch, optimizer, keep_grads=True) - _step_peak_bytes(model, batch, optimizer,
                                                                                         keep_grads=False)
    # (2026-11-30: saved 3.81 MB, claimed 3.61 MB of 4.20 MB of gradients; a plan dropping every gradient fails)
    assert saved >= 0.98 * claimed, (saved, claimed, grads.total)


def test_memory_budget_with_freed_gradients_plans_less_recompute():
    """MemoryBudget(grads_freed=True) leaves the gradients out of the fixed bytes, prints them as freed, and at a
    budget between its own and the counting plan's no-checkpointing peaks recomputes nothing where the counting plan
    must."""
    model = build("llama")
    ids = torch.randint(0, 128, (1, TOKENS))
    batch = {"input_ids": ids, "labels": ids}
    counting = MemoryBudget(budget=10**12, sample_batch=batch, headroom=0.0, verbose=False)
    counting.apply(model)
    freeing = MemoryBudget(budget=10**12, sample_batch=batch, headroom=0.0, verbose=False, grads_freed=True)
    freeing.apply(model)
    grads = sum(p.numel() * p.element_size() for p in model.parameters())
    assert counting.plan.fixed_bytes - freeing.plan.fixed_bytes == grads == freeing.plan.freed_grad_bytes
    assert counting.plan.freed_grad_bytes is None
    assert "| gradients (freed before each forward) |" in freeing.plan.table()
    between = (counting.plan.predicted_peak_bytes + freeing.plan.predicted_peak_bytes) // 2
    assert freeing.plan.predicted_peak_bytes < between < counting.plan.predicted_peak_bytes
    for policy in (counting, freeing):
        policy.budget = between
        policy.apply(model)
    assert freeing.plan.fits and set(freeing.plan.choices) == {"none"}
    assert counting.plan.recompute_cost > 0



def _state_bytes_reports(tmp_path: Path, engine: str, lora: bool) -> list[dict]:
    """tests/dist_state_bytes.py on 2 gloo processes: each rank's report."""
    import json

    from benchlib.distributed import free_port
    from tests.multi_gpu_runs import ROOT, launch_or_fail

    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", str(free_port()),
           str(ROOT / "tests" / "dist_state_bytes.py"), "--out", str(tmp_path), "--engine", engine,
           *(["--lora"] if lora else [])]
    launch_or_fail(cmd, ROOT, 150, env={"OMP_NUM_THREADS": "1"})
    return [json.loads((tmp_path / f"state.rank{rank}.json").read_text()) for rank in (0, 1)]


@pytest.mark.slow
@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
def test_sharded_state_estimate_is_what_each_fsdp2_rank_holds(tmp_path, lora):
    """Budgets under FSDP2 plan with each process's share of the training state (hf_accel's Trainers pass the
    sharding): on 2 gloo processes, accelerate's own fsdp2_prepare_model under bf16 mixed precision (trainable
    parameters upcast to fp32 master weights) and one AdamW step, each rank's local shards of parameters, gradients
    and optimizer states add up to exactly the estimate made on the model before sharding. The unsharded estimate
    (what the plan used before) is off by the frozen weights' other half for LoRA."""
    for report in _state_bytes_reports(tmp_path, "fsdp2", lora):
        assert sum(report["held"].values()) == report["estimated_shard"], report
        if lora:  # the estimate before the sharding was known fails here (for full FT on 2 ranks it happens to agree)
            assert report["unsharded_estimate"] > 1.5 * report["estimated_shard"], report


@pytest.mark.slow
@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
def test_sharded_state_estimate_is_what_each_zero3_rank_holds(deepspeed_cpu, tmp_path, lora):
    """The same under DeepSpeed ZeRO-3 (deepspeed.initialize with the shipped ds_zero3.json, bf16): every tensor
    storage a rank holds after one AdamW step, less DeepSpeed's gradient bucket and the whole copies of parameters
    under its persistence threshold, is the estimated share within 1% (measured 0.2%).
    Its bf16 engine keeps a bf16 and an fp32 partition of each trainable parameter, bf16 gradient partitions (the
    estimate counted fp32 ones before: 12% over for full FT) and casts fp32 LoRA adapters to bf16."""
    for report in _state_bytes_reports(tmp_path, "zero3", lora):
        held = report["held"]["all"] - report["bucket_bytes"] - report["persistent_bytes"]
        assert held == pytest.approx(report["estimated_shard"], rel=0.01), report


def test_trainer_tells_the_budget_how_its_wrapper_shards_the_state():
    """hf_accel's Trainers hand the budget the sharding they run under: FSDP2 and ZeRO-3 over the processes, fp32
    master weights under bf16/fp16 mixed precision; FSDP1, ZeRO-2 and plain runs plan with the whole state."""
    from types import SimpleNamespace as NS

    from hf_accel.memory.estimate import Sharding
    from hf_accel.training.trainer import AccelMixin

    def trainer(fsdp2=False, fsdp1=False, zero=None, bf16=True):
        plugin = NS(zero_stage=zero) if zero else None
        return NS(args=NS(bf16=bf16, fp16=False, world_size=4), is_fsdp_enabled=fsdp2 or fsdp1,
                  is_deepspeed_enabled=zero is not None,
                  accelerator=NS(is_fsdp2=fsdp2, state=NS(deepspeed_plugin=plugin)))

    assert AccelMixin._accel_sharding(trainer(fsdp2=True)) == Sharding("fsdp2", 4, 4, 2)
    assert AccelMixin._accel_sharding(trainer(fsdp2=True, bf16=False)) == Sharding("fsdp2", 4, None, None)
    assert AccelMixin._accel_sharding(trainer(zero=3)) == Sharding("zero3", 4, 4, 2)
    assert AccelMixin._accel_sharding(trainer(zero=3, bf16=False)) == Sharding("zero3", 4, None, None)
    for other in (trainer(), trainer(fsdp1=True), trainer(zero=2)):
        assert AccelMixin._accel_sharding(other) is None


def test_a_sharded_budget_plans_with_this_processs_share():
    """With a sharding set, the plan's fixed bytes are this process's share plus its gathered copies, below the
    whole state's the plan counted before (8 processes here)."""
    from hf_accel.memory.estimate import Sharding, sharded_state_bytes

    model = build("llama")
    ids = torch.randint(0, 128, (1, TOKENS))
    batch = {"input_ids": ids, "labels": ids}
    sharding = Sharding("fsdp2", 8, None)
    whole = MemoryBudget(budget="1GiB", sample_batch=batch, verbose=False)
    whole.apply(model)
    whole.remove(model)
    shared = MemoryBudget(budget="1GiB", sample_batch=batch, verbose=False, sharding=sharding)
    shared.apply(model)
    shared.remove(model)
    assert shared.plan.fixed_bytes == sum(sharded_state_bytes(model, "adamw", True, sharding))
    assert shared.plan.fixed_bytes < whole.plan.fixed_bytes == training_state_bytes(model)
    # refused, it names a length without probing it (each process would decide alone whether to probe again, and a
    # probe of a sharded model gathers weights across all of them)
    tight = shared.plan.fixed_bytes + (shared.plan.predicted_peak_bytes - shared.plan.fixed_bytes) // 4
    with pytest.raises(ConfigurationError, match="not confirmed by a probe at that length"):
        MemoryBudget(budget=tight, sample_batch=batch, verbose=False, sharding=sharding, headroom=0.0).apply(model)


class _StepPeak:
    """The most bytes alive at once of the storages a training step creates (parameters and buffers excepted),
    checked after every op: the reference a plan's predicted activation peak is held to."""

    def __init__(self, model):
        from torch.utils._python_dispatch import TorchDispatchMode
        from torch.utils._pytree import tree_leaves
        from torch.multiprocessing.reductions import StorageWeakRef

        known = {t.untyped_storage().data_ptr() for t in itertools.chain(model.parameters(), model.buffers())}
        refs, outer = {}, self
        self.peak = 0

        class Track(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                out = func(*args, **(kwargs or {}))
                for t in tree_leaves(out):
                    if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() not in known:
                        ptr = t.untyped_storage().data_ptr()
                        if ptr not in refs or refs[ptr][0].expired():
                            refs[ptr] = (StorageWeakRef(t.untyped_storage()), t.untyped_storage().nbytes())
                outer.peak = max(outer.peak, sum(n for ref, n in refs.values() if not ref.expired()))
                return out

        self.mode = Track()


@pytest.mark.parametrize("spec", ["none", "full"])
def test_predicted_peak_covers_the_backward_of_a_real_step(spec):
    """A layer's backward makes gradients on top of what its forward saved (an MLP's gate and up gradients are two
    intermediate-sized tensors): without them plans under-predicted every peak (on the H200 a QLoRA budget:14.5GiB
    run peaked at 15.10 GiB against 13.99 predicted). Frozen weights (LoRA's base), so the step makes activation
    gradients only; the prediction covers the measured peak and stays within 25% of it."""
    from hf_accel.memory.checkpointing import policy_from_spec
    from hf_accel.memory.plan import probe_training_memory

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=256, hidden_size=128, intermediate_size=512, num_hidden_layers=3,
                                         num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False,
                                         attn_implementation="sdpa"))
    model.requires_grad_(False)
    model.enable_input_require_grads()
    model.train()
    tokens = 512
    ids = torch.randint(0, 256, (1, tokens))
    batch = {"input_ids": ids, "labels": ids, "position_ids": torch.arange(tokens)[None], "use_cache": False}
    probe = probe_training_memory(model, batch)
    assert probe.layers[0].backward_bytes > 0
    # a sharded model's probe runs no layer backward alone: it counts the input's and output's gradients, a lower
    # bound of what the backward makes (it counted none)
    unmeasured = probe_training_memory(model, batch, backward=False).layers
    assert all(0 < layer.backward_bytes == 2 * layer.full_bytes < probe.layers[0].backward_bytes
               for layer in unmeasured)
    policy_from_spec(spec).apply(model)
    predicted = plan_peak_bytes(probe.layers, [spec] * 3, 0, probe.tail_peak_bytes)
    peak = _StepPeak(model)
    with peak.mode:
        model(**batch).loss.backward()
    assert peak.peak <= predicted <= 1.25 * peak.peak, (peak.peak / 2**20, predicted / 2**20)


@pytest.mark.parametrize("hidden, vocab, share", [
    pytest.param(512, 1000, 0.0, marks=pytest.mark.slow), (512, 1000, 0.5),
    pytest.param(512, 1000, 1.0, marks=pytest.mark.slow), (256, 8000, 0.0), (256, 8000, 0.5)])
def test_a_plan_s_predicted_peak_bounds_the_step_s_closely(hidden, vocab, share):
    """Live reference: the tensor bytes a real CPU training step holds at its peak, under plans from the leanest
    (share 0) to none checkpointed (1), with a large loss tail (vocab 8000) or large layers. The prediction bounds
    the step from above and within 10% of it. The count before 2026-12-05 put the largest layer's backward on top of
    the forward's end (the loss tail with every layer's bytes) and was 16-24% over where the tail or the layers'
    rebuilds are large (as run 32's 344k-token QLoRA step: predicted 76.0 GiB, peaked at 59.0)."""
    from hf_accel.memory.checkpointing import applied_policy
    from hf_accel.memory.context import run_context
    from hf_accel.memory.plan import peak_terms

    torch.manual_seed(0)
    tokens = 2048
    config = LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=4 * hidden, num_hidden_layers=6,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=tokens)
    ids = torch.randint(0, vocab, (1, tokens), generator=torch.Generator().manual_seed(1))
    batch = {"input_ids": ids, "labels": ids, "position_ids": torch.arange(tokens)[None]}

    def planned(budget):
        model = LlamaForCausalLM(config).train()
        hf_accel.patch(model, checkpointing=MemoryBudget(budget=budget, headroom=0.0, verbose=False),
                       compile=False, fused_ce=True, context=run_context(batch_tokens=tokens))
        return model, applied_policy(model)

    _, roomy = planned(1 << 40)
    leanest = plan_checkpointing(roomy.probe.layers, **{**roomy.planning, "budget_bytes": 0}).predicted_peak_bytes
    model, policy = planned(int(leanest + share * (roomy.plan.predicted_peak_bytes - leanest)))
    assert policy.plan.fits
    terms = peak_terms(policy.probe.layers, policy.plan.choices, **{k: policy.planning[k] for k in (
        "fixed_bytes", "extra_bytes", "grads")})
    predicted = terms["peak"] - terms["fixed"]  # (the parameters and optimizer states the step does not make)
    model.zero_grad(set_to_none=True)
    peak = _StepPeak(model)
    with peak.mode:
        model(**batch).loss.backward()
    measured = peak.peak
    assert 0.9 * predicted <= measured <= predicted, (measured, predicted, policy.plan.choices, terms)
