"""Offloaded checkpointing against full checkpointing (the live reference): the same tiny models, fp32, CPU.

On the CPU the "host" copy stays on the same device, so the tests watch the hooks' bookkeeping and what autograd keeps
alive: each decoder layer's input is copied once in forward, the original is freed (full checkpointing keeps it),
and the copy is what the recompute reads. tests/gpu/test_long_context_gpu.py repeats the comparison on CUDA.
"""
import copy

import pytest
import torch
from torch import nn

from hf_accel.errors import ConfigurationError
from tests.test_checkpointing import NUM_LAYERS, packed_batch, tiny_llama, tiny_neox
from tests.tiny_models import layer_inputs_alive_after_forward
from hf_accel.memory.checkpointing import (FullCheckpointing, OffloadedCheckpointing, applied_policy, decoder_layers,
                                           policy_from_spec)

HIDDEN = 64  # the hidden size of the tiny models shared with test_checkpointing

MODELS = {"llama": tiny_llama, "gpt_neox": tiny_neox}


def step(model: nn.Module, batch: dict) -> tuple[torch.Tensor, dict]:
    model.zero_grad(set_to_none=True)
    loss = model(**batch).loss
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("family", sorted(MODELS))
def test_offload_is_bit_identical_to_full_checkpointing(family):
    full_model = MODELS[family]()
    offload_model = copy.deepcopy(full_model)
    FullCheckpointing().apply(full_model)
    policy = policy_from_spec("offload")
    policy.apply(offload_model)
    batch = packed_batch()
    loss_full, grads_full = step(full_model, batch)
    loss_off, grads_off = step(offload_model, batch)
    assert policy.offloader.stats.packed == NUM_LAYERS  # it acted: one saved input per decoder layer
    assert torch.equal(loss_full, loss_off)
    assert grads_full.keys() == grads_off.keys() and len(grads_full) > 0
    for name, grad in grads_full.items():
        assert torch.equal(grad, grads_off[name]), name



@pytest.mark.parametrize("family", sorted(MODELS))
def test_offload_moves_each_layer_input_and_frees_the_original(family):
    batch = packed_batch()
    full_model = MODELS[family]()
    FullCheckpointing().apply(full_model)
    assert all(layer_inputs_alive_after_forward(full_model, batch))  # full checkpointing keeps them

    model = MODELS[family]()
    policy = OffloadedCheckpointing()
    policy.apply(model)
    stats = policy.offloader.stats
    seen = []  # what the recompute received
    unpack = policy.offloader.unpack
    policy.offloader.unpack = lambda entry: seen.append((entry, unpack(entry))) or seen[-1][1]
    assert not any(layer_inputs_alive_after_forward(model, batch))  # only the host copies are kept

    tokens = batch["input_ids"].numel()
    assert (stats.packed, stats.unpacked) == (NUM_LAYERS, NUM_LAYERS)
    assert stats.packed_bytes == NUM_LAYERS * tokens * HIDDEN * 4
    assert len(seen) == NUM_LAYERS
    for entry, tensor in seen:
        assert entry.host.device.type == "cpu" and tensor.data_ptr() == entry.host.data_ptr()


def test_a_host_limit_keeps_the_inputs_past_it_on_the_device():
    """Room in host memory for one and a half layer inputs: the first layer's input goes there, every later one stays
    on the device (counted), and the gradients are still those of full checkpointing."""
    batch = packed_batch()
    layer_bytes = batch["input_ids"].numel() * HIDDEN * 4
    full_model = tiny_llama()
    model = copy.deepcopy(full_model)
    FullCheckpointing().apply(full_model)
    policy = OffloadedCheckpointing(host_limit=layer_bytes * 3 // 2)
    policy.apply(model)
    assert "up to" in policy.describe()
    assert layer_inputs_alive_after_forward(model, batch) == [False] + [True] * (NUM_LAYERS - 1)
    stats = policy.offloader.stats
    assert (stats.packed, stats.over_limit, stats.host_peak_bytes) == (1, NUM_LAYERS - 1, layer_bytes)
    loss_full, grads_full = step(full_model, batch)
    loss, grads = step(model, batch)
    assert torch.equal(loss_full, loss) and grads.keys() == grads_full.keys()
    assert all(torch.equal(grad, grads[name]) for name, grad in grads_full.items())


def test_offload_spec_apply_remove_and_reentrant_refused():
    model = tiny_llama()
    policy = policy_from_spec(" Offload ")
    assert isinstance(policy, OffloadedCheckpointing) and "offloaded" in policy.describe()
    policy.apply(model)
    assert applied_policy(model) is policy
    assert all(layer.gradient_checkpointing for layer in decoder_layers(model))
    policy.remove(model)
    assert applied_policy(model) is None
    assert not any(layer.gradient_checkpointing for layer in decoder_layers(model))
    with pytest.raises(ConfigurationError, match="non-reentrant"):
        OffloadedCheckpointing(use_reentrant=True)


def test_offload_leaves_small_tensors_and_eval_alone():
    model = tiny_llama()
    policy = OffloadedCheckpointing(min_bytes=1 << 30)
    policy.apply(model)
    step(model, packed_batch())
    assert policy.offloader.stats.packed == 0 and policy.offloader.stats.kept >= NUM_LAYERS
    with torch.no_grad():
        model(**packed_batch())
    assert policy.offloader.stats.packed == 0


def test_budget_plans_offload_on_cuda_or_when_asked_and_only_where_full_does_not_fit():
    from hf_accel.memory.plan import DEVICE_MODES, LayerActivation, plan_checkpointing

    layers = [LayerActivation(none_bytes=100, op_bytes=60, full_bytes=10)] * 4
    # all full: the top layer's backward under the 3 inputs below it: 30 + 10 kept + 90 rebuilt = 130. Offloading
    # the two middle layers' inputs leaves room for the top layer to keep its 100 through the forward's end (no
    # recompute): 10 + 100 + 10 (its output); its backward then holds the offloaded input below it, prefetched: 120
    assert not plan_checkpointing(layers, fixed_bytes=0, budget_bytes=125).fits
    plan = plan_checkpointing(layers, fixed_bytes=0, budget_bytes=125, modes=(*DEVICE_MODES, "offload"))
    assert plan.fits and plan.choices == ("full", "offload", "offload", "none") and plan.predicted_peak_bytes == 120
    roomy = plan_checkpointing(layers, fixed_bytes=0, budget_bytes=130, modes=(*DEVICE_MODES, "offload"))
    assert "offload" not in roomy.choices  # full fits: no host copies
    assert "offloaded checkpointing | 2 layers" in plan.table() and plan.host_bytes == 2 * 10
    assert roomy.host_bytes == 0
    policy = policy_from_spec("budget:20GiB+offload")
    assert policy.offload and policy.budget == "20gib"
    assert policy.offloads(torch.device("cpu"))  # asked for: whatever the device
    plain, kept = policy_from_spec("budget:20GiB"), policy_from_spec("budget:20GiB+no-offload")
    assert kept.budget == "20gib" and not kept.offloads(torch.device("cuda"))
    # by default a budget plan offloads on CUDA only (issue 18b: a Llama-8B LoRA 24 GiB budget needed it)
    assert plain.offloads(torch.device("cuda")) and not plain.offloads(torch.device("cpu"))


def test_per_layer_offload_choice_matches_full():
    from hf_accel.memory.checkpointing import PerLayer

    ref, model = tiny_llama(), tiny_llama()
    PerLayer(choices=["full", "full", "none", "op"]).apply(ref)
    policy = PerLayer(choices=["offload", "full", "none", "op"])
    policy.apply(model)
    (loss_ref, grads_ref), (loss, grads) = step(ref, packed_batch()), step(model, packed_batch())
    assert policy.offloader.stats.packed == 1 and "1 offloaded" in policy.describe()
    assert torch.equal(loss, loss_ref) and all(torch.equal(grads[n], g) for n, g in grads_ref.items())


def test_offloading_plan_refused_before_training_when_host_memory_is_short(monkeypatch):
    """An offloading budget plan whose saved inputs exceed the host's available memory raises before the first step,
    naming the sizes (not an out-of-memory kill of the host mid-run)."""
    import types

    import psutil

    from hf_accel.memory.budget import HOST_SHARE, _check_host_memory
    from hf_accel.memory.plan import DEVICE_MODES, LayerActivation, plan_checkpointing

    layers = [LayerActivation(none_bytes=100 << 20, op_bytes=60 << 20, full_bytes=10 << 20)] * 4
    plan = plan_checkpointing(layers, fixed_bytes=0, budget_bytes=125 << 20, modes=(*DEVICE_MODES, "offload"))
    assert plan.host_bytes == 20 << 20
    monkeypatch.setattr(psutil, "virtual_memory", lambda: types.SimpleNamespace(available=int((20 << 20) / HOST_SHARE)))
    _check_host_memory(plan, "125MiB")  # just fits
    monkeypatch.setattr(psutil, "virtual_memory", lambda: types.SimpleNamespace(available=10 << 20))
    with pytest.raises(ConfigurationError, match=r"offloads 2 layers' saved inputs, 20.0 MiB of host memory, but only "
                                                 r"10.0 MiB is available"):
        _check_host_memory(plan, "125MiB")


def test_budget_plans_under_reentrant_checkpointing_use_whole_layers_only():
    """Reentrant checkpointing (ZeRO-3 + PEFT on an older deepspeed needs it) supports neither op-level, offloaded nor
    spaced layers: budget plans there choose between none and full, and '+offload' is refused before the probe
    forward."""
    from hf_accel.memory.budget import MemoryBudget

    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    assert MemoryBudget(budget="1GiB").modes(cuda) == ("none", "op", "full", "offload", "spaced")
    assert MemoryBudget(budget="1GiB").modes(cpu) == ("none", "op", "full", "spaced")
    assert MemoryBudget(budget="1GiB", spacing=False).modes(cpu) == ("none", "op", "full")
    assert MemoryBudget(budget="1GiB", use_reentrant=True).modes(cuda) == ("none", "full")
    forced = policy_from_spec("budget:1GiB+offload", use_reentrant=True)
    with pytest.raises(ConfigurationError, match="needs non-reentrant checkpointing"):
        forced.apply(tiny_llama())
    assert forced.plan is None  # refused before probing
    policy = policy_from_spec("budget:19MiB", use_reentrant=True)  # tight (all full needs 18.9): layers checkpointed
    policy.apply(model := tiny_llama())
    assert set(policy.plan.choices) <= {"none", "full"} and "full" in policy.plan.choices
    step(model, packed_batch())  # trains with reentrant checkpointing


@pytest.fixture
def pinning(monkeypatch):
    """register_pinned_host_memory's process-wide state, fresh, with torch's setter recorded (on the CPU the setting
    would do nothing; the GPU figures: scripts/bench_pinned.py, way hf_accel)."""
    from hf_accel.memory import offload

    monkeypatch.setattr(offload, "_PINNING", {})
    for name in offload.ALLOCATOR_ENV:
        monkeypatch.delenv(name, raising=False)
    calls = []
    monkeypatch.setattr(torch._C, "_accelerator_setAllocatorSettings", calls.append, raising=False)
    monkeypatch.setattr(torch._C, "_accelerator_getAllocatorSettings", lambda: "", raising=False)
    return offload, calls


@pytest.mark.parametrize("cpus, threads", [(1, 1), (2, 2), (6, 4), (16, 8), (64, 8)])
def test_pinned_host_memory_is_registered_on_threads_once_per_process(pinning, monkeypatch, cpus, threads):
    offload, calls = pinning
    monkeypatch.setattr(offload.os, "sched_getaffinity", lambda pid: set(range(cpus)), raising=False)
    settings = f"pinned_use_cuda_host_register:True,pinned_num_register_threads:{threads}"
    assert offload.register_pinned_host_memory() == settings and calls == [settings]
    assert offload.register_pinned_host_memory() == settings and calls == [settings]  # once


@pytest.mark.parametrize("name", ["PYTORCH_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF"])
def test_a_user_s_allocator_configuration_is_left_alone(pinning, monkeypatch, name):
    offload, calls = pinning
    monkeypatch.setenv(name, "expandable_segments:True")
    assert offload.register_pinned_host_memory() is None and calls == []


def test_allocator_settings_made_in_code_are_left_alone(pinning, monkeypatch):
    """A setting resets the keys it does not name (max_split_size_mb, roundup_power2_divisions, ...)."""
    offload, calls = pinning
    monkeypatch.setattr(torch._C, "_accelerator_getAllocatorSettings", lambda: "max_split_size_mb:512", raising=False)
    assert offload.register_pinned_host_memory() is None and calls == []


def test_a_refused_setting_leaves_the_default_allocation(pinning, monkeypatch):
    offload, _ = pinning

    def refuse(settings):
        raise RuntimeError("unknown allocator option")

    monkeypatch.setattr(torch._C, "_accelerator_setAllocatorSettings", refuse, raising=False)
    assert offload.register_pinned_host_memory() is None
