"""``hf-accel sft``'s training data: the embedded default task, random documents (--model-shape / --doc-length), or
--dataset (json / jsonl / parquet, a pretokenized folder, a hub id), checked once before training."""
from __future__ import annotations

import argparse
import json
import os
from pathlib import Path
from typing import Any

from ..data.validate import DataReport, check_dataset, report_for_jsonl, scan_jsonl
from ..errors import ConfigurationError


def read_dataset(path: str) -> tuple[Any, DataReport | None, list[str] | None]:
    """(rows, report of unparsable JSONL lines or None, location name of each row or None) of --dataset (its path
    was checked with the arguments)."""
    from datasets import Dataset, load_dataset, load_from_disk

    if os.path.isdir(path):  # a folder written by save_to_disk (scripts/pretokenize.py)
        try:
            data = load_from_disk(path)
        except FileNotFoundError as e:
            raise ConfigurationError(f"--dataset {path} is a folder but not a saved dataset ({e}); pass a folder "
                                     "written by scripts/pretokenize.py, or a json, jsonl or parquet file.") from e
        if hasattr(data, "keys"):  # a DatasetDict
            if "train" not in data:
                raise ConfigurationError(f"--dataset {path} holds splits {sorted(data)}; it needs a 'train' split.")
            data = data["train"]
        return data, None, None
    if not os.path.exists(path):  # a hub id
        return load_dataset(path, split="train"), None, None
    suffix = Path(path).suffix.lower().lstrip(".")
    if suffix == "parquet":
        return load_dataset("parquet", data_files=path, split="train"), None, None
    with open(path, encoding="utf-8", errors="replace") as f:
        head = f.read(4096).lstrip()
    if suffix == "json" and head.startswith("["):  # one JSON array, not JSON Lines
        return load_dataset("json", data_files=path, split="train"), None, None
    scan = scan_jsonl(path)
    if not scan.good_lines and not scan.bad_lines:
        raise ConfigurationError(f"--dataset {path} holds no rows (blank lines only); pass a file with one JSON "
                                 "object per line.")
    locations = [f"line {n}" for n in scan.good_lines]
    if not scan.bad_lines:
        return load_dataset("json", data_files=path, split="train"), None, locations
    with open(path, encoding="utf-8", errors="replace") as f:  # parse the good lines ourselves, skipping the bad
        good = set(scan.good_lines)
        rows = [json.loads(line) for n, line in enumerate(f, start=1) if n in good]
    return Dataset.from_list(rows), report_for_jsonl(scan), locations


def load_data(args: argparse.Namespace, tok: Any, model, max_length: int) -> tuple[Any, list[dict] | None, DataReport]:
    """(checked, tokenized train dataset, held-out default-task examples or None, data check report)."""
    import torch
    from datasets import Dataset

    from ..data import default_task

    report, locations, heldout = None, None, None
    if args.doc_length or (args.model_shape and not args.dataset):
        from ..data.prepare import sft_lengths

        gen = torch.Generator().manual_seed(args.seed)
        max_len = min(max_length, 4096)  # a --max-length under the median (350) lowers the median with it
        lengths = [args.doc_length] * 16 if args.doc_length else \
            sft_lengths(4000, seed=args.seed, median=min(350, max_len), max_len=max_len, min_len=min(16, max_len))
        vocab_size = model.config.vocab_size
        rows = [torch.randint(0, vocab_size, (n,), generator=gen).tolist() for n in lengths]
        data = Dataset.from_dict({"input_ids": rows})
    elif args.dataset:
        data, report, locations = read_dataset(args.dataset)
    else:
        train, heldout = default_task.train_and_heldout(n_eval=max(1, args.eval_examples), seed=args.seed)
        data, heldout = Dataset.from_list(train), (heldout if args.eval_examples > 0 else None)
    vocab_size = model.get_input_embeddings().num_embeddings
    data, report = check_dataset(data, tok, vocab_size=vocab_size, max_length=max_length, truncate=args.truncate,
                                 bad_rows=args.bad_rows, locations=locations, report=report)
    if len(data) == 0:
        raise ConfigurationError(f"no rows left to train on ({report.format()}).")
    return data, heldout, report


def check_token_budget(args: argparse.Namespace, train: Any) -> None:
    """Packed micro-batches of --max-tokens-per-batch tokens must each hold the longest example: refuse a smaller
    budget with the two flags that fix it (the sampler's own error advises its Python arguments)."""
    budget = args.max_tokens_per_batch
    if not (budget and args.packing) or "input_ids" not in getattr(train, "column_names", ()):
        return
    lengths = [len(ids) for ids in train["input_ids"]]
    longer = sum(n > budget for n in lengths)
    if longer:
        from ..errors import UsageError

        raise UsageError(f"--max-tokens-per-batch {budget} is less than {longer} of the {len(lengths)} examples (the "
                         f"longest has {max(lengths)} tokens): raise --max-tokens-per-batch to {max(lengths)} or "
                         f"more, or pass --max-length {budget} to truncate them")
