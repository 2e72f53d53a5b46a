"""``hf_accel.training.trainer.Trainer``: a drop-in ``transformers.Trainer`` that patches the model, packs batches, applies a
checkpoint policy, logs real throughput, and saves checkpoints atomically (optionally in the background).

``hf_accel.training.trainer.SFTTrainer`` (TRL's ``SFTTrainer`` with the same behaviour) lives in ``trl_trainer.py`` and is
imported lazily, so TRL stays optional.

Loss normalisation is transformers' own: the Trainer counts the targets of every micro-batch of an optimizer step
(``num_items_in_batch``) and the model divides its summed cross-entropy by it, so packed, padded and regrouped
batches of the same samples give the same loss (see ``hf_accel.training.loss``).
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any

import torch
import transformers
from torch.utils.data import DataLoader

from . import checkpoint_io
from .snapshot import SnapshotBuffers
from ..data.collators import REAL_TOKENS_KEY, DataCollatorForPacking, DataCollatorForPadding
from ..errors import ConfigurationError
from ..patch_options import PatchOptions
from ..patching import patch
from ..data.sampling import TokenBudgetBatchSampler
from .checkpoint_hooks import CheckpointFilesMixin, ReserveSnapshotAhead, RestoreLossWindow
from .metrics import ThroughputMeter, format_summary

logger = logging.getLogger("hf_accel")

__all__ = ["AccelArguments", "Trainer", "SFTTrainer"]


@dataclass
class AccelArguments:
    """What hf_accel adds to a Trainer.

    patch: route attention through hf_accel (False = stock transformers, for speed comparisons).
    backend: attention backend for ``hf_accel.patch`` ("auto", "fa4", "torch-fa2", "sdpa", ...).
    packing: padding-free batches (one packed row per micro-batch); False = dynamic padding.
    max_tokens_per_batch: with packing, form micro-batches by a token budget (``TokenBudgetBatchSampler``) instead of
        ``per_device_train_batch_size`` examples.
    checkpointing: a checkpoint policy or spec ("full", "every_2", "op", "budget:20GiB"); None leaves the model and
        ``TrainingArguments.gradient_checkpointing`` alone.
    fused_ce: training loss from hidden states by chunked cross-entropy (hf_accel.fused.cross_entropy), no full logits tensor
        (``patch(fused_ce=True)``: computed inside the model's forward, so DDP/FSDP see it).
    fused_ops: liger-kernel's fused norms / SwiGLU bound to this model (``patch(fused_ops=True)``; CUDA + liger).
    compile: each decoder layer's training forward through torch.compile, attention excluded (``patch(compile=...)``:
        True or a dict of torch.compile options). Costs a compile at the first steps; eval / generate stay eager.
    fused_ce, fused_ops and compile default to "auto": ``patch()``'s choice (on CUDA all three where they apply, off
        elsewhere; the report says why); "auto" compile also stands down under ``torch_compile``, FSDP1 and DeepSpeed.
    mlp_chunks: each decoder layer's MLP over chunks of tokens, each chunk checkpointed (``patch(mlp_chunks=...)``):
        "auto" (training calls whose MLP intermediates would exceed 16 GiB), a chunk size in tokens, or False.
    async_save: write checkpoints on a background thread after copying the state to CPU (single process only).
    save: what a checkpoint holds of the model: "full" (every weight, loadable by ``from_pretrained``) or
        "trainable" (only the parameters that train, plus a fingerprint of the frozen part that resume checks).
    layer_shards: with save="full", checkpoint weights as one safetensors file per decoder layer (+ embeddings, +
        the rest) with the standard index, so ``from_pretrained`` loads them and ``shards.load_layer_range`` reads
        only the layers it needs.
    overwrite_output_dir: a new run (no resume) clears ``output_dir`` first; without it a non-empty ``output_dir``
        is refused, so a run never mixes with an earlier run's files.
    print_summary: print a throughput table when training ends.
    non_blocking: copy each batch to the GPU without blocking the host (with ``dataloader_pin_memory``, the default).
        transformers' default copies blocking, and a blocking copy waits for the GPU to finish the previous step, so
        every step starts from an idle GPU. False keeps transformers' setting.
    """

    patch: bool = True
    backend: str = "auto"
    packing: bool = True
    max_tokens_per_batch: int | None = None
    checkpointing: Any = None
    fused_ce: Any = "auto"
    fused_ops: Any = "auto"
    compile: Any = "auto"
    mlp_chunks: Any = "auto"
    async_save: bool = False
    save: str = "full"
    layer_shards: bool = False
    overwrite_output_dir: bool = False
    print_summary: bool = True
    non_blocking: bool = True

    def patch_options(self, **decided: Any) -> PatchOptions:
        """These arguments as ``patch()``'s options (validated here: a bad value raises ConfigurationError), with
        what the Trainer ``decided`` for its run (fused_ce, compile and why "auto" compile stands down)."""
        given = dict(backend=self.backend, checkpointing=self.checkpointing, fused_ops=self.fused_ops,
                     fused_ce=self.fused_ce, compile=self.compile, mlp_chunks=self.mlp_chunks)
        return PatchOptions(**{**given, **decided})


def _skip_first_batches_with_ulysses(stock):
    """accelerate's ``skip_first_batches``, which also skips in DeepSpeed's ``UlyssesSPDataLoaderAdapter``: that yields
    each inner batch ``sp_world_size`` times (every rank's row of the group in turn, sharded), so skipping ``n`` of
    its micro-batches skips ``n // sp`` inner batches in the wrapped loader (the sampler skips, nothing is loaded),
    then draws the remaining ``n % sp`` from a new adapter (a resume between two rows of one gathered group)."""

    def skip(dataloader, num_batches=0):
        try:
            from deepspeed.runtime.sequence_parallel.ulysses_sp import UlyssesSPDataLoaderAdapter
        except ImportError:
            return stock(dataloader, num_batches)
        if not isinstance(dataloader, UlyssesSPDataLoaderAdapter):
            return stock(dataloader, num_batches)
        whole, rest = divmod(num_batches, dataloader.sp_world_size)
        adapter = UlyssesSPDataLoaderAdapter(stock(dataloader.dl, whole), sp_rank=dataloader.sp_rank,
                                             sp_group=dataloader.sp_group, sp_world_size=dataloader.sp_world_size,
                                             device=dataloader.device)
        for _ in range(rest):
            next(adapter)
        return adapter

    return skip


def _sequence_parallel_size(trainer: Any) -> int:
    """The Ulysses sequence-parallel size of ``trainer``'s accelerate config (DeepSpeed's ``sp_size``), 1 when off."""
    config = getattr(trainer.accelerator, "parallelism_config", None)
    if config is None or getattr(config, "sp_backend", None) != "deepspeed" or not getattr(config, "sp_enabled", False):
        return 1
    return int(config.sp_size)


class AccelMixin(CheckpointFilesMixin):
    """The behaviour shared by ``Trainer`` and ``SFTTrainer``; expects to sit before a transformers Trainer in MRO."""

    accel: AccelArguments

    def _accel_setup(self, accel: AccelArguments | None) -> None:
        self.accel = accel or AccelArguments()
        self.patch_report = None
        self._accel_check_explicit()
        options = self.accel.patch_options(fused_ce=self._accel_fused_ce(), compile=self._accel_compile(),
                                           compile_stand_down=self._accel_compile_stands_down())
        policy = self._accel_applied_policy = options.policy
        context = self._accel_run_context() if policy is not None and policy.needs_run_context else None
        if self.accel.patch:
            self.patch_report = patch(self.model, options=options, context=context)
            logger.info("%s", self.patch_report)
        elif policy is not None:
            policy.apply(self.model, context)
        if self.patch_report is not None and self.patch_report.fused_ce and getattr(self, "_own_collator", False) \
                and hasattr(self.data_collator, "target_rows"):
            # the fused loss consumes the collator's target rows (and takes them out of the batch): no LM-head work
            # for masked positions. Only then: a stock forward must not receive the key.
            self.data_collator.target_rows = True
        self._accel_sequence_parallel()
        if self.accel.async_save and self.args.world_size > 1:
            raise ConfigurationError(
                f"async_save=True with world_size={self.args.world_size}; background saves support one process only. "
                "Pass async_save=False (saves are still atomic)."
            )
        if self.accel.non_blocking and self.args.dataloader_pin_memory:
            # read when the Trainer prepares its dataloaders (accelerate's send_to_device(non_blocking=...))
            self.accelerator.dataloader_config.non_blocking = True
        self._check_save_options()
        self._writer = checkpoint_io.AsyncWriter()
        self._buffers = SnapshotBuffers()
        self.add_callback(ReserveSnapshotAhead(self))
        self.add_callback(RestoreLossWindow(self))
        self._resumed_loss_window = None
        self._run_record: dict[str, Any] | None = None
        self._frozen_fingerprint: dict[str, Any] | None = None
        self._saving_checkpoint = False
        self._meter: ThroughputMeter | None = None
        self.throughput_summary: dict[str, float] | None = None

    def _accel_sequence_parallel(self) -> None:
        """Ulysses sequence parallelism (accelerate ``ParallelismConfig(sp_backend="deepspeed", sp_size=N)``): DeepSpeed
        wraps the attention function registered under ``sp_attn_implementation`` with its all-to-alls and requires that
        name to be the model's own, so a patched model hands it hf_accel's (accelerate accepts only its built-in names
        there, hence set after validation); our packing collator emits rows it can shard. Falcon's attention does not
        go through transformers' AttentionInterface, so the wrapper would never run: refused instead of each rank
        attending within its own shard."""
        config = getattr(self.accelerator, "parallelism_config", None)
        if _sequence_parallel_size(self) == 1:
            return
        family = _family(self.model)
        if family is not None and family.seam != "attention_interface":
            raise ConfigurationError(
                f"sequence parallelism (sp_size > 1) wraps transformers' AttentionInterface, which {family.name} "
                f"attention ({family.touches}) does not call: each rank would attend only within its own shard of the "
                "sequence. Train it "
                "without sp_size, or a model whose family goes through the AttentionInterface (Llama, Qwen, "
                "Mistral, Gemma, GPT-NeoX).")
        if getattr(self, "_own_collator", False):  # hf_accel.Trainer's collator (the TRL SFTTrainer brings its own)
            if not hasattr(self.data_collator, "sequence_parallel"):
                raise ConfigurationError(
                    "sequence parallelism needs packed batches (AccelArguments(packing=True)): padded rows carry an "
                    "attention mask that DeepSpeed's Ulysses wrapper does not shard.")
            if not self.accel.max_tokens_per_batch:
                raise ConfigurationError(
                    "sequence parallelism needs a token budget (AccelArguments(max_tokens_per_batch=...), sft.py "
                    "--max-tokens-per-batch): DeepSpeed's Ulysses loader all-gathers the packed row of every rank in "
                    "the group, which needs rows of one length, and hf_accel pads every row to the budget.")
            self.data_collator.sequence_parallel(config.sp_size, row_length=self.accel.max_tokens_per_batch)
            # one packed row per micro-batch whatever per_device_train_batch_size says (it counts examples): the
            # Ulysses wrapper checks every activation against DeepSpeed's micro-batch size, so that is 1 row
            plugin = getattr(self.accelerator.state, "deepspeed_plugin", None)
            if plugin is not None:
                plugin.deepspeed_config["train_micro_batch_size_per_gpu"] = 1
                plugin.deepspeed_config["train_batch_size"] = self.args.world_size * self.args.gradient_accumulation_steps
        attn = getattr(getattr(self.model, "config", None), "_attn_implementation", None)
        from ..patching import patch_report, pin_attention_name

        if self.accel.patch and patch_report(self.model) is not None:
            # DeepSpeed checks the config's name and wraps the function registered under it: hf_accel's own
            attn = pin_attention_name(self.model)
        if self.accel.patch and attn is not None:
            if config.sp_handler.sp_attn_implementation not in (None, attn):
                logger.info("hf_accel: sequence parallelism wraps hf_accel's attention (%r), not the configured %r",
                            attn, config.sp_handler.sp_attn_implementation)
            config.sp_handler.sp_attn_implementation = attn

    def _accel_check_explicit(self) -> None:
        """Explicit requests that cannot work raise here, before patching ("auto" stands down instead)."""
        compile_asked = self.accel.compile not in (False, None, "auto")
        if self.accel.fused_ce is True and not self.accel.patch:
            raise ConfigurationError("fused_ce=True works through hf_accel.patch; it needs AccelArguments(patch=True).")
        if compile_asked and not self.accel.patch:
            raise ConfigurationError("compile=True works through hf_accel.patch; it needs AccelArguments(patch=True).")
        if compile_asked and getattr(self.args, "torch_compile", False):
            raise ConfigurationError(
                "AccelArguments(compile=...) compiles the decoder layers and TrainingArguments(torch_compile=True) the "
                "whole model; use one. AccelArguments(compile=True) keeps attention on hf_accel's kernel."
            )

    def _accel_fused_ce(self) -> Any:
        return self.accel.fused_ce

    def _accel_compile(self) -> Any:
        """AccelArguments.compile for patch(); "auto" is off where something else compiles the model, under FSDP1
        (not measured there) and under DeepSpeed (measured slower than eager there, likely as its gather hooks around
        every submodule break the compiled graphs; docs/MULTI_GPU.md). FSDP2 keeps it (measured faster there)."""
        if self.accel.compile != "auto":
            return self.accel.compile
        return False if self._accel_compile_stands_down() else "auto"

    def _accel_compile_stands_down(self) -> str | None:
        """Why "auto" compile is off for this Trainer (the patch report's compile line says it), or None."""
        if self.accel.compile != "auto":
            return None
        if getattr(self.args, "torch_compile", False):
            return "TrainingArguments(torch_compile=True) compiles the whole model instead"
        if getattr(self, "is_fsdp_enabled", False) and not getattr(self.accelerator, "is_fsdp2", False):
            return "stands down under FSDP1 (not measured there; FSDP2 keeps it)"
        if getattr(self, "is_deepspeed_enabled", False):
            return "stands down under DeepSpeed (measured slower there than eager; FSDP2 keeps it)"
        return None

    def _accel_run_context(self) -> Any:
        """The run the checkpoint policy is applied for (``memory.context.RunContext``): a micro-batch of the size this
        run trains on, the sharding, whether gradients are freed before each forward (transformers' loop frees them
        after each optimizer step, set_to_none; DeepSpeed keeps its own buffers), and the autocast accelerate runs
        the forwards under."""
        from ..memory.context import autocast_dtype, run_context

        return run_context(batch_tokens=self._micro_batch_tokens(),
                           accumulation_steps=self.args.gradient_accumulation_steps,
                           engine_keeps_grads=getattr(self, "is_deepspeed_enabled", False),
                           sharding=self._accel_sharding(),
                           autocast=autocast_dtype(self.args.device.type, self.accelerator.autocast()))

    def _accel_sharding(self) -> Any:
        """How this process will hold the training state (``memory.estimate.Sharding``): under FSDP2 and DeepSpeed
        ZeRO-3 a 1/world_size share, trainable parameters as fp32 master weights under mixed precision (accelerate
        upcasts them for FSDP2; DeepSpeed casts every parameter to bf16/fp16 and keeps an fp32 partition of the
        trainable ones). None: unsharded."""
        from ..memory.estimate import Sharding

        mixed = self.args.bf16 or self.args.fp16
        if getattr(self, "is_fsdp_enabled", False) and getattr(self.accelerator, "is_fsdp2", False):
            return Sharding("fsdp2", self.args.world_size, 4 if mixed else None, 2 if mixed else None)
        plugin = getattr(self.accelerator.state, "deepspeed_plugin", None) \
            if getattr(self, "is_deepspeed_enabled", False) else None
        if plugin is not None and plugin.zero_stage == 3:
            return Sharding("zero3", self.args.world_size, 4 if mixed else None, 2 if mixed else None)
        return None

    def _micro_batch_tokens(self) -> int | None:
        """The most tokens one micro-batch of this run can hold (None when unknown)."""
        batch = self.args.per_device_train_batch_size
        max_length = getattr(self.args, "max_length", None)  # TRL's SFTConfig: packed rows of max_length
        if getattr(self.args, "packing", False) and max_length:
            return int(max_length) * batch
        if self.accel.packing and self.accel.max_tokens_per_batch:
            return int(self.accel.max_tokens_per_batch)
        try:
            lengths = sorted(_example_lengths(self.train_dataset), reverse=True) if self.train_dataset else []
        except (KeyError, TypeError):
            return None
        if not lengths:
            return None
        return sum(lengths[:batch]) if self.accel.packing else lengths[0] * batch

    # ---- training loop hooks -------------------------------------------------------------------------------------

    def _inner_training_loop(self, *args, **kwargs):
        # Trainer.train() has just (re-)enabled checkpointing from its args; put our policy's choices back.
        if self.accel.checkpointing is not None:
            from ..memory.checkpointing import reapply_checkpointing

            reapply_checkpointing(self.model)
        self._meter = ThroughputMeter(self.model, self.args.device)
        return super()._inner_training_loop(*args, **kwargs)

    def _run_epoch(self, *args, **kwargs):
        # Resuming under Ulysses sequence parallelism: transformers skips the trained micro-batches with accelerate's
        # skip_first_batches, which knows no DeepSpeed loader adapter (it has no `.dataset`: every such resume
        # failed). For that call only, transformers' module gets a skip that rebuilds the adapter.
        import transformers.trainer as hf_trainer

        stock = getattr(hf_trainer, "skip_first_batches", None)
        if stock is None or _sequence_parallel_size(self) == 1:
            return super()._run_epoch(*args, **kwargs)
        hf_trainer.skip_first_batches = _skip_first_batches_with_ulysses(stock)
        try:
            return super()._run_epoch(*args, **kwargs)
        finally:
            hf_trainer.skip_first_batches = stock

    def train(self, resume_from_checkpoint: str | bool | None = None, *args, **kwargs):
        resume_from_checkpoint = self._prepare_run(resume_from_checkpoint)
        try:
            out = super().train(resume_from_checkpoint, *args, **kwargs)
        finally:
            self._writer.wait()
        # After a normal end only: a summary's device reads must not replace the exception of a failed run.
        if self._meter is not None:
            from ..memory.budget import plan_vs_peak

            self.throughput_summary = self._meter.summary()
            # a memory budget's plan against what the run measured (is the plan tight, or over?)
            self.throughput_summary.update(
                plan_vs_peak(self._accel_applied_policy, self.throughput_summary.get("peak_mem_gib")))
            if self.accel.print_summary and self.args.should_log:
                print(format_summary(self.throughput_summary), flush=True)
        return out

    def get_batch_samples(self, *args, **kwargs):
        start = time.perf_counter()
        out = super().get_batch_samples(*args, **kwargs)
        if self._meter is not None:
            self._meter.add_wait(time.perf_counter() - start)
        return out

    def training_step(self, model, inputs, *args, **kwargs):
        if self._meter is not None:
            self._meter.add_batch(inputs)
        inputs.pop(REAL_TOKENS_KEY, None)  # the meter's, not the model's
        return super().training_step(model, inputs, *args, **kwargs)

    def log(self, logs: dict[str, float], *args, **kwargs) -> None:
        if "loss" in logs and self._meter is not None:
            logs.update(self._meter.pop())
        super().log(logs, *args, **kwargs)

def _family(model: Any) -> Any:
    """The model's hf_accel family (hf_accel.patches.Family), None for a model hf_accel has no patch for."""
    from ..errors import UnsupportedModel
    from ..patches import family_of

    try:
        return family_of(model)
    except UnsupportedModel:
        return None


def _example_lengths(dataset: Any) -> list[int]:
    if hasattr(dataset, "column_names") and "length" in dataset.column_names:
        return [int(n) for n in dataset["length"]]
    return [len(example["input_ids"]) for example in dataset]


def _needs_tokenizing(dataset: Any) -> bool:
    if dataset is None:
        return False
    columns = getattr(dataset, "column_names", None)
    if columns is None:
        columns = list(dataset[0].keys()) if len(dataset) else []
    return "input_ids" not in columns


def tokenize_dataset(dataset: Any, tokenizer: Any) -> Any:
    """Tokenize a dataset of ``messages``, ``prompt``/``completion`` or ``text`` examples (a list or ``datasets``)."""
    from ..data.prepare import pretokenize, tokenize_example

    if hasattr(dataset, "map") and hasattr(dataset, "column_names"):
        return pretokenize(dataset, tokenizer)
    return [tokenize_example(example, tokenizer) for example in dataset]


class Trainer(AccelMixin, transformers.Trainer):
    """``transformers.Trainer`` with hf_accel's attention patch, packing collator, token-budget sampler, checkpoint
    policy, throughput logging and atomic checkpoints. Takes every ``transformers.Trainer`` argument plus ``accel``.

    Datasets may be pre-tokenized (``input_ids``, optional ``labels``) or raw (``messages``, ``prompt``/``completion``
    or ``text``; tokenized here with ``processing_class``, labels on completions / assistant turns only).
    """

    def __init__(self, model=None, args=None, data_collator=None, train_dataset=None, eval_dataset=None,
                 processing_class=None, *, accel: AccelArguments | None = None, **kwargs) -> None:
        accel = accel or AccelArguments()
        datasets = []
        for dataset in (train_dataset, eval_dataset):
            if _needs_tokenizing(dataset):
                if processing_class is None:
                    raise ConfigurationError(
                        "the dataset has no 'input_ids' column and no processing_class was given; pass a tokenizer "
                        "as processing_class, or pre-tokenize with hf_accel.data.prepare.pretokenize."
                    )
                dataset = tokenize_dataset(dataset, processing_class)
            datasets.append(dataset)
        self._own_collator = data_collator is None
        if data_collator is None:
            data_collator = self._default_collator(model, processing_class, accel)
        super().__init__(model=model, args=args, data_collator=data_collator, train_dataset=datasets[0],
                         eval_dataset=datasets[1], processing_class=processing_class, **kwargs)
        self._accel_setup(accel)

    @staticmethod
    def _default_collator(model, processing_class, accel: AccelArguments):
        pad_id = getattr(processing_class, "pad_token_id", None)
        if pad_id is None:
            pad_id = getattr(getattr(model, "config", None), "pad_token_id", None) or 0
        if not accel.packing:
            return DataCollatorForPadding(pad_token_id=pad_id)
        collator = DataCollatorForPacking(pad_token_id=pad_id)
        family = _family(model)
        if not accel.patch and family is not None and not family.stock_packing:
            # e.g. stock Falcon builds its mask without position_ids: packed documents would attend to each other
            collator.use_padding(f"stock (unpatched) {family.name} cannot keep packed documents apart")
        return collator

    def get_train_dataloader(self) -> DataLoader:
        if not (self.accel.packing and self.accel.max_tokens_per_batch and self._own_collator):
            return super().get_train_dataloader()
        dataset = self.train_dataset
        replicas, rank = self.args.world_size, self.args.process_index
        if _sequence_parallel_size(self) > 1:
            # DeepSpeed's Ulysses loader gathers the row of every rank in the group and trains each in turn, so every
            # process reads its own rows. torch.distributed says which: accelerate's state, which the arguments
            # read, reports one process on every rank of a CPU DeepSpeed launch (no backend of its own there)
            replicas, rank = torch.distributed.get_world_size(), torch.distributed.get_rank()
        sampler = TokenBudgetBatchSampler(
            _example_lengths(dataset), self.accel.max_tokens_per_batch, shuffle=True, seed=self.args.data_seed
            if self.args.data_seed is not None else self.args.seed, num_replicas=replicas, rank=rank,
        )
        dataset = self._remove_unused_columns(dataset, description="training") if hasattr(dataset, "column_names") \
            else dataset
        collator = self.data_collator if hasattr(dataset, "column_names") else \
            self._get_collator_with_removed_columns(self.data_collator, description="training")
        loader = DataLoader(
            dataset, batch_sampler=sampler, collate_fn=collator, num_workers=self.args.dataloader_num_workers,
            pin_memory=self.args.dataloader_pin_memory, persistent_workers=self.args.dataloader_persistent_workers,
            prefetch_factor=self.args.dataloader_prefetch_factor,
        )
        prepared = self.accelerator.prepare(loader)
        # The sampler already shards by rank; make accelerate's BatchSamplerShard (multi-process) a passthrough.
        shard = getattr(prepared, "batch_sampler", None)
        if shard is not None and getattr(shard, "batch_sampler", None) is sampler:
            shard.num_processes, shard.process_index = 1, 0
        return prepared


def __getattr__(name: str):
    if name == "SFTTrainer":  # TRL is optional: import it only when asked for
        from .trl_trainer import SFTTrainer

        return SFTTrainer
    raise AttributeError(f"module 'hf_accel.training.trainer' has no attribute {name!r}")

