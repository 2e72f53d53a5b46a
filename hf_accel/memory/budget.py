"""The ``budget:`` checkpointing policy: the least recompute whose predicted peak fits a memory budget.

It probes one forward for each decoder layer's activation bytes and one layer's backward for the gradients it makes on
top of them, adds the training state (weights, gradients, optimizer) and the loss's own peak, asks
``planner.plan_checkpointing`` for per-layer choices (none / op-level / full / offload / spaced) within the device
budget and the host memory offloaded inputs may take, and applies them as a ``PerLayer`` plan. So the longest document
the device and the host together hold trains: layers keep their input on the device while it fits, in pinned host
memory after that, and spaced (the input rebuilt in backward from the layer below) where neither holds them all.
The plan prints its split; a budget no plan meets raises before training, naming the smallest budget that fits and
the longest micro-batch this one holds. Before refusing a length that patch()'s ``mlp_chunks="auto"`` runs unchunked
(it chunks only the longest calls, for speed), it chunks every MLP call over one chunk and plans again
(``mlp_chunks.chunk_every_long_call``; removing the plan undoes it). ``policy_from_spec("budget:20GiB")`` builds it.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import ClassVar, Sequence

import torch
from torch import nn

from . import mlp_chunks
from .context import RunContext
from .machine import device_cap_bytes, host_available_bytes
from .policies import CheckpointingPolicy, LayerChoice, PerLayer, logger, remove_checkpointing
from .targets import base_model, decoder_mlps
from ..errors import BudgetExceeded, ConfigurationError


HEADROOM = 0.03  # MemoryBudget.headroom by default (the offline estimate plans with it too)


@dataclass(kw_only=True)
class MemoryBudget(CheckpointingPolicy):
    """The least recompute that fits `budget`: bytes, "20GiB", or a fraction (0, 1] of the device's memory.

    apply(model, context) probes activation bytes per decoder layer with one forward on `sample_batch` (default:
    `batch_tokens` random tokens in one row: the run's largest micro-batch), under the autocast training runs under,
    and adds the fixed cost of
    weights, gradients and optimizer states (`memory.training_state_bytes`) and the peak of the loss as the forward
    computes it (full logits, or a fused loss's chunks), and applies `plan.plan_checkpointing`'s choice for
    `1 - headroom` of the budget. Apply it after everything else that changes the forward (patch() does).
    The plan is kept in `self.plan` and printed (`verbose`); a budget no plan fits raises ConfigurationError naming
    the smallest budget that fits and the longest micro-batch (in tokens) the budget holds. Offloaded inputs may take
    `host_budget` of host memory (default HOST_SHARE of what is available: host_available_bytes).

    The run's facts (`batch_tokens`, `sharding`, `grads_freed`, `compiled`, `autocast`) come from the `RunContext`
    apply() receives (hf_accel's Trainers and patch() build it: memory.context); a value given here stands over the
    context's. After apply() these fields say what the plan was made for.
    """

    needs_run_context: ClassVar[bool] = True

    budget: int | float | str
    sample_batch: dict | None = None
    batch_tokens: int | None = None  # None: DEFAULT_PROBE_TOKENS
    optimizer: str = "adamw"
    device_bytes: int | None = None  # total device memory for fractional budgets; default: the CUDA device's
    # Share of the budget kept free for what the probe cannot see (allocator fragmentation, transient buffers): on the
    # GPU, measured peaks ran 1-2% over plans made to the full budget (benchmarks/other-measurements.md, frontier).
    headroom: float = HEADROOM
    verbose: bool = True  # print the plan (on the first process only)
    # plans may keep layers' saved inputs in pinned host memory ("offload", priced above full recompute, so chosen
    # only where device-only plans do not fit): None = where the model is on CUDA; spec "budget:...+offload" forces
    # it on, "budget:...+no-offload" off
    offload: bool | None = None
    # the decoder layers run compiled (patch(compile=...) says so in the context): the probe measures what their
    # compiled graphs save, and an op-level layer, which loses the compiled path, is priced as such
    # (plan.RECOMPUTE_COST_COMPILED). None: the context's
    compiled: bool | None = None
    # the training loop frees gradients before each forward: one micro-batch per optimizer step and
    # zero_grad(set_to_none=True), as torch's optimizers and transformers' Trainer do by default. Gradients then never
    # meet the whole forward's activations (plan.plan_peak_bytes); counting them on top over-predicts a full
    # fine-tune's peak by the gradients' size (docs/guide/memory.md). None/False: counted on top (right for gradient
    # accumulation and for any loop); None takes the context's (hf_accel's Trainers: gradient_accumulation_steps 1).
    grads_freed: bool | None = None
    # the training state is sharded (FSDP2, DeepSpeed ZeRO-3; estimate.Sharding): the plan counts this process's
    # share and what it gathers while computing, not the whole model's state. None: the context's.
    sharding: object = None
    # the dtype training forwards autocast to: the probe forward runs under it, so it saves what training saves and
    # meets the kernels training meets. None: the context's (no autocast there: the caller's, if it entered one)
    autocast: torch.dtype | None = None
    # host memory offloaded layer inputs may take (bytes or "64GiB"); None: HOST_SHARE of what the host has available
    # when the plan is made (host_available_bytes)
    host_budget: int | str | None = None
    # plans may rebuild layers' inputs in backward from the layer below ("spaced", memory.spacing: one more layer
    # forward each, priced above offloading, so chosen only where the inputs fit neither the device nor the host)
    spacing: bool = True
    plan: object = field(default=None, init=False, repr=False)
    probe: object = field(default=None, init=False, repr=False)  # what apply()'s probe forward measured (plan.Probe)
    budget_bytes_resolved: int | None = field(default=None, init=False, repr=False)  # the budget apply() planned for
    _asked: dict = field(default=None, init=False, repr=False, compare=False)  # the run facts given here

    def __post_init__(self) -> None:
        super().__post_init__()
        self._asked = {name: getattr(self, name) for name in _RUN_FACTS}

    def context_for(self, context: RunContext | None) -> RunContext:
        """The run this budget plans for: the facts given to it, else the context's."""
        context = context or RunContext()
        return RunContext(**{name: getattr(context, name) if self._asked[name] is None else self._asked[name]
                             for name in _RUN_FACTS})

    def budget_bytes(self, device: torch.device) -> int:
        from .spec import parse_bytes

        budget = parse_bytes(self.budget) if isinstance(self.budget, str) else self.budget
        cap = device_cap_bytes(device)
        if isinstance(budget, float) and 0 < budget <= 1:
            total = self.device_bytes
            if total is None and device.type == "cuda":
                total = cap
            if total is None:
                raise ConfigurationError(
                    f"budget fraction {budget} needs the device's memory size, but the model is on {device}. "
                    "Pass an absolute budget such as 'budget:20GiB', or MemoryBudget(..., device_bytes=N)."
                )
            return int(budget * total)
        if budget <= 0:
            raise ConfigurationError(f"memory budget must be positive, got {self.budget!r}; e.g. 'budget:20GiB'.")
        if cap is not None and budget > cap + 2**20:  # (the cap is a fraction of the device: rounding slack)
            from .plan import format_bytes

            raise ConfigurationError(
                f"memory budget {self.budget} ({format_bytes(budget)}) is more than this process may allocate on "
                f"{device} ({format_bytes(cap)}: torch.cuda.set_per_process_memory_fraction or the device's size). "
                f"Pass a budget of at most 'budget:{format_bytes(cap).replace(' ', '')}', or a fraction such as "
                "'budget:0.9' (of what the process may allocate)."
            )
        return int(budget)

    def host_budget_bytes(self) -> int:
        """Host memory offloaded inputs may take: `host_budget`, or HOST_SHARE of the host's available memory."""
        from .plan import parse_bytes

        if self.host_budget is None:
            return int(HOST_SHARE * host_available_bytes())
        value = parse_bytes(self.host_budget) if isinstance(self.host_budget, str) else int(self.host_budget)
        if value < 0:
            raise ConfigurationError(f"host_budget must be >= 0 bytes, got {self.host_budget!r}; e.g. '64GiB'.")
        return value

    def apply(self, model: nn.Module, context: RunContext | None = None) -> None:
        run = self.context_for(context)
        for name in _RUN_FACTS:  # what this plan is made for, readable on the policy
            setattr(self, name, getattr(run, name))
        remove_checkpointing(model)
        device = next(model.parameters()).device
        modes, budget = self.modes(device), self.budget_bytes(device)  # bad settings raise before the probe forward
        try:
            # the probes draw random tokens and run dropout: the run's random streams are left as they were
            with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
                tokens, planning, chunked, started = self._plan_or_refuse(model, run, device, modes, budget)
            _check_host_memory(self.plan, self.budget)
            self._announce(tokens, modes, planning, chunked, started)
            super().apply(model, run)
        except BaseException:  # (a refusal, an OOM in a probe, an interrupt): patch()'s MLP chunking again
            mlp_chunks.restore_bound(model)
            raise

    def _announce(self, tokens: int, modes: tuple[str, ...], planning: dict, chunked: mlp_chunks.MlpChunking | None,
                  started: float) -> None:
        """The plan's printout (logged; printed too where ``verbose``, by the first process)."""
        from .plan import format_bytes

        sharded = "" if self.sharding is None else (
            f", the training state as one of {self.sharding.world_size} {self.sharding.engine} processes holds it")
        text = (f"hf_accel checkpointing plan for budget {self.budget} ({tokens} tokens per micro-batch, loss and "
                f"head peak {format_bytes(self.probe.tail_peak_bytes)}{sharded}; probed and planned in "
                f"{time.perf_counter() - started:.1f} s):\n{self.plan.table()}")
        if "offload" in modes:
            text += (f"\nhost memory: {format_bytes(self.plan.host_bytes)} of pinned copies needed, "
                     f"{format_bytes(planning['host_budget_bytes'])} allowed" + (
                         "" if self.host_budget is not None else
                         f" ({HOST_SHARE:.0%} of the host's available memory)"))
        if chunked is not None:
            text += (f"\nMLPs: every training call over {chunked.chunk_tokens} tokens runs in chunks of that many "
                     "(mlp_chunks='auto' chunks only calls over its threshold): no plan fit with this length's MLPs "
                     "unchunked")
        logger.info("%s", text)
        if self.verbose and _first_process():
            print(text, flush=True)

    def _plan_or_refuse(self, model: nn.Module, run: RunContext, device: torch.device, modes: tuple[str, ...],
                        budget: int) -> tuple[int, dict, mlp_chunks.MlpChunking | None, float]:
        """Probe and plan (``self.probe``, ``self.plan``); where no plan fits a length auto's MLP chunking leaves
        unchunked, chunk every long MLP call and plan again; where still none fits, raise BudgetExceeded naming the
        longest length that fits. The tokens planned for, the planning arguments, the chunking the fallback put in
        force (None: none) and when probing started."""
        batch = self.sample_batch or _synthetic_batch(model, self.batch_tokens or DEFAULT_PROBE_TOKENS, device)
        self.budget_bytes_resolved = budget
        tokens = batch["input_ids"].numel()
        started = time.perf_counter()
        planning = self._plan(model, batch, run, device, modes, budget)
        chunked, unchunked = None, None if self.plan.fits else _unchunked_auto(model, tokens)
        # (sharded: each process would decide alone whether to probe again)
        if unchunked is not None and self.sharding is None:
            # before refusing: chunk this length's MLPs too (auto chunks only the longest calls, for speed), so a
            # layer's backward rebuilds one chunk's MLP intermediates, not every token's
            chunked = mlp_chunks.chunk_every_long_call(model)
            planning = self._plan(model, batch, run, device, modes, budget)
        if self.plan.fits:
            return tokens, planning, chunked, started
        longest, checked = self._longest(model, run, device, tokens, planning)
        why = self._refusal(budget, tokens, planning, longest, checked, chunked)
        if unchunked is not None and chunked is None:
            why += (f" This length's MLPs run unchunked (mlp_chunks='auto' chunks only the longest calls): "
                    f"patch(model, mlp_chunks={unchunked.chunk_tokens}) chunks them here too; try that first.")
        smallest = f"budget:{_ceil_bytes(self.plan.predicted_peak_bytes / (1 - self.headroom))}"
        raise BudgetExceeded(why, longest, smallest)

    def _plan(self, model: nn.Module, batch: dict, run: RunContext, device: torch.device, modes: tuple[str, ...],
              budget: int) -> dict:
        """Probe the forward on `batch` (``self.probe``) and plan for the budget (``self.plan``); the planning
        arguments."""
        from .plan import RECOMPUTE_COST, RECOMPUTE_COST_COMPILED, plan_checkpointing
        from .state import gradient_bytes, training_state_bytes
        from .targets import decoder_layers

        self.probe = self._probe(model, batch, run, device)
        grads = gradient_bytes(model, decoder_layers(model), self.sharding) if self.grads_freed else None
        planning = dict(fixed_bytes=training_state_bytes(model, self.optimizer, grads=grads is None,
                                                         sharding=self.sharding),
                        budget_bytes=int(budget * (1 - self.headroom)), extra_bytes=self.probe.tail_peak_bytes,
                        modes=modes, costs=RECOMPUTE_COST_COMPILED if self.compiled else RECOMPUTE_COST, grads=grads,
                        host_budget_bytes=self.host_budget_bytes() if "offload" in modes else 0)
        self.plan = plan_checkpointing(self.probe.layers, **planning)
        self.planning = planning  # (what the plan's peak is made of: plan.peak_terms)
        return planning

    def _probe(self, model: nn.Module, batch: dict, run: RunContext, device: torch.device):
        """One probe (``plan.probe_training_memory``) of `batch` as training runs it: train mode, its autocast, and
        the decoder's input needing a gradient (transformers' checkpointing enable, which applying the plan calls,
        hooks the input embeddings so: in 5.25 for every model taking input_ids; where it does not, the probe is an
        upper bound for frozen layers below the first trainable one, which it had probed saving nothing)."""
        from .plan import probe_training_memory

        was_training = model.training
        model.train()
        embeddings = base_model(model).get_input_embeddings()
        hook = embeddings.register_forward_hook(lambda module, args, out: out.requires_grad_(True)
                                                if torch.is_grad_enabled() and not out.requires_grad else out)
        try:
            with run.autocast_context(device):  # the autocast training runs under: its kernels, its saved dtypes
                # a sharded model runs every layer: its engine's hooks (ZeRO-3 traces the order of the first forward's
                # modules to prefetch) should see the forward training runs
                sharded = self.sharding is not None
                return probe_training_memory(model, batch, compiled=self.compiled, backward=not sharded,
                                             every_layer=sharded)
        finally:
            hook.remove()
            model.train(was_training)

    def _longest(self, model: nn.Module, run: RunContext, device: torch.device, tokens: int,
                 planning: dict) -> tuple[int, bool]:
        """The longest micro-batch under `tokens` this budget holds, and whether a probe at that length confirmed it.
        The probe's sizes scaled linearly name a length; part of a step does not shrink with its tokens (a fused
        loss's chunk of logits, a chunked MLP's chunk), so a probe at that length (random tokens in one row) checks
        it, and where no plan fits there, the sizes taken as affine through the last two probes name a shorter one
        (LONGEST_CHECKS probes at most; none for a sharded model)."""
        from .plan import affine_between, longest_feasible_tokens, plan_checkpointing

        if self.sharding is None:
            # every probe in one regime: a shorter length that auto's MLP chunking leaves unchunked is one this
            # budget would chunk before refusing (apply), so it is probed chunked; the caller restores the chunking
            mlp_chunks.chunk_every_long_call(model)
        length = longest_feasible_tokens(self.probe.layers, tokens, **planning)
        before = (tokens, self.probe)
        # a sharded model's probes gather its weights across processes, which might not all need the same probes
        for _ in range(LONGEST_CHECKS if self.sharding is None else 0):
            if not length:
                break
            probe = self._probe(model, _synthetic_batch(model, length, device), run, device)
            if plan_checkpointing(probe.layers, **{**planning, "extra_bytes": probe.tail_peak_bytes}).fits:
                return length, True
            layers_at, extra_at = affine_between(before, (length, probe))
            before, length = (length, probe), longest_feasible_tokens(
                layers_at, length, **{**planning, "extra_bytes": extra_at, "upper": length - 1})
        return length, False

    def _refusal(self, budget: int, tokens: int, planning: dict, longest: int, checked: bool,
                 chunked: mlp_chunks.MlpChunking | None) -> str:
        """Why no plan fits: the leanest plan's needs, the smallest budget that fits these tokens, and the longest
        micro-batch (document) this budget holds."""
        from .plan import format_bytes

        plan = self.plan
        smallest = plan.predicted_peak_bytes / (1 - self.headroom)
        held = ("weights, gradients and optimizer states" if planning["grads"] is None
                else "weights and optimizer states")
        host = "" if plan.host_budget_bytes is None or "offload" not in plan.choices else (
            f" with {format_bytes(plan.host_bytes)} of host memory (of {format_bytes(plan.host_budget_bytes)} "
            "it may use)")
        if chunked is not None:  # (tried before refusing: chunk_every_long_call)
            host += f", every MLP call over {chunked.chunk_tokens:,} tokens chunked"
        if longest:
            how = ("a probe at that length fits" if checked else
                   f"the probe of {tokens:,} tokens scaled linearly, not confirmed by a probe at that length")
            shorter = (f"or train on at most {longest:,} tokens per micro-batch: about the longest document this "
                       f"budget holds ({how})")
        elif plan.fixed_bytes >= planning["budget_bytes"]:
            shorter = "even an empty micro-batch does not fit: the training state alone is over the budget"
        else:
            shorter = ("no shorter micro-batch was found to fit either (its probes did not): train on fewer tokens "
                       "per micro-batch and let the plan say")
        return (f"checkpointing budget {self.budget} ({format_bytes(budget)}) cannot be met for {tokens:,} tokens per "
                f"micro-batch: even the leanest plan ({PerLayer(choices=plan.choices).describe()}{host}) needs "
                f"{format_bytes(plan.predicted_peak_bytes)} on the device ({format_bytes(plan.fixed_bytes)} of it "
                f"{held}) plus {self.headroom:.0%} headroom. The smallest feasible budget is "
                f"'budget:{_ceil_bytes(smallest)}'; {shorter}.")

    def offloads(self, device: torch.device) -> bool:
        """Whether plans may offload: as asked, else on CUDA (host memory is a separate pool only there) with
        non-reentrant checkpointing (offload hooks what that saves)."""
        if self.offload is not None:
            return self.offload
        return device.type == "cuda" and not self.use_reentrant

    def modes(self, device: torch.device) -> tuple[str, ...]:
        """The per-layer choices plans may use. Reentrant checkpointing (docs/MULTI_GPU.md: ZeRO-3 with PEFT on an older
        deepspeed) has neither op-level nor offloaded layers: plans use whole-layer checkpointing or none there."""
        from .plan import DEVICE_MODES

        if self.use_reentrant:
            if self.offload:
                raise ConfigurationError(
                    f"checkpointing budget {self.budget}+offload needs non-reentrant checkpointing (offload hooks "
                    "what it saves), but this run uses reentrant checkpointing. Drop '+offload'."
                )
            return ("none", "full")
        return (*DEVICE_MODES, *(("offload",) if self.offloads(device) else ()), *(("spaced",) if self.spacing else ()))

    def layer_choices(self, layers: Sequence[nn.Module]) -> list[LayerChoice]:
        return list(self.plan.choices)

    def describe(self) -> str:
        planned = "" if self.plan is None else f": {PerLayer(choices=self.plan.choices).describe()}"
        return f"memory budget {self.budget}{planned}"


def plan_vs_peak(policy, peak_gib: float | None) -> dict[str, float]:
    """For a run's end summary: the budget, the plan's predicted peak and the measured peak, in GiB ({} when the
    policy is no applied memory budget or nothing was measured)."""
    if not isinstance(policy, MemoryBudget) or policy.plan is None or peak_gib is None:
        return {}
    return {"budget_gib": policy.budget_bytes_resolved / 2**30,
            "budget_predicted_gib": policy.plan.predicted_peak_bytes / 2**30, "peak_mem_gib": peak_gib}


_RUN_FACTS = ("batch_tokens", "sharding", "grads_freed", "compiled", "autocast")  # RunContext's fields
DEFAULT_PROBE_TOKENS = 2048
LONGEST_CHECKS = 3  # probes a refusal may run to confirm the longest length it names
HOST_SHARE = 0.8  # an offloading plan may use at most this share of the host memory available when it is made


def _check_host_memory(plan, budget) -> None:
    """Refuse, before training, an offloading plan whose saved inputs would not fit the host's available memory."""
    if not plan.host_bytes:
        return
    from .plan import format_bytes

    available = host_available_bytes()
    if plan.host_bytes > HOST_SHARE * available:
        raise ConfigurationError(
            f"checkpointing budget {budget}: the plan offloads {plan.choices.count('offload')} layers' saved inputs, "
            f"{format_bytes(plan.host_bytes)} of host memory, but only {format_bytes(available)} is available "
            f"(a plan may use {HOST_SHARE:.0%}). Raise the budget, train on fewer tokens per micro-batch, or free host "
            "memory."
        )


def _ceil_bytes(n: float) -> str:
    """A budget spec's size, rounded up: '23.47GiB', '4.4MiB'."""
    import math

    if n >= 1024**3:
        return f"{math.ceil(n / 1024**3 * 100) / 100:g}GiB"
    return f"{math.ceil(n / 1024**2 * 10) / 10:g}MiB"


def _first_process() -> bool:
    import os

    return os.environ.get("RANK", "0") == "0"


def _synthetic_batch(model: nn.Module, tokens: int, device: torch.device) -> dict:
    vocab = base_model(model).config.vocab_size
    input_ids = torch.randint(0, vocab, (1, tokens), device=device)
    position_ids = torch.arange(tokens, device=device)[None]
    return {"input_ids": input_ids, "labels": input_ids.clone(), "position_ids": position_ids, "use_cache": False}


def _unchunked_auto(model: nn.Module, tokens: int) -> mlp_chunks.MlpChunking | None:
    """The decoder MLPs' one chunking, where it is mlp_chunks="auto"'s and leaves a call of `tokens` unchunked
    (``MlpChunking.leaves_unchunked``); else None."""
    chunking = {mlp_chunks.chunking_of(mlp) for _, mlp in decoder_mlps(model)}
    if len(chunking) != 1 or None in chunking:
        return None
    (chunking,) = chunking
    return chunking if chunking.leaves_unchunked(tokens) else None
