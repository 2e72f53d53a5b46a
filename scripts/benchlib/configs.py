"""The benchmarked configurations: what each needs (as data) and how it builds its model and batches."""
from __future__ import annotations

import functools
import importlib.util
import itertools
from typing import Any, Callable, Iterator

import torch
from torch import nn

import hf_accel
from hf_accel.data.collators import TARGET_ROWS_KEY, DataCollatorForPacking
from hf_accel.data.prepare import dataloader_kwargs
from hf_accel.data.sampling import TokenBudgetBatchSampler
from hf_accel.fused.cross_entropy import causal_lm_loss_from_hidden
from hf_accel.fused.ops import unavailable_reason
from hf_accel.patches import FAMILIES, family_of

from .anchors import ANCHORS, FA4, TrlRecipe
from .apart import (APART_PACKAGES, BNB_SITES, TORCHAO_SITES, UNSLOTH_SITES, child_sites, missing_apart, qlora_base,
                    unsloth_runner)
from .distributed import run_accel_trainer
from .options import BenchConfig, Options
from .train import (Batch, RunSettings, Timing, add_lora, build_model, call_filtered, causal_lm, forward_autocast,
                    Targets, hf_loss, lora_config, progress, run_loop, run_trl)
from .targets import data_targets
from .workloads import BenchData, Workload, greedy_steps, micro_batches


def _has(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


def _hf_accel_api() -> bool:
    try:
        import hf_accel
        from hf_accel.data.collators import DataCollatorForPacking  # noqa: F401
        from hf_accel.data.sampling import TokenBudgetBatchSampler  # noqa: F401
    except ImportError:
        return False
    return hasattr(hf_accel, "patch")


def _liger_families() -> set[str]:
    try:
        from liger_kernel.transformers.monkey_patch import MODEL_TYPE_TO_APPLY_LIGER_FN
    except Exception:  # noqa: BLE001 - liger imports triton; any failure means "cannot use liger"
        return set()
    return set(MODEL_TYPE_TO_APPLY_LIGER_FN)


def _cuda(device: str) -> bool:
    return device.startswith("cuda") and torch.cuda.is_available()


# name -> check(device, family) returning why it is unmet, or None
REQUIREMENTS: dict[str, Callable[[str, str], str | None]] = {
    "cuda": lambda device, fam: None if _cuda(device) else "needs CUDA",
    "fa4": lambda device, fam: ("needs CUDA" if not _cuda(device) else
                                None if _has("flash_attn.cute") else "flash-attn-4 (flash_attn.cute) not installed"),
    "liger": lambda device, fam: None if _has("liger_kernel") else "liger-kernel not installed",
    "liger-family": lambda device, fam: (None if fam in _liger_families()
                                         else f"liger-kernel has no kernels for model_type {fam!r}"),
    "trl": lambda device, fam: None if _has("trl") and _has("datasets") else "trl / datasets not installed",
    "hf_accel": lambda device, fam: (None if _hf_accel_api()
                                     else "hf_accel.patch / collators / sampling not importable yet"),
}


def missing_requirement(config: BenchConfig, device: str, family: str, options: Options,
                        workload: Workload | None = None) -> str | None:
    """Why `config` cannot run here (first unmet requirement), or None. A substitute attention waives "fa4".
    Packages kept apart (APART_PACKAGES) are looked for in the config's child path: its sites, then this process's."""
    if config.loads_files and workload is not None and workload.qlora_build == "device":
        return (f"it loads its model from files, and {workload.name}'s bf16 weights (2 bytes a parameter: ~140 GB "
                "for 70B shapes) fit neither this machine's disk nor its RAM; the QLoRA rows build the 4-bit base "
                "on the GPU instead (benchlib.quantized_base)")
    for need in config.needs:
        if need == "fa4" and options.substitute_attn:
            continue
        if need in APART_PACKAGES:
            reason = missing_apart(need, child_sites(config, options))
        else:
            reason = REQUIREMENTS[need](device, family)
        if reason:
            return reason
    return None


def _attn(options: Options, wanted: str) -> str:
    return options.substitute_attn if (wanted == FA4 and options.substitute_attn) else wanted


def _padded_steps(data: BenchData, timing: Timing | None = None) -> Iterator[list[Batch]]:
    steps = greedy_steps(data.lengths, data.spec.tokens_per_step)
    if timing is not None and data.prompts is not None:
        timing.data_targets = data_targets(_pad(data, mb) for step in steps
                                           for mb in micro_batches(step, data.spec.padded_batch_size))
    for step in itertools.cycle(steps):
        yield [_pad(data, mb) for mb in micro_batches(step, data.spec.padded_batch_size)]


def _pad(data: BenchData, indices: list[int]) -> Batch:
    """Right-pad samples to the longest: input_ids (B, S), attention_mask, labels (-100 on padding and prompts)."""
    samples = [data.samples[i] for i in indices]
    longest = max(len(s) for s in samples)
    input_ids = torch.zeros(len(samples), longest, dtype=torch.long)
    mask = torch.zeros_like(input_ids)
    for row, sample in enumerate(samples):
        input_ids[row, : len(sample)] = torch.tensor(sample)
        mask[row, : len(sample)] = 1
    labels = input_ids.masked_fill(mask == 0, -100)
    for row, i in enumerate(indices):
        if data.prompts is not None:
            labels[row, : data.prompts[i]] = -100
    return {"input_ids": input_ids, "attention_mask": mask, "labels": labels}


def _flattened_steps(data: BenchData, timing: Timing | None = None) -> Iterator[list[Batch]]:
    """Stock packing: transformers' DataCollatorWithFlattening, one row per step, position_ids only."""
    from transformers import DataCollatorWithFlattening

    collate = DataCollatorWithFlattening(return_tensors="pt")
    steps = greedy_steps(data.lengths, data.spec.tokens_per_step)
    if timing is not None and data.prompts is not None:
        timing.data_targets = data_targets(collate(data.features(step)) for step in steps)
    for step in itertools.cycle(steps):
        batch = collate(data.features(step))
        yield [{k: batch[k] for k in ("input_ids", "labels", "position_ids")}]


def _hf_accel_steps(data: BenchData, seed: int, target_rows: bool = False,
                    timing: Timing | None = None) -> Iterator[list[Batch]]:
    """hf_accel's data path: token-budget best-fit bins packed into one row each by DataCollatorForPacking, through a
    DataLoader with hf_accel.data.prepare.dataloader_kwargs() (collating in worker processes, pinned memory on CUDA).
    ``target_rows``: the collator lists the positions with a target, for a model whose loss is the fused loss."""
    from torch.utils.data import DataLoader

    sampler = TokenBudgetBatchSampler(data.lengths, max_tokens=data.spec.tokens_per_step, shuffle=True, seed=seed)
    collator = DataCollatorForPacking(pad_token_id=0, max_tokens=None, target_rows=target_rows)
    features = data.features()
    if timing is not None and data.prompts is not None:
        timing.data_targets = data_targets(collator(features[i: i + 64]) for i in range(0, len(features), 64))
    loader = DataLoader(features, batch_sampler=sampler, collate_fn=collator, **dataloader_kwargs())
    for epoch in itertools.count():
        sampler.set_epoch(epoch)
        for batch in loader:
            yield [batch]


def _stock(attn: str, packed: bool) -> Callable[..., nn.Module]:
    def run(settings: RunSettings, data: BenchData, options: Options, timing: Timing) -> nn.Module:
        model = add_lora(build_model(settings, _attn(options, attn)), settings.workload)
        steps = _flattened_steps(data, timing) if packed else _padded_steps(data, timing)
        run_loop(model, steps, hf_loss, settings, timing)
        return model

    return run


def _liger_padded(settings: RunSettings, data: BenchData, options: Options, timing: Timing) -> nn.Module:
    from liger_kernel.transformers.monkey_patch import _apply_liger_kernel_to_instance

    model = build_model(settings, "sdpa")
    _apply_liger_kernel_to_instance(model=model)  # rope, norms, MLP and fused linear CE in the forward
    model = add_lora(model, settings.workload)
    run_loop(model, _padded_steps(data, timing), hf_loss, settings, timing)
    return model


def _trl(name: str, ours: bool = False) -> Callable[..., nn.Module]:
    """Anchor `name`'s TRL configuration, from its recipe (anchors.ANCHORS): the base as the recipe loads it (bf16, or
    NF4 with or without PEFT's kbit preparation), LoRA through TRL's peft_config, SFTConfig from the recipe.
    ``ours``: the same recipe through hf_accel.SFTTrainer (the TRL drop-in, no hf_accel flags: issue 69c)."""
    recipe: TrlRecipe = ANCHORS[name].trl

    def run(settings: RunSettings, data: BenchData, options: Options, timing: Timing) -> nn.Module:
        attn = _attn(options, recipe.attn_implementation)
        if recipe.quantized:
            model = qlora_base(settings, attn, kbit_preparation=recipe.kbit_preparation)
        else:
            model = build_model(settings, attn)
        peft = lora_config(settings.workload, model) if settings.workload.lora else None
        timing.notes.append(f"{'hf_accel.SFTTrainer on the recipe of ' if ours else ''}anchor {name}: {recipe}")
        trainer_cls = None
        if ours:
            from hf_accel import SFTTrainer as trainer_cls
        return run_trl(model, data, settings, timing, liger=recipe.liger, peft_config=peft,
                       packing_strategy=recipe.packing_strategy, loss_type=recipe.loss_type, trainer_cls=trainer_cls)

    return run


def _fused_loss(options: Options) -> Callable[..., torch.Tensor]:
    def loss_fn(model: nn.Module, batch: Batch, targets: Targets) -> torch.Tensor:
        lm = causal_lm(model)
        decoder = getattr(lm, lm.base_model_prefix)
        inputs = {k: v for k, v in batch.items() if k not in ("labels", TARGET_ROWS_KEY)}
        hidden = call_filtered(decoder, {**inputs, "use_cache": False}).last_hidden_state
        return causal_lm_loss_from_hidden(model, hidden, batch["labels"], num_items_in_batch=targets.step,
                                          target_rows=batch.get(TARGET_ROWS_KEY), chunk_size=options.ce_chunk_size,
                                          method=options.fused_ce,
                                          softcap=family_of(lm).final_logit_softcap(lm.config))  # Gemma 2's cap

    return loss_fn


def _bench_context(settings: RunSettings | None, tokens_per_step: int) -> Any:
    """The run a checkpoint policy is applied for here: a packed row of the step's real size (one micro-batch per
    step), gradients freed as the bench loop frees them (zero_grad(set_to_none=True)), and the autocast the loop's
    forwards run under (``forward_autocast``)."""
    from hf_accel.memory.context import autocast_dtype, run_context

    autocast = None if settings is None else autocast_dtype(torch.device(settings.device).type,
                                                            forward_autocast(settings))
    return run_context(batch_tokens=tokens_per_step, autocast=autocast)


def _apply_checkpointing(model: nn.Module, spec: str, tokens_per_step: int, timing: Timing,
                         settings: RunSettings | None = None) -> None:
    """The policy goes on after LoRA, so a memory budget counts only the adapters' gradients and optimizer states."""
    from hf_accel.memory.checkpointing import policy_from_spec

    policy = policy_from_spec(spec)
    policy.apply(model, _bench_context(settings, tokens_per_step))
    timing.notes.append(f"checkpointing: {policy.describe()}")


def _patched(base: Callable[[RunSettings, str], nn.Module] | None = None, all_rows: bool = False,
             untrimmed: str | None = None, **patch_kwargs: Any) -> Callable[..., nn.Module]:
    """`hf_accel.patch(model, **patch_kwargs)` on the workload's model from ``base`` (default: the random-init model;
    or the NF4 QLoRA base), then its LoRA and hf_accel's packing; no --best-* option reaches it. With no arguments:
    whatever the library chooses by itself (issue 18's "hf_accel defaults"). Where that binds the fused loss the
    collator lists the target rows, as hf_accel.Trainer does (``all_rows``: it does not, the loss takes every row).
    ``untrimmed``: the name of a policy class in hf_accel.memory.checkpointing, applied with trim_recompute=False (a
    fresh one per run): the defaults' checkpointing without the trimmed recompute, for a same-run comparison."""

    def run(settings: RunSettings, data: BenchData, options: Options, timing: Timing) -> nn.Module:
        model = (base or build_model)(settings, "sdpa")
        kwargs = dict(patch_kwargs)
        if untrimmed is not None:
            from hf_accel.memory import checkpointing

            kwargs["checkpointing"] = getattr(checkpointing, untrimmed)(trim_recompute=False, explicit=False)
        report = hf_accel.patch(model, **kwargs)
        timing.notes.append(f"patch: {report}")
        rows = bool(getattr(report, "fused_ce", False)) and not all_rows
        if getattr(report, "fused_ce", False):
            timing.notes.append(f"fused loss over {'target rows only' if rows else 'every row'}")
        model = add_lora(model, settings.workload)
        run_loop(model, _hf_accel_steps(data, settings.seed, rows, timing), hf_loss, settings, timing)
        return model

    return run


def _hf_accel(best: bool) -> Callable[..., nn.Module]:
    def run(settings: RunSettings, data: BenchData, options: Options, timing: Timing) -> nn.Module:
        model = build_model(settings, "sdpa")
        # every fast path is named explicitly, so `hf_accel` stays "attention + packing only" whatever the defaults
        kwargs: dict[str, Any] = {"backend": options.backend if best else "auto", "fused_ops": False,
                                  "mlp_chunks": options.mlp_chunks if best else False}
        if best and options.fused_ops != "off":
            kwargs["fused_ops"] = options.fused_ops == "on" or unavailable_reason(model) is None
        # fused_ce "auto" is the user's path: patch(fused_ce=True) computes the loss inside the model's forward
        # (its "inline" method); "inline" / "recompute" / "liger" force one method, computed from outside the model.
        in_forward = best and options.fused_ce == "auto"
        report = hf_accel.patch(model, fused_ce=in_forward, compile=best and options.compile, **kwargs)
        timing.notes.append(f"patch: {report}")
        model = add_lora(model, settings.workload)
        if best and options.checkpointing is not None:
            _apply_checkpointing(model, options.checkpointing, data.spec.tokens_per_step, timing, settings)
        outside = best and options.fused_ce in ("inline", "recompute", "liger")
        loss_fn = _fused_loss(options) if outside else hf_loss
        rows = outside or bool(getattr(report, "fused_ce", False))  # a fused loss: over the target rows only
        if best:
            timing.notes.append(f"fused_ce={options.fused_ce}{', over target rows only' if rows else ''}")
        steps = _hf_accel_steps(data, settings.seed, target_rows=rows, timing=timing)
        run_loop(model, steps, loss_fn, settings, timing)
        return model

    return run


def _hf_accel_trainer(kind: str) -> Callable[..., nn.Module]:
    """An hf_accel configuration under a launcher: hf_accel.Trainer (it patches the model; FSDP2 comes from the
    launcher's environment) with a token budget of the step's tokens per rank. `kind`: "defaults" (AccelArguments'
    own choices: patch(model)'s), "defaults-all-rows" (the same, the fused loss over every row), "plain" (every fast
    path off) or "best" (the --best-* options, as hf_accel-best)."""

    def run(settings: RunSettings, data: BenchData, options: Options, timing: Timing) -> nn.Module:
        from hf_accel import AccelArguments  # the Trainer's module loads transformers' Trainer: only where launched

        model = add_lora(build_model(settings, "sdpa"), settings.workload)
        accel = AccelArguments(max_tokens_per_batch=data.spec.tokens_per_step)
        if kind == "plain":
            accel.fused_ce = accel.fused_ops = accel.compile = accel.mlp_chunks = False
        elif kind == "best":
            accel.backend, accel.checkpointing, accel.fused_ce = options.backend, options.checkpointing, True
            accel.fused_ops = options.fused_ops == "on" or (options.fused_ops == "auto"
                                                            and unavailable_reason(causal_lm(model)) is None)
            accel.compile, accel.mlp_chunks = options.compile, options.mlp_chunks
            timing.notes.append("fused_ce=True (AccelArguments; --fused-ce methods are not used under a launcher)")
        return run_accel_trainer(model, data, settings, timing, accel, all_rows=kind == "defaults-all-rows")

    return run


def _stock_packing_leaks() -> tuple[str, ...]:
    """Model types whose stock packing lets documents attend to each other (Falcon ignores packed position_ids
    under sdpa / TRL): ``Family.stock_packing``."""
    return tuple(t for family in FAMILIES if not family.stock_packing for t in family.model_types)


_PACKING_LEAKS = _stock_packing_leaks()
CONFIGS: dict[str, BenchConfig] = {
    c.name: c
    for c in [
        BenchConfig("hf-sdpa-padded", True, (), _stock("sdpa", packed=False),
                    "stock HF, sdpa, micro-batches of 8 padded to longest"),
        BenchConfig("hf-fa4-padded", True, ("fa4",), _stock(FA4, packed=False),
                    "stock HF, attn_implementation=flash_attention_4, padded"),
        BenchConfig("hf-sdpa-packed", True, (), _stock("sdpa", packed=True),
                    "stock HF, sdpa, DataCollatorWithFlattening (one row, position_ids)", wrong_for=_PACKING_LEAKS),
        BenchConfig("liger-sdpa-padded", True, ("cuda", "liger", "liger-family"), _liger_padded,
                    "liger_kernel on stock sdpa, padded"),
        BenchConfig("trl-fa4-packed", True, ("fa4", "trl"), _trl("trl-fa4-packed"),
                    "TRL SFTTrainer packing=True (bfd, padding-free), flash_attention_4, LoRA through peft_config",
                    wrong_for=_PACKING_LEAKS, launched=_trl("trl-fa4-packed")),
        BenchConfig("trl-fa4-packed-liger", True, ("fa4", "trl", "cuda", "liger", "liger-family"),
                    _trl("trl-fa4-packed-liger"), "as trl-fa4-packed plus use_liger_kernel=True",
                    wrong_for=_PACKING_LEAKS, launched=_trl("trl-fa4-packed-liger")),
        # issue 69c: the TRL route, TRL's own SFTConfig through hf_accel.SFTTrainer, with and without Liger
        BenchConfig("hf_accel-trl", False, ("hf_accel", "trl"), _trl("trl-fa4-packed", ours=True),
                    "hf_accel.SFTTrainer (no hf_accel flags) with trl-fa4-packed's SFTConfig and model: the TRL "
                    "drop-in"),
        BenchConfig("hf_accel-trl-liger", False, ("hf_accel", "trl", "cuda", "liger", "liger-family"),
                    _trl("trl-fa4-packed-liger", ours=True),
                    "as hf_accel-trl with use_liger_kernel=True (trl-fa4-packed-liger's SFTConfig): liger's modules "
                    "bound before hf_accel patches"),
        BenchConfig("hf_accel", False, ("hf_accel",), _hf_accel(best=False),
                    "hf_accel.patch(model, fused_ce=False, fused_ops=False, compile=False, mlp_chunks=False) + "
                    "TokenBudgetBatchSampler "
                    "+ DataCollatorForPacking: attention and packing only (what patch(model) did before issue 18)",
                    launched=_hf_accel_trainer("plain")),
        BenchConfig("hf_accel-defaults", False, ("hf_accel",), _patched(),
                    "hf_accel.patch(model), no arguments (the library's own choices) + the same packing",
                    launched=_hf_accel_trainer("defaults")),
        BenchConfig("hf_accel-trainer", False, ("hf_accel",), _hf_accel_trainer("defaults"),
                    "hf_accel.Trainer with no hf_accel flags (AccelArguments' token budget: the step's tokens), "
                    "the data as a datasets.Dataset: the drop-in for transformers' Trainer, its loop and logging "
                    "included (hf_accel-defaults runs the harness's own loop)"),
        BenchConfig("hf_accel-defaults-all-rows", False, ("hf_accel",), _patched(all_rows=True),
                    "as hf_accel-defaults, the fused loss over every row (the collator lists no target rows): "
                    "the LM head's work on masked positions, as before issue 39",
                    launched=_hf_accel_trainer("defaults-all-rows")),
        BenchConfig("hf_accel-untrimmed", False, ("hf_accel",), _patched(untrimmed="FullCheckpointing"),
                    "as hf_accel-defaults, the recompute untrimmed (the checkpointing before 2026-12-04: "
                    "FullCheckpointing(trim_recompute=False)); on workloads that checkpoint, what the trimmed "
                    "recompute gains"),
        BenchConfig("hf_accel-sdpa", False, ("hf_accel",), _patched(backend="sdpa"),
                    "hf_accel.patch(model, backend='sdpa'), otherwise no arguments: the path ALiBi took before flex "
                    "(documents regrouped into padded rows with a dense float bias)"),
        BenchConfig("hf_accel-offload", False, ("hf_accel",), _patched(checkpointing="offload"),
                    "hf_accel.patch(model, checkpointing='offload'), otherwise no arguments: every layer "
                    "checkpointed, its input kept in pinned host memory (Unsloth's offloaded checkpointing's memory "
                    "class) + the same packing"),
        BenchConfig("hf_accel-offload-mlp4k", False, ("hf_accel",), _patched(checkpointing="offload", mlp_chunks=4096),
                    "as hf_accel-offload, with the MLP in checkpointed chunks of 4,096 tokens (mlp_chunks=4096): a "
                    "layer's recompute holds a quarter of its MLP intermediates at 16k-token packs"),
        # issue 39c's levers toward 60% MFU, one at a time on top of the defaults
        BenchConfig("hf_accel-autotune", False, ("hf_accel", "cuda"),
                    _patched(compile={"mode": "max-autotune-no-cudagraphs"}),
                    "hf_accel.patch(model, compile={'mode': 'max-autotune-no-cudagraphs'}): inductor's autotuned "
                    "matmul templates with fused epilogues in the compiled layers (longer first compile)"),
        BenchConfig("hf_accel-cudagraphs", False, ("hf_accel", "cuda"), _patched(compile={"mode": "reduce-overhead"}),
                    "hf_accel.patch(model, compile={'mode': 'reduce-overhead'}): the compiled layers' regions "
                    "replayed as CUDA graphs (one recording per token count seen; two graphs a layer)"),
        BenchConfig("hf_accel-without-nested-breaks", False, ("hf_accel", "cuda"),
                    _patched(compile={"nested_graph_breaks": False}),
                    "hf_accel.patch(model, compile={'nested_graph_breaks': False}): the compiled layers traced "
                    "without dynamo's nested graph breaks (a frame per enclosing call around the attention, ~6 graphs "
                    "a layer, instead of the default's one graph before the attention and one after)"),
        BenchConfig("hf_accel-torch-fa2", False, ("hf_accel", "cuda"), _patched(backend="torch-fa2"),
                    "hf_accel.patch(model, backend='torch-fa2'), otherwise no arguments: torch's built-in "
                    "FlashAttention-2 (varlen) instead of flash-attn-4, the attention kernel on short documents"),
        BenchConfig("hf_accel-fp8", False, ("hf_accel", "torchao"), _patched(precision="fp8"),
                    "hf_accel.patch(model, precision='fp8'), otherwise no arguments: the decoder linears through "
                    "torchao's float8 training (rowwise scaling); an explicit opt-in",
                    changes_computation="float8 matmuls", sites=TORCHAO_SITES),
        BenchConfig("hf_accel-best", False, ("hf_accel",), _hf_accel(best=True),
                    "hf_accel.patch(model, fused_ce=True, fused_ops=True, compile=True) + the same packing, with "
                    "the --fused-ce / --best-* options", launched=_hf_accel_trainer("best")),
    ]
}


# ---- Unsloth and QLoRA (issue 20): packages kept apart (apart.py), models loaded from files -----------------------
# hf_accel's QLoRA rows need no CUDA of their own: bitsandbytes' CPU backend runs them in the CPU smoke run (--tiny).
# model types the Unsloth configs run (FastLanguageModel's own list is longer; these are the bench's workloads)
UNSLOTH_FAMILIES = ("llama", "qwen3", "mistral", "gemma2",
                    "qwen3_moe", "gpt_oss")  # the MoE two: its faster-MoE path, LoRA on the experts included
REQUIREMENTS["unsloth-family"] = lambda device, fam: (None if fam in UNSLOTH_FAMILIES else
                                                      f"the Unsloth configs run {', '.join(UNSLOTH_FAMILIES)} "
                                                      f"workloads only, not {fam!r}")


def _hf_accel_sft(settings: RunSettings, data: BenchData, options: Options, timing: Timing) -> nn.Module:
    """hf_accel.SFTTrainer (TRL's SFTTrainer with hf_accel's patch, AccelArguments' defaults) on the NF4 base as
    loaded, LoRA through peft_config, the same SFTConfig as TRL's QLoRA anchor without Liger."""
    from hf_accel import SFTTrainer

    model = qlora_base(settings, "sdpa")
    return run_trl(model, data, settings, timing, liger=False, peft_config=lora_config(settings.workload, model),
                   trainer_cls=SFTTrainer)


# The memory class of Unsloth's QLoRA on Llama-3-8B shapes (its peak in the same run, BENCHMARKS.md), with room
# for the budget's own headroom: the row hf_accel offers at no more memory than Unsloth, unless --best-checkpointing
# names another budget (the long-context QLoRA preset's, under its device cap).
QLORA_BUDGET = "budget:14.5GiB"


def _qlora_budget(settings: RunSettings, data: BenchData, options: Options, timing: Timing,
                  keep_bf16: bool = False) -> nn.Module:
    """The QLoRA model on PEFT's recipe (prepare_model_for_kbit_training) with its LoRA, then `hf_accel.patch(model,
    checkpointing=<budget plan>)` (--best-checkpointing, else QLORA_BUDGET), otherwise the defaults: the plan sees the
    adapters' states and probes a packed row of the step's size. keep_bf16: the base's other weights back in bf16
    after the recipe (apart.qlora_base)."""
    model = add_lora(qlora_base(settings, "sdpa", kbit_preparation=True, keep_bf16=keep_bf16), settings.workload)
    from hf_accel.memory.checkpointing import policy_from_spec

    policy = policy_from_spec(options.checkpointing or QLORA_BUDGET)
    context = _bench_context(settings, data.spec.tokens_per_step)
    progress("QLoRA model built; patch() and its budget plan (a probe forward of the step's size) next")
    timing.notes.append(f"patch: {hf_accel.patch(model, checkpointing=policy, context=context)}")
    run_loop(model, _hf_accel_steps(data, settings.seed), hf_loss, settings, timing)
    return model


_UNSLOTH_NEEDS = ("unsloth", "cuda", "unsloth-family")  # "not installed" first: the likelier news
CONFIGS.update({
    c.name: c
    for c in [
        BenchConfig("unsloth", True, _UNSLOTH_NEEDS, unsloth_runner(load_in_4bit=False),
                    "Unsloth FastLanguageModel (bf16): its LoRA r=16 (or full_finetuning=True), its offloaded "
                    "checkpointing where the workload checkpoints, TRL SFTTrainer packing=True (padding-free)",
                    sites=UNSLOTH_SITES, loads_files=True),
        BenchConfig("unsloth-eager", True, _UNSLOTH_NEEDS, unsloth_runner(load_in_4bit=False, compiled=False),
                    "as unsloth, with UNSLOTH_COMPILE_DISABLE=1 (Unsloth's compiled modules off): the Unsloth row "
                    "for a base whose compiled layers fail on the installed torch (Gemma 2 on torch 2.11)",
                    sites=UNSLOTH_SITES, loads_files=True),
        BenchConfig("unsloth-qlora", True, ("unsloth", "bitsandbytes", "cuda", "unsloth-family"), unsloth_runner(load_in_4bit=True),
                    "Unsloth FastLanguageModel load_in_4bit=True (its NF4 QLoRA), LoRA r=16, its offloaded "
                    "checkpointing, TRL SFTTrainer packing=True (padding-free)", sites=UNSLOTH_SITES,
                    loads_files=True),
        *(BenchConfig(name, True, ("bitsandbytes", "fa4", "trl", *(("cuda", "liger", "liger-family")
                                                                   if ANCHORS[name].trl.liger else ())),
                      _trl(name), ANCHORS[name].settings, sites=BNB_SITES)
          for name in ("trl-qlora", "trl-qlora-noliger", "trl-qlora-kbit")),
        BenchConfig("hf_accel-qlora", False, ("bitsandbytes", "hf_accel"), _patched(qlora_base),
                    "hf_accel's QLoRA recipe (docs/qlora.md): the same NF4 base as loaded (no "
                    "prepare_model_for_kbit_training: norms, embeddings and LM head bf16), hf_accel.patch(model) with "
                    "no arguments, + hf_accel's packing", sites=BNB_SITES),
        BenchConfig("hf_accel-qlora-kbit", False, ("bitsandbytes", "hf_accel"),
                    _patched(functools.partial(qlora_base, kbit_preparation=True)),
                    "hf_accel.patch(model), no arguments, on PEFT's recipe (prepare_model_for_kbit_training: fp32 "
                    "norms, embeddings and LM head) + hf_accel's packing: hf_accel-qlora before issue 70",
                    sites=BNB_SITES),
        BenchConfig("hf_accel-qlora-sft", False, ("bitsandbytes", "hf_accel", "trl"), _hf_accel_sft,
                    "hf_accel.SFTTrainer(peft_config=...) on the NF4 base as loaded, TRL's packing (the TRL anchor's "
                    "SFTConfig without Liger): the drop-in path for TRL users", sites=BNB_SITES),
        BenchConfig("hf_accel-qlora-sft-liger", False, ("bitsandbytes", "hf_accel", "trl", "cuda", "liger",
                                                        "liger-family"),
                    _trl("trl-qlora", ours=True),
                    "hf_accel.SFTTrainer with TRL's QLoRA anchor's SFTConfig and base (peft_config, "
                    "use_liger_kernel=True): the drop-in path for TRL users who follow TRL's speed advice",
                    sites=BNB_SITES),
        BenchConfig("hf_accel-qlora-untrimmed", False, ("bitsandbytes", "hf_accel"),
                    _patched(functools.partial(qlora_base, kbit_preparation=True), untrimmed="OffloadedCheckpointing"),
                    "as hf_accel-qlora-kbit (PEFT's recipe), the recompute untrimmed (the defaults before "
                    "2026-12-04: OffloadedCheckpointing(trim_recompute=False)): what the trimmed recompute gains",
                    sites=BNB_SITES),
        BenchConfig("hf_accel-qlora-offload", False, ("bitsandbytes", "hf_accel"),
                    _patched(functools.partial(qlora_base, kbit_preparation=True), checkpointing="offload"),
                    "PEFT's QLoRA recipe with hf_accel.patch(model, checkpointing='offload') (layer inputs in "
                    "pinned host memory, as Unsloth's offloaded checkpointing) + hf_accel's packing",
                    sites=BNB_SITES),
        BenchConfig("hf_accel-qlora-budget", False, ("bitsandbytes", "hf_accel"), _qlora_budget,
                    f"PEFT's QLoRA recipe with its LoRA, then hf_accel.patch(model, checkpointing=<budget plan>) "
                    f"(--best-checkpointing, else {QLORA_BUDGET}: Unsloth QLoRA's memory class; the plan keeps, "
                    "recomputes, offloads or spaces each layer's input) + hf_accel's packing", sites=BNB_SITES),
        BenchConfig("hf_accel-qlora-bf16-budget", False, ("bitsandbytes", "hf_accel"),
                    functools.partial(_qlora_budget, keep_bf16=True),
                    "as hf_accel-qlora-budget on the base as Unsloth's QLoRA keeps it: norms, embeddings and LM head "
                    "back in bf16 after PEFT's recipe (which makes them fp32), so the residual stream and every layer "
                    "input is bf16 (half the recipe's bytes)", sites=BNB_SITES),
    ]
})
