"""The embedded default task of ``scripts/sft.py``: fully offline, learnable by a tiny model in a minute on a CPU.

Examples are prompt/completion pairs over short digit strings: ``copy:4821=`` -> ``4821``, ``rev:4821=`` -> ``1284``,
``sort:4821=`` -> ``1248``. Strings have different lengths, so batches carry documents of different lengths (what
packing is for). The tokenizer is character-level, built in code (no hub), with a chat template so the same
tokenizer also serves ``messages`` datasets. The held-out metric is exact match of the greedy completion.
"""
from __future__ import annotations

import random
from typing import Any, Sequence

import torch

TASKS = ("copy", "rev", "sort")
SPECIAL_TOKENS = ("<pad>", "<eos>", "<bos>", "<unk>")
# A tiny chat template (role markers are plain characters of the vocabulary), prefix-stable as tokenize_messages needs.
CHAT_TEMPLATE = (
    "{% for m in messages %}{{ m['role'][0] }}:{{ m['content'] }}{% if m['role'] == 'assistant' %}<eos>"
    "{% else %}={% endif %}{% endfor %}{% if add_generation_prompt %}a:{% endif %}"
)


def build_tokenizer() -> Any:
    """Character-level ``PreTrainedTokenizerFast`` (pad 0, eos 1, bos 2; task names are single tokens)."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    chars = list("0123456789:=,") + list("abcdefghijklmnopqrstuvwxyz") + list(TASKS)
    vocab = {tok: i for i, tok in enumerate(list(SPECIAL_TOKENS) + chars)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("|".join(TASKS) + r"|<eos>|\S"), behavior="isolated")
    tok.post_processor = processors.TemplateProcessing(single="<bos> $A", special_tokens=[("<bos>", vocab["<bos>"])])
    tok.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>", bos_token="<bos>", unk_token="<unk>",
        chat_template=CHAT_TEMPLATE,
    )


def solve(task: str, digits: str) -> str:
    return {"copy": digits, "rev": digits[::-1], "sort": "".join(sorted(digits))}[task]


def make_examples(n: int, seed: int, min_len: int = 2, max_len: int = 6,
                  tasks: Sequence[str] = TASKS) -> list[dict[str, str]]:
    """``n`` prompt/completion pairs, deterministic in ``seed``."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        task = rng.choice(list(tasks))
        digits = "".join(rng.choice("0123456789") for _ in range(rng.randint(min_len, max_len)))
        out.append({"prompt": f"{task}:{digits}=", "completion": solve(task, digits)})
    return out


def train_and_heldout(n_train: int = 6000, n_eval: int = 200, seed: int = 0) -> tuple[list[dict], list[dict]]:
    """Disjoint train and held-out sets (held-out prompts never appear in training)."""
    train = make_examples(n_train, seed)
    seen = {ex["prompt"] for ex in train}
    heldout = [ex for ex in make_examples(4 * n_eval, seed + 1) if ex["prompt"] not in seen][:n_eval]
    return train, heldout


def chance_exact_match(examples: Sequence[dict[str, str]]) -> float:
    """Expected exact match of guessing the completion's digits uniformly, its length known: mean of 10**-len."""
    return sum(10.0 ** -len(ex["completion"]) for ex in examples) / len(examples)


@torch.no_grad()
def exact_match(model: torch.nn.Module, tokenizer: Any, examples: Sequence[dict[str, str]],
                batch_size: int = 64, progress: bool | None = None) -> float:
    """Fraction of examples whose greedy completion (up to EOS) equals the reference completion.

    Prompts are grouped by token length so each generate() call needs no padding. ``progress``: a tqdm bar over the
    examples (None: only on a terminal).
    """
    from tqdm.auto import tqdm

    was_training = model.training
    model.eval()
    device = next(model.parameters()).device
    by_length: dict[int, list[int]] = {}
    encoded = [tokenizer(ex["prompt"])["input_ids"] for ex in examples]
    for i, ids in enumerate(encoded):
        by_length.setdefault(len(ids), []).append(i)
    correct = done = 0
    bar = tqdm(total=len(examples), desc="held-out exact match", unit="ex",
               disable=None if progress is None else not progress)
    for indices in by_length.values():
        for s in range(0, len(indices), batch_size):
            chunk = indices[s : s + batch_size]
            prompt_bs = torch.tensor([encoded[i] for i in chunk], device=device)
            longest = max(len(examples[i]["completion"]) for i in chunk) + 1
            out_bs = model.generate(
                input_ids=prompt_bs, attention_mask=torch.ones_like(prompt_bs), max_new_tokens=longest,
                do_sample=False, pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id,
            )
            for row, i in enumerate(chunk):
                text = tokenizer.decode(out_bs[row, prompt_bs.shape[1]:].tolist(), skip_special_tokens=False)
                correct += text.split(tokenizer.eos_token)[0].strip() == examples[i]["completion"]
            done += len(chunk)
            bar.update(len(chunk))
            bar.set_postfix(exact_match=f"{correct / done:.1%}", refresh=False)
    bar.close()
    model.train(was_training)
    return correct / len(examples)


def tiny_llama(vocab_size: int, seed: int = 0, hidden_size: int = 128, layers: int = 2) -> torch.nn.Module:
    """A small random-init Llama (fp32) sized to learn the default task in about a minute on two CPU cores."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=vocab_size, hidden_size=hidden_size, intermediate_size=2 * hidden_size,
        num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
        pad_token_id=0, eos_token_id=1, bos_token_id=2, tie_word_embeddings=True, use_cache=False,
        attn_implementation="sdpa",
    )
    return LlamaForCausalLM(config)
