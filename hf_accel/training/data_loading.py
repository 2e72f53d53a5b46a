"""What a Trainer feeds the model: raw datasets tokenized (``tokenized``), the default collator (packing, or padding
where the stock model cannot keep packed documents apart), the token-budget train loader, and the most tokens one
micro-batch holds (what a memory budget probes).
"""
from __future__ import annotations

from typing import Any

from torch.utils.data import DataLoader

from ..data.collators import DataCollatorForPacking, DataCollatorForPadding
from ..data.sampling import TokenBudgetBatchSampler
from ..errors import ConfigurationError


def model_family(model: Any) -> Any:
    """The model's hf_accel family (hf_accel.patches.Family), None for a model hf_accel has no patch for."""
    from ..errors import UnsupportedModel
    from ..patches import family_of

    try:
        return family_of(model)
    except UnsupportedModel:
        return None


def example_lengths(dataset: Any) -> list[int]:
    if hasattr(dataset, "column_names") and "length" in dataset.column_names:
        return [int(n) for n in dataset["length"]]
    return [len(example["input_ids"]) for example in dataset]


def needs_tokenizing(dataset: Any) -> bool:
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


def tokenized(dataset: Any, processing_class: Any) -> Any:
    """``dataset`` as it is when it has ``input_ids``, else tokenized with ``processing_class``."""
    if not needs_tokenizing(dataset):
        return dataset
    if processing_class is None:
        raise ConfigurationError(
            "the dataset has no 'input_ids' column and no processing_class was given; pass a tokenizer "
            "as processing_class, or pre-tokenize with hf_accel.data.prepare.pretokenize."
        )
    return tokenize_dataset(dataset, processing_class)


def default_collator(model: Any, processing_class: Any, accel: Any) -> Any:
    """Packing (padding with ``AccelArguments(packing=False)``), padded with the tokenizer's (or config's) pad id."""
    pad_id = getattr(processing_class, "pad_token_id", None)
    if pad_id is None:
        pad_id = getattr(getattr(model, "config", None), "pad_token_id", None) or 0
    if not accel.packing:
        return DataCollatorForPadding(pad_token_id=pad_id)
    collator = DataCollatorForPacking(pad_token_id=pad_id)
    family = model_family(model)
    if not accel.patch and family is not None and not family.stock_keeps_documents_apart(model):
        # e.g. stock Falcon builds its mask without position_ids, stock gpt-oss's eager attention ignores them:
        # packed documents would attend to each other
        collator.use_padding(f"stock (unpatched) {family.name} cannot keep packed documents apart")
    return collator


def token_budget_loader(trainer: Any, replicas: int, rank: int) -> DataLoader:
    """The train loader of micro-batches filled to ``AccelArguments.max_tokens_per_batch`` (best-fit decreasing),
    this process's share of ``replicas``, prepared by accelerate."""
    args, dataset = trainer.args, trainer.train_dataset
    sampler = TokenBudgetBatchSampler(
        example_lengths(dataset), trainer.accel.max_tokens_per_batch, shuffle=True,
        seed=args.data_seed if args.data_seed is not None else args.seed, num_replicas=replicas, rank=rank,
    )
    columns = hasattr(dataset, "column_names")
    dataset = trainer._remove_unused_columns(dataset, description="training") if columns else dataset
    collator = trainer.data_collator if columns else \
        trainer._get_collator_with_removed_columns(trainer.data_collator, description="training")
    loader = DataLoader(
        dataset, batch_sampler=sampler, collate_fn=collator, num_workers=args.dataloader_num_workers,
        pin_memory=args.dataloader_pin_memory, persistent_workers=args.dataloader_persistent_workers,
        prefetch_factor=args.dataloader_prefetch_factor,
    )
    prepared = trainer.accelerator.prepare(loader)
    # The sampler already shards by rank; make accelerate's BatchSamplerShard (multi-process) a passthrough.
    shard = getattr(prepared, "batch_sampler", None)
    if shard is not None and getattr(shard, "batch_sampler", None) is sampler:
        shard.num_processes, shard.process_index = 1, 0
    return prepared


def micro_batch_tokens(trainer: Any) -> int | None:
    """The most tokens one micro-batch of ``trainer``'s run can hold (None when unknown)."""
    args, accel = trainer.args, trainer.accel
    batch = args.per_device_train_batch_size
    max_length = getattr(args, "max_length", None)  # TRL's SFTConfig: packed rows of max_length
    if getattr(args, "packing", False) and max_length:
        return int(max_length) * batch
    if accel.packing and accel.max_tokens_per_batch:
        return int(accel.max_tokens_per_batch)
    try:
        lengths = sorted(example_lengths(trainer.train_dataset), reverse=True) if trainer.train_dataset else []
    except (KeyError, TypeError):
        return None
    if not lengths:
        return None
    return sum(lengths[:batch]) if accel.packing else lengths[0] * batch
