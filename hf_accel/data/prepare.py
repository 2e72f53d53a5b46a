"""Getting examples to the collator: tokenization with completion-only labels, offline pre-tokenization with
datasets, DataLoader settings for the machine, a data-wait timer, and a synthetic SFT length distribution.

Labels follow the causal-LM convention: -100 where the model is not trained (prompts, user and system turns).
"""
from __future__ import annotations

import functools
import math
import os
import time
from typing import Any, Iterable, Iterator, Mapping, Sequence

import torch

from ..errors import ConfigurationError, InvalidBatch

IGNORE_INDEX = -100


def sft_lengths(n: int, seed: int = 0, median: float = 350, max_len: int = 4096, min_len: int = 16,
                sigma: float = 1.0) -> list[int]:
    """``n`` integer sequence lengths, log-normal with the given median (``exp(mu)``) and ``sigma``, clipped to
    ``[min_len, max_len]``: a stand-in for SFT data (many short chats, a long tail)."""
    if not 1 <= min_len <= median <= max_len:
        raise ConfigurationError(f"need 1 <= min_len <= median <= max_len; got {min_len}, {median}, {max_len}.")
    gen = torch.Generator().manual_seed(seed)
    normal = torch.randn(n, generator=gen, dtype=torch.float64)
    lengths = torch.exp(math.log(median) + sigma * normal).round().clamp(min_len, max_len)
    return lengths.long().tolist()


def dataloader_kwargs(
    num_workers: int | None = None, pin_memory: bool | None = None, local_world_size: int | None = None
) -> dict[str, Any]:
    """DataLoader settings for this machine: workers from the CPUs this process may use (shared among the ranks
    of a node, one core left for the training loop, at most 4 since collating pre-tokenized data is cheap),
    pinned memory when CUDA is present, persistent workers and prefetching only with workers."""
    if local_world_size is None:
        local_world_size = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    if num_workers is None:
        cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
        num_workers = max(0, min(4, cpus // max(1, local_world_size) - 1))
    kwargs: dict[str, Any] = {
        "num_workers": num_workers,
        "pin_memory": torch.cuda.is_available() if pin_memory is None else pin_memory,
    }
    if num_workers > 0:  # DataLoader rejects both options without workers
        kwargs.update(persistent_workers=True, prefetch_factor=2)
    return kwargs


def _chat_ids(tokenizer: Any, messages: Sequence[Mapping[str, str]], add_generation_prompt: bool = False) -> list[int]:
    if not messages:
        return []
    return list(tokenizer.apply_chat_template(
        list(messages), tokenize=True, return_dict=False, add_generation_prompt=add_generation_prompt
    ))


def tokenize_messages(messages: Sequence[Mapping[str, str]], tokenizer: Any) -> dict[str, list[int]]:
    """Tokenize a chat with the tokenizer's chat template; labels only on assistant turns.

    An assistant turn's tokens are found by rendering incremental prefixes: they run from the end of the
    conversation before it (with the generation prompt, so the assistant header is not trained) to the end of
    the conversation including it (so the end-of-turn marker is trained). Raises InvalidBatch if the template does
    not render prefixes as prefixes of the whole conversation (then spans cannot be found this way).
    """
    input_ids = _chat_ids(tokenizer, messages)
    labels = [IGNORE_INDEX] * len(input_ids)
    for i, message in enumerate(messages):
        if message.get("role") != "assistant":
            continue
        before = _chat_ids(tokenizer, messages[:i], add_generation_prompt=True)
        through = _chat_ids(tokenizer, messages[: i + 1])
        if input_ids[: len(before)] != before or input_ids[: len(through)] != through:
            raise InvalidBatch(
                f"the chat template does not render the conversation up to message {i} as a prefix of the whole "
                f"conversation, so assistant tokens cannot be located. Use a prefix-stable template, or pass "
                f"prompt/completion pairs instead of messages."
            )
        labels[len(before) : len(through)] = input_ids[len(before) : len(through)]
    return {"input_ids": input_ids, "labels": labels}


def _encode(tokenizer: Any, text: str, add_special_tokens: bool) -> list[int]:
    return list(tokenizer(text, add_special_tokens=add_special_tokens)["input_ids"])


def tokenize_example(example: Mapping[str, Any], tokenizer: Any, add_eos: bool = True) -> dict[str, list[int]]:
    """Tokenize one example into ``input_ids`` and ``labels``. Accepted shapes, first match wins:

    - ``messages``: a chat (list of ``{"role", "content"}``), labels on assistant turns (``tokenize_messages``);
    - ``prompt`` + ``completion``: labels -100 on the prompt; each part is tokenized on its own so the boundary is
      exact; EOS appended to the completion when ``add_eos``;
    - ``text``: labels = input ids, EOS appended when ``add_eos``.
    """
    eos = [tokenizer.eos_token_id] if add_eos and tokenizer.eos_token_id is not None else []
    if example.get("messages") is not None:
        return tokenize_messages(example["messages"], tokenizer)
    if example.get("prompt") is not None and example.get("completion") is not None:
        prompt = _encode(tokenizer, example["prompt"], add_special_tokens=True)
        completion = _encode(tokenizer, example["completion"], add_special_tokens=False) + eos
        return {"input_ids": prompt + completion, "labels": [IGNORE_INDEX] * len(prompt) + completion}
    if example.get("text") is not None:
        ids = _encode(tokenizer, example["text"], add_special_tokens=True) + eos
        return {"input_ids": ids, "labels": list(ids)}
    raise InvalidBatch(
        f"example has keys {sorted(example)}; expected 'messages', 'prompt' and 'completion', or 'text'."
    )


def _tokenize_with_length(example: Mapping[str, Any], tokenizer: Any, add_eos: bool) -> dict[str, Any]:
    out = tokenize_example(example, tokenizer, add_eos)
    out["length"] = len(out["input_ids"])
    return out


def pretokenize(dataset: Any, tokenizer: Any, add_eos: bool = True, num_proc: int | None = None,
                cache_dir: str | None = None) -> Any:
    """Tokenize a ``datasets.Dataset`` once with ``Dataset.map`` (offline), returning ``input_ids``, ``labels`` and
    ``length`` columns (feed ``length`` to the samplers). With ``cache_dir`` the result is cached there under a
    fingerprint of the dataset, tokenizer and options, so a second call reads it from disk."""
    from datasets.fingerprint import Hasher  # optional dependency: only pretokenization needs datasets

    kwargs: dict[str, Any] = {}
    if cache_dir is not None:
        os.makedirs(cache_dir, exist_ok=True)
        key = Hasher.hash([dataset._fingerprint, tokenizer, add_eos])
        kwargs["cache_file_name"] = os.path.join(cache_dir, f"tokenized-{key}.arrow")
    return dataset.map(
        functools.partial(_tokenize_with_length, tokenizer=tokenizer, add_eos=add_eos),
        remove_columns=dataset.column_names,
        num_proc=num_proc,
        desc="tokenizing",
        **kwargs,
    )


class DataWaitTimer:
    """Wraps an iterable (a DataLoader) and measures how long each ``next()`` blocked: the time the training loop
    waited for data. ``pop_metrics()`` returns the totals since the previous call and starts a new window."""

    def __init__(self, iterable: Iterable[Any]) -> None:
        self.iterable = iterable
        self.last_wait_s = 0.0
        self._window_s = 0.0
        self._window_steps = 0

    def __len__(self) -> int:
        return len(self.iterable)  # type: ignore[arg-type]

    def __iter__(self) -> Iterator[Any]:
        iterator = iter(self.iterable)
        while True:
            start = time.perf_counter()
            try:
                batch = next(iterator)
            except StopIteration:
                return
            self.last_wait_s = time.perf_counter() - start
            self._window_s += self.last_wait_s
            self._window_steps += 1
            yield batch

    def pop_metrics(self) -> dict[str, float]:
        """``data_wait_s`` (total), ``data_wait_per_step_s`` and ``data_steps`` since the last call."""
        steps, total = self._window_steps, self._window_s
        self._window_s, self._window_steps = 0.0, 0
        return {"data_wait_s": total, "data_wait_per_step_s": total / steps if steps else 0.0, "data_steps": steps}
