"""hf_accel.data.validate: every row checked once before training; bad rows counted per kind, dropped or refused."""
import json

import pytest

from hf_accel.data.default_task import build_tokenizer
from hf_accel.data.validate import check_dataset, report_for_jsonl, scan_jsonl
from hf_accel.errors import ConfigurationError, InvalidBatch, InvalidDataset

VOCAB = 50
GOOD = {"input_ids": [2, 5, 6, 7], "labels": [-100, -100, 6, 7]}
ROWS = [
    GOOD,
    {"input_ids": []},                                              # empty
    {"input_ids": [2, 5, 60]},                                      # token id past the vocabulary
    {"input_ids": [2, 5, 6], "labels": [-100, -100, 99]},           # label past the vocabulary
    {"input_ids": [2, 5, 6], "labels": [-100, -100, -100]},         # no target
    {"input_ids": [2, 5, 6], "labels": [-100, 6]},                  # labels not aligned
    {"input_ids": [2, 5.0, 6]},                                     # float id
    {"input_ids": [2, 5, 6, 7, 8, 9, 10, 11], "labels": [-100] * 7 + [11]},  # its only target is past max_length
    {"input_ids": [2, 5, 6, 7, 8, 9, 10, 11]},                      # over-long, truncated
]


def test_every_bad_kind_is_counted_and_named_before_failing():
    with pytest.raises(InvalidDataset) as info:
        check_dataset(ROWS, vocab_size=VOCAB, max_length=6)
    report = info.value.report
    assert isinstance(info.value, InvalidBatch)  # callers catching InvalidBatch keep working
    assert report.counts == {"malformed": 2, "empty": 1, "out_of_vocab": 2, "over_long": 0, "no_target": 2}
    message = str(info.value)
    for text in ("7 of 9 rows", "row 1: no tokens", "row 2: token id 60 outside [0, 50)", "label 99",
                 "row 7: no target token in the first 6 tokens", "bad-rows drop"):
        assert text in message, message


def test_drop_keeps_the_good_rows_and_truncates_counted():
    data, report = check_dataset(ROWS, vocab_size=VOCAB, max_length=6, bad_rows="drop")
    assert data == [GOOD, {"input_ids": [2, 5, 6, 7, 8, 9]}]
    assert (report.rows, report.kept, report.dropped) == (9, 2, 7)
    assert (report.truncated_rows, report.truncated_tokens) == (1, 2)
    assert "2 kept; 1 truncated to 6 tokens (2 tokens cut)" in report.format()


def test_without_truncation_over_long_rows_are_bad():
    with pytest.raises(InvalidDataset, match=r"over_long 1 \(row 1: 8 tokens > max_length 6\)"):
        check_dataset([GOOD, ROWS[-1]], max_length=6, truncate=False)
    data, report = check_dataset([GOOD, ROWS[-1]], max_length=6, truncate=False, bad_rows="drop")
    assert data == [GOOD] and report.counts["over_long"] == 1 and report.truncated_rows == 0


def test_arrow_dataset_is_truncated_with_its_length_column():
    from datasets import Dataset

    rows = [{"input_ids": list(range(1, n + 1)), "labels": list(range(1, n + 1)), "length": n} for n in (3, 9, 5)]
    data, report = check_dataset(Dataset.from_list(rows), vocab_size=VOCAB, max_length=4)
    assert data["length"] == [3, 4, 4] and [len(x) for x in data["labels"]] == [3, 4, 4]
    assert data["input_ids"][1] == [1, 2, 3, 4] and report.truncated_tokens == 5 + 1


def test_raw_examples_are_tokenized_and_unknown_shapes_are_malformed():
    from datasets import Dataset

    tok = build_tokenizer()
    raw = Dataset.from_list([{"prompt": "copy:12=", "completion": "12"}, {"prompt": None, "completion": "3"},
                             {"prompt": "rev:", "completion": "21"}, {"prompt": None, "completion": None}])
    with pytest.raises(InvalidDataset, match=r"row 1: 'prompt' is null, expected a string.*row 3: has fields \[\]"):
        check_dataset(raw, tok, vocab_size=len(tok))
    data, report = check_dataset(raw, tok, vocab_size=len(tok), bad_rows="drop")
    assert report.counts["malformed"] == 2 and len(data) == 2 and "input_ids" in data.column_names
    assert data[0]["input_ids"] == tok("copy:12=")["input_ids"] + tok("12", add_special_tokens=False)["input_ids"] \
        + [tok.eos_token_id]
    with pytest.raises(ConfigurationError, match="tokenizer"):
        check_dataset(raw)


@pytest.mark.parametrize("row, detail", [
    ({"prompt": "copy:12=", "completion": ""}, "'completion' is empty"),
    ({"prompt": "", "completion": "12"}, "'prompt' is empty"),
    ({"text": "   "}, "'text' is empty"),
    ({"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": ""}]},
     "messages[1].content (assistant) is empty"),
    ({"messages": []}, "'messages' is an empty list"),
])
def test_empty_text_fields_are_empty_rows(row, detail):
    """An empty text, prompt, completion or message is a bad row of kind ``empty`` (it used to pass the check and be
    trained on); the good rows around it train."""
    from datasets import Dataset

    tok = build_tokenizer()
    good = {"messages": [{"role": "user", "content": "copy:12="}, {"role": "assistant", "content": "12"}]} \
        if "messages" in row else {"text": "copy:12=12"} if "text" in row else {"prompt": "copy:12=", "completion": "12"}
    raw = Dataset.from_list([good, row, good])
    with pytest.raises(InvalidDataset, match=r"empty 1 \(row 1: " + detail.replace("[", r"\[").replace("]", r"\]")
                       .replace("(", r"\(").replace(")", r"\)")):
        check_dataset(raw, tok, vocab_size=len(tok))
    data, report = check_dataset(raw, tok, vocab_size=len(tok), bad_rows="drop")
    assert report.counts["empty"] == 1 and report.bad == 1 and len(data) == 2


def test_a_wrong_type_names_the_field_and_the_type_found(tmp_path):
    """A parquet completion column of integers: the message names the column and its type."""
    from datasets import Dataset, load_dataset

    Dataset.from_dict({"prompt": ["copy:1=", "copy:2="], "completion": [1, 2]}).to_parquet(tmp_path / "d.parquet")
    raw = load_dataset("parquet", data_files=str(tmp_path / "d.parquet"), split="train")
    tok = build_tokenizer()
    with pytest.raises(InvalidDataset, match=r"malformed 2 \(row 0: 'completion' is int, expected a string"):
        check_dataset(raw, tok, vocab_size=len(tok))
    bad_messages = [{"messages": [{"role": "user", "content": 5}]}]
    with pytest.raises(InvalidDataset, match=r"messages\[0\].content is int, expected a string"):
        check_dataset(bad_messages, tok, vocab_size=len(tok))


def test_malformed_jsonl_lines_are_reported_with_their_line_number(tmp_path):
    path = tmp_path / "data.jsonl"
    lines = [json.dumps({"text": "ab"}), "{not json", "", json.dumps([1, 2]), json.dumps({"text": "cd"})]
    path.write_text("\n".join(lines) + "\n")
    scan = scan_jsonl(str(path))
    assert scan.good_lines == [1, 5] and [n for n, _ in scan.bad_lines] == [2, 4]
    rows = [{"input_ids": [2, 5]}, {"input_ids": [2, 99]}]  # what the good lines tokenized to
    with pytest.raises(InvalidDataset) as info:
        check_dataset(rows, vocab_size=VOCAB, report=report_for_jsonl(scan),
                      locations=[f"line {n}" for n in scan.good_lines])
    message = str(info.value)
    assert "3 of 4 rows" in message and "line 2: not JSON" in message and "line 4: a JSON list" in message
    assert "line 5: token id 99" in message


def test_bad_options_are_configuration_errors():
    with pytest.raises(ConfigurationError, match="bad_rows"):
        check_dataset([GOOD], bad_rows="skip")
    with pytest.raises(ConfigurationError, match="max_length"):
        check_dataset([GOOD], max_length=0)
