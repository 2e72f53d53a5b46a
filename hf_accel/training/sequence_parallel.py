"""Ulysses sequence parallelism through DeepSpeed (accelerate ``ParallelismConfig(sp_backend="deepspeed",
sp_size=N)``): the wiring a Trainer needs before training (``wire``) and on resume (``resume_skip``).

DeepSpeed wraps the attention function registered under ``sp_attn_implementation`` with its all-to-alls and requires
that name to be the model's own, so a patched model hands it hf_accel's (accelerate accepts only its built-in names
there, hence set after validation); hf_accel's packing collator emits rows it can shard. Falcon's attention does not go
through transformers' AttentionInterface, so the wrapper would never run: refused instead of each rank attending
within its own shard.
"""
from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterator
from typing import Any

from .data_loading import model_family
from ..errors import ConfigurationError

logger = logging.getLogger("hf_accel")


def sequence_parallel_size(trainer: Any) -> int:
    """The Ulysses sequence-parallel size of ``trainer``'s accelerate config (DeepSpeed's ``sp_size``), 1 when off."""
    config = getattr(trainer.accelerator, "parallelism_config", None)
    if config is None or getattr(config, "sp_backend", None) != "deepspeed" or not getattr(config, "sp_enabled", False):
        return 1
    return int(config.sp_size)


def loader_ranks(trainer: Any) -> tuple[int, int]:
    """(processes, this one's rank) a token-budget loader shards its micro-batches over. Under sequence parallelism
    DeepSpeed's Ulysses loader gathers the row of every rank in the group and trains each in turn, so every process
    reads its own rows; torch.distributed says which: accelerate's state, which the arguments read, reports one
    process on every rank of a CPU DeepSpeed launch (no backend of its own there)."""
    if sequence_parallel_size(trainer) > 1:
        import torch.distributed as dist

        return dist.get_world_size(), dist.get_rank()
    return trainer.args.world_size, trainer.args.process_index


def wire(trainer: Any) -> None:
    """Refuse what cannot shard, size the collator's rows and DeepSpeed's micro-batch, and hand DeepSpeed the
    attention name to wrap (a no-op without sequence parallelism)."""
    if sequence_parallel_size(trainer) == 1:
        return
    config = trainer.accelerator.parallelism_config
    family = model_family(trainer.model)
    if family is not None and family.seam != "attention_interface":
        raise ConfigurationError(
            f"sequence parallelism (sp_size > 1) wraps transformers' AttentionInterface, which {family.name} "
            f"attention ({family.touches}) does not call: each rank would attend only within its own shard of the "
            "sequence. Train it without sp_size, or a model whose family goes through the AttentionInterface "
            "(Llama, Qwen, Mistral, Gemma, GPT-NeoX).")
    if getattr(trainer, "_own_collator", False):  # hf_accel.Trainer's collator (the TRL SFTTrainer brings its own)
        _shard_rows(trainer, config.sp_size)
    attn = getattr(getattr(trainer.model, "config", None), "_attn_implementation", None)
    from ..patching import patch_report, pin_attention_name

    if trainer.accel.patch and patch_report(trainer.model) is not None:
        # DeepSpeed checks the config's name and wraps the function registered under it: hf_accel's own
        attn = pin_attention_name(trainer.model)
    if trainer.accel.patch and attn is not None:
        if config.sp_handler.sp_attn_implementation not in (None, attn):
            logger.info("hf_accel: sequence parallelism wraps hf_accel's attention (%r), not the configured %r",
                        attn, config.sp_handler.sp_attn_implementation)
        config.sp_handler.sp_attn_implementation = attn


def _shard_rows(trainer: Any, sp_size: int) -> None:
    """hf_accel's packing collator emits one row of the token budget per micro-batch, which DeepSpeed's Ulysses
    loader gathers and shards."""
    if not hasattr(trainer.data_collator, "sequence_parallel"):
        raise ConfigurationError(
            "sequence parallelism needs packed batches (AccelArguments(packing=True)): padded rows carry an "
            "attention mask that DeepSpeed's Ulysses wrapper does not shard.")
    if not trainer.accel.max_tokens_per_batch:
        raise ConfigurationError(
            "sequence parallelism needs a token budget (AccelArguments(max_tokens_per_batch=...), sft.py "
            "--max-tokens-per-batch): DeepSpeed's Ulysses loader all-gathers the packed row of every rank in "
            "the group, which needs rows of one length, and hf_accel pads every row to the budget.")
    trainer.data_collator.sequence_parallel(sp_size, row_length=trainer.accel.max_tokens_per_batch)
    # one packed row per micro-batch whatever per_device_train_batch_size says (it counts examples): the
    # Ulysses wrapper checks every activation against DeepSpeed's micro-batch size, so that is 1 row
    plugin = getattr(trainer.accelerator.state, "deepspeed_plugin", None)
    if plugin is not None:
        plugin.deepspeed_config["train_micro_batch_size_per_gpu"] = 1
        plugin.deepspeed_config["train_batch_size"] = trainer.args.world_size * trainer.args.gradient_accumulation_steps


@contextlib.contextmanager
def resume_skip(trainer: Any) -> Iterator[None]:
    """While an epoch starts: resuming under Ulysses sequence parallelism, transformers skips the trained
    micro-batches with accelerate's skip_first_batches, which knows no DeepSpeed loader adapter (it has no
    `.dataset`: every such resume failed). For that time only, transformers' module gets a skip that rebuilds the
    adapter (``skip_first_batches_with_ulysses``)."""
    import transformers.trainer as hf_trainer

    stock = getattr(hf_trainer, "skip_first_batches", None)
    if stock is None or sequence_parallel_size(trainer) == 1:
        yield
        return
    hf_trainer.skip_first_batches = skip_first_batches_with_ulysses(stock)
    try:
        yield
    finally:
        hf_trainer.skip_first_batches = stock


def skip_first_batches_with_ulysses(stock: Callable) -> Callable:
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
