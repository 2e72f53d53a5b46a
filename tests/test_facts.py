"""A family's facts found from the model (hf_accel.facts), each against a live reference: PEFT's own "all-linear"
for the LoRA targets, a perturbation of each projection's output for the projections only the residual reads, the
same probe on real tensors for the bytes the fake-tensor forward counts, the configs for what each attention call
asks, and what each norm computes for the kinds liger may take over. Where the probe forward cannot run, the seam
still serves the model, and says what it left off."""
from __future__ import annotations

import pytest
import torch
from torch import nn

import hf_accel
from hf_accel.facts import probe as facts_probe
from hf_accel.facts.fusable import fusable_modules, module_kind
from hf_accel.patches import family_of
from tiny_models import FAMILIES_2026, VARIANTS, make, slow_2026

pytestmark = pytest.mark.usefixtures("one_torch_thread")

GENERIC = sorted(name for name in VARIANTS if not name.startswith("falcon"))  # Falcon's family is typed by hand


@pytest.mark.parametrize("name", GENERIC)
def test_lora_targets_are_what_peft_all_linear_adapts(name):
    """PEFT's target_modules="all-linear" (every linear but the output layer) adapts every module the found targets
    name; the targets are exactly the model's plain linear maps but its LM head (a linear subclass with a forward of
    its own, Llama 4's router, is left out: LoRA's wrapper would take its tuple for a tensor)."""
    from peft import LoraConfig, get_peft_model

    model = make(name)
    targets = set(family_of(model).lora_targets)
    head = model.get_output_embeddings()
    plain = {n.rsplit(".", 1)[-1] for n, m in model.named_modules() if facts_probe._is_linear(m) and m is not head}
    peft_model = get_peft_model(make(name), LoraConfig(r=2, target_modules="all-linear"))
    adapted = {n.rsplit(".", 1)[-1] for n, m in peft_model.named_modules() if hasattr(m, "lora_A")}
    assert targets and targets == plain and targets <= adapted


@pytest.mark.parametrize("name", slow_2026(GENERIC))
def test_output_projections_are_those_whose_output_reaches_only_the_layer_output(name):
    """A projection qualifies when a change of its output moves the layer's output by exactly that change (it feeds
    the residual sum and nothing else) and nothing writes into its output in place (a trimmed recompute's skipped
    matmul would hand the writer its fill: Llama 4's shared expert, out.add_(routed)): checked by adding a random
    tensor to each linear's output in the last decoder layer of a real forward (a constant would pass unseen through
    a LayerNorm), and by the output's version counter."""
    model = make(name).float()
    found = set(family_of(model).output_projections(model.config))
    layer = facts_probe.decoder_layers(model)[-1]
    ids = torch.randint(1, 96, (1, 9), generator=torch.Generator().manual_seed(0))

    def layer_output(path: str | None, delta: torch.Tensor | None) -> torch.Tensor:
        got = []
        hooks = [layer.register_forward_hook(lambda m, a, out: got.append(out[0] if isinstance(out, tuple) else out))]
        if path is not None:
            hooks.append(layer.get_submodule(path).register_forward_hook(lambda m, a, out: out + delta))
        try:
            with torch.no_grad():
                model(input_ids=ids)
        finally:
            for hook in hooks:
                hook.remove()
        return got[0]

    base = layer_output(None, None)
    outputs = {}
    def keep(path):
        def hook(module, args, out):
            outputs.setdefault(path, (out, out._version))
        return hook

    hooks = [m.register_forward_hook(keep(p)) for p, m in layer.named_modules() if isinstance(m, nn.Linear)
             and facts_probe._is_linear(m)]
    layer_output(None, None)
    for hook in hooks:
        hook.remove()
    written = {p for p, (out, version) in outputs.items() if out._version != version}
    qualifies = set()
    for path, module in layer.named_modules():
        if isinstance(module, nn.Linear) and facts_probe._is_linear(module) and module.out_features == base.shape[-1]:
            delta = torch.randn(module.out_features, generator=torch.Generator().manual_seed(1))
            if torch.allclose(layer_output(path, delta) - base, delta.expand_as(base), atol=1e-5):
                qualifies.add(path)
    assert found == qualifies - written


def _real_per_token(model: nn.Module, dtype: torch.dtype) -> list[tuple[float, float, float]]:
    """(none, op, full) bytes per token of each decoder layer, saved-tensor probe on real tensors (two lengths), with
    the probe's flash-like attention (it saves q, k, v, out and the log-sum-exp)."""
    from hf_accel.memory.plan import probe_training_memory
    from hf_accel.memory.targets import default_save_ops

    facts_probe.register()
    save_ops = default_save_ops() | {torch.ops.hf_accel.probe_attention}  # kept by op-level checkpointing, as a
    # flash kernel's output is (kernels.SAVEABLE_OPS)
    model = model.to(dtype).train()
    model.config._attn_implementation_internal = facts_probe.PROBE_NAME
    figures = []
    for tokens in facts_probe.TOKENS:
        ids = torch.randint(1, 96, (1, tokens), generator=torch.Generator().manual_seed(0))
        figures.append(probe_training_memory(model, {"input_ids": ids}, save_ops=save_ops, backward=False,
                                             every_layer=True).layers)
    span = facts_probe.TOKENS[1] - facts_probe.TOKENS[0]
    return [tuple((getattr(b, f) - getattr(a, f)) / span for f in ("none_bytes", "op_bytes", "full_bytes"))
            for a, b in zip(*figures)]


@pytest.mark.parametrize("name", slow_2026(GENERIC))
def test_fake_tensor_probe_counts_what_real_tensors_save(name):
    """The bytes the fake-tensor forward finds per layer and token are what the budget planner's probe measures on
    real tensors of the same model (fp32 here; the same ops)."""
    model = make(name)
    probed = facts_probe.probe_config(type(model), model.config, torch.float32)
    real = _real_per_token(model, torch.float32)
    fake = [(s.none, s.op, s.full) for s in probed.layers]
    assert len(fake) == len(real)
    for layer, (got, want) in enumerate(zip(fake, real)):
        assert got == pytest.approx(want, rel=0.02), (layer, got, want)


def test_each_call_is_read_as_the_config_asks():
    """Windows, soft-caps, sinks, chunks and per-layer head dims found from the calls, against the configs."""
    expect = {
        "gemma2-softcap": {0: dict(window=4, softcap=1.0), 1: dict(window=None, softcap=1.0)},
        "gpt-oss": {0: dict(window=4, sinks=True), 1: dict(window=None, sinks=True)},
        "llama4-text": {0: dict(chunk=4), 1: dict(chunk=None)},
        "gemma4-text": {i: dict(window=None if i % 2 else 4, heads=(4, 1, 32) if i % 2 else None) for i in range(4)},
        "mistral-window": {0: dict(window=4), 1: dict(window=4)},
        "qwen3.5-text": {1: dict(window=None)},  # layer 0 is linear attention: no call
    }
    for name, layers in expect.items():
        model = make(name)
        found = family_of(model).layer_attentions(model.config)
        assert set(found) == set(layers), name
        for index, fields in layers.items():
            for field, value in fields.items():
                assert getattr(found[index], field) == value, (name, index, field)


def test_the_norms_and_mlps_liger_may_replace_are_found_by_what_they_compute():
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    kinds = {name: {type(m).__name__: k for _, m, k in fusable_modules(make(name))}
             for name in ("llama-gqa", "gemma2-softcap", "olmo2", "phi3", "qwen3.5-text", "neox-parallel")}
    assert kinds["llama-gqa"] == {"LlamaRMSNorm": "rms_norm", "LlamaMLP": "swiglu"}
    assert kinds["gemma2-softcap"] == {"Gemma2RMSNorm": "rms_norm_gemma", "Gemma2MLP": "geglu"}
    assert kinds["olmo2"]["Olmo2RMSNorm"] == "rms_norm_fp32"  # the weight applied in fp32
    assert "Phi3MLP" not in kinds["phi3"]  # fused gate_up_proj: not liger's SwiGLU module
    assert "Qwen3_5RMSNormGated" not in kinds["qwen3.5-text"]  # a gated norm of two inputs
    assert kinds["neox-parallel"] == {"LayerNorm": "layer_norm"}

    class ScaledRMSNorm(LlamaRMSNorm):  # an unknown variant: never bound
        def forward(self, hidden_states):
            return 2 * super().forward(hidden_states)

    assert module_kind(LlamaRMSNorm(16)) == "rms_norm" and module_kind(ScaledRMSNorm(16)) is None


def test_a_model_whose_probe_forward_fails_is_still_served_by_the_seam(monkeypatch):
    """Where a forward on fake tensors cannot run, every call still reads its asks: the patched model computes what
    the unpatched one does (padded and packed), the report says what was left off, and the memory estimate refuses
    with the reason."""
    import copy

    from hf_accel.errors import ConfigurationError

    def fail(*args, **kwargs):
        raise RuntimeError("data-dependent shape")

    monkeypatch.setattr("hf_accel.facts.probe_config", fail)
    monkeypatch.setattr("hf_accel.facts._PROBES", {})
    ref = make("gemma4-text")
    ours = copy.deepcopy(ref)
    report = hf_accel.patch(ours)
    assert any("probe forward failed" in note for note in report.notes)
    ids = torch.randint(1, 96, (1, 14), generator=torch.Generator().manual_seed(0))
    pos = torch.cat([torch.arange(6), torch.arange(8)])[None]
    torch.testing.assert_close(ours(input_ids=ids, position_ids=pos).logits, ref(input_ids=ids, position_ids=pos).logits)
    alone = torch.cat([ref(input_ids=ids[:, :6]).logits, ref(input_ids=ids[:, 6:]).logits], dim=1)
    torch.testing.assert_close(ours(input_ids=ids, position_ids=pos).logits, alone, rtol=1e-4, atol=1e-5)
    with pytest.raises(ConfigurationError, match="needs its probe forward"):
        family_of(ours).layer_bytes(ours.config, 4)


@pytest.mark.parametrize("name", sorted(FAMILIES_2026))
def test_every_2026_family_has_an_attention_layer_and_a_probe(name):
    model = make(name)
    family = family_of(model)
    assert family.layer_attentions(model.config) and family.layer_bytes(model.config, 2).none > 0


@pytest.mark.parametrize("name", ["llama-gqa", "qwen3-moe", "gpt-oss", "falcon-mha"])
def test_a_stock_model_that_lets_packed_documents_mix_trains_padded_unpatched(name):
    """Where the unpatched model lets one packed document attend to the one before (stock gpt-oss's eager attention
    on transformers 5.25, Falcon's mask up to 5.23), hf_accel's Trainer told not to patch pads instead of packing;
    the check runs the model itself, so it follows the installed transformers."""
    from types import SimpleNamespace

    from hf_accel.training.data_loading import default_collator

    model = make(name)
    ids = torch.randint(1, 96, (1, 11), generator=torch.Generator().manual_seed(0))
    pos = torch.cat([torch.arange(5), torch.arange(6)])[None]
    with torch.no_grad():
        alone = torch.cat([model(input_ids=ids[:, :5]).logits, model(input_ids=ids[:, 5:]).logits], dim=1)
        mixed = bool((model(input_ids=ids, position_ids=pos).logits - alone).abs().max() > 1e-3)
    if name == "llama-gqa":
        assert not mixed
    assert family_of(model).stock_keeps_documents_apart(model) == (not mixed)  # the live reference: stock's row
    collator = default_collator(model, None, SimpleNamespace(packing=True, patch=False))
    assert collator.fallback_to_padding == mixed


def test_a_model_that_scales_its_logits_keeps_its_own_loss():
    """Cohere multiplies the LM head's logits by logit_scale in its forward: the probe sees an op on the logits that
    the fused loss (which runs the head itself) would leave out, so "auto" leaves the loss to the model and
    fused_ce=True is refused; Llama's head is plain. The live reference: the loss the unpatched model computes."""
    import copy

    from transformers import CohereConfig, CohereForCausalLM

    from hf_accel.errors import ConfigurationError

    torch.manual_seed(0)
    ref = CohereForCausalLM(CohereConfig(vocab_size=96, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=2, logit_scale=0.5,
                                         pad_token_id=0, bos_token_id=1, eos_token_id=2)).train()
    assert family_of(ref).head_differs(ref.config) and family_of(make("llama-gqa")).head_differs(None) is None
    with pytest.raises(ConfigurationError, match="fused_ce=True"):
        hf_accel.patch(copy.deepcopy(ref), fused_ce=True)
    ours = copy.deepcopy(ref)
    report = hf_accel.patch(ours)
    assert not report.fused_ce
    ids = torch.randint(1, 96, (1, 9), generator=torch.Generator().manual_seed(1))
    torch.testing.assert_close(ours(input_ids=ids, labels=ids).loss, ref(input_ids=ids, labels=ids).loss)


def test_the_fused_loss_leaves_a_mixture_of_experts_asked_for_router_logits_to_its_own_forward():
    """With output_router_logits the model adds the load-balancing loss to its loss in its own forward: the fused loss
    hands that call to it, so the loss is the unpatched model's, aux loss included."""
    import copy

    ref = make("qwen3-moe").train()
    ours = copy.deepcopy(ref)
    hf_accel.patch(ours, fused_ce=True)
    ids = torch.randint(1, 96, (1, 9), generator=torch.Generator().manual_seed(1))
    got = ours(input_ids=ids, labels=ids, output_router_logits=True)
    want = ref(input_ids=ids, labels=ids, output_router_logits=True)
    assert want.aux_loss is not None and got.aux_loss is not None
    torch.testing.assert_close(got.loss, want.loss)
    without = ref(input_ids=ids, labels=ids).loss
    assert (want.loss - without).abs() > 1e-6  # the aux loss counts: the test can fail


def test_the_probe_runs_stock_code_where_a_kernel_library_is_bound(monkeypatch):
    """liger's RoPE bound into modeling_llama (by an earlier use_liger_kernel=True run) or liger's norm class (by
    apply_liger_kernel_to_llama() before the model was built) would launch Triton kernels on the probe's fake tensors:
    their null data pointers are an illegal memory access on the GPU (run 39). The probe runs the registered stock
    stand-in instead and finds the facts it finds without liger, leaves the bound code in place, and where no
    stand-in is registered fails (the seam still serves the model) without running the kernel."""
    from transformers.models.llama import modeling_llama

    from hf_accel import foreign
    from hf_accel.facts.probe import ForeignKernel, probe_config

    model = make("llama-gqa")
    cls, config = type(model), model.config
    want = probe_config(cls, config)
    stock_rope, stock_norm = modeling_llama.apply_rotary_pos_emb, modeling_llama.LlamaRMSNorm

    def kernel_rope(q, k, cos, sin, position_ids=None, unsqueeze_dim=1):
        raise AssertionError("a kernel library's RoPE ran on the probe's fake tensors")

    class KernelRMSNorm(stock_norm):
        def forward(self, hidden_states):
            raise AssertionError("a kernel library's norm ran on the probe's fake tensors")

    kernel_rope.__module__ = KernelRMSNorm.__module__ = "liger_kernel.transformers.fake"
    monkeypatch.setattr(foreign, "_STAND_INS", dict(foreign._STAND_INS))
    monkeypatch.setattr(modeling_llama, "apply_rotary_pos_emb", kernel_rope)
    with pytest.raises(ForeignKernel, match="apply_rotary_pos_emb .*liger-kernel's kernel"):
        probe_config(cls, config)
    foreign.register_stand_in(kernel_rope, stock_rope)
    assert probe_config(cls, config) == want
    assert modeling_llama.apply_rotary_pos_emb is kernel_rope  # restored after the probe

    monkeypatch.setattr(modeling_llama, "LlamaRMSNorm", KernelRMSNorm)
    with pytest.raises(ForeignKernel, match="KernelRMSNorm's forward"):
        probe_config(cls, config)
    foreign.register_stand_in(KernelRMSNorm.forward, stock_norm.forward)
    assert probe_config(cls, config) == want


def test_modules_a_kernel_library_already_serves_are_left_as_bound():
    """liger bound before patch() (a forward on a stock norm or MLP, or liger's own class): not probed (its Triton
    kernel cannot run on the CPU copy a norm is probed on) and not fusable, so patch() leaves what it was given."""
    import types

    from transformers.models.llama.modeling_llama import LlamaMLP, LlamaRMSNorm

    ran = []

    def kernel_forward(self, x):  # computes what the module computes, as liger's kernels do
        ran.append(type(self).__name__)
        return type(self).forward(self, x)

    kernel_forward.__module__ = "liger_kernel.transformers.rms_norm"
    model = make("llama-gqa")
    bound = [m for m in model.modules() if isinstance(m, (LlamaRMSNorm, LlamaMLP))]
    for m in bound:
        m.forward = types.MethodType(kernel_forward, m)
    assert fusable_modules(model) == [] and ran == []
    assert module_kind(LlamaRMSNorm(16)) == "rms_norm"  # unbound: found by what it computes


def test_the_probe_builds_its_copy_as_one_process_under_deepspeed_zero3():
    """Under ZeRO-3 (transformers' ``HfDeepSpeedConfig`` alive, as in every DeepSpeed launch of the Trainer),
    ``_from_config`` builds a model inside ``deepspeed.zero.Init``: the probe's copy then ran collectives on fake
    tensors and got 1-D partitioned weights, and every ZeRO-3 run lost its facts (the report's "probe forward failed:
    'weight' must be 2-D"). Here, without a process group, that path raised at once. The facts are those found
    without DeepSpeed."""
    pytest.importorskip("deepspeed", reason="needs deepspeed")
    from transformers.integrations.deepspeed import (HfDeepSpeedConfig, is_deepspeed_zero3_enabled,
                                                     unset_hf_deepspeed_config)

    model = make("llama-gqa")
    alone = facts_probe.probe_config(type(model), model.config, torch.float32)
    zero3 = HfDeepSpeedConfig({"zero_optimization": {"stage": 3}, "train_micro_batch_size_per_gpu": 1})
    try:
        assert is_deepspeed_zero3_enabled()
        under = facts_probe.probe_config(type(model), model.config, torch.float32)
    finally:
        unset_hf_deepspeed_config()
    del zero3
    assert under == alone


def test_a_model_whose_attention_builds_its_own_mask_is_refused_by_name():
    """Doge's attention turns the mask it is handed into a learned bias over query and key positions before calling
    the attention interface: no varlen kernel takes that bias, and under the seam the model built it from hf_accel's
    padding mask instead of transformers' (patched logits were off by ~6 on this tiny config). The probe sees a mask
    at a call its mask function never handed out; patch() refuses, saying so, and the model stays as it was."""
    from transformers import DogeConfig, DogeForCausalLM

    from hf_accel.errors import UnsupportedModel

    config = DogeConfig(vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=2, keep_window_size=8, pad_token_id=0)
    torch.manual_seed(0)
    model = DogeForCausalLM(config).eval()
    ids = torch.randint(1, 96, (1, 12), generator=torch.Generator().manual_seed(0))
    before = model(input_ids=ids).logits
    with pytest.raises(UnsupportedModel, match="DogeAttention.*builds a mask of its own"):
        hf_accel.patch(model)
    torch.testing.assert_close(model(input_ids=ids).logits, before, rtol=0, atol=0)


def assert_trains_as(ours: nn.Module, ref: nn.Module, ids: torch.Tensor) -> None:
    """``ours`` (patched) gives ``ref``'s (unpatched, fp32) logits, and every gradient of the loss on ``ids``."""
    outs = []
    for model in (ref, ours):
        model.zero_grad(set_to_none=True)
        out = model(input_ids=ids, labels=ids)
        out.loss.backward()
        outs.append((out.logits, {n: p.grad for n, p in model.named_parameters() if p.grad is not None}))
    (want, want_grads), (got, got_grads) = outs
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
    assert got_grads.keys() == want_grads.keys()
    for name, g in want_grads.items():
        torch.testing.assert_close(got_grads[name], g, rtol=1e-4, atol=1e-5 * g.abs().max().item(), msg=name)


def test_a_window_only_the_mask_carries_is_kept():
    """PhiMoE builds a sliding-window mask and calls attention without ``sliding_window``: the seam, which replaces
    the mask, attended over the whole row (logits off by ~6 on rows longer than the window; the sweep's one
    MISMATCH). The probe reads the window from the mask the model asked for, every call takes it: patched equals
    unpatched (fp32) on a full row four times the window, loss and every gradient; unpatch takes the window off."""
    import copy

    from transformers import AutoConfig, AutoModelForCausalLM

    from hf_accel.attention.calls import MASK_WINDOW_ATTR

    config = AutoConfig.for_model("phimoe", vocab_size=96, hidden_size=64, intermediate_size=64, num_hidden_layers=2,
                                  num_attention_heads=4, num_key_value_heads=2, num_local_experts=4,
                                  sliding_window=4, attn_implementation="sdpa")
    torch.manual_seed(0)
    ref = AutoModelForCausalLM.from_config(config).train()
    ours = copy.deepcopy(ref)
    report = hf_accel.patch(ours)
    assert any("sliding window 4: read from the mask" in note for note in report.notes), report
    ids = torch.randint(1, 96, (1, 16), generator=torch.Generator().manual_seed(1))
    assert_trains_as(ours, ref, ids)
    hf_accel.unpatch(ours)
    assert not any(MASK_WINDOW_ATTR in m.__dict__ for m in ours.modules())


def test_a_sliding_mask_no_layer_takes_is_not_a_window():
    """Cohere Compass's model builds a sliding-window mask beside the causal one on every forward, and hands it only to
    "sliding_attention" layers, which its defaults have none of; each call passes ``sliding_window`` (None on full
    layers). patch() refused it ("masks with sliding windows (none, 4) ... known only to the masks"). The calls say
    each layer's window: patched equals unpatched (fp32) on a row four times the window, loss and every gradient, and
    on two packed documents against each alone; with sliding layers configured, they keep their window."""
    import copy

    from transformers import AutoConfig, AutoModelForCausalLM

    for layer_types in (None, ["sliding_attention", "full_attention"]):
        config = AutoConfig.for_model(
            "cohere_compass_text", vocab_size=96, hidden_size=64, intermediate_size=64, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, sliding_window=4, layer_types=layer_types,
            rope_parameters={kind: {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [4, 2, 2]}
                             for kind in ("full_attention", "sliding_attention")},
            pad_token_id=0, attn_implementation="sdpa")
        torch.manual_seed(0)
        ref = AutoModelForCausalLM.from_config(config).train()
        ours = copy.deepcopy(ref)
        hf_accel.patch(ours)
        ids = torch.randint(1, 96, (1, 16), generator=torch.Generator().manual_seed(1))
        assert_trains_as(ours, ref, ids)
        positions = torch.cat([torch.arange(9), torch.arange(7)])[None]
        with torch.no_grad():
            packed = ours(input_ids=ids, position_ids=positions).logits
            alone = torch.cat([ref(input_ids=ids[:, :9]).logits, ref(input_ids=ids[:, 9:]).logits], dim=1)
        torch.testing.assert_close(packed, alone, rtol=1e-4, atol=1e-5)


def test_an_attention_that_reads_transformers_mask_itself_is_refused_at_patch():
    """DeepSeek V3.2's (and GLM-5's, ...) sparse-attention indexer indexes transformers' 4-D mask inside the attention
    module, before the attention call (``attention_mask[:, 0, :, :]``). Under the seam the model gets a padding mask
    or none, so the patched model failed at its first forward with a TypeError; patch() now refuses it, naming the
    module. The stock model trains."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from hf_accel.errors import UnsupportedModel

    config = AutoConfig.for_model(
        "deepseek_v32", vocab_size=128, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4, n_routed_experts=4, n_shared_experts=1,
        kv_lora_rank=16, q_lora_rank=32, qk_rope_head_dim=8, v_head_dim=16, qk_nope_head_dim=8, n_group=1,
        topk_group=1, num_experts_per_tok=2, first_k_dense_replace=1, index_topk=8, index_head_dim=16,
        index_n_heads=2, max_position_embeddings=256, pad_token_id=0, bos_token_id=1, eos_token_id=2, use_cache=False)
    model = AutoModelForCausalLM.from_config(config)
    ids = torch.randint(3, 128, (1, 12))
    model(input_ids=ids, labels=ids).loss.backward()  # stock: fine
    with pytest.raises(UnsupportedModel, match="DeepseekV32Attention.*reads the attention mask"):
        hf_accel.patch(model)


def test_an_attention_call_longer_than_the_forward_s_layout_is_refused():
    """BLT attends over sequences of its own making (byte patches): a call of 15 positions in a forward whose packed
    position_ids cover 14. The seam expanded the 14 onto the 15 (a RuntimeError); it now says what the model does."""
    from hf_accel.attention.varlen import varlen_batch
    from hf_accel.errors import UnsupportedModel

    positions = torch.cat([torch.arange(6), torch.arange(8)])[None]
    with pytest.raises(UnsupportedModel, match="15 positions in a forward whose position_ids covers 14"):
        varlen_batch(batch_size=1, seq_len=15, device=torch.device("cpu"), position_ids=positions)
    with pytest.raises(UnsupportedModel, match="attention mask covers 14"):
        varlen_batch(batch_size=1, seq_len=15, device=torch.device("cpu"), attention_mask=torch.ones(1, 14))
    assert varlen_batch(batch_size=1, seq_len=14, device=torch.device("cpu"), position_ids=positions).cu_seqlens.tolist() \
        == [0, 6, 14]


def test_a_model_whose_probe_failed_reads_its_heads_from_its_attention_s_own_config():
    """BLT's probe forward fails on fake tensors (a data-dependent patching step) and its top config has no
    num_attention_heads (each sub-model has its own config): the seam without found facts read the top config and
    patch() raised AttributeError. It reads the attention module's own config first."""
    import types

    from transformers import LlamaConfig, LlamaForCausalLM

    from hf_accel.facts import _unprobed

    model = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=2))
    top = types.SimpleNamespace(model_type="blt")  # no num_attention_heads, no hidden_size
    family = _unprobed(model, top, RuntimeError("a probe failure"))
    assert family.head_shape(top) == (4, 2, 8)


def test_an_attention_that_indexes_the_mask_is_refused_where_the_probe_failed_before_it():
    """HunYuan V4's probe forward fails while its fake-tensor copy is built, before any attention runs, so the probe
    cannot show its attention indexing transformers' 4-D mask (as DeepSeek V3.2's does); patch() went on without
    found facts and the model failed at its first forward. The attention's own code is read instead."""
    from transformers import CONFIG_MAPPING, AutoModelForCausalLM

    from hf_accel.errors import UnsupportedModel

    if "hy_v4" not in CONFIG_MAPPING:
        pytest.skip("this transformers has no HunYuan V4 (hy_v4: transformers 5.2x)")
    try:
        config = hy_v4_config()
    except Exception as e:  # noqa: BLE001 - 5.17's HunYuan V4 names its layer types otherwise
        pytest.skip(f"this transformers' HunYuan V4 config takes other layer types ({str(e)[:80]})")
    model = AutoModelForCausalLM.from_config(config)
    ids = torch.randint(3, 128, (1, 12))
    model(input_ids=ids, labels=ids).loss.backward()  # stock: fine
    with pytest.raises(UnsupportedModel, match="HYV4Attention.*its forward indexes the mask"):
        hf_accel.patch(model)


def hy_v4_config():
    from transformers import AutoConfig

    return AutoConfig.for_model(
        "hy_v4", vocab_size=128, hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=4, head_dim=8, max_position_embeddings=256, pad_token_id=0,
        bos_token_id=1, eos_token_id=2, n_routed_experts=4, num_experts_per_tok=2, q_lora_rank=32, kv_lora_rank=16,
        qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=16, mlp_layer_types=["dense", "sparse", "sparse"],
        layer_types=["indexed_attention"] * 3, index_topk=8, index_head_dim=16, index_n_heads=2,
        indexer_types=["full", "full", "shared"], use_cache=False)


def test_a_text_only_causal_lm_on_a_text_sub_config_is_patched():
    """MllamaForCausalLM (and Emu3ForCausalLM) is a text-only causal LM built on the text sub-config, whose model type
    transformers maps to no causal LM class: patch() refused it as "not a causal LM". The class itself is one: it is
    patched, and a packed row computes each document alone."""
    import copy

    from transformers import MllamaForCausalLM
    from transformers.models.mllama.configuration_mllama import MllamaTextConfig

    config = MllamaTextConfig(vocab_size=128, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                              num_key_value_heads=2, intermediate_size=128, max_position_embeddings=256,
                              cross_attention_layers=[1], bos_token_id=1, eos_token_id=2, pad_token_id=0,
                              use_cache=False)
    torch.manual_seed(0)
    ref = MllamaForCausalLM(config).train()
    ours = copy.deepcopy(ref)
    hf_accel.patch(ours)
    ids = torch.randint(3, 128, (1, 14), generator=torch.Generator().manual_seed(0))
    pos = torch.cat([torch.arange(6), torch.arange(8)])[None]
    with torch.no_grad():
        alone = torch.cat([ref(input_ids=ids[:, :6]).logits, ref(input_ids=ids[:, 6:]).logits], dim=1)
        torch.testing.assert_close(ours(input_ids=ids, position_ids=pos).logits, alone, rtol=1e-4, atol=1e-5)
