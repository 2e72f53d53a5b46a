"""Pre-tokenize local JSON / JSONL / Parquet files into a saved ``datasets`` dataset (offline).

    python scripts/pretokenize.py data/train.jsonl --tokenizer path/to/tokenizer --output data/train_tok \
        --num-proc 4 --cache-dir data/.cache
    python scripts/sft.py --model path/to/model --dataset data/train_tok      # train on the saved folder

Rows need ``messages`` (chat; labels on assistant turns), ``prompt`` + ``completion`` (labels on the completion) or
``text``. The output has ``input_ids``, ``labels`` and ``length`` columns; load it with ``datasets.load_from_disk``
and give ``dataset["length"]`` to a sampler. Every row is checked once (``hf_accel.data.validate``): unparsable JSONL
lines (with their line number), unknown row shapes, empty rows, rows without a target token, ids outside the
tokenizer's vocabulary. Bad rows stop the run with a count per kind, or with ``--bad-rows drop`` are left out and
counted, so they are not discovered mid-training.
"""
from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from a checkout without installing

from hf_accel.data.validate import DataReport, check_dataset, report_for_jsonl, scan_jsonl  # noqa: E402
from hf_accel.errors import ConfigurationError, run_cli  # noqa: E402

FORMATS = {".json": "json", ".jsonl": "json", ".parquet": "parquet"}


def _is_json_lines(path: str) -> bool:
    if path.lower().endswith(".jsonl"):
        return True
    with open(path, encoding="utf-8", errors="replace") as f:
        return not f.read(4096).lstrip().startswith("[")  # a .json file holding one array is not JSON Lines


def load_local(paths: list[str]) -> tuple[object, DataReport | None, list[str] | None]:
    """(rows of all files, report of unparsable JSONL lines or None, ``file:line`` of each row or None)."""
    import json

    from datasets import Dataset, load_dataset

    kinds = {FORMATS.get(os.path.splitext(p)[1].lower()) for p in paths}
    if None in kinds or len(kinds) != 1:
        raise ConfigurationError(f"inputs {paths}: use files of one kind among {sorted(FORMATS)}.")
    missing = [p for p in paths if not os.path.isfile(p)]
    if missing:
        raise ConfigurationError(f"inputs {missing}: no such file.")
    kind = kinds.pop()
    if kind != "json" or not all(_is_json_lines(p) for p in paths):
        return load_dataset(kind, data_files=paths, split="train"), None, None
    scans = {p: scan_jsonl(p) for p in paths}
    locations = [f"{p}:{n}" if len(paths) > 1 else f"line {n}" for p, s in scans.items() for n in s.good_lines]
    if not any(s.bad_lines for s in scans.values()):
        return load_dataset("json", data_files=paths, split="train"), None, locations
    report, rows = DataReport(), []
    for p, scan in scans.items():
        part = report_for_jsonl(scan)
        report.rows += part.rows
        for number, problem in scan.bad_lines:
            report.add("malformed", f"{p}:{number}: {problem}" if len(paths) > 1 else f"line {number}: {problem}")
        good = set(scan.good_lines)
        with open(p, encoding="utf-8", errors="replace") as f:
            rows += [json.loads(line) for n, line in enumerate(f, start=1) if n in good]
    return Dataset.from_list(rows), report, locations


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("inputs", nargs="+", help="local .json/.jsonl/.parquet files")
    parser.add_argument("--tokenizer", required=True, help="a local tokenizer directory (no hub access)")
    parser.add_argument("--output", required=True, help="directory for Dataset.save_to_disk")
    parser.add_argument("--num-proc", type=int, default=None)
    parser.add_argument("--cache-dir", default=None, help="reuse tokenization across runs")
    parser.add_argument("--no-eos", action="store_true", help="do not append EOS to completions and texts")
    parser.add_argument("--bad-rows", choices=["fail", "drop"], default="fail",
                        help="rows that cannot be trained on: stop with a count per kind, or leave them out (counted)")
    args = parser.parse_args(argv)

    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(args.tokenizer, local_files_only=True)
    raw, report, locations = load_local(args.inputs)
    tokenize = {"add_eos": not args.no_eos, "num_proc": args.num_proc, "cache_dir": args.cache_dir}
    dataset, report = check_dataset(raw, tokenizer, vocab_size=len(tokenizer), bad_rows=args.bad_rows,
                                    locations=locations, report=report, tokenize=tokenize)
    dataset.save_to_disk(args.output)
    lengths = sorted(dataset["length"])
    print(f"{len(lengths)} rows, {sum(lengths)} tokens, length min/median/max "
          f"{lengths[0] if lengths else 0}/{lengths[len(lengths) // 2] if lengths else 0}/"
          f"{lengths[-1] if lengths else 0} -> {args.output}\n{report.format()}")


def cli(argv: list[str] | None = None) -> int:
    """main() for the command line: hf_accel's own errors print as one message (no traceback), exit status 1."""
    return run_cli(main, argv, "pretokenize.py")


if __name__ == "__main__":
    sys.exit(cli())
