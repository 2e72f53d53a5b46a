"""Checkpointing policies against a live reference: the same tiny model without checkpointing (fp32, CPU)."""
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn
from transformers import GPTNeoXConfig, GPTNeoXForCausalLM, LlamaConfig, LlamaForCausalLM
from transformers.modeling_layers import GradientCheckpointingLayer

from hf_accel.memory.checkpointing import (EveryN, FullCheckpointing, MemoryBudget, NoCheckpointing,
                                           OffloadedCheckpointing, OpLevel, SelectiveModules, applied_policy,
                                           decoder_layers, policy_from_spec, reapply_checkpointing)
from hf_accel.memory.targets import _hf_enable_function
from hf_accel.errors import ConfigurationError
from hf_accel.memory.plan import live_activation_bytes

# fp32 on CPU: recompute runs the same kernels on the same inputs, so only summation-order noise is allowed
GRAD_ATOL, GRAD_RTOL = 1e-6, 1e-5
NUM_LAYERS = 4


def tiny_llama() -> nn.Module:
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=NUM_LAYERS,
                         num_attention_heads=4, num_key_value_heads=2, use_cache=False)
    return LlamaForCausalLM(config).train()


def tiny_neox() -> nn.Module:
    torch.manual_seed(0)
    config = GPTNeoXConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=NUM_LAYERS,
                           num_attention_heads=4, use_cache=False, attention_dropout=0.0, hidden_dropout=0.0)
    return GPTNeoXForCausalLM(config).train()


def packed_batch() -> dict:
    """One row, three documents (position_ids restart); first label of each document ignored."""
    torch.manual_seed(1)
    lengths = [20, 28, 16]
    input_ids = torch.randint(0, 128, (1, sum(lengths)))
    position_ids = torch.cat([torch.arange(n) for n in lengths])[None]
    labels = input_ids.clone()
    labels[position_ids == 0] = -100
    return {"input_ids": input_ids, "labels": labels, "position_ids": position_ids}


def is_mlp(module: nn.Module) -> bool:
    return type(module).__name__.endswith("MLP")


def grads_and_recomputed(model: nn.Module, batch: dict) -> tuple[dict, set]:
    """Parameter grads of one step and the modules that ran forward during backward (the recompute)."""
    in_backward = [False]
    ran: set = set()
    hooks = [m.register_forward_hook(lambda m, a, o: ran.add(m) if in_backward[0] else None)
             for m in model.modules()]
    model.zero_grad(set_to_none=True)
    loss = model(**batch).loss
    in_backward[0] = True
    loss.backward()
    for hook in hooks:
        hook.remove()
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}, ran


def recomputed_owners(model: nn.Module, ran: set, candidates) -> set:
    """The candidates with a descendant that ran during backward; asserts nothing outside them ran."""
    owners = {c for c in candidates if any(m in ran for m in c.modules())}
    inside = {m for c in candidates for m in c.modules()}
    assert ran <= inside, f"modules outside the policy were recomputed: {[type(m).__name__ for m in ran - inside]}"
    return owners


POLICIES = {
    "none": (lambda: NoCheckpointing(), lambda layers: []),
    "full": (lambda: FullCheckpointing(), lambda layers: layers),
    "full-reentrant": (lambda: FullCheckpointing(use_reentrant=True), lambda layers: layers),
    "every_2": (lambda: EveryN(n=2), lambda layers: layers[::2]),
    "op": (lambda: OpLevel(), lambda layers: layers),
    "check_fn-layer-1": (lambda: SelectiveModules(check_fn=lambda m: isinstance(m, GradientCheckpointingLayer)
                                                   and m is _LAYER_1[0]), lambda layers: layers[1:2]),
}
_LAYER_1: list = [None]


@pytest.mark.parametrize("make_model", [tiny_llama, tiny_neox], ids=["llama", "gpt_neox"])
@pytest.mark.parametrize("name", list(POLICIES))
def test_policy_grads_match_and_recompute_matches_policy(make_model, name):
    model, batch = make_model(), packed_batch()
    reference, ran = grads_and_recomputed(model, batch)
    assert not ran
    layers = decoder_layers(model)
    _LAYER_1[0] = layers[1]
    make_policy, expected = POLICIES[name]
    make_policy().apply(model)
    grads, ran = grads_and_recomputed(model, batch)
    assert grads.keys() == reference.keys()
    for key in reference:
        torch.testing.assert_close(grads[key], reference[key], atol=GRAD_ATOL, rtol=GRAD_RTOL, msg=key)
    assert recomputed_owners(model, ran, layers) == set(expected(layers))


@pytest.mark.parametrize("make_model", [tiny_llama, tiny_neox], ids=["llama", "gpt_neox"])
def test_check_fn_on_mlps_recomputes_exactly_the_mlps(make_model):
    model, batch = make_model(), packed_batch()
    reference, _ = grads_and_recomputed(model, batch)
    policy_from_spec(is_mlp).apply(model)
    grads, ran = grads_and_recomputed(model, batch)
    for key in reference:
        torch.testing.assert_close(grads[key], reference[key], atol=GRAD_ATOL, rtol=GRAD_RTOL, msg=key)
    mlps = [m for m in model.modules() if is_mlp(m)]
    assert recomputed_owners(model, ran, mlps) == set(mlps)


def test_activation_memory_order():
    """Live activation bytes: none > op-level > every_2 > full (4 layers, so every_2 checkpoints half)."""
    model, batch = tiny_llama(), packed_batch()
    measured = {}
    for spec in ("none", "op", "every_2", "full"):
        policy_from_spec(spec).apply(model)
        measured[spec] = live_activation_bytes(model, batch)
    assert measured["none"] > measured["op"] > measured["every_2"] > measured["full"], measured


def _identity(value):
    if isinstance(value, (bool, int, float, str, type(None))):
        return value
    if isinstance(value, dict):  # hook tables: same hooks, same order
        return tuple((k, id(v)) for k, v in value.items())
    return id(value)


def _state(model: nn.Module) -> dict:
    """Every module's plain attributes, forward and hooks, by identity, to compare before/after."""
    state = {}
    for name, module in model.named_modules():
        plain = {k: v for k, v in vars(module).items()
                 if k not in ("_parameters", "_buffers", "_modules", "training")}
        state[name] = {k: _identity(v) for k, v in plain.items()}
    return state


@pytest.mark.parametrize("spec", [FullCheckpointing(use_reentrant=True), is_mlp, "op", "every_2"],
                         ids=["full-reentrant", "mlp", "op", "every_2"])
def test_remove_restores_model_exactly(spec):
    model = tiny_llama()
    before = _state(model)
    policy = policy_from_spec(spec)
    policy.apply(model)
    assert _state(model) != before
    policy.remove(model)
    assert _state(model) == before
    assert applied_policy(model) is None


def test_apply_twice_replaces_previous_policy_and_remove_restores():
    model = tiny_llama()
    before = _state(model)
    policy_from_spec(is_mlp).apply(model)
    policy_from_spec("full").apply(model)
    assert all("forward" not in vars(m) for m in model.modules() if is_mlp(m))
    policy_from_spec("full").remove(model)
    assert _state(model) == before


@pytest.mark.parametrize("spec", ["full", "op", FullCheckpointing(use_reentrant=True)], ids=["full", "op", "reentrant"])
def test_peft_lora_grads_equal_with_and_without_policy(spec):
    peft = pytest.importorskip("peft")
    model = peft.get_peft_model(tiny_llama(), peft.LoraConfig(
        r=4, lora_alpha=8, lora_dropout=0.0,
        target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]))
    for name, p in model.named_parameters():  # lora_B starts at zero, which would make lora_A's grad zero
        if "lora_B" in name:
            torch.nn.init.normal_(p, std=0.02)
    batch = packed_batch()
    reference, _ = grads_and_recomputed(model, batch)
    policy_from_spec(spec).apply(model)
    grads, ran = grads_and_recomputed(model, batch)
    assert ran, "the policy recomputed nothing"
    assert reference.keys() == grads.keys() and all("lora_" in k for k in grads)
    for key in reference:
        assert reference[key].abs().max() > 0, key
        torch.testing.assert_close(grads[key], reference[key], atol=GRAD_ATOL, rtol=GRAD_RTOL, msg=key)


class OldNameLlama(LlamaForCausalLM):
    """transformers 5.17's surface: only gradient_checkpointing_enable exists."""

    @property
    def activation_checkpointing_enable(self):
        raise AttributeError("activation_checkpointing_enable (not in transformers 5.17)")

    def gradient_checkpointing_enable(self, gradient_checkpointing_kwargs=None, **kwargs):
        self.old_name_called_with = gradient_checkpointing_kwargs
        super().gradient_checkpointing_enable(gradient_checkpointing_kwargs, **kwargs)  # real on 5.17 and 5.23+


def test_old_transformers_enable_name_is_used():
    model = OldNameLlama(tiny_llama().config).train()
    batch = packed_batch()
    reference, _ = grads_and_recomputed(model, batch)
    EveryN(n=2).apply(model)
    assert model.old_name_called_with == {"use_reentrant": False}
    grads, ran = grads_and_recomputed(model, batch)
    layers = decoder_layers(model)
    assert recomputed_owners(model, ran, layers) == set(layers[::2])
    for key in reference:
        torch.testing.assert_close(grads[key], reference[key], atol=GRAD_ATOL, rtol=GRAD_RTOL, msg=key)


def test_reapply_after_transformers_overwrites_flags():
    model = tiny_llama()
    EveryN(n=2).apply(model)
    _hf_enable_function(model)()  # what Trainer.train() does from its arguments (named per transformers version)
    assert all(layer.gradient_checkpointing for layer in decoder_layers(model))
    reapply_checkpointing(model)
    assert [layer.gradient_checkpointing for layer in decoder_layers(model)] == [True, False, True, False]


def test_stands_down_under_fsdp_activation_checkpointing(monkeypatch):
    monkeypatch.setenv("ACCELERATE_USE_FSDP", "true")
    monkeypatch.setenv("FSDP_ACTIVATION_CHECKPOINTING", "true")
    model = tiny_llama()
    with pytest.raises(ConfigurationError, match="FSDP"):
        policy_from_spec("full").apply(model)
    policy_from_spec("full", explicit=False).apply(model)
    assert not any(layer.gradient_checkpointing for layer in decoder_layers(model))
    assert applied_policy(model) is None


def test_policy_from_spec_parsing_and_errors():
    assert isinstance(policy_from_spec("none"), NoCheckpointing)
    assert isinstance(policy_from_spec("FULL"), FullCheckpointing)
    assert policy_from_spec("every_3").n == 3
    assert isinstance(policy_from_spec("op"), OpLevel)
    assert policy_from_spec("budget:20GiB").budget == "20gib"
    assert policy_from_spec("budget:0.6").budget == 0.6
    assert policy_from_spec(is_mlp).check_fn is is_mlp
    policy = EveryN(n=4)
    assert policy_from_spec(policy) is policy
    for bad in ("every_0", "every_x", "budget:lots", "sometimes", None, 3):
        with pytest.raises(ConfigurationError, match="Allowed"):
            policy_from_spec(bad)
    # a budget the parser can tell is wrong is refused there (the command refuses it before loading anything)
    for bad, why in (("budget:-3GiB", "must be positive"), ("budget:0GiB", "must be positive"),
                     ("budget:0.0", "must be positive"), ("budget:1.5", "between 0 and 1.*'budget:1.5GiB'"),
                     ("budget:2", "needs a unit.*'budget:2GiB'"), ("budget:inf", "Allowed"),
                     ("budget:nanGiB", "Allowed")):
        with pytest.raises(ConfigurationError, match=why):
            policy_from_spec(bad)
    assert policy_from_spec("budget:1.0").budget == 1.0 and policy_from_spec("budget:120B+offload").budget == "120b"
    with pytest.raises(ConfigurationError, match="non-reentrant"):
        OpLevel(use_reentrant=True).apply(tiny_llama())
    for make_bad in (lambda: FullCheckpointing(trim_recompute="no"), lambda: EveryN(n=2, use_reentrant=1),
                     lambda: OffloadedCheckpointing(trim_recompute=None), lambda: MemoryBudget(budget=0.8, explicit=0)):
        with pytest.raises(ConfigurationError, match="takes True or False"):
            make_bad()
    for policy in (NoCheckpointing(), FullCheckpointing(), EveryN(n=2), OpLevel(), policy_from_spec(is_mlp)):
        assert policy.describe()


def test_op_level_saves_custom_saveable_ops(monkeypatch):
    """Ops named in hf_accel.attention.kernels.SAVEABLE_OPS at apply time join the op-level save list."""
    import hf_accel.attention.kernels
    from hf_accel.memory.checkpointing import default_save_ops

    monkeypatch.setattr(hf_accel.attention.kernels, "SAVEABLE_OPS", ["aten::gelu"], raising=False)
    assert torch.ops.aten.gelu in default_save_ops()
    assert torch.ops.aten.mm in default_save_ops()


@pytest.mark.slow
def test_bench_script_tiny_runs(tmp_path):
    out = tmp_path / "bench.json"
    script = Path(__file__).resolve().parents[1] / "scripts" / "bench_checkpointing.py"
    result = subprocess.run([sys.executable, str(script), "--tiny", "--out", str(out)],
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert out.exists() and "| policy |" in result.stdout


def test_trainer_budget_probes_the_runs_micro_batch(tmp_path):
    """A budget plan is only as good as its probe: hf_accel's Trainer probes a micro-batch of the size it will train
    on (here the token budget), not the policy's 2,048-token default (a 16k-token run then planned no checkpointing
    and peaked 4 GiB over a 23 GiB budget on the H200)."""
    import transformers

    from hf_accel.memory.budget import MemoryBudget
    from hf_accel.memory.checkpointing import applied_policy
    from hf_accel.training.trainer import AccelArguments, Trainer
    from tiny_models import VOCAB, make

    data = [{"input_ids": list(range(3, 3 + n)), "labels": list(range(3, 3 + n))} for n in (9, 14, 20, 7)]
    args = transformers.TrainingArguments(output_dir=str(tmp_path), per_device_train_batch_size=2, max_steps=1,
                                          report_to="none", use_cpu=True, save_strategy="no")
    model = make("llama-gqa").train()
    budget = MemoryBudget(budget="1GiB")
    trainer = Trainer(model=model, args=args, train_dataset=data,
                      accel=AccelArguments(backend="reference", checkpointing=budget, max_tokens_per_batch=40))
    assert applied_policy(model) is budget and budget.batch_tokens == 40
    model2 = make("llama-gqa").train()
    Trainer(model=model2, args=args, train_dataset=data, accel=AccelArguments(backend="reference",
                                                                              checkpointing="budget:1GiB"))
    assert applied_policy(model2).batch_tokens == 20 + 14  # packing, 2 examples: the two longest
    assert VOCAB and trainer.patch_report.checkpointing.startswith("memory budget")
    # one micro-batch per optimizer step: transformers frees the gradients before each forward, and the plan knows
    assert budget.grads_freed is True and applied_policy(model2).grads_freed is True
    assert budget.plan.freed_grad_bytes == sum(p.numel() * p.element_size() for p in model.parameters())
    accumulating = transformers.TrainingArguments(output_dir=str(tmp_path), per_device_train_batch_size=2,
                                                  gradient_accumulation_steps=2, max_steps=1, report_to="none",
                                                  use_cpu=True, save_strategy="no")
    model3 = make("llama-gqa").train()
    Trainer(model=model3, args=accumulating, train_dataset=data,
            accel=AccelArguments(backend="reference", checkpointing="budget:1GiB"))
    assert applied_policy(model3).grads_freed is False and applied_policy(model3).plan.freed_grad_bytes is None
    model4 = make("llama-gqa").train()  # a user's explicit choice stands
    Trainer(model=model4, args=args, train_dataset=data,
            accel=AccelArguments(backend="reference", checkpointing=MemoryBudget(budget="1GiB", grads_freed=False)))
    assert applied_policy(model4).grads_freed is False


@pytest.mark.slow
def test_memory_budget_keeps_its_documented_import_path():
    """MemoryBudget lives in hf_accel.memory.budget; README's hf_accel.memory.checkpointing path still imports it, in
    either import order (budget.py imports checkpointing.py)."""
    import subprocess
    import sys

    for first in ("hf_accel.memory.budget", "hf_accel.memory.checkpointing"):
        code = (f"import {first}; from hf_accel.memory.checkpointing import MemoryBudget as A, policy_from_spec; "
                "from hf_accel.memory.budget import MemoryBudget as B; assert A is B; "
                "assert isinstance(policy_from_spec('budget:20GiB'), B)")
        subprocess.run([sys.executable, "-c", code], check=True, timeout=120)
