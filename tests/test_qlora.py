"""QLoRA on bitsandbytes' CPU backend: a tiny random Llama saved and reloaded as bitsandbytes 4-bit
(`BitsAndBytesConfig`), PEFT's recipe (prepare_model_for_kbit_training with its gradient checkpointing, LoRA on every
linear), then hf_accel.patch. Against live references built from the same files and adapters: the unpatched PEFT
QLoRA model (fp32 compute: losses and LoRA gradients), the patched eager model (compiled layers, bf16 autocast), and
PEFT's own input cast (the LoRA cast skip, bit-identical). The GPU test (tests/gpu/test_qlora_gpu.py) trains 20 steps
in bf16 against PEFT's QLoRA on CUDA."""
from __future__ import annotations

import copy

import pytest
import torch
from torch._dynamo.utils import counters

import hf_accel
from hf_accel.attention.kernels import DeviceInfo
from hf_accel.fused import lora_casts
from hf_accel.fused.compiling import compiled_layers

pytestmark = pytest.mark.usefixtures("fresh_dynamo")

bnb = pytest.importorskip("bitsandbytes", reason="needs bitsandbytes (pip install 'hf_accel[qlora]')")
peft = pytest.importorskip("peft")

VOCAB = 128
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
AOT_EAGER = {"backend": "aot_eager"}  # dynamo + AOTAutograd, the graphs inductor would get, without code generation
STEPS = ([5, 9, 3], [7, 11, 4, 6])  # new token and document counts: the second step reuses the dynamic graphs
VARIANTS = {"nf4": dict(bnb_4bit_quant_type="nf4"), "nf4-nested": dict(bnb_4bit_quant_type="nf4",
                                                                          bnb_4bit_use_double_quant=True),
            "fp4": dict(bnb_4bit_quant_type="fp4")}


@pytest.fixture(scope="module")
def saved_llama(tmp_path_factory):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False)
    folder = tmp_path_factory.mktemp("qlora-llama")
    LlamaForCausalLM(config).to(torch.bfloat16).save_pretrained(folder)
    return folder




def qlora(folder, variant: str = "nf4", compute: torch.dtype = torch.bfloat16, kbit: bool = True,
          keep_base_dtype: bool = False):
    """The 4-bit base from `folder`, PEFT's kbit preparation (fp32 norms / embeddings / head, non-reentrant
    checkpointing) unless `kbit` is False (`keep_base_dtype`: those weights back in bf16 after it, as hf-accel sft
    --keep-base-dtype does), LoRA r=4 on every linear with random B (seeded, so every copy is equal)."""
    from peft import LoraConfig, get_peft_model, prepare_model_for_kbit_training
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    quant = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_compute_dtype=compute, **VARIANTS[variant])
    model = AutoModelForCausalLM.from_pretrained(folder, quantization_config=quant, dtype=torch.bfloat16,
                                                 attn_implementation="sdpa", device_map={"": "cpu"})
    model.config.use_cache = False
    if kbit:
        model = prepare_model_for_kbit_training(model, use_gradient_checkpointing=True,
                                                gradient_checkpointing_kwargs={"use_reentrant": False})
    if keep_base_dtype:
        from hf_accel.cli.quantized import unquantized_weights_to

        assert unquantized_weights_to(model, torch.bfloat16) > 0
    torch.manual_seed(1)
    config = LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=TARGETS, init_lora_weights=False)
    return get_peft_model(model, config).train()


def packed(lengths: list[int], seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, VOCAB, (1, sum(lengths)), generator=g)
    pos = torch.cat([torch.arange(n) for n in lengths])[None]
    return dict(input_ids=ids, position_ids=pos, labels=ids.masked_fill(pos == 0, -100))


def step(model, batch, autocast: bool) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    model.zero_grad(set_to_none=True)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        loss = model(**batch).loss
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def assert_close_steps(ours, ref, autocast: bool, loss_rtol: float, grad_rtol: float) -> None:
    for seed, lengths in enumerate(STEPS):
        loss, grads = step(ours, packed(lengths, seed), autocast)
        ref_loss, ref_grads = step(ref, packed(lengths, seed), autocast)
        assert abs(loss - ref_loss) <= loss_rtol * abs(ref_loss), (seed, loss, ref_loss)
        assert grads.keys() == ref_grads.keys() and all("lora_" in n for n in grads) and len(grads) == 2 * 2 * 7
        for name, g in ref_grads.items():
            err = ((grads[name] - g).abs().max() / g.abs().max().clamp_min(1e-12)).item()
            assert err <= grad_rtol, (seed, name, err)


def test_the_cpu_backend_quantizes_and_peft_wraps_every_linear(saved_llama):
    model = qlora(saved_llama)
    base = [m for m in model.modules() if isinstance(m, bnb.nn.Linear4bit)]
    lora = [m for m in model.modules() if type(m).__module__ == "peft.tuners.lora.bnb"]
    assert len(base) == len(lora) == 2 * len(TARGETS)
    assert all(m.weight.dtype == torch.uint8 and m.weight.quant_state.quant_type == "nf4" for m in base)


@pytest.mark.parametrize("variant", ["nf4", pytest.param("nf4-nested", marks=pytest.mark.slow),
                                     pytest.param("fp4", marks=pytest.mark.slow)])
def test_compiled_patched_qlora_matches_unpatched_peft(saved_llama, variant):
    """fp32 compute, so only summation order separates the patched, compiled model (hf_accel's reference attention,
    checkpointed layers through compiled bodies) from PEFT's QLoRA model on transformers' sdpa."""
    ref = qlora(saved_llama, variant, compute=torch.float32)
    ours = qlora(saved_llama, variant, compute=torch.float32)
    report = hf_accel.patch(ours, backend="reference", compile=AOT_EAGER)
    assert report.compiled_layers == 2 and all(layer.gradient_checkpointing for layer in compiled_layers(ours))
    assert_close_steps(ours, ref, autocast=False, loss_rtol=1e-5, grad_rtol=1e-4)
    # the layers ran through captured graphs, broken at the attention seam only: bitsandbytes' matmul and
    # dequantize stayed ops inside them
    assert counters["stats"]["unique_graphs"] > 0
    assert counters["graph_break"] and all("hf_accel_attention" in r for r in counters["graph_break"])


def test_compiled_matches_eager_under_bf16_autocast_and_unpatch_restores_the_model(saved_llama):
    eager = qlora(saved_llama)
    compiled = qlora(saved_llama)
    before = {n: p.data.clone() for n, p in compiled.named_parameters()}
    hf_accel.patch(eager, backend="reference", compile=False)
    hf_accel.patch(compiled, backend="reference", compile=AOT_EAGER)
    assert_close_steps(compiled, eager, autocast=True, loss_rtol=1e-6, grad_rtol=1e-5)
    assert counters["stats"]["unique_graphs"] > 0
    assert not compiled_layers(copy.deepcopy(compiled))  # a copy (reference model, EMA) gets eager layers
    hf_accel.unpatch(compiled)
    assert not compiled_layers(compiled) and not any("_cast_input_dtype" in m.__dict__ for m in compiled.modules())
    frozen = [n for n, p in compiled.named_parameters() if not p.requires_grad]
    assert frozen and all(torch.equal(compiled.get_parameter(n).data, before[n]) for n in frozen)


@pytest.mark.parametrize("kbit", [True, False])
def test_lora_cast_skip_on_4bit_layers_is_bit_identical(saved_llama, kbit):
    """Under CPU autocast PEFT's 4-bit LoRA layers cast their input to the fp32 adapter's dtype (their forward checks
    CUDA autocast only): a round trip the skip drops. Without kbit preparation the layers' inputs are bf16 and the
    skip saves copies; with it they are fp32 and there is nothing to skip. Either way: the same bits."""
    model = qlora(saved_llama, kbit=kbit)
    report = hf_accel.patch(model, backend="reference")
    layers = [m for m in model.modules() if type(m).__module__ == "peft.tuners.lora.bnb"]
    assert layers and all("_cast_input_dtype" in m.__dict__ for m in layers)
    assert not any(n.startswith("LoRA cast skip") for n in report.notes), report.notes
    from test_lora_casts import Fp32Copies

    results = []
    for bound in (True, False):
        if not bound:
            lora_casts.unbind(model.get_base_model())
        counter = Fp32Copies()
        with counter:
            results.append((*step(model, packed([6, 9, 4], 0), autocast=True), counter.count))
    (loss, grads, copies), (ref_loss, ref_grads, ref_copies) = results
    assert torch.equal(loss, ref_loss) and grads.keys() == ref_grads.keys()
    assert all(torch.equal(grads[n], ref_grads[n]) for n in grads)
    assert copies < ref_copies if not kbit else copies <= ref_copies


def test_auto_speedups_with_a_4bit_base_and_stand_down_on_8bit(saved_llama):
    from hf_accel.attention.kernels import DeviceInfo
    from hf_accel.patching import resolve_speedups

    h200 = DeviceInfo("cuda", (9, 0))
    model = qlora(saved_llama).get_base_model()
    got = resolve_speedups(model, h200, liger_installed=True)
    assert all(s.on for s in got.values()), got  # fused loss, fused ops, compiled layers
    model.model.layers[0].mlp.down_proj = bnb.nn.Linear8bitLt(128, 64, has_fp16_weights=False)
    compile_ = resolve_speedups(model, h200, liger_installed=True)["compile"]
    assert not compile_.on and "Linear8bitLt layers" in compile_.why and "4-bit" in compile_.why


# ---- the defaults' checkpoint storage for a 4-bit base (hf_accel.memory.defaults): the choice is made for CUDA (a
# faked device); the offload it chooses runs on the CPU here, where its "host" copies are plain copies
H200 = DeviceInfo("cuda", (9, 0))


def test_the_defaults_offload_a_4bit_base_s_checkpointed_inputs_with_the_same_bits(saved_llama):
    from hf_accel.memory.checkpointing import OffloadedCheckpointing, applied_policy
    from hf_accel.memory.defaults import checkpoint_default

    ref = qlora(saved_llama, compute=torch.float32)
    ours = qlora(saved_llama, compute=torch.float32)
    storage = checkpoint_default(ours, H200, base_4bit=True, output_projections=("mlp.down_proj",),
                                 host_free=8 << 30, processes=2)
    policy = storage.policy
    assert isinstance(policy, OffloadedCheckpointing) and not policy.explicit and policy.host_limit == 2 << 30
    assert "auto: a 4-bit base" in storage.describe() and "2 processes" in storage.describe()
    policy.apply(ours)
    assert applied_policy(ours) is policy
    for seed, lengths in enumerate(STEPS):
        loss, grads = step(ours, packed(lengths, seed), autocast=False)
        ref_loss, ref_grads = step(ref, packed(lengths, seed), autocast=False)
        assert torch.equal(loss, ref_loss) and grads.keys() == ref_grads.keys() and grads
        assert all(torch.equal(grads[n], ref_grads[n]) for n in grads)
    assert policy.offloader.stats.packed == 2 * len(STEPS)  # every layer's input, every step


def test_off_cuda_the_defaults_trim_a_4bit_base_s_recompute_with_the_same_bits(saved_llama, monkeypatch):
    """On the CPU the defaults keep the checkpointed inputs on the device and take over the model's checkpointing to
    trim its recompute (memory.trim): each layer's recompute skips the frozen 4-bit down_proj matmul. The skipped
    outputs are NaN here, so any use of them would show; the steps equal, bit for bit, those of the same patch with
    the untrimmed recompute, and stay within summation order of PEFT's unpatched QLoRA model."""
    from hf_accel.memory import trim
    from hf_accel.memory.checkpointing import FullCheckpointing, applied_policy
    from hf_accel.patching import checkpoint_default

    monkeypatch.setattr(trim, "FILL", float("nan"))
    ref = qlora(saved_llama, compute=torch.float32)
    untrimmed = qlora(saved_llama, compute=torch.float32)
    ours = qlora(saved_llama, compute=torch.float32)
    default = checkpoint_default(ours)
    assert isinstance(default.policy, FullCheckpointing) and "mlp.down_proj" in default.why, default
    report = hf_accel.patch(ours, backend="reference", compile=False)
    assert isinstance(applied_policy(ours), FullCheckpointing) and "skips the mlp.down_proj" in report.checkpointing
    hf_accel.patch(untrimmed, backend="reference", compile=False, checkpointing=FullCheckpointing(trim_recompute=False))
    for seed, lengths in enumerate(STEPS):
        skipped = trim.STATS.skipped
        loss, grads = step(ours, packed(lengths, seed), autocast=False)
        assert trim.STATS.skipped - skipped == 2  # one 4-bit down_proj per layer, in its recompute
        plain_loss, plain_grads = step(untrimmed, packed(lengths, seed), autocast=False)
        assert torch.equal(loss, plain_loss) and grads.keys() == plain_grads.keys() and grads
        assert all(torch.equal(grads[n], plain_grads[n]) for n in grads)
        ref_loss, ref_grads = step(ref, packed(lengths, seed), autocast=False)
        assert abs(loss - ref_loss) <= 1e-5 * abs(ref_loss)
        for name, g in ref_grads.items():
            assert ((grads[name] - g).abs().max() / g.abs().max()).item() <= 1e-4, name


def test_a_long_context_plan_s_chunked_mlps_with_a_hook_in_forward_only(saved_llama):
    """The 344k-token QLoRA step's plan on the GPU (offloaded and spaced layers, chunked MLPs, trimmed recompute)
    failed in backward with torch's CheckpointError: a chunk's forward ran bitsandbytes' stock forward (which keeps
    the 4-bit weight on its context, unseen by checkpointing) and its recompute the bound trimmed one (which saves
    it). A forward under a global hook, gone before backward, made that sequence on the CPU: it stopped the trim
    before binding, and a later call bound it. The step now equals one without the hook, bit for bit."""
    from hf_accel.memory.checkpointing import PerLayer

    def model():
        m = qlora(saved_llama, compute=torch.float32)
        hf_accel.patch(m, backend="reference", compile=False, checkpointing=PerLayer(choices=["offload", "spaced"]),
                       mlp_chunks=4)
        return m

    from tiny_models import loss_and_grads, loss_and_grads_hook_in_forward

    batch = packed([5, 9, 3], 0)
    loss, grads = loss_and_grads_hook_in_forward(model(), batch)
    ref_loss, ref_grads = loss_and_grads(model(), batch)
    assert loss == ref_loss and grads.keys() == ref_grads.keys() and grads
    assert all(torch.equal(grads[n], ref_grads[n]) for n in grads)


@pytest.mark.parametrize("case", ["not 4-bit", "no checkpointing", "context_fn", "hf_accel policy", "reentrant"])
def test_where_the_defaults_keep_the_model_s_checkpointing(saved_llama, case):
    import functools

    from torch.utils.checkpoint import checkpoint

    from hf_accel.memory.checkpointing import policy_from_spec
    from hf_accel.memory.defaults import checkpoint_default
    from hf_accel.memory.targets import decoder_layers

    model = qlora(saved_llama, kbit=case != "no checkpointing")
    if case == "context_fn":  # a selective checkpoint of the user's own
        for layer in decoder_layers(model):
            layer._gradient_checkpointing_func = functools.partial(checkpoint, use_reentrant=False,
                                                                   context_fn=lambda: None)
    if case == "hf_accel policy":
        policy_from_spec("every_2").apply(model)
    if case == "reentrant":  # prepare_model_for_kbit_training's own default: the same gradients, so offload too
        model.get_base_model().gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": True})
    storage = checkpoint_default(model, H200, base_4bit=case != "not 4-bit", output_projections=(),
                                 host_free=1 << 30)
    why = {"not 4-bit": "no output projection a recompute may skip",
           "no checkpointing": "does not checkpoint every decoder layer",
           "context_fn": "a function or options of their own", "hf_accel policy": "an hf_accel checkpointing policy",
           "reentrant": None}[case]
    assert (storage.policy is None) == (why is not None) and (why is None or why in storage.why), storage


def test_hf_accel_trainer_offloads_the_checkpointing_train_turns_on(saved_llama, tmp_path, monkeypatch):
    """The model has no checkpointing when the Trainer patches it; TrainingArguments(gradient_checkpointing=True)
    turns it on in train(), and the Trainer then applies the defaults' choice (on a faked CUDA device). The trained
    adapters are those of a run that keeps the model's own checkpointing, bit for bit."""
    import transformers

    import hf_accel.patching
    from hf_accel.memory.checkpointing import OffloadedCheckpointing, applied_policy

    real = hf_accel.patching.checkpoint_default
    monkeypatch.setattr(hf_accel.patching, "checkpoint_default", lambda model, device=None: real(model, H200))
    g = torch.Generator().manual_seed(0)
    data = [{"input_ids": torch.randint(1, VOCAB, (n,), generator=g).tolist()} for n in (9, 14, 6, 11, 8, 12)]
    trained = {}
    for checkpointing in (None, "full"):
        model = qlora(saved_llama, compute=torch.float32, kbit=False)
        args = transformers.TrainingArguments(
            output_dir=str(tmp_path / str(checkpointing)), max_steps=2, per_device_train_batch_size=3,
            gradient_checkpointing=True, gradient_checkpointing_kwargs={"use_reentrant": False}, use_cpu=True,
            report_to="none", save_strategy="no", disable_tqdm=True, seed=0, optim="sgd", learning_rate=0.05,
            lr_scheduler_type="constant", dataloader_num_workers=0, train_sampling_strategy="sequential")
        trainer = hf_accel.Trainer(model=model, args=args, train_dataset=data, accel=hf_accel.AccelArguments(
            backend="reference", checkpointing=checkpointing, print_summary=False))
        assert checkpointing is None or trainer.patch_report.checkpointing.startswith("full")
        assert checkpointing is not None or trainer.patch_report.checkpointing is None  # nothing to take over yet
        trainer.train()
        policy = applied_policy(model)
        if checkpointing is None:
            assert isinstance(policy, OffloadedCheckpointing) and policy.offloader.stats.packed == 2 * 2
            assert "auto: a 4-bit base" in trainer.patch_report.checkpointing
        trained[checkpointing] = {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
    assert trained[None].keys() == trained["full"].keys() and trained[None]
    assert all(torch.equal(trained[None][n], trained["full"][n]) for n in trained[None])


def test_an_evaluation_before_training_leaves_the_gradients_unchanged(saved_llama):
    """bitsandbytes' Linear4bit repacks its weight for a CPU inference kernel (without a backward) the first time it
    runs in eval mode without gradients, on a CPU with AVX512-BF16. patch() turns that off, so a model evaluated (a
    generate()) before training trains as a copy that never was; unpatch() gives the layers their flag back, and a
    weight repacked before patch() is refused. (On a CPU without AVX512-BF16 bitsandbytes never repacks, and the
    comparison holds either way.)"""
    from hf_accel.errors import ConfigurationError
    from hf_accel.fused.quantized import CPU_PACKING_FLAG

    evaluated, ref = qlora(saved_llama, compute=torch.float32), qlora(saved_llama, compute=torch.float32)
    flags = {m: getattr(m, CPU_PACKING_FLAG, False) for m in evaluated.modules() if isinstance(m, bnb.nn.Linear4bit)}
    report = hf_accel.patch(evaluated, backend="reference", compile=False)
    hf_accel.patch(ref, backend="reference", compile=False)
    assert any(flags.values()) == any("CPU inference repacking off" in n for n in report.notes)
    evaluated.eval()
    with torch.no_grad():
        evaluated.generate(input_ids=torch.tensor([[5, 7, 9]]), max_new_tokens=3, do_sample=False, pad_token_id=0)
    evaluated.train()
    for seed, lengths in enumerate(STEPS):
        loss, grads = step(evaluated, packed(lengths, seed), autocast=False)
        ref_loss, ref_grads = step(ref, packed(lengths, seed), autocast=False)
        assert torch.equal(loss, ref_loss) and grads.keys() == ref_grads.keys()
        assert all(torch.equal(grads[n], ref_grads[n]) for n in grads), seed
    hf_accel.unpatch(evaluated)
    assert all(getattr(m, CPU_PACKING_FLAG, False) == flag for m, flag in flags.items())

    if not any(flags.values()):
        return
    repacked = qlora(saved_llama, compute=torch.float32).eval()
    last = [m for m in repacked.modules() if isinstance(m, bnb.nn.Linear4bit)][-1]
    with torch.no_grad():
        last(torch.randn(3, last.in_features))  # one layer repacked, the last one patch() meets
    with pytest.raises(ConfigurationError, match="repacked this 4-bit weight for CPU inference"):
        hf_accel.patch(repacked, backend="reference", compile=False)
    assert hf_accel.patch_report(repacked) is None  # nothing of the patch stays bound
    assert all(getattr(m, CPU_PACKING_FLAG) for m in repacked.modules() if isinstance(m, bnb.nn.Linear4bit))


@pytest.mark.parametrize("variant, keep", [("nf4", False), ("nf4-nested", False), ("nf4", True)],
                         ids=["nf4", "nf4-nested", "nf4-kept-bf16"])
def test_the_memory_estimate_counts_a_4bit_base_s_bytes(saved_llama, variant, keep):
    """estimate_training_memory(base_4bit=True): the weights' bytes are what the prepared QLoRA model holds, counted
    on the real model (bitsandbytes' packed weights and their quantization statistics, the fp32 weights the kbit
    preparation leaves or, keep_base_dtype, those weights back in bf16; the fp32 adapters)."""
    from hf_accel.memory.estimate import estimate_training_memory

    model = qlora(saved_llama, variant, keep_base_dtype=keep)
    held, seen = 0, set()
    for p in model.parameters():
        if id(p) not in seen:
            seen.add(id(p))
            held += p.numel() * p.element_size()
    for m in model.modules():
        if isinstance(m, bnb.nn.Linear4bit):
            state = m.weight.quant_state
            tensors = [state.absmax, state.code] + ([state.state2.absmax, state.state2.code, state.offset]
                                                    if state.nested else [])
            held += sum(t.numel() * t.element_size() for t in tensors)
    estimate = estimate_training_memory(model.config, lora_rank=4, lora_targets=TARGETS, base_4bit=True,
                                        nested_quant=variant == "nf4-nested", keep_base_dtype=keep)
    assert estimate.param_bytes == held
    assert estimate.trainable_params == sum(p.numel() for p in model.parameters() if p.requires_grad)


def test_the_memory_estimate_of_8b_qlora_weights_and_refusals():
    from hf_accel.errors import ConfigurationError
    from hf_accel.memory.estimate import estimate_training_memory

    bf16 = estimate_training_memory("llama-3-8b", lora_rank=16)
    nf4 = estimate_training_memory("llama-3-8b", lora_rank=16, base_4bit=True)
    nested = estimate_training_memory("llama-3-8b", lora_rank=16, base_4bit=True, nested_quant=True)
    # 6.98e9 linear weights at ~0.56 bytes, 1.05e9 embedding and head weights in fp32, 42M fp32 adapters
    assert 7.3 * 2**30 < nested.param_bytes < nf4.param_bytes < 7.9 * 2**30 < 15 * 2**30 < bf16.param_bytes
    with pytest.raises(ConfigurationError, match="pass lora_rank"):
        estimate_training_memory("llama-3-8b", base_4bit=True)
    with pytest.raises(ConfigurationError, match="base_4bit=True"):
        estimate_training_memory("llama-3-8b", lora_rank=16, nested_quant=True)
    with pytest.raises(ConfigurationError, match="base_4bit=True"):
        estimate_training_memory("llama-3-8b", lora_rank=16, keep_base_dtype=True)


@pytest.mark.parametrize("autocast, keep", [(False, False), (True, False), (True, True)],
                         ids=["fp32", "bf16-autocast", "bf16-kept"])
def test_the_memory_estimate_bounds_a_4bit_base_s_activations(saved_llama, autocast, keep):
    """Per decoder layer, what the estimate counts for a 4-bit base (fp32, as the kbit preparation leaves the residual
    stream; bf16 where its other weights are kept in bf16) against what autograd saves on the real prepared model
    (the probe): a checkpointed layer's input exactly, and never less than what it saves without checkpointing or at
    op level, computing in fp32 or under bf16 autocast."""
    from hf_accel.memory.estimate import estimate_training_memory
    from hf_accel.memory.plan import probe_layer_activations

    model = qlora(saved_llama, compute=torch.bfloat16 if autocast else torch.float32, keep_base_dtype=keep)
    tokens = 96
    ids = torch.randint(1, VOCAB, (1, tokens), generator=torch.Generator().manual_seed(0))
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        measured = probe_layer_activations(model, {"input_ids": ids, "labels": ids})[1]  # layer 0 holds rotary tables
    estimate = estimate_training_memory(model.config, lora_rank=4, lora_targets=TARGETS, base_4bit=True,
                                        keep_base_dtype=keep, batch_tokens=tokens).layer
    element = 2 if keep else 4
    assert estimate.retained("full") == measured.retained("full") == tokens * model.config.hidden_size * element
    # in 16 bits the op-level count is looser (2.56x here: it counts the bf16 LoRA formula's saved tensors)
    loosest = 2.6 if keep else 1.9
    for choice in ("none", "op"):
        assert measured.retained(choice) <= estimate.retained(choice) <= loosest * measured.retained(choice), choice


@pytest.mark.parametrize("trainer", ["trl", "hf_accel"])
def test_trl_s_sft_trainer_casts_a_quantized_model_s_adapters_to_bf16(saved_llama, tmp_path, trainer):
    """What docs/qlora.md says of the bench's TRL QLoRA row and of hf_accel.SFTTrainer: TRL's SFTTrainer (and so
    hf_accel's, its subclass), built on PEFT's QLoRA model, turns its fp32 adapters into bf16 ones (hf_accel's bench
    rows and Trainer keep PEFT's fp32). If TRL stops doing so, the docs and the row's description change with it."""
    pytest.importorskip("trl", reason="needs trl (pip install 'hf_accel[trl]')")
    from datasets import Dataset
    from trl import SFTConfig

    from hf_accel.data.default_task import build_tokenizer

    if trainer == "trl":
        from trl import SFTTrainer
    else:
        from hf_accel import SFTTrainer
    model = qlora(saved_llama)
    assert {p.dtype for p in model.parameters() if p.requires_grad} == {torch.float32}
    rows = Dataset.from_dict({"input_ids": [[1, 2, 3, 4, 5]] * 4})
    SFTTrainer(model=model, train_dataset=rows, processing_class=build_tokenizer(),
               args=SFTConfig(output_dir=str(tmp_path), use_cpu=True, report_to="none", max_steps=1))
    assert {p.dtype for p in model.parameters() if p.requires_grad} == {torch.bfloat16}


# ---- hf_accel's QLoRA recipe (issue 70, docs/qlora.md): the 4-bit base as loaded, no PEFT kbit preparation -------
BF16_EPS = 2.0**-8  # bf16's relative rounding step
# How far the recipe (bf16 norms, embeddings, LM head, so a bf16 residual stream) may sit from PEFT's QLoRA computed
# in fp32, against how far PEFT's own QLoRA computed in bf16 sits from it (flash-attn's rule: a multiple of the
# low-precision baseline's own error). Measured on these shapes (2026-12-07, CPU, bitsandbytes 0.50.2): LoRA
# gradients up to 1.96x PEFT's bf16 error, losses up to 1.5e-4 relative (PEFT's bf16: up to 6.4e-5).
RECIPE_GRAD_FACTOR = 3.0
RECIPE_LOSS_RTOL = BF16_EPS / 16


def _rel(ours: tuple, ref: tuple) -> tuple[float, float]:
    """(loss, worst LoRA gradient) relative errors of step results `ours` against `ref`."""
    (loss, grads), (ref_loss, ref_grads) = ours, ref
    assert grads.keys() == ref_grads.keys() and grads
    worst = max(((grads[n] - g).abs().max() / g.abs().max().clamp_min(1e-12)).item() for n, g in ref_grads.items())
    return abs(loss - ref_loss).item() / abs(ref_loss).item(), worst


def test_the_recipe_trains_within_bf16_error_of_peft_s_own_qlora(saved_llama):
    """hf_accel's recipe (the NF4 base as loaded: norms, embeddings and LM head bf16) and the same model patched, under
    bf16 autocast, against PEFT's QLoRA (prepare_model_for_kbit_training: those weights fp32) computed in fp32: their
    losses and LoRA gradients are as close to it as PEFT's own QLoRA under bf16 autocast is (RECIPE_GRAD_FACTOR times
    its gradient error, losses within RECIPE_LOSS_RTOL). The recipe is a different model than PEFT's by bf16 rounding
    of those weights and of the residual stream, nothing more."""
    ref = qlora(saved_llama, compute=torch.float32)
    peft_bf16 = qlora(saved_llama)
    recipe = qlora(saved_llama, kbit=False)
    patched = qlora(saved_llama, kbit=False)
    hf_accel.patch(patched, backend="reference", compile=False)
    assert {p.dtype for n, p in recipe.named_parameters() if "lora_" not in n and p.is_floating_point()} == \
        {torch.bfloat16}
    for seed, lengths in enumerate((*STEPS, [30, 20, 50, 12])):
        batch = packed(lengths, seed)
        want = step(ref, batch, autocast=False)
        _, baseline = _rel(step(peft_bf16, batch, autocast=True), want)
        for model in (recipe, patched):
            loss_err, grad_err = _rel(step(model, batch, autocast=True), want)
            assert loss_err <= RECIPE_LOSS_RTOL, (seed, loss_err)
            assert grad_err <= RECIPE_GRAD_FACTOR * baseline, (seed, grad_err, baseline)


@pytest.mark.parametrize("peft_kbit", [False, True], ids=["recipe", "peft-kbit-preparation"])
def test_the_command_prepares_a_4bit_base_as_the_recipe_unless_asked_for_peft_s(saved_llama, peft_kbit):
    """`hf-accel sft --load-in-4bit` (hf_accel.cli.quantized.prepare_quantized): the base frozen, every layer
    checkpointed, its weights that are not 4-bit left bf16 as loaded (hf_accel's recipe: issue 70 measured it faster
    and smaller than PEFT's), or fp32 through PEFT's prepare_model_for_kbit_training when asked for
    (args.peft_kbit_preparation)."""
    import argparse

    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    from hf_accel.cli.quantized import prepare_quantized

    quant = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_compute_dtype=torch.bfloat16, bnb_4bit_quant_type="nf4")
    model = AutoModelForCausalLM.from_pretrained(saved_llama, quantization_config=quant, dtype=torch.bfloat16,
                                                 device_map={"": "cpu"})
    args = argparse.Namespace(checkpointing=None, keep_base_dtype=False, peft_kbit_preparation=peft_kbit)
    model = prepare_quantized(model, args)
    floating = {p.dtype for p in model.parameters() if p.is_floating_point()}
    assert floating == {torch.float32 if peft_kbit else torch.bfloat16}, floating
    assert not any(p.requires_grad for p in model.parameters())
    assert all(layer.gradient_checkpointing for layer in model.model.layers)
    args.checkpointing = "full"  # the command's own choice: the model's checkpointing is left off
    fresh = AutoModelForCausalLM.from_pretrained(saved_llama, quantization_config=quant, dtype=torch.bfloat16,
                                                 device_map={"": "cpu"})
    assert not any(layer.gradient_checkpointing for layer in prepare_quantized(fresh, args).model.layers)
