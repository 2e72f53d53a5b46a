"""Tokenization with completion-only / assistant-only labels, pretokenization, loader settings, timer, lengths."""
import statistics
import time

import pytest
import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from hf_accel.data.prepare import DataWaitTimer, dataloader_kwargs, pretokenize, sft_lengths, tokenize_example
from hf_accel.errors import ConfigurationError, InvalidBatch

CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}<|end|>{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
SPECIALS = ["<|pad|>", "<|eos|>", "<|end|>", "<|system|>", "<|user|>", "<|assistant|>"]
CORPUS = ["the quick brown fox jumps over the lazy dog", "hello world, how are you today?",
          "packing documents saves padding", "assistant answers the user politely"] * 5


@pytest.fixture(scope="module")
def tokenizer():
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    bpe.train_from_iterator(CORPUS, trainers.BpeTrainer(
        vocab_size=300, special_tokens=SPECIALS, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok = PreTrainedTokenizerFast(tokenizer_object=bpe, pad_token="<|pad|>", eos_token="<|eos|>")
    tok.chat_template = CHAT_TEMPLATE
    return tok


def decode_targets(tokenizer, out):
    return tokenizer.decode([t for t, label in zip(out["input_ids"], out["labels"]) if label != -100])


def test_chat_labels_only_on_assistant_turns(tokenizer):
    messages = [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "hello world"},
        {"role": "assistant", "content": "how are you"},
        {"role": "user", "content": "the lazy dog"},
        {"role": "assistant", "content": "jumps over"},
    ]
    out = tokenize_example({"messages": messages}, tokenizer)
    assert out["input_ids"] == tokenizer.apply_chat_template(messages, return_dict=False)
    assert decode_targets(tokenizer, out) == "how are you<|end|>jumps over<|end|>"
    # labels equal the ids wherever they are set
    assert all(label in (-100, t) for t, label in zip(out["input_ids"], out["labels"]))


def test_chat_template_that_is_not_prefix_stable_raises(tokenizer):
    unstable = CHAT_TEMPLATE.replace("{% endfor %}", "{% endfor %}{{ messages | length }}")
    tok = PreTrainedTokenizerFast(tokenizer_object=tokenizer.backend_tokenizer, eos_token="<|eos|>")
    tok.chat_template = unstable
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]
    with pytest.raises(InvalidBatch, match="prefix"):
        tokenize_example({"messages": messages}, tok)


def test_prompt_completion_masks_the_prompt(tokenizer):
    out = tokenize_example({"prompt": "hello world,", "completion": " how are you"}, tokenizer)
    n_prompt = len(tokenizer("hello world,")["input_ids"])
    assert out["labels"][:n_prompt] == [-100] * n_prompt
    assert out["labels"][n_prompt:] == out["input_ids"][n_prompt:]
    assert decode_targets(tokenizer, out) == " how are you<|eos|>"


def test_text_trains_on_everything(tokenizer):
    out = tokenize_example({"text": "the quick brown fox"}, tokenizer)
    assert out["labels"] == out["input_ids"] and out["input_ids"][-1] == tokenizer.eos_token_id
    with pytest.raises(InvalidBatch, match="expected 'messages'"):
        tokenize_example({"question": "?"}, tokenizer)


def test_pretokenize_is_cached_on_disk(tokenizer, tmp_path):
    from datasets import Dataset

    rows = [{"prompt": "hello", "completion": " world"}, {"prompt": "the lazy", "completion": " dog"}]
    data = Dataset.from_list(rows)
    first = pretokenize(data, tokenizer, cache_dir=str(tmp_path))
    assert first.column_names == ["input_ids", "labels", "length"]
    assert first[0] == {**tokenize_example(data[0], tokenizer), "length": len(first[0]["input_ids"])}
    cached = list(tmp_path.glob("tokenized-*.arrow"))
    assert len(cached) == 1
    mtime = cached[0].stat().st_mtime_ns
    second = pretokenize(data, tokenizer, cache_dir=str(tmp_path))
    assert second[:] == first[:] and cached[0].stat().st_mtime_ns == mtime  # read back, not recomputed
    assert second.cache_files[0]["filename"] == str(cached[0])


def test_sft_lengths_median_and_clipping():
    lengths = sft_lengths(20_000, seed=0)
    assert min(lengths) == 16 and max(lengths) == 4096  # the clip bounds are reached, never crossed
    assert statistics.median(lengths) == pytest.approx(350, rel=0.05)
    assert all(isinstance(n, int) for n in lengths)
    assert sft_lengths(100, seed=3) == sft_lengths(100, seed=3) != sft_lengths(100, seed=4)
    short = sft_lengths(5000, seed=1, median=64, max_len=128, min_len=8)
    assert min(short) == 8 and max(short) == 128 and statistics.median(short) == pytest.approx(64, rel=0.05)
    with pytest.raises(ConfigurationError):
        sft_lengths(10, median=5000)


def test_dataloader_kwargs_are_accepted_by_dataloader():
    for kwargs in (dataloader_kwargs(), dataloader_kwargs(num_workers=0), dataloader_kwargs(num_workers=1)):
        assert kwargs["pin_memory"] == torch.cuda.is_available()
        assert ("prefetch_factor" in kwargs) == (kwargs["num_workers"] > 0)
        loader = torch.utils.data.DataLoader(list(range(4)), batch_size=2, **kwargs)
        assert [b.tolist() for b in loader] == [[0, 1], [2, 3]]
    assert dataloader_kwargs(local_world_size=10_000)["num_workers"] == 0


def test_data_wait_timer_measures_blocking_next():
    def slow():
        for i in range(3):
            time.sleep(0.05)
            yield i

    timer = DataWaitTimer(slow())
    start = time.perf_counter()
    items = []
    for item in timer:
        items.append(item)
        time.sleep(0.02)  # compute time must not count as waiting
    elapsed = time.perf_counter() - start
    metrics = timer.pop_metrics()
    assert items == [0, 1, 2] and metrics["data_steps"] == 3
    assert 0.15 <= metrics["data_wait_s"] < elapsed - 0.05
    assert timer.pop_metrics()["data_steps"] == 0
