"""Issue 40a: budget plans that split layers' saved inputs between the device and host memory and space checkpoints
where neither holds them all. The planner against a brute-force search over every per-layer plan (and every length),
and spaced / offloaded plans on tiny models against no checkpointing and full checkpointing (fp32, CPU)."""
import copy
import itertools
import random
import re

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from hf_accel.errors import ConfigurationError
from hf_accel.memory.budget import MemoryBudget
from hf_accel.memory.machine import host_available_bytes
from hf_accel.memory.checkpointing import (FullCheckpointing, NoCheckpointing, PerLayer, decoder_layers,
                                           policy_from_spec)
from hf_accel.memory.offload import MIN_PIECE, copy_to_pieces, join_pieces, pinned_pieces
from hf_accel.memory.planner import (LayerActivation, host_bytes, longest_feasible_tokens, plan_checkpointing,
                                     plan_cost, plan_peak_bytes, valid_choices)
from tests.test_checkpointing import GRAD_ATOL, GRAD_RTOL, NUM_LAYERS, packed_batch, tiny_llama, tiny_neox
from tests.test_offload import step
from tests.tiny_models import layer_inputs_alive_after_forward

ALL_MODES = ("none", "op", "full", "offload", "spaced")
MODELS = {"llama": tiny_llama, "gpt_neox": tiny_neox}


def every_plan(n: int):
    return [c for c in itertools.product(ALL_MODES, repeat=n) if valid_choices(c)]


def brute_force(layers, fixed, budget, host_budget, extra=0):
    """(least cost of a fitting plan or None, lowest peak of a plan within the host budget) over every plan."""
    plans = [(plan_cost(c), plan_peak_bytes(layers, c, fixed, extra)) for c in every_plan(len(layers))
             if host_bytes(layers, c) <= host_budget]
    fitting = [cost for cost, peak in plans if peak <= budget]
    return (min(fitting) if fitting else None), min(peak for _, peak in plans)


def random_layers(rng: random.Random, n: int) -> list[LayerActivation]:
    layers = []
    for _ in range(n):
        full = rng.randint(5, 60)
        op = full + rng.randint(0, 200)
        layers.append(LayerActivation(none_bytes=op + rng.randint(0, 300), op_bytes=op, full_bytes=full))
    return layers


def test_planner_is_the_cheapest_plan_within_device_and_host_budgets():
    """Random uneven layers, every mode, random device and host budgets: the plan's cost is the least among every
    valid plan that fits both (a brute-force search), and when none fits it has the lowest peak of those within the
    host budget."""
    rng = random.Random(0)
    for trial in range(150):
        layers = random_layers(rng, rng.randint(1, 4))
        fixed, extra = rng.randint(0, 50), rng.randint(0, 30)
        top = plan_peak_bytes(layers, ["none"] * len(layers), fixed, extra)
        budget, host_budget = rng.randint(fixed, top + 10), rng.choice([0, rng.randint(0, 150), 10**9])
        plan = plan_checkpointing(layers, fixed_bytes=fixed, budget_bytes=budget, extra_bytes=extra,
                                  modes=ALL_MODES, host_budget_bytes=host_budget)
        cheapest, lowest = brute_force(layers, fixed, budget, host_budget, extra)
        assert valid_choices(plan.choices) and plan.host_bytes <= host_budget, (trial, plan.choices)
        assert plan.predicted_peak_bytes == plan_peak_bytes(layers, plan.choices, fixed, extra)
        assert plan.fits == (cheapest is not None), (trial, plan.choices, budget)
        if plan.fits:
            assert plan.recompute_cost == pytest.approx(cheapest) and plan.predicted_peak_bytes <= budget, trial
        else:
            assert plan.predicted_peak_bytes == lowest, (trial, plan.choices)


def test_spacing_and_offload_are_chosen_only_when_needed():
    """16 equal layers whose inputs are small beside what one layer rebuilds (as at long context: Llama-3-8B at 512k
    tokens has 4 GiB inputs): a roomy device keeps every input; a tighter one moves inputs to the host; with the host
    short too, layers are spaced; with no host memory at all, only spaced; the split says so."""
    gib = 1 << 30
    layers = [LayerActivation(none_bytes=80 * gib, op_bytes=80 * gib, full_bytes=4 * gib)] * 16
    fixed = 16 * gib

    def plan(device_gib, host_gib):  # (a loss tail of 40 GiB: the top layer cannot keep its 80 GiB through it)
        return plan_checkpointing(layers, fixed_bytes=fixed, budget_bytes=device_gib * gib, modes=ALL_MODES,
                                  host_budget_bytes=host_gib * gib, extra_bytes=40 * gib)

    roomy = plan(16 + 16 * 4 + 76, 100)  # all inputs + one full layer's rebuild (the top layer's: under the others)
    assert roomy.fits and set(roomy.choices) == {"full"} and roomy.host_bytes == 0
    # 120 - 16 - 80 - 4 (the prefetched input) = 20 GiB: 5 inputs on the device under the offloaded layers, and the
    # top layer's (its backward comes first: the layers above an offloaded one have freed theirs by its rebuild)
    split = plan(120, 100)
    assert split.fits and (split.choices.count("full"), split.choices.count("offload")) == (6, 10)
    assert split.choices[:5] == ("full",) * 5 and split.choices[-1] == "full"
    assert split.host_bytes == 10 * 4 * gib and split.split().startswith("6 layer inputs on the device, 10 in host")
    spaced = plan(120, 20)
    assert spaced.fits and "spaced" in spaced.choices and spaced.host_bytes <= 20 * gib
    assert spaced.recompute_cost > split.recompute_cost
    assert "rebuilt in backward (spacing" in spaced.split() and "| spaced checkpointing |" in spaced.table()
    assert "(host budget 20.00 GiB)" in spaced.table()
    no_host = plan(120, 0)  # spans of 4: 4 inputs kept + 80 rebuilt + 3 inputs waiting = 104 GiB
    assert no_host.fits and "offload" not in no_host.choices and max(no_host.spans) == 4
    assert not plan(16 + 80 + 3, 10**6).fits  # a layer's own rebuild does not fit: no plan does


def test_longest_feasible_length_matches_brute_force():
    """The longest micro-batch a budget holds (sizes linear in tokens) is the largest length at which some plan of a
    brute-force search fits."""
    rng = random.Random(1)
    tokens = 40
    for trial in range(12):
        layers = random_layers(rng, 3)
        fixed, extra = rng.randint(0, 40), rng.randint(0, 40)
        budget = rng.randint(fixed, plan_peak_bytes(layers, ["full"] * 3, fixed, extra) + 50)
        host_budget = rng.choice([0, 40, 10**6])
        longest = longest_feasible_tokens(layers, tokens, fixed_bytes=fixed, budget_bytes=budget, extra_bytes=extra,
                                          modes=ALL_MODES, host_budget_bytes=host_budget)
        feasible = [t for t in range(tokens + 1)
                    if brute_force([layer.scaled(t, tokens) for layer in layers], fixed, budget, host_budget,
                                   extra * t // tokens)[0] is not None]
        assert longest == max(feasible, default=0), (trial, longest, feasible)


def test_longest_feasible_length_searches_each_regime():
    """Sizes that change form past a length (a chunked MLP: past the break a layer keeps less, its backward rebuilds a
    fixed chunk): feasibility is no longer monotone in tokens (a length just under the break may not fit where a
    longer one does). With the break named, the longest length is the brute-force answer over every length."""
    rng = random.Random(2)
    tokens, split = 60, 0
    for trial in range(40):
        brk, chunk = rng.randint(5, 50), rng.randint(1, 5)
        layers = random_layers(rng, 3)
        # per token, the part of 'none' a chunked MLP holds for one chunk only
        shares = [rng.randint(0, (layer.none_bytes - layer.op_bytes) // tokens) for layer in layers]

        def layers_at(t, layers=layers, shares=shares, brk=brk, chunk=chunk):
            scaled = [layer.scaled(t, tokens) for layer in layers]
            if t <= brk:
                return scaled
            return [LayerActivation(layer.none_bytes - share * t, layer.op_bytes, layer.full_bytes,
                                    backward_bytes=share * chunk) for layer, share in zip(scaled, shares)]

        fixed = rng.randint(0, 40)
        budget = rng.randint(fixed, plan_peak_bytes(layers, ["full"] * 3, fixed, 0) + 50)
        longest = longest_feasible_tokens(layers_at, tokens, fixed_bytes=fixed, budget_bytes=budget,
                                          modes=ALL_MODES, host_budget_bytes=10**6, breaks=(brk,))
        feasible = [t for t in range(tokens + 1) if brute_force(layers_at(t), fixed, budget, 10**6)[0] is not None]
        assert longest == max(feasible, default=0), (trial, longest, feasible)
        split += bool(feasible) and feasible != list(range(max(feasible) + 1))  # a gap below the break
    assert split  # some trials are not monotone: a search that ignored the break could have missed them


# ----------------------------------------------------------------------------------------------- on a model
SPACED_PLANS = {
    "spaced": ["full", "spaced", "full", "spaced"],
    "offloaded-heads": ["offload", "spaced", "offload", "spaced"],
    "one-span": ["offload", "spaced", "spaced", "spaced"],
    "mixed": ["none", "full", "spaced", "op"],
}


@pytest.mark.parametrize("plan", list(SPACED_PLANS))
@pytest.mark.parametrize("family", sorted(MODELS))
def test_spaced_plans_match_no_checkpointing_and_full(family, plan):
    """Loss and gradients of a spaced / offloaded plan: those of no checkpointing (within recompute's summation-order
    noise) and bit for bit those of full checkpointing (the rebuilt inputs are the forward's own values); every
    spaced layer's input was rebuilt, none kept."""
    base = MODELS[family]()
    none, full, spaced = base, copy.deepcopy(base), copy.deepcopy(base)
    NoCheckpointing().apply(none)
    FullCheckpointing().apply(full)
    policy = PerLayer(choices=SPACED_PLANS[plan])
    policy.apply(spaced)
    batch = packed_batch()
    (loss_none, g_none), (loss_full, g_full), (loss, g) = step(none, batch), step(full, batch), step(spaced, batch)
    count = SPACED_PLANS[plan].count("spaced")
    stats = policy.spacer.stats
    assert (stats.spaced, stats.kept, stats.rebuilt) == (count, 0, count)
    assert torch.equal(loss, loss_full) and all(torch.equal(g[n], t) for n, t in g_full.items())
    torch.testing.assert_close(loss, loss_none, atol=GRAD_ATOL, rtol=GRAD_RTOL)
    for name, grad in g_none.items():
        torch.testing.assert_close(g[name], grad, atol=GRAD_ATOL, rtol=GRAD_RTOL, msg=name)



def test_spaced_layers_keep_no_input_and_offloaded_heads_free_theirs():
    """After forward, a full layer's input is alive (kept), a spaced or offloaded one's is not; the host copies the
    offloader counts are gone after backward."""
    model = tiny_llama()
    policy = PerLayer(choices=["full", "spaced", "offload", "spaced"])
    policy.apply(model)
    assert layer_inputs_alive_after_forward(model, packed_batch()) == [True, False, False, False]
    stats = policy.offloader.stats
    tokens = packed_batch()["input_ids"].numel()
    assert stats.host_peak_bytes == tokens * 64 * 4 and stats.host_bytes == 0


def test_rebuilt_inputs_replay_rng_and_autocast():
    """A spaced layer's input is rebuilt in backward, outside the forward's autocast region and after its RNG moved
    on: the rebuild replays both (dropout on, CPU bf16 autocast), so gradients equal full checkpointing's."""
    from transformers import GPTNeoXConfig, GPTNeoXForCausalLM

    torch.manual_seed(0)
    base = GPTNeoXForCausalLM(GPTNeoXConfig(vocab_size=128, hidden_size=64, intermediate_size=128,
                                            num_hidden_layers=NUM_LAYERS, num_attention_heads=4, use_cache=False,
                                            attention_dropout=0.2, hidden_dropout=0.2)).train()
    full, spaced = base, copy.deepcopy(base)
    FullCheckpointing().apply(full)
    PerLayer(choices=["full", "spaced", "spaced", "spaced"]).apply(spaced)
    batch = packed_batch()
    results = []
    for model in (full, spaced):
        torch.manual_seed(5)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = model(**batch).loss
        loss.backward()
        results.append((loss.detach(), [p.grad.clone() for p in model.parameters()]))
    (loss_full, g_full), (loss, g) = results
    assert torch.equal(loss, loss_full) and all(torch.equal(a, b) for a, b in zip(g, g_full))


def test_spaced_layer_whose_input_is_not_its_spans_output_keeps_it():
    """When something changes the hidden states between two layers, the spaced layer cannot rebuild its input from
    the layer below: it keeps it, as full checkpointing would, and gradients stay right. (Before transformers 5.23
    the layer's checkpoint wraps its ``__call__``, so a forward pre-hook runs inside it, on the layer below's output:
    the span is rebuilt through the hook and spacing holds.)"""
    import transformers
    from packaging.version import Version

    hooks_inside_checkpoint = Version(transformers.__version__).release < (5, 23)
    model, reference = tiny_llama(), tiny_llama()
    layers = decoder_layers(model)
    layers[1].register_forward_pre_hook(lambda m, args: (args[0] * 1.0,))  # a new tensor, not layer 0's output
    decoder_layers(reference)[1].register_forward_pre_hook(lambda m, args: (args[0] * 1.0,))
    policy = PerLayer(choices=["full", "spaced", "full", "full"])
    policy.apply(model)
    (loss, g), (loss_ref, g_ref) = step(model, packed_batch()), step(reference, packed_batch())
    kept, spaced = (0, 1) if hooks_inside_checkpoint else (1, 0)
    assert (policy.spacer.stats.kept, policy.spacer.stats.spaced) == (kept, spaced)
    torch.testing.assert_close(loss, loss_ref)
    for name, grad in g_ref.items():
        torch.testing.assert_close(g[name], grad, atol=GRAD_ATOL, rtol=GRAD_RTOL, msg=name)


def test_spaced_choices_are_checked():
    model = tiny_llama()
    with pytest.raises(ConfigurationError, match="must be checkpointed"):
        PerLayer(choices=["none", "spaced", "full", "full"]).apply(model)
    with pytest.raises(ConfigurationError, match="must be checkpointed"):
        PerLayer(choices=["spaced", "full", "full", "full"]).apply(model)
    with pytest.raises(ConfigurationError, match="non-reentrant"):
        PerLayer(choices=["full", "spaced", "full", "full"], use_reentrant=True).apply(model)


# ----------------------------------------------------------------------------------------------- the budget policy
def _tokens_batch(tokens: int) -> dict:
    ids = torch.randint(0, 128, (1, tokens), generator=torch.Generator().manual_seed(2))
    return {"input_ids": ids, "labels": ids, "use_cache": False}


def test_budget_plan_splits_and_spaces_within_the_host_budget(capsys):
    """'budget:...+offload' on a tiny model with a budget between the leanest plan and all-full: with host memory
    it offloads, without it spaces; both plans print their split, train with no checkpointing's gradients, and the
    host copies fit the host budget."""
    batch = _tokens_batch(256)
    reference = tiny_llama()
    _, g_ref = step(reference, batch)
    layers, fixed, tail = _probe_sizes(tiny_llama(), batch)
    full_peak = plan_peak_bytes(layers, ["full"] * NUM_LAYERS, fixed, tail)
    for host_budget, expect in ((10**9, "offload"), (0, "spaced")):
        model = tiny_llama()
        policy = policy_from_spec(f"budget:{full_peak - 1}B+offload")
        policy.sample_batch, policy.headroom, policy.host_budget = batch, 0.0, host_budget
        policy.apply(model)
        printed = capsys.readouterr().out
        assert policy.plan.fits and expect in policy.plan.choices and policy.plan.host_bytes <= host_budget
        assert "| split |" in printed and "layer inputs on the device" in printed, printed
        _, g = step(model, batch)
        for name, grad in g_ref.items():
            torch.testing.assert_close(g[name], grad, atol=GRAD_ATOL, rtol=GRAD_RTOL, msg=name)


def _probe_sizes(model, batch):
    from hf_accel.memory.estimate import training_state_bytes
    from hf_accel.memory.plan import probe_training_memory

    probe = probe_training_memory(model, batch)
    return probe.layers, training_state_bytes(model), probe.tail_peak_bytes


def test_refusal_names_the_longest_feasible_length():
    """A budget no plan meets for the batch raises before training, naming the longest micro-batch it holds: at most
    the planner's longest length for the probed sizes (below the batch's), confirmed by a probe at that length, so a
    budget plan at that length fits."""
    tokens = 512
    batch = _tokens_batch(tokens)
    model = tiny_llama()
    layers, fixed, tail = _probe_sizes(model, batch)
    leanest = plan_checkpointing(layers, fixed_bytes=fixed, budget_bytes=0, extra_bytes=tail,
                                 modes=("none", "op", "full", "spaced")).predicted_peak_bytes
    budget = (fixed + leanest) // 2
    with pytest.raises(ConfigurationError, match=r"train on at most ([0-9,]+) tokens per micro-batch") as err:
        MemoryBudget(budget=budget, sample_batch=batch, headroom=0.0, verbose=False).apply(model)
    assert not any(layer.gradient_checkpointing for layer in decoder_layers(model))  # nothing applied
    named = int(re.search(r"at most ([0-9,]+) tokens", str(err.value)).group(1).replace(",", ""))
    expected = longest_feasible_tokens(layers, tokens, fixed_bytes=fixed, budget_bytes=budget, extra_bytes=tail,
                                       modes=("none", "op", "full", "spaced"), host_budget_bytes=0)
    assert 0.9 * expected < named <= expected < tokens and "a probe at that length fits" in str(err.value)
    at = MemoryBudget(budget=budget, sample_batch=_tokens_batch(named), headroom=0.0, verbose=False)
    at.apply(model)
    assert at.plan.fits
    with pytest.raises(ConfigurationError, match="the training state alone is over the budget"):
        MemoryBudget(budget=fixed // 2, sample_batch=batch, headroom=0.0, verbose=False).apply(model)


def test_refusal_names_a_length_whose_own_plan_fits(monkeypatch):
    """Part of what a step holds does not shrink with its tokens: the fused loss's chunk of logits (a fixed number of
    rows) and a layer's backward working set at most stay as probed. The longest length a refusal names keeps them
    at the probed length's size, so a plan probed at exactly that length fits (scaled down with the tokens, they
    named a length whose own probe did not fit)."""
    from hf_accel.fused import cross_entropy

    monkeypatch.setattr(cross_entropy, "auto_chunk_size", lambda *args, **kwargs: 64)  # a chunk that stays
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=8192, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                         num_attention_heads=4, num_key_value_heads=2, use_cache=False, attn_implementation="sdpa")
    model = LlamaForCausalLM(config).train()  # torch's CPU sdpa: layers linear in tokens, as flash attention's are
    cross_entropy.bind_fused_loss(model)  # the loss patch() binds: its tail is mostly the chunk's logits
    tokens = 1024
    ids = torch.randint(0, 8192, (1, tokens), generator=torch.Generator().manual_seed(2))
    layers, fixed, tail = _probe_sizes(model, {"input_ids": ids, "labels": ids, "use_cache": False})
    modes = ("none", "op", "full", "spaced")
    leanest = plan_checkpointing(layers, fixed_bytes=fixed, budget_bytes=0, extra_bytes=tail,
                                 modes=modes).predicted_peak_bytes
    budget = (leanest + fixed + tail) // 2  # over the loss's chunk: the layers' part decides the length

    def policy(n, slack=0):
        batch = {"input_ids": ids[:, :n], "labels": ids[:, :n], "use_cache": False}
        return MemoryBudget(budget=budget + slack, sample_batch=batch, headroom=0.0, verbose=False, offload=False)

    with pytest.raises(ConfigurationError, match=r"train on at most ([0-9,]+) tokens per micro-batch") as err:
        policy(tokens).apply(model)
    named = int(re.search(r"at most ([0-9,]+) tokens", str(err.value)).group(1).replace(",", ""))
    assert 0 < named < tokens and "a probe at that length fits" in str(err.value)
    # (64 KiB of slack: two probes of one length measure the loss tail a few KiB apart, which the default 3%
    # headroom covers; the failure this guards against named lengths whose probe was over by far more)
    fits = policy(named, slack=1 << 16)
    fits.apply(model)
    assert fits.plan.fits
    with pytest.raises(ConfigurationError):  # and it is about the longest: 5% more does not fit
        policy(named * 105 // 100).apply(model)


def test_budget_chunks_the_mlps_auto_leaves_unchunked_before_refusing(capsys):
    """At a length mlp_chunks="auto" runs unchunked (under its threshold, for speed), a budget that no plan meets so
    but one does with the MLPs chunked chunks every MLP call over one chunk, says so, and trains with no
    checkpointing's gradients; removing the plan puts auto's chunking back. A budget under even that refuses, says
    the chunking was tried, and leaves auto's chunking as it was; a sharded one refuses naming the setting."""
    from hf_accel.memory import mlp_chunks
    from hf_accel.memory.checkpointing import remove_checkpointing
    from hf_accel.memory.estimate import Sharding

    tokens, chunk = 256, 32
    batch = _tokens_batch(tokens)
    model, reference = tiny_llama(), tiny_llama()
    auto = mlp_chunks.MlpChunking(chunk, 4 * tokens, auto=True)  # calls over 1,024 tokens chunked: this one not
    mlp_chunks.apply(model, auto)
    mlps = [mlp for _, mlp in mlp_chunks.decoder_mlps(model)]

    def leanest():
        layers, state, tail = _probe_sizes(model, batch)
        return plan_checkpointing(layers, fixed_bytes=state, budget_bytes=0, extra_bytes=tail,
                                  modes=("none", "op", "full", "spaced")).predicted_peak_bytes

    unchunked = leanest()
    assert mlp_chunks.chunk_every_long_call(model) == mlp_chunks.MlpChunking(chunk, chunk, auto=True)
    chunked = leanest()
    mlp_chunks.restore_bound(model)
    assert all(mlp_chunks.chunking_of(mlp) == auto for mlp in mlps) and chunked < unchunked
    policy = MemoryBudget(budget=(chunked + unchunked) // 2, sample_batch=batch, headroom=0.0)
    policy.apply(model)
    assert policy.plan.fits and "MLPs: every training call over 32 tokens runs in chunks" in capsys.readouterr().out
    assert all(mlp_chunks.chunking_of(mlp).min_tokens == chunk for mlp in mlps)
    loss, grads = step(model, batch)
    loss_ref, grads_ref = step(reference, batch)
    torch.testing.assert_close(loss, loss_ref, atol=GRAD_ATOL, rtol=GRAD_RTOL)
    for name, grad in grads_ref.items():
        torch.testing.assert_close(grads[name], grad, atol=GRAD_ATOL, rtol=GRAD_RTOL, msg=name)
    remove_checkpointing(model)
    assert all(mlp_chunks.chunking_of(mlp) == auto for mlp in mlps)
    with pytest.raises(ConfigurationError, match="every MLP call over 32 tokens chunked"):
        MemoryBudget(budget=chunked - 1, sample_batch=batch, headroom=0.0, verbose=False).apply(model)
    assert all(mlp_chunks.chunking_of(mlp) == auto for mlp in mlps)
    # sharded, each process would decide alone whether to probe again (a probe gathers weights across all of them):
    # it refuses and names the setting instead
    sharded = MemoryBudget(budget=(chunked + unchunked) // 2, sample_batch=batch, headroom=0.0, verbose=False,
                           sharding=Sharding("fsdp2", 1, None))
    with pytest.raises(ConfigurationError, match=r"patch\(model, mlp_chunks=32\) chunks them here too"):
        sharded.apply(model)
    assert all(mlp_chunks.chunking_of(mlp) == auto for mlp in mlps)


def test_a_refusal_above_auto_s_threshold_names_a_shorter_length_that_chunks(monkeypatch):
    """A length over mlp_chunks="auto"'s threshold that no plan meets: the longest length the refusal names is
    searched as the budget would plan it, chunked every long call (a shorter length auto leaves unchunked is chunked
    before refusing). Probed unchunked there, a line through a chunked and an unchunked probe named 0 tokens and
    blamed the training state, though a plan at a shorter length fits. Nothing stays chunked after the refusal."""
    from hf_accel.memory import mlp_chunks
    from hf_accel.memory.state import training_state_bytes

    model = tiny_llama()
    auto = mlp_chunks.MlpChunking(32, 256, auto=True)  # calls over 256 tokens chunked
    mlp_chunks.apply(model, auto)
    mlps = [mlp for _, mlp in mlp_chunks.decoder_mlps(model)]

    def policy(n, budget):
        return MemoryBudget(budget=budget, sample_batch=_tokens_batch(n), headroom=0.0, verbose=False, offload=False)

    mlp_chunks.chunk_every_long_call(model)
    layers, fixed, tail = _probe_sizes(model, _tokens_batch(240))
    budget = plan_checkpointing(layers, fixed_bytes=fixed, budget_bytes=0, extra_bytes=tail,
                                modes=("none", "op", "full", "spaced")).predicted_peak_bytes  # 240 tokens, chunked
    mlp_chunks.restore_bound(model)
    assert training_state_bytes(model) < budget
    with pytest.raises(ConfigurationError, match=r"train on at most ([0-9,]+) tokens") as err:
        policy(400, budget).apply(model)
    named = int(re.search(r"at most ([0-9,]+) tokens", str(err.value)).group(1).replace(",", ""))
    assert 200 < named < 400 and all(mlp_chunks.chunking_of(mlp) == auto for mlp in mlps)
    fits = policy(named, budget)
    fits.apply(model)
    assert fits.plan.fits


def test_a_budget_leaves_the_run_s_random_streams_and_its_chunking_as_they_were(monkeypatch):
    """The probes draw random tokens and run dropout: a seeded run draws the same numbers after apply() as without
    it (its data order, dropout and any later init). A probe that raises midway (an out-of-memory error, an
    interrupt) leaves patch()'s MLP chunking bound as it was, not the every-long-call fallback."""
    from hf_accel.memory import mlp_chunks
    from hf_accel.memory import plan as plan_module

    model = tiny_llama()
    torch.manual_seed(123)
    expected = torch.rand(3)
    torch.manual_seed(123)
    MemoryBudget(budget="1GiB", batch_tokens=64, verbose=False).apply(model)
    assert torch.equal(torch.rand(3), expected)

    auto = mlp_chunks.MlpChunking(32, 1024, auto=True)
    mlp_chunks.apply(model, auto)
    real, calls = plan_module.probe_training_memory, []

    def failing(*args, **kwargs):
        calls.append(1)
        if len(calls) == 2:  # the probe after chunk_every_long_call
            raise torch.OutOfMemoryError("out of memory in the second probe")
        return real(*args, **kwargs)

    monkeypatch.setattr(plan_module, "probe_training_memory", failing)
    fixed = _probe_sizes(model, _tokens_batch(256))[1]
    with pytest.raises(torch.OutOfMemoryError):
        MemoryBudget(budget=fixed + 1000, sample_batch=_tokens_batch(256), headroom=0.0, verbose=False).apply(model)
    assert len(calls) == 2
    assert all(mlp_chunks.chunking_of(mlp) == auto for _, mlp in mlp_chunks.decoder_mlps(model))


def test_a_budget_probes_frozen_lower_layers_as_training_runs_them():
    """Applying a plan enables transformers' checkpointing, which hooks the input embeddings so that the decoder's
    input needs a gradient (5.25: every model taking input_ids): the frozen layers below LoRA's first adapted layer
    then save their activations. The budget's probe sees them so (it probed them saving nothing), and its figures
    equal a probe of the model with that hook."""
    peft = pytest.importorskip("peft")
    from hf_accel.memory.plan import probe_training_memory

    def lora_middle_layers():
        torch.manual_seed(0)
        config = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=6,
                             num_attention_heads=4, num_key_value_heads=2, use_cache=False)
        return peft.get_peft_model(LlamaForCausalLM(config).train(),
                                   peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"], layers_to_transform=[3]))

    batch = _tokens_batch(128)
    hooked = lora_middle_layers()
    hooked.enable_input_require_grads()
    expected = probe_training_memory(hooked, batch).layers
    model = lora_middle_layers()
    policy = MemoryBudget(budget="1GiB", sample_batch=batch, headroom=0.0, verbose=False)
    policy.apply(model)
    assert policy.probe.layers == expected and expected[0].none_bytes > 0


def test_host_available_memory_honours_a_cgroup_limit(tmp_path):
    """Inside a container the host's MemAvailable overstates what the process may take: a cgroup v2 limit minus its
    usage (reclaimable file pages counted free) caps it; no limit ("max") leaves MemAvailable."""
    (tmp_path / "memory.max").write_text("8589934592\n")
    (tmp_path / "memory.current").write_text("6442450944\n")
    (tmp_path / "memory.stat").write_text("anon 5368709120\ninactive_file 1073741824\n")
    assert host_available_bytes(str(tmp_path)) == min(3 << 30, host_available_bytes(str(tmp_path / "none")))
    (tmp_path / "memory.max").write_text("max\n")
    assert host_available_bytes(str(tmp_path)) == host_available_bytes(str(tmp_path / "none"))


def test_every_host_memory_check_honours_a_container_s_limit(tmp_path, monkeypatch):
    """The QLoRA defaults' host-copy limit and the background saves' room check count host memory as the budget plan
    does: inside a container, its cgroup limit caps MemAvailable (they read the machine's MemAvailable before, so a
    4-bit base in a container could plan to copy half of the machine's free memory into a smaller container)."""
    from hf_accel.attention.kernels.base import DeviceInfo
    from hf_accel.memory import machine
    from hf_accel.memory.defaults import checkpoint_default
    from hf_accel.training.snapshot import SnapshotBuffers

    (tmp_path / "memory.max").write_text(str(4 << 30))
    (tmp_path / "memory.current").write_text(str(3 << 30))
    monkeypatch.setattr(machine, "CGROUP_ROOT", str(tmp_path))
    room = host_available_bytes()
    assert room == min(1 << 30, host_available_bytes(str(tmp_path / "none")))
    from hf_accel.memory.targets import _hf_enable_function

    model = tiny_llama()
    _hf_enable_function(model)({"use_reentrant": False})  # (the kwargs are named per version)
    storage = checkpoint_default(model, DeviceInfo("cuda", (9, 0)), base_4bit=True,
                                 output_projections=("mlp.down_proj",), processes=1)
    assert storage.policy.host_limit == int(0.5 * room)
    state = {"w": torch.zeros(int(room * 0.9) // 4 + 1, dtype=torch.float32, device="meta")}
    assert "host memory is short" in SnapshotBuffers(pin=False).shortfall(state)


def test_host_copies_come_in_power_of_two_pieces():
    """torch's pinned allocator rounds each block up to a power of two (a 3 GiB copy would take 4): copies are cut
    into power-of-two pieces (the rest under MIN_PIECE in one), and put back bit for bit."""
    for nbytes in (3 << 30, (5 << 20) + 12345, 1000, 1 << 20):
        pieces = pinned_pieces(nbytes)
        assert sum(pieces) == nbytes
        assert all(p & (p - 1) == 0 and p >= MIN_PIECE for p in pieces[:-1])
        assert pieces[-1] & (pieces[-1] - 1) == 0 or pieces[-1] < MIN_PIECE
    tensor = torch.randn(3, 700, 1001).to(torch.bfloat16)[:, ::2]  # non-contiguous, odd size
    pieces, _ = copy_to_pieces(tensor, pin_memory=False)
    assert [p.numel() for p in pieces] == pinned_pieces(tensor.numel() * 2)
    back = join_pieces(pieces, tensor.shape, tensor.dtype, tensor.device)
    assert back.dtype == tensor.dtype and torch.equal(back, tensor)


def test_offline_estimate_plans_the_split_and_names_the_longest_length():
    """estimate_training_memory with a budget and host memory: the plan offloads within the host memory given (none
    without it) and says how much; a budget it cannot meet names the longest micro-batch, which the estimate at that
    length meets and one token more does not (the layers' formula is linear in tokens, the fused loss's tail is taken
    at each length: its chunk does not shrink)."""
    from hf_accel.memory.estimate import estimate_training_memory

    gib = 1 << 30
    kwargs = dict(lora_rank=16, batch_tokens=16384)
    device_only = estimate_training_memory("llama-3.2-1b", checkpointing="budget:10.5GiB", **kwargs)
    split = estimate_training_memory("llama-3.2-1b", checkpointing="budget:10.5GiB", host_bytes=gib, **kwargs)
    assert "offload" not in device_only.choices and device_only.host_bytes == 0
    assert "offload" in split.choices and 0 < split.host_bytes <= gib
    assert "| host memory (offloaded inputs) |" in split.table() and "offload" in split.table()
    assert ": fits" in split.notes[-1] and split.peak_bytes <= 0.97 * 10.5 * gib
    tight = estimate_training_memory("llama-3.2-1b", checkpointing="budget:7.5GiB", host_bytes=gib, **kwargs)
    longest = int(re.search(r"holds is ([0-9,]+) tokens", tight.notes[-1]).group(1).replace(",", ""))
    assert 0 < longest < 16384

    def fits(tokens):
        return ": fits" in estimate_training_memory("llama-3.2-1b", checkpointing="budget:7.5GiB", host_bytes=gib,
                                                    lora_rank=16, batch_tokens=tokens).notes[-1]

    assert fits(longest) and not fits(longest + 1)


def test_offline_estimate_counts_chunked_mlps_past_the_auto_threshold():
    """Llama-3-8B QLoRA with 110 GiB of host memory (issue 40c's shape): past the length where mlp_chunks="auto"
    chunks the MLPs (199,728 tokens) a layer keeps no MLP intermediates, so 344,064 tokens fit an 88 GiB budget,
    and not unchunked; the longest length named for 458,752 lies past the threshold, where it fits and one token
    more does not. The estimate stays above what the H100 measured for that length (59.0 GiB, torch's peak under a
    79 GiB cap, tests/gpu/RESULTS.md run 32): an upper bound, and under 'budget:80GiB' it promises the length. Just
    under the threshold, where auto's unchunked MLPs do not fit, the plan chunks them, as the run's budget does
    before refusing (and says so)."""
    from hf_accel.memory.estimate import estimate_training_memory
    from hf_accel.memory.mlp_chunks import auto_min_tokens

    def estimate(tokens, budget="88GiB", **kwargs):
        return estimate_training_memory("llama-3-8b", lora_rank=16, base_4bit=True, batch_tokens=tokens,
                                        checkpointing=f"budget:{budget}", host_bytes=110 << 30, **kwargs)

    def fits(tokens, **kwargs):
        return ": fits" in estimate(tokens, **kwargs).notes[-1]

    threshold = auto_min_tokens(14336, 2)
    assert fits(344064) and not fits(344064, mlp_chunks=False)
    assert estimate(344064, budget="80GiB").peak_bytes > 59.0 * 2**30 and fits(344064, budget="80GiB")
    longest = int(re.search(r"holds is ([0-9,]+) tokens", estimate(458752).notes[-1]).group(1).replace(",", ""))
    assert threshold < longest < 458752 and fits(longest) and not fits(longest + 1)
    under = estimate(threshold)
    assert fits(threshold) and not fits(threshold, mlp_chunks=False) and not fits(threshold, mlp_chunks=threshold)
    assert "(the budget plan, as it does before refusing" in under.notes[-2]
    assert under.peak_bytes == estimate(threshold, mlp_chunks=12288).peak_bytes  # every call over a chunk: chunked
    assert "budget plan" not in estimate(344064).notes[-2]  # auto chunks that length itself


def test_offline_estimate_plans_with_the_run_s_headroom_and_searches_chunked_from_over_the_threshold():
    """The estimate's verdict is the run's: a budget just over the leanest plan's peak, but not by the 3% headroom
    the run's plan leaves free, does not fit (it said "fits" where the run refused). From a length over auto's
    threshold the longest length is searched as the run plans shorter ones (every long MLP call chunked), so it is
    the one named from a length under the threshold (it named a shorter one, searched unchunked)."""
    from hf_accel.memory.estimate import estimate_training_memory

    def estimate(tokens, budget, **kwargs):
        return estimate_training_memory("llama-3.2-1b", batch_tokens=tokens, checkpointing=f"budget:{budget}",
                                        **kwargs)

    leanest = estimate(65536, "1GiB", mlp_chunks=False).peak_bytes
    assert "does NOT fit" in estimate(65536, f"{leanest * 1.01 / 2**20:.1f}MiB", mlp_chunks=False).notes[-1]
    assert ": fits" in estimate(65536, f"{leanest * 1.04 / 2**20:.1f}MiB", mlp_chunks=False).notes[-1]

    def longest(tokens):
        note = estimate_training_memory("llama-3-8b", lora_rank=16, base_4bit=True, batch_tokens=tokens,
                                        checkpointing="budget:40GiB").notes[-1]
        return int(re.search(r"holds is ([0-9,]+) tokens", note).group(1).replace(",", ""))

    assert longest(300_000) == longest(196_608)


def test_budget_honours_the_process_device_memory_cap(monkeypatch):
    """Under torch.cuda.set_per_process_memory_fraction a budget above the cap is refused before the probe, and a
    fractional budget is a share of what the process may allocate, not of the whole device (faked 140 GiB device
    capped at 80 GiB)."""
    import types

    gib = 1 << 30
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda index: types.SimpleNamespace(total_memory=140 * gib))
    monkeypatch.setattr(torch.cuda, "get_per_process_memory_fraction", lambda index: 80 / 140, raising=False)
    cuda = torch.device("cuda", 0)
    assert MemoryBudget(budget="80GiB").budget_bytes(cuda) == 80 * gib
    assert MemoryBudget(budget=0.5).budget_bytes(cuda) == 40 * gib
    with pytest.raises(ConfigurationError, match=r"more than this process may allocate .*80.00 GiB"):
        MemoryBudget(budget="100GiB").budget_bytes(cuda)
