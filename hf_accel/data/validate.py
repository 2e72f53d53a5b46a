"""Checking a dataset once, before training, so bad rows do not surface at step 4000.

Every row is looked at once and sorted into a kind (first match wins):

- ``malformed``: a JSON Lines line that does not parse to an object, an example without ``messages``,
  ``prompt`` + ``completion`` or ``text``, one of those of another type (named, with the type found), or token
  fields that are not aligned lists of ints;
- ``empty``: no token at all, or an empty ``text``, ``prompt``, ``completion`` or message content;
- ``out_of_vocab``: a token id (or a label other than -100) outside ``[0, vocab_size)``, which the embedding would
  reject mid-training with a bare IndexError;
- ``over_long``: more than ``max_length`` tokens; truncated to ``max_length`` (and counted) unless ``truncate=False``,
  then a bad row like the others;
- ``no_target``: no label other than -100 after the first token (nothing to learn; the first token is never a
  target), also when truncation cut every target away.

``bad_rows="fail"`` raises :class:`~hf_accel.errors.InvalidDataset` with the count per kind and the first rows of
each; ``"drop"`` removes them and counts them in the returned :class:`DataReport`. Nothing is dropped or truncated
without being counted there.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, Literal, Sequence

from ..errors import ConfigurationError, InvalidBatch, InvalidDataset
from .collators import validate_feature

IGNORE_INDEX = -100
KINDS = ("malformed", "empty", "out_of_vocab", "over_long", "no_target")
SHOWN_PER_KIND = 3  # locations listed per kind in messages
BadRows = Literal["fail", "drop"]


@dataclass
class DataReport:
    """What checking a dataset found. ``counts``: bad rows per kind (over-long rows only when not truncated);
    ``where``: the first few locations per kind ("line 7: ...", "row 12: ..."); ``truncated_*``: rows cut to
    ``max_length`` and the tokens cut off; ``dropped``: bad rows removed (``bad_rows="drop"``)."""

    rows: int = 0
    kept: int = 0
    dropped: int = 0
    truncated_rows: int = 0
    truncated_tokens: int = 0
    max_length: int | None = None
    counts: dict[str, int] = field(default_factory=lambda: dict.fromkeys(KINDS, 0))
    where: dict[str, list[str]] = field(default_factory=lambda: {k: [] for k in KINDS})

    @property
    def bad(self) -> int:
        return sum(self.counts.values())

    def add(self, kind: str, location: str) -> None:
        self.counts[kind] += 1
        if len(self.where[kind]) < SHOWN_PER_KIND:
            self.where[kind].append(location)

    def describe_bad(self) -> str:
        parts = []
        for kind in KINDS:
            if self.counts[kind]:
                more = self.counts[kind] - len(self.where[kind])
                shown = "; ".join(self.where[kind]) + (f"; and {more} more" if more > 0 else "")
                parts.append(f"{kind} {self.counts[kind]} ({shown})")
        return ", ".join(parts) if parts else "none"

    def format(self) -> str:
        """One line for a run's log."""
        line = f"data check: {self.rows} rows, {self.kept} kept"
        if self.max_length is not None:
            line += (f"; {self.truncated_rows} truncated to {self.max_length} tokens "
                     f"({self.truncated_tokens} tokens cut)")
        line += f"; bad rows: {self.describe_bad()}"
        if self.dropped:
            line += f"; {self.dropped} dropped"
        return line

    def as_dict(self) -> dict[str, Any]:
        return {"rows": self.rows, "kept": self.kept, "dropped": self.dropped, "max_length": self.max_length,
                "truncated_rows": self.truncated_rows, "truncated_tokens": self.truncated_tokens,
                "bad": dict(self.counts), "where": {k: v for k, v in self.where.items() if v}}


@dataclass
class JsonlScan:
    """Result of :func:`scan_jsonl`: the line numbers (1-based) of the rows that parsed, in order, and the lines
    that did not, with the parser's message."""

    good_lines: list[int]
    bad_lines: list[tuple[int, str]]


def scan_jsonl(path: str) -> JsonlScan:
    """Parse a JSON Lines file line by line (streaming) and note which lines are not one JSON object each.
    Blank lines are skipped, as ``datasets``' json loader skips them."""
    good, bad = [], []
    with open(path, encoding="utf-8", errors="replace") as f:
        for number, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                value = json.loads(line)
            except json.JSONDecodeError as e:
                bad.append((number, f"not JSON ({e.msg} at column {e.colno})"))
                continue
            if isinstance(value, dict):
                good.append(number)
            else:
                bad.append((number, f"a JSON {type(value).__name__}, not an object"))
    return JsonlScan(good, bad)


def _type_name(value: Any) -> str:
    return "null" if value is None else type(value).__name__


def example_problem(example: dict[str, Any]) -> tuple[str, str] | None:
    """(kind, detail) of why a raw example cannot be tokenized and trained on by ``tokenize_example``: a field of the
    wrong type (``malformed``, naming the field and the type found) or with nothing in it (``empty``); None when it
    can."""
    if example.get("messages") is not None:
        messages = example["messages"]
        if not isinstance(messages, (list, tuple)):
            return "malformed", f"'messages' is {_type_name(messages)}, expected a list of {{'role', 'content'}} objects"
        if not messages:
            return "empty", "'messages' is an empty list"
        for i, m in enumerate(messages):
            if not isinstance(m, dict) or not m.get("role"):
                return "malformed", f"messages[{i}] is not a {{'role', 'content'}} object"
            if not isinstance(m.get("content"), str):
                return "malformed", f"messages[{i}].content is {_type_name(m.get('content'))}, expected a string"
            if not m["content"].strip():
                return "empty", f"messages[{i}].content ({m['role']}) is empty"
        return None
    prompt, completion, text = example.get("prompt"), example.get("completion"), example.get("text")
    fields = {"prompt": prompt, "completion": completion} if prompt is not None or completion is not None else \
        {"text": text} if text is not None else None
    if fields is None:
        present = sorted(k for k, v in example.items() if v is not None)
        return "malformed", f"has fields {present}; expected 'messages', 'prompt' and 'completion', or 'text'"
    for name, value in fields.items():
        if not isinstance(value, str):
            return "malformed", f"'{name}' is {_type_name(value)}, expected a string"
    for name, value in fields.items():
        if not value.strip():
            return "empty", f"'{name}' is empty"
    return None


def token_problem(input_ids: list[int], labels: list[int], vocab_size: int | None) -> tuple[str, str] | None:
    """(kind, detail) of what makes a tokenized row untrainable regardless of length, or None."""
    if not input_ids:
        return "empty", "no tokens"
    if vocab_size is not None:
        low, high = min(input_ids), max(input_ids)
        if low < 0 or high >= vocab_size:
            bad = high if high >= vocab_size else low
            return "out_of_vocab", f"token id {bad} outside [0, {vocab_size})"
        for label in labels:
            if label != IGNORE_INDEX and not 0 <= label < vocab_size:
                return "out_of_vocab", f"label {label} outside [0, {vocab_size}) and not -100"
    return None


def _has_target(labels: Sequence[int]) -> bool:
    return any(label != IGNORE_INDEX for label in labels[1:])


def _rows(dataset: Any, columns: Sequence[str]):
    """Rows of a ``datasets.Dataset`` (read in batches) or of a list of dicts, as dicts with ``columns``."""
    if hasattr(dataset, "iter") and hasattr(dataset, "column_names"):
        present = [c for c in columns if c in dataset.column_names]
        for batch in dataset.select_columns(present).iter(batch_size=1000):
            for i in range(len(batch[present[0]])):
                yield {c: batch[c][i] for c in present}
    else:
        for example in dataset:
            yield example


def _select(dataset: Any, keep: list[int]) -> Any:
    if hasattr(dataset, "select"):
        return dataset.select(keep)
    return [dataset[i] for i in keep]


def _truncate(dataset: Any, cut: set[int], max_length: int) -> Any:
    def truncate(example: dict[str, Any], index: int) -> dict[str, Any]:
        if index not in cut:
            return example
        out = dict(example)
        for name in ("input_ids", "labels", "attention_mask"):
            if out.get(name) is not None:
                out[name] = list(out[name])[:max_length]
        if "length" in out:
            out["length"] = len(out["input_ids"])
        return out

    if hasattr(dataset, "map") and hasattr(dataset, "column_names"):
        return dataset.map(truncate, with_indices=True, desc=f"truncating to {max_length} tokens")
    return [truncate(dict(example), i) for i, example in enumerate(dataset)]


def report_for_jsonl(scan: JsonlScan) -> DataReport:
    """A report that starts with a JSONL file's unparsable lines (pass it to ``check_dataset(report=...)`` with
    ``locations=[f"line {n}" for n in scan.good_lines]``)."""
    report = DataReport(rows=len(scan.bad_lines))
    for number, problem in scan.bad_lines:
        report.add("malformed", f"line {number}: {problem}")
    return report


def check_dataset(
    dataset: Any,
    tokenizer: Any = None,
    *,
    vocab_size: int | None = None,
    max_length: int | None = None,
    truncate: bool = True,
    bad_rows: BadRows = "fail",
    locations: Sequence[str] | None = None,
    report: DataReport | None = None,
    tokenize: dict[str, Any] | None = None,
) -> tuple[Any, DataReport]:
    """Check every row once and return ``(dataset to train on, report)``.

    ``dataset``: a ``datasets.Dataset`` or a list of dicts, raw (``messages`` / ``prompt`` + ``completion`` /
    ``text``; tokenized here with ``tokenizer`` by ``pretokenize``) or tokenized (``input_ids``, optional
    ``labels``). ``vocab_size``: the model's embedding rows (ids at or past it are ``out_of_vocab``).
    ``max_length``: longer rows are truncated (counted) or, with ``truncate=False``, ``over_long`` bad rows.
    ``locations``: how to name row i in messages (e.g. ``"line 12"`` of a JSONL file); default ``"row i"``.
    ``report``: continue a report (e.g. one that already counts malformed JSONL lines). ``tokenize``: keyword
    arguments for ``pretokenize`` (``add_eos``, ``num_proc``, ``cache_dir``).

    Raises InvalidDataset when ``bad_rows="fail"`` and any row is bad, after looking at every row.
    """
    if bad_rows not in ("fail", "drop"):
        raise ConfigurationError(f"bad_rows={bad_rows!r}; allowed: 'fail', 'drop'.")
    if max_length is not None and max_length < 1:
        raise ConfigurationError(f"max_length={max_length}; use a positive number of tokens or None.")
    report = report or DataReport()
    report.max_length = max_length
    report.rows += len(dataset)
    names = list(locations) if locations is not None else None  # None: "row i", named only when reported
    columns = getattr(dataset, "column_names", None)
    if columns is None:
        columns = sorted({k for example in dataset for k in example})
    if "input_ids" not in columns:
        if tokenizer is None:
            raise ConfigurationError("the dataset has no 'input_ids' column; pass the tokenizer to tokenize it.")
        dataset, names = _tokenize_raw(dataset, columns, tokenizer, tokenize or {}, names, report)
    keep, cut, cut_tokens = _judge_rows(dataset, names, vocab_size, max_length, truncate, report)

    if report.bad and bad_rows == "fail":
        raise InvalidDataset(
            f"{report.bad} of {report.rows} rows cannot be trained on: {report.describe_bad()}. Fix or remove them, "
            f"or drop them and train on the rest (bad_rows='drop'; hf-accel sft --bad-rows drop).", report)
    if cut:
        dataset = _truncate(dataset, cut, max_length)  # type: ignore[arg-type]
    if len(keep) < len(dataset):
        dataset = _select(dataset, keep)
    report.truncated_rows += len(cut)
    report.truncated_tokens += cut_tokens
    report.kept = len(keep)
    report.dropped = report.bad
    return dataset, report


def _row(names: list[str] | None, i: int) -> str:
    """How messages name row ``i``: its given location, or "row i"."""
    return names[i] if names is not None else f"row {i}"


def _tokenize_raw(dataset: Any, columns: Sequence[str], tokenizer: Any, tokenize: dict[str, Any],
                  names: list[str] | None, report: DataReport) -> tuple[Any, list[str] | None]:
    """Raw rows tokenized (``pretokenize``; per row for a list); rows that cannot be tokenized are counted in
    ``report`` and set aside first (tokenizing would raise). Returns the tokenized rows and their names."""
    tokenizable = []
    for i, example in enumerate(_rows(dataset, columns)):
        problem = example_problem(example)
        if problem is None:
            tokenizable.append(i)
        else:
            report.add(problem[0], f"{_row(names, i)}: {problem[1]}")
    if len(tokenizable) < len(dataset):
        dataset = _select(dataset, tokenizable)
        names = [_row(names, i) for i in tokenizable]
    from .prepare import pretokenize, tokenize_example

    if hasattr(dataset, "map") and hasattr(dataset, "column_names"):
        return pretokenize(dataset, tokenizer, **tokenize), names
    return [tokenize_example(example, tokenizer, tokenize.get("add_eos", True)) for example in dataset], names


def _judge_rows(dataset: Any, names: list[str] | None, vocab_size: int | None, max_length: int | None, truncate: bool,
                report: DataReport) -> tuple[list[int], set[int], int]:
    """Each tokenized row's verdict: bad (counted in ``report`` under its kind), or kept, and then truncated or not.
    Returns the kept rows, the truncated ones among them and the tokens truncation removes."""
    keep, cut = [], set()
    cut_tokens = 0
    for i, example in enumerate(_rows(dataset, ("input_ids", "labels", "attention_mask"))):
        try:
            ids, labels = validate_feature(example, i)
        except InvalidBatch as e:
            report.add("malformed", f"{_row(names, i)}: {str(e).removeprefix(f'feature {i}: ')}")
            continue
        problem = token_problem(ids, labels, vocab_size)
        if problem is not None:
            report.add(problem[0], f"{_row(names, i)}: {problem[1]}")
            continue
        truncated = max_length is not None and len(ids) > max_length
        if truncated and not truncate:
            report.add("over_long", f"{_row(names, i)}: {len(ids)} tokens > max_length {max_length}")
            continue
        if not _has_target(labels[:max_length] if truncated else labels):
            detail = f"no target token in the first {max_length} tokens" if truncated else "no target token"
            report.add("no_target", f"{_row(names, i)}: {detail} (all labels -100)")
            continue
        if truncated:
            cut.add(i)
            cut_tokens += len(ids) - max_length
        keep.append(i)
    return keep, cut, cut_tokens
