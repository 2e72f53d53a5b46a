"""Padding fraction and packing efficiency of four batching strategies on an SFT-like length distribution (CPU).

    python scripts/padding_stats.py --n 20000 --seed 0 --batch-size 8 --max-len 4096 --token-budget 16384

Strategies: pad every sample to max_len; pad to the longest of random batches; pad to the longest of length-grouped
batches (LengthGroupedBatchSampler); packed bins of the token budget (TokenBudgetBatchSampler +
DataCollatorForPacking). Slot counts come from the batch index lists and are cross-checked against the real
collators' counters on the first ``--check`` batches of each strategy. Prints a Markdown table.
"""
from __future__ import annotations

import argparse
import random
import statistics

from hf_accel.data.collators import DataCollatorForPacking, DataCollatorForPadding
from hf_accel.data.prepare import sft_lengths
from hf_accel.data.sampling import LengthGroupedBatchSampler, TokenBudgetBatchSampler


def padded_slots(batch: list[int], lengths: list[int], pad_to: int | None = None) -> int:
    return len(batch) * (pad_to or max(lengths[i] for i in batch))


def check_with_collator(collator, batches, lengths, expected_slots) -> None:
    """Run the real collator on a few batches and compare its slot count with the one computed from lengths."""
    for batch in batches:
        collator([{"input_ids": [1] * lengths[i]} for i in batch])
    if collator.stats.slots != expected_slots:
        raise SystemExit(f"collator counted {collator.stats.slots} slots, computed {expected_slots}")


def row(name: str, batches: list[list[int]], lengths: list[int], slots: int, budget_fill: float | None) -> str:
    real = sum(lengths[i] for b in batches for i in b)
    fill = "" if budget_fill is None else f"{100 * budget_fill:.1f}%"
    return (f"| {name} | {len(batches):,} | {real / len(batches):,.0f} | {slots / len(batches):,.0f} "
            f"| {100 * (1 - real / slots):.1f}% | {fill} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--n", type=int, default=20_000)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--median", type=float, default=350)
    parser.add_argument("--max-len", type=int, default=4096)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--token-budget", type=int, default=16_384)
    parser.add_argument("--check", type=int, default=20, help="batches per strategy run through the real collators")
    args = parser.parse_args()

    lengths = sft_lengths(args.n, seed=args.seed, median=args.median, max_len=args.max_len)
    order = list(range(args.n))
    random.Random(args.seed).shuffle(order)
    random_batches = [order[s : s + args.batch_size] for s in range(0, args.n, args.batch_size)]
    grouped = LengthGroupedBatchSampler(lengths, args.batch_size, seed=args.seed)
    grouped_batches = list(grouped)
    packer = TokenBudgetBatchSampler(lengths, args.token_budget, seed=args.seed)
    packed_batches = list(packer)

    k = args.check
    pad_max = DataCollatorForPadding(0, pad_to_multiple_of=args.max_len)
    check_with_collator(pad_max, random_batches[:k], lengths,
                        sum(padded_slots(b, lengths, args.max_len) for b in random_batches[:k]))
    for batches in (random_batches, grouped_batches):
        check_with_collator(DataCollatorForPadding(0), batches[:k], lengths,
                            sum(padded_slots(b, lengths) for b in batches[:k]))
    check_with_collator(DataCollatorForPacking(0, max_tokens=args.token_budget), packed_batches[:k], lengths,
                        sum(lengths[i] for b in packed_batches[:k] for i in b))

    print(f"n={args.n} seed={args.seed} median={statistics.median(lengths)} mean={sum(lengths) / args.n:.0f} "
          f"min={min(lengths)} max={max(lengths)}")
    print("| strategy | batches | real tokens / batch | token slots / batch | padding | token-budget fill |")
    print("|---|---:|---:|---:|---:|---:|")
    print(row(f"pad to max ({args.max_len}), batches of {args.batch_size}", random_batches, lengths,
              sum(padded_slots(b, lengths, args.max_len) for b in random_batches), None))
    print(row(f"pad to longest, random batches of {args.batch_size}", random_batches, lengths,
              sum(padded_slots(b, lengths) for b in random_batches), None))
    print(row(f"pad to longest, length-grouped batches of {args.batch_size}", grouped_batches, lengths,
              sum(padded_slots(b, lengths) for b in grouped_batches), None))
    print(row(f"packed, token budget {args.token_budget} (one row per batch)", packed_batches, lengths,
              sum(lengths[i] for b in packed_batches for i in b), packer.packing_efficiency))


if __name__ == "__main__":
    main()
