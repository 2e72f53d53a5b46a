"""Pre-tokenize local JSON / JSONL / Parquet files into a saved ``datasets`` dataset (offline).

    python scripts/pretokenize.py data/train.jsonl --tokenizer path/to/tokenizer --output data/train_tok \
        --num-proc 4 --cache-dir data/.cache

Rows need ``messages`` (chat; labels on assistant turns), ``prompt`` + ``completion`` (labels on the completion) or
``text``. The output has ``input_ids``, ``labels`` and ``length`` columns; load it with ``datasets.load_from_disk``
and give ``dataset["length"]`` to a sampler. Prints how many rows have no target token or no token at all, so they
are not discovered mid-training.
"""
from __future__ import annotations

import argparse
import os

from hf_accel.data.prepare import pretokenize

FORMATS = {".json": "json", ".jsonl": "json", ".parquet": "parquet"}


def load_local(paths: list[str]):
    from datasets import load_dataset

    kinds = {FORMATS.get(os.path.splitext(p)[1].lower()) for p in paths}
    if None in kinds or len(kinds) != 1:
        raise SystemExit(f"inputs {paths}: use files of one kind among {sorted(FORMATS)}")
    return load_dataset(kinds.pop(), data_files=paths, split="train")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("inputs", nargs="+", help="local .json/.jsonl/.parquet files")
    parser.add_argument("--tokenizer", required=True, help="a local tokenizer directory (no hub access)")
    parser.add_argument("--output", required=True, help="directory for Dataset.save_to_disk")
    parser.add_argument("--num-proc", type=int, default=None)
    parser.add_argument("--cache-dir", default=None, help="reuse tokenization across runs")
    parser.add_argument("--no-eos", action="store_true", help="do not append EOS to completions and texts")
    args = parser.parse_args()

    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(args.tokenizer, local_files_only=True)
    dataset = pretokenize(load_local(args.inputs), tokenizer, add_eos=not args.no_eos,
                          num_proc=args.num_proc, cache_dir=args.cache_dir)
    dataset.save_to_disk(args.output)
    lengths = sorted(dataset["length"])
    no_target = sum(all(label == -100 for label in labels[1:]) for labels in dataset["labels"])
    print(f"{len(lengths)} rows, {sum(lengths)} tokens, length min/median/max "
          f"{lengths[0] if lengths else 0}/{lengths[len(lengths) // 2] if lengths else 0}/"
          f"{lengths[-1] if lengths else 0}; empty rows {lengths.count(0)}; rows without a target token "
          f"{no_target} (the collators drop and count these by default) -> {args.output}")


if __name__ == "__main__":
    main()
