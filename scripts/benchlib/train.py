"""Model construction and the timed training loops (a plain loop, and TRL's SFTTrainer with a timing callback)."""
from __future__ import annotations

import contextlib
import gc
import inspect
import itertools
import math
import sys
import tempfile
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Mapping, NamedTuple

import torch
from torch import nn

from hf_accel.training.flops import FlopModel, doc_lengths_from_batch
from .targets import target_count, targets_where_they_are, trainer_data_targets
from .workloads import BenchData, Workload, build_config

Batch = dict[str, Any]


class Targets(NamedTuple):
    """Real target tokens (after the causal shift), counted on the host batch before it moves to the device: a
    count read from the device batch would wait for the forward to finish before the backward is queued."""
    micro: int  # in this micro-batch
    step: int  # in the whole optimizer step


# (model, micro-batch on device, its target counts) -> loss already divided by the step's targets
LossFn = Callable[[nn.Module, Batch, Targets], torch.Tensor]
_STARTED = time.perf_counter()  # the child imports this module first thing: its start, for progress()


def progress(what: str) -> None:
    """One line on stderr with the seconds since the child started (host time: the GPU may be behind): a run killed
    at its timeout shows in its record's log tail how far it got, e.g. a long document's set-up against its step."""
    print(f"[bench child +{time.perf_counter() - _STARTED:.0f}s] {what}", file=sys.stderr, flush=True)


@dataclass
class RunSettings:
    """What the child process runs: one workload x one configuration."""

    workload: Workload
    device: str
    tiny: bool
    steps: int
    warmup: int
    step_time_budget: float  # seconds of timed steps; stops early (after >= min_steps) when spent
    seed: int = 0
    min_steps: int = 3
    profile_steps: int = 0  # profile the first N timed steps (bench.py --profile-steps): kernel time by category

    @property
    def dtype(self) -> torch.dtype:
        # bf16 weights (no fp32 master copy) for every configuration on GPU; fp32 for the CPU smoke run
        return torch.bfloat16 if self.device.startswith("cuda") else torch.float32


@dataclass
class Timing:
    step_seconds: list[float] = field(default_factory=list)
    step_docs: list[list[int]] = field(default_factory=list)
    losses: list[float] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    host_events: list[dict[str, Any]] = field(default_factory=list)  # per timed step, see HostEvents
    profile: dict[str, Any] | None = None  # kernel ms per step by category (RunSettings.profile_steps)
    step_targets: list[int] = field(default_factory=list)  # per timed step: tokens with a target (after the shift)
    data_targets: int | None = None  # the whole data set's target tokens as this configuration's data path labels it


def synchronize(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def build_model(settings: RunSettings, attn_implementation: str) -> nn.Module:
    """Random-init model of the workload's shape, on the device, in settings.dtype (+ checkpointing, no LoRA yet).
    "sdpa" means the family's stock reference implementation (``Family.reference_attention``)."""
    from transformers import AutoModelForCausalLM

    from hf_accel.patches import family_of

    torch.manual_seed(settings.seed)
    config = build_config(settings.workload, settings.tiny)
    if attn_implementation == "sdpa":  # the stock reference: eager where transformers refuses SDPA (Gemma 2)
        attn_implementation = family_of(config).reference_attention
    with torch.device(settings.device):
        model = AutoModelForCausalLM.from_config(
            config, attn_implementation=attn_implementation, dtype=settings.dtype
        )
    if any(t.device.type != torch.device(settings.device).type for t in itertools.chain(model.parameters(),
                                                                                         model.buffers())):
        model.to(settings.device)  # a submodule built its tensors outside the device context
    model.train()
    if settings.workload.checkpointing:
        # 5.23 renamed gradient_checkpointing_enable (5.17) and its kwargs; the first positional is the same dict
        enable = getattr(model, "activation_checkpointing_enable", None) or model.gradient_checkpointing_enable
        enable({"use_reentrant": False})
    progress("model built")
    return model


def expert_target_parameters(workload: Workload, model: nn.Module) -> list[str] | None:
    """Where the workload says so, the MoE experts' 3-D projections as PEFT's ``target_parameters`` names them in
    ``model`` (``hf_accel.patches.experts.lora_target_parameters``, the list ``hf-accel sft --lora-experts`` adapts):
    every row that adapts the experts takes these names. None for a workload without LoRA on the experts."""
    if not workload.lora_experts:
        return None
    from hf_accel.patches.experts import lora_target_parameters

    parameters = list(lora_target_parameters(model))
    if not parameters:
        raise ValueError(f"workload {workload.name} asks for LoRA on the experts, but this "
                         f"{type(model).__name__} has no MoE experts module")
    return parameters


def lora_config(workload: Workload, model: nn.Module):
    """The workload's LoRA for ``model``: r=16, alpha=32, no dropout, on its decoder linears, and where the workload
    says so on the MoE experts' 3-D projections too (``expert_target_parameters``)."""
    from peft import LoraConfig

    return LoraConfig(r=16, lora_alpha=32, lora_dropout=0.0, target_modules=list(workload.lora_targets),
                      target_parameters=expert_target_parameters(workload, model), task_type="CAUSAL_LM")


def add_lora(model: nn.Module, workload: Workload) -> nn.Module:
    """The workload's LoRA (lora_config) added with get_peft_model (identity when the workload has no LoRA)."""
    if not workload.lora:
        return model
    from peft import get_peft_model

    return get_peft_model(model, lora_config(workload, model))


def causal_lm(model: nn.Module) -> nn.Module:
    """The *ForCausalLM module under an optional PEFT wrapper."""
    return model.get_base_model() if hasattr(model, "get_base_model") else model


def call_filtered(fn: Callable[..., Any], batch: Mapping[str, Any]) -> Any:
    """Call `fn(**batch)`, dropping keys its signature cannot take (Falcon's forwards take no **kwargs)."""
    params = inspect.signature(fn).parameters
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return fn(**batch)
    return fn(**{k: v for k, v in batch.items() if k in params})


def hf_loss(model: nn.Module, batch: Batch, targets: Targets) -> torch.Tensor:
    """Stock loss: the model's own mean over this micro-batch, re-weighted to sum / step targets."""
    loss = call_filtered(model, {**batch, "use_cache": False}).loss
    return loss * (targets.micro / max(targets.step, 1))


def _to_device(batch: Mapping[str, Any], device: str) -> Batch:
    return {k: v.to(device, non_blocking=True) if torch.is_tensor(v) else v for k, v in batch.items()}


def forward_autocast(settings: RunSettings):
    """bf16 autocast around LoRA forwards on CUDA, as Trainer / TRL run them with bf16=True (accelerate wraps the
    forward): PEFT keeps adapters in fp32, and without autocast every adapted linear casts its input to fp32."""
    if settings.workload.lora and settings.device.startswith("cuda"):
        return torch.autocast("cuda", dtype=torch.bfloat16)
    return contextlib.nullcontext()


class HostEvents:
    """What the host did during each timed step that can stall the GPU: new torch.compile graphs, new flash-attn-4
    kernels (its JIT caches), and full (generation-2) garbage collections with their time. Host counters only, read
    at step ends: no sync. A slow step with none of these points elsewhere (allocator, data, the GPU itself)."""

    def __init__(self) -> None:
        self._gc_started = 0.0
        self._gc_full = 0
        self._gc_full_s = 0.0
        self._last = self._counts()
        gc.callbacks.append(self._on_gc)

    def _on_gc(self, phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            self._gc_started = time.perf_counter()
        elif info.get("generation") == 2:
            self._gc_full += 1
            self._gc_full_s += time.perf_counter() - self._gc_started

    def _counts(self) -> dict[str, float]:
        from hf_accel.fused.compiling import graphs_compiled

        fa4 = sys.modules.get("flash_attn.cute.interface")
        caches = [getattr(getattr(fa4, name, None), "compile_cache", None) for name in _FA4_JIT_FUNCTIONS]
        return {
            "compiled_graphs": graphs_compiled(),
            "fa4_kernels": sum(len(getattr(c, "cache", ())) for c in caches if c is not None),
            "gc_full": self._gc_full,
            "gc_full_ms": 1e3 * self._gc_full_s,
        }

    def step(self, index: int) -> dict[str, Any] | None:
        """The events since the previous call, or None when there were none."""
        now = self._counts()
        delta = {k: now[k] - self._last[k] for k in now}
        self._last = now
        if not any(delta.values()):
            return None
        delta["gc_full_ms"] = round(delta["gc_full_ms"], 1)
        return {"step": index, **{k: v for k, v in delta.items() if v}}

    def close(self) -> None:
        if self._on_gc in gc.callbacks:
            gc.callbacks.remove(self._on_gc)


_FA4_JIT_FUNCTIONS = ("_flash_attn_fwd", "_flash_attn_bwd", "_bwd_preprocess", "_bwd_postprocess_convert",
                      "_compute_tile_cumsum", "_compute_blocks_to_batch")


class StepClock:
    """Step-end marks without a host sync per step: CUDA events on GPU (read once, after the run), the CPU clock
    otherwise. The harness adds no synchronisation to the loop it times; each stack keeps the ones it makes itself
    (TRL reads its token-accuracy metrics with ``.item()`` every step; Liger's fused CE syncs once per call)."""

    def __init__(self, device: str, profile_steps: int = 0) -> None:
        from .profile import StepProfiler

        self.cuda = device.startswith("cuda")
        self.marks: list[Any] = []
        self.started_at: float | None = None  # perf_counter at the first mark, for the step-time budget
        # the first `profile_steps` timed steps under torch.profiler (bench.py --profile-steps)
        self.profiler = StepProfiler(profile_steps, self.cuda) if profile_steps > 0 else None

    def start(self) -> None:
        """The first mark, after warm-up: compilation and allocator growth stay out of the timed window."""
        synchronize("cuda" if self.cuda else "cpu")
        self.started_at = time.perf_counter()
        self.mark()

    def mark(self) -> None:
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            self.marks.append(event)
        else:
            self.marks.append(time.perf_counter())
        if self.profiler is not None:
            if len(self.marks) == 1:
                self.profiler.begin()
            elif len(self.marks) == 1 + self.profiler.steps:
                self.profiler.end()

    def finish_profile(self) -> dict[str, Any] | None:
        """After the run: the profiled steps' kernel time by category (benchlib.profile); a profiler the run
        stopped before its last profiled step is stopped here, over the steps that ran."""
        if self.profiler is not None and self.profiler.result is None:
            self.profiler.end(max(1, self.steps))  # the run stopped before the last profiled step: what ran
        return None if self.profiler is None else self.profiler.result

    @property
    def steps(self) -> int:
        return max(0, len(self.marks) - 1)

    def spent(self) -> float:
        """Host seconds since start (the GPU may still be up to a step or two behind)."""
        return 0.0 if self.started_at is None else time.perf_counter() - self.started_at

    def step_seconds(self) -> list[float]:
        if self.cuda:
            torch.cuda.synchronize()
            return [a.elapsed_time(b) / 1e3 for a, b in itertools.pairwise(self.marks)]
        return [b - a for a, b in itertools.pairwise(self.marks)]


def run_loop(
    model: nn.Module, steps: Iterator[list[Batch]], loss_fn: LossFn, settings: RunSettings, timing: Timing,
    optimizer: torch.optim.Optimizer | None = None,
) -> torch.optim.Optimizer:
    """Warmup + timed optimizer steps; each step = its micro-batches (input wait and collation included). Returns
    the optimizer, which a later call can continue (a new one creates its state again on its first step)."""
    model.train()  # from_pretrained returns eval mode, where HF's gradient checkpointing stands down
    if optimizer is None:
        optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-5, fused=True)
    clock = StepClock(settings.device, settings.profile_steps)
    events = HostEvents()
    losses: list[torch.Tensor | float] = []
    progress("model ready (built, patched, planned); training starts")
    if settings.warmup == 0:
        clock.start()
    for index in range(settings.warmup + settings.steps):
        micro = next(steps)
        counts = [target_count(mb) for mb in micro]  # CPU tensors: no sync
        step_targets = sum(counts)
        step_loss = 0.0  # becomes a device tensor: no host-to-device copy of a CPU scalar (which can sync)
        for mb, count in zip(micro, counts):
            with forward_autocast(settings):
                loss = loss_fn(model, _to_device(mb, settings.device), Targets(count, step_targets))
            loss.backward()
            step_loss = loss.detach().float() + step_loss
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if index < 3 or (index + 1) % 20 == 0:  # a long document's steps, not thirty lines of short ones
            progress(f"step {index + 1} of {settings.warmup + settings.steps} queued")
        happened = events.step(index - settings.warmup)
        if index + 1 == settings.warmup:
            clock.start()
        elif index >= settings.warmup:
            clock.mark()
            timing.step_docs.append([n for mb in micro for n in doc_lengths_from_batch(mb)])
            timing.step_targets.append(step_targets)
            losses.append(step_loss)
            if happened:
                timing.host_events.append(happened)
            if clock.spent() > settings.step_time_budget and clock.steps >= settings.min_steps:
                timing.notes.append(f"stopped after {clock.steps} timed steps (step time budget)")
                break
    events.close()
    timing.profile = clock.finish_profile()
    timing.step_seconds = clock.step_seconds()
    timing.losses = [float(x) for x in losses]
    return optimizer


def offline_tokenizer():
    """A tiny word-level tokenizer (pad id 0, eos id 1): TRL needs a processing class; the data is pre-tokenized."""
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel({"<pad>": 0, "<eos>": 1, "<unk>": 2}, unk_token="<unk>"))
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>", unk_token="<unk>")


def _timing_callback(settings: RunSettings, timing: Timing, clock: StepClock):
    from transformers import TrainerCallback

    class StepTimer(TrainerCallback):
        """Marks step ends on the StepClock (no sync of its own) and notes host events, as run_loop does."""

        events: HostEvents | None = None

        def on_train_begin(self, args, state, control, **kwargs):
            progress("trainer ready; training starts")
            self.events = HostEvents()
            if settings.warmup == 0:
                clock.start()

        def on_train_end(self, args, state, control, **kwargs):
            self.events.close()

        def on_step_end(self, args, state, control, **kwargs):
            if state.global_step <= 3 or state.global_step % 20 == 0:
                progress(f"step {state.global_step} queued")
            happened = self.events.step(state.global_step - 1 - settings.warmup)
            if state.global_step == settings.warmup:
                clock.start()
            elif state.global_step > settings.warmup:
                clock.mark()
                if happened:
                    timing.host_events.append(happened)
                if clock.spent() > settings.step_time_budget and clock.steps >= settings.min_steps:
                    timing.notes.append(f"stopped after {clock.steps} timed steps (step time budget)")
                    control.should_training_stop = True

    return StepTimer()


def train_timed(trainer_cls: type, settings: RunSettings, timing: Timing,
                make: Callable[[type, Any], Any]) -> Any:
    """Build a trainer with ``make(trainer class, timing callback)`` and train it: the class records each training
    step's document lengths and loss (read after the run: no sync from the harness), the callback marks step ends on
    a StepClock; the timed steps (after ``settings.warmup``) go to ``timing``. Returns the trainer."""
    docs: list[list[int]] = []
    losses: list[torch.Tensor] = []
    targets: list[torch.Tensor] = []
    clock = StepClock(settings.device, settings.profile_steps)

    class Counting(trainer_cls):
        def training_step(self, model, inputs, *args, **kwargs):
            docs.append(doc_lengths_from_batch(inputs))
            targets.append(targets_where_they_are(inputs))
            loss = super().training_step(model, inputs, *args, **kwargs)
            losses.append(loss.detach())
            return loss

    trainer = make(Counting, _timing_callback(settings, timing, clock))
    trainer.train()
    timing.profile = clock.finish_profile()
    timing.step_seconds = clock.step_seconds()
    timed = slice(settings.warmup, settings.warmup + len(timing.step_seconds))
    timing.step_docs.extend(docs[timed])
    timing.step_targets.extend(int(t) for t in targets[timed])
    timing.losses = [float(x) for x in losses[timed]]
    return trainer


def sft_arguments(settings: RunSettings, data: BenchData, output_dir: str, liger: bool,
                  packing_strategy: str = "bfd", loss_type: str = "nll") -> dict[str, Any]:
    """TRL SFTConfig arguments: the harness's shared settings (steps, learning rate, fused AdamW, bf16 on CUDA, the
    step's token budget as rows of max_len) and the configuration's own (packing strategy, loss, Liger). packing=True
    with strategy "bfd" is TRL's padding-free path; prompt-masked data trains with completion_only_loss=True."""
    spec = data.spec
    cuda = settings.device.startswith("cuda")
    return dict(
        output_dir=output_dir, max_steps=settings.warmup + settings.steps, max_length=spec.max_len, packing=True,
        packing_strategy=packing_strategy, per_device_train_batch_size=max(1, spec.tokens_per_step // spec.max_len),
        gradient_accumulation_steps=1, learning_rate=1e-5, lr_scheduler_type="constant", warmup_steps=0,
        optim="adamw_torch_fused", bf16=cuda, use_cpu=not cuda, gradient_checkpointing=settings.workload.checkpointing,
        gradient_checkpointing_kwargs={"use_reentrant": False}, save_strategy="no",  # TRL's logging_steps
        report_to="none", disable_tqdm=True, dataloader_num_workers=0, seed=settings.seed,
        use_liger_kernel=liger, shuffle_dataset=False, completion_only_loss=data.prompts is not None,
        loss_type=loss_type, **liger_settings(settings.workload, liger),
    )


def liger_settings(workload: Workload, liger: bool) -> dict[str, Any]:
    """TrainingArguments' ``liger_kernel_config`` where Liger's defaults cannot train the workload: with LoRA on the
    MoE experts, its fused experts kernel (``LigerExperts``, bound by ``swiglu=True`` on Qwen3-MoE and Mixtral) takes
    full weights only, and bound on PEFT's ``ParamWrapper`` it fails at the first step (run 41: "'ParamWrapper' object
    has no attribute 'hidden_dim'"); its norms and RoPE still serve."""
    return {"liger_kernel_config": {"swiglu": False}} if liger and workload.lora_experts else {}


def run_trl(model: nn.Module, data: BenchData, settings: RunSettings, timing: Timing, liger: bool,
            sft_overrides: dict[str, Any] | None = None, processing_class: Any = None, *, peft_config: Any = None,
            packing_strategy: str = "bfd", loss_type: str = "nll", trainer_cls: type | None = None) -> nn.Module:
    """TRL SFTTrainer, packing=True (bfd => padding-free): rows of max_len, tokens_per_step // max_len rows a step.
    ``sft_overrides`` replace SFTConfig arguments (Unsloth: its own checkpointing instead of TRL's). Prompt-masked
    data goes in TRL's prompt-completion form, pre-tokenized: ``completion_mask`` (0 on the prompt) with
    ``completion_only_loss=True``, from which TRL builds the labels itself. ``peft_config``: the adapters as TRL's own
    LoRA / QLoRA path adds them (SFTTrainer(peft_config=...) on the base model). ``trainer_cls``: another SFTTrainer
    (hf_accel's). Returns the model the trainer trained (the PeftModel TRL built, where it built one)."""
    from datasets import Dataset
    from trl import SFTConfig, SFTTrainer

    columns: dict[str, Any] = {"input_ids": data.samples}
    if data.prompts is not None:
        columns["completion_mask"] = [[0] * p + [1] * (n - p) for n, p in zip(data.lengths, data.prompts)]
    with tempfile.TemporaryDirectory() as out:
        args = SFTConfig(**{**sft_arguments(settings, data, out, liger, packing_strategy, loss_type),
                            **(sft_overrides or {})})
        extra = {} if peft_config is None else {"peft_config": peft_config}

        def make(cls: type, timer: Any) -> Any:
            trainer = cls(model=model, args=args, train_dataset=Dataset.from_dict(columns),
                          processing_class=processing_class or offline_tokenizer(), callbacks=[timer], **extra)
            if data.prompts is not None:
                timing.data_targets = trainer_data_targets(trainer)
            return trainer

        trainer = train_timed(trainer_cls or SFTTrainer, settings, timing, make)
    return model if trainer is None else trainer.model


def summarize(model: nn.Module, timing: Timing, peak: float | None, device: str) -> dict[str, Any]:
    """tokens/s, MFU and the rest from the timed steps."""
    if not timing.step_seconds:
        raise RuntimeError("no timed steps were recorded (steps too small or run stopped during warmup)")
    flop_model = FlopModel.from_model(model)
    seconds = sum(timing.step_seconds)
    docs = timing.step_docs[: len(timing.step_seconds)]
    step_tokens = [sum(d) for d in docs]
    tokens = sum(step_tokens)
    step_targets = timing.step_targets[: len(docs)] if len(timing.step_targets) >= len(docs) else [None] * len(docs)
    flops = sum(flop_model.step_flops(d, t) for d, t in zip(docs, step_targets))
    step_rates = sorted(n / s for n, s in zip(step_tokens, timing.step_seconds))
    result = {
        "timed_steps": len(timing.step_seconds), "timed_seconds": seconds, "real_tokens": tokens,
        "tokens_per_s": tokens / seconds, "model_flops_per_s": flops / seconds,
        "steady_tokens_per_s": step_rates[len(step_rates) // 2], "step_tokens": step_tokens,
        "mfu": flops / seconds / peak if peak else None,
        "loss": timing.losses[-1] if timing.losses else None, "losses": timing.losses,
        "loss_finite": bool(timing.losses) and all(math.isfinite(x) for x in timing.losses),
        "step_seconds": timing.step_seconds, "flop_model": flop_model.__dict__, "notes": timing.notes,
        "host_events": timing.host_events,
        "mfu_counts": "every matmul weight on every real token, but the LM head on target tokens only (a masked "
                      "position needs no logits), attention per document; no recomputation" if None not in step_targets
                      else "every matmul weight on every real token (targets not counted), attention per document",
    }
    if None not in step_targets:
        result.update(step_targets=step_targets, target_tokens=sum(step_targets),
                      target_fraction=sum(step_targets) / tokens if tokens else None)
    if timing.data_targets is not None:
        result["data_target_tokens"] = timing.data_targets
    if device.startswith("cuda"):
        result["peak_gib"] = torch.cuda.max_memory_allocated() / 2**30
    return result
