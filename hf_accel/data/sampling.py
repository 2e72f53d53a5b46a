"""Batch samplers that decide which examples share a step: token-budget bins (packed mode) and length-grouped
batches (padded mode). Both are deterministic per (seed, epoch), shard across ranks, and resume mid-epoch.

Sharding rule (both samplers): the epoch's global list of batches is dealt round-robin to ranks
(``batches[rank::num_replicas]``). With ``drop_last=False`` the list is first extended by repeating its first batches
until its length is a multiple of ``num_replicas`` (as ``torch.utils.data.DistributedSampler`` does with samples), so
every rank runs the same number of steps; with ``drop_last=True`` the last ``len % num_replicas`` batches of the
(shuffled) epoch are dropped instead.
"""
from __future__ import annotations

import bisect
import math
import random
from typing import Any, Iterator, Literal, Sequence

from ..errors import ConfigurationError, InvalidBatch

__all__ = ["best_fit_decreasing", "TokenBudgetBatchSampler", "LengthGroupedBatchSampler"]


def best_fit_decreasing(lengths: Sequence[int], capacity: int, order: Sequence[int] | None = None) -> list[list[int]]:
    """Pack item indices into bins of at most ``capacity`` total length, longest item first, each into the fullest
    bin it fits (ties between equal lengths follow ``order``, default index order). Items longer than ``capacity``
    get a bin of their own."""
    order = range(len(lengths)) if order is None else order
    by_length = sorted(order, key=lambda i: -lengths[i])  # stable: equal lengths keep ``order``
    bins: list[list[int]] = []
    free: list[tuple[int, int]] = []  # sorted (remaining capacity, bin id)
    for i in by_length:
        slot = bisect.bisect_left(free, (lengths[i], -1))
        if slot == len(free):
            bins.append([i])
            if capacity - lengths[i] > 0:
                bisect.insort(free, (capacity - lengths[i], len(bins) - 1))
            continue
        remaining, b = free.pop(slot)
        bins[b].append(i)
        if remaining - lengths[i] > 0:
            bisect.insort(free, (remaining - lengths[i], b))
    return bins


class _ShardedBatchSampler:
    """Epoch shuffling, rank sharding and mid-epoch resume around a ``_global_batches(epoch)`` list."""

    def __init__(
        self, lengths: Sequence[int], shuffle: bool, seed: int, num_replicas: int, rank: int, drop_last: bool
    ) -> None:
        if num_replicas < 1 or not 0 <= rank < num_replicas:
            raise ConfigurationError(f"rank={rank}, num_replicas={num_replicas}; need 0 <= rank < num_replicas.")
        if len(lengths) == 0:
            raise InvalidBatch("lengths is empty; the sampler needs at least one example.")
        bad = [i for i, n in enumerate(lengths) if int(n) < 1]
        if bad:
            raise InvalidBatch(
                f"examples {bad[:5]} have length {[lengths[i] for i in bad[:5]]}; every example needs >= 1 token. "
                f"Filter empty examples before sampling."
            )
        self.lengths = [int(n) for n in lengths]
        self.shuffle, self.seed, self.drop_last = shuffle, seed, drop_last
        self.num_replicas, self.rank = num_replicas, rank
        self.epoch = 0
        self._start = 0  # where the next __iter__ starts in this epoch (set by load_state_dict)
        self._position = 0  # batches of this epoch yielded so far

    def _global_batches(self, epoch: int) -> list[list[int]]:
        raise NotImplementedError

    def _num_global_batches(self) -> int:
        raise NotImplementedError

    def _rng(self, epoch: int) -> random.Random:
        return random.Random(f"{self.seed}:{epoch}")

    def _rank_batches(self, epoch: int) -> list[list[int]]:
        batches = self._global_batches(epoch)
        if self.drop_last:
            batches = batches[: len(batches) - len(batches) % self.num_replicas]
        else:
            extra = -len(batches) % self.num_replicas
            batches = batches + (batches * math.ceil(extra / len(batches)))[:extra]
        return batches[self.rank :: self.num_replicas]

    def set_epoch(self, epoch: int) -> None:
        """Select the epoch whose order ``__iter__`` yields (call before every epoch, like DistributedSampler)."""
        if epoch != self.epoch:
            self._start = self._position = 0
        self.epoch = epoch

    def __len__(self) -> int:
        """Batches this rank yields in a full epoch (the same on every rank and every epoch)."""
        n = self._num_global_batches()
        return n // self.num_replicas if self.drop_last else math.ceil(n / self.num_replicas)

    def __iter__(self) -> Iterator[list[int]]:
        start, self._start = self._start, 0
        self._position = start
        for position, batch in enumerate(self._rank_batches(self.epoch)[start:], start=start):
            self._position = position + 1
            yield batch

    def state_dict(self) -> dict[str, int]:
        """Resume point: ``batches_consumed`` counts this rank's batches already yielded this epoch. A DataLoader
        prefetches, so a Trainer should store the number of optimizer micro-steps it actually ran instead."""
        return {"epoch": self.epoch, "seed": self.seed, "batches_consumed": self._position}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Make the next ``__iter__`` continue epoch ``state['epoch']`` after ``state['batches_consumed']`` batches."""
        if int(state.get("seed", self.seed)) != self.seed:
            raise ConfigurationError(
                f"state was saved with seed={state['seed']} but this sampler has seed={self.seed}; "
                f"resuming would yield a different order. Build the sampler with the saved seed."
            )
        self.epoch = int(state["epoch"])
        self._start = int(state["batches_consumed"])
        self._position = self._start


class TokenBudgetBatchSampler(_ShardedBatchSampler):
    """Batches of example indices whose total length is at most ``max_tokens`` (best fit decreasing).

    The number of bins depends only on the multiset of lengths, so ``len()`` is exact before training; the
    assignment of equal-length examples to bins and the order of bins change with (seed, epoch).
    ``oversized="own_bin"`` lets an example longer than ``max_tokens`` form a bin of its own (the collator's
    ``overflow`` then truncates or splits it; counted in ``num_oversized``); the default raises.
    """

    def __init__(
        self,
        lengths: Sequence[int],
        max_tokens: int,
        shuffle: bool = True,
        seed: int = 0,
        num_replicas: int = 1,
        rank: int = 0,
        drop_last: bool = False,
        oversized: Literal["error", "own_bin"] = "error",
    ) -> None:
        super().__init__(lengths, shuffle, seed, num_replicas, rank, drop_last)
        if max_tokens < 1:
            raise ConfigurationError(f"max_tokens={max_tokens}; use a positive token budget per batch.")
        self.max_tokens = max_tokens
        over = [i for i, n in enumerate(self.lengths) if n > max_tokens]
        if over and oversized != "own_bin":
            raise InvalidBatch(
                f"{len(over)} examples are longer than max_tokens={max_tokens} (e.g. index {over[0]} with "
                f"{self.lengths[over[0]]} tokens). Truncate when tokenizing, raise max_tokens, or pass "
                f"oversized='own_bin' together with a collator overflow='truncate'|'split'."
            )
        self.num_oversized = len(over)
        self._num_bins = len(best_fit_decreasing(self.lengths, max_tokens))

    def _global_batches(self, epoch: int) -> list[list[int]]:
        if not self.shuffle:
            return best_fit_decreasing(self.lengths, self.max_tokens)
        rng = self._rng(epoch)
        order = list(range(len(self.lengths)))
        rng.shuffle(order)
        bins = best_fit_decreasing(self.lengths, self.max_tokens, order)
        rng.shuffle(bins)
        return bins

    def _num_global_batches(self) -> int:
        return self._num_bins

    @property
    def packing_efficiency(self) -> float:
        """Real tokens / (bins * max_tokens) over the whole dataset (oversized examples count ``max_tokens``)."""
        real = sum(min(n, self.max_tokens) for n in self.lengths)
        return real / (self._num_bins * self.max_tokens)


class LengthGroupedBatchSampler(_ShardedBatchSampler):
    """Fixed-size batches of similar length for padded mode.

    Like transformers' length grouping: a random permutation is cut into megabatches of ``batch_size *
    mega_batch_mult`` examples, each sorted by length and cut into batches; then the batch order is shuffled.
    """

    def __init__(
        self,
        lengths: Sequence[int],
        batch_size: int,
        shuffle: bool = True,
        seed: int = 0,
        num_replicas: int = 1,
        rank: int = 0,
        drop_last: bool = False,
        mega_batch_mult: int = 50,
    ) -> None:
        super().__init__(lengths, shuffle, seed, num_replicas, rank, drop_last)
        if batch_size < 1 or mega_batch_mult < 1:
            raise ConfigurationError(f"batch_size={batch_size}, mega_batch_mult={mega_batch_mult}; both must be >= 1.")
        self.batch_size, self.mega_batch_mult = batch_size, mega_batch_mult

    def _global_batches(self, epoch: int) -> list[list[int]]:
        rng = self._rng(epoch)
        order = list(range(len(self.lengths)))
        if self.shuffle:
            rng.shuffle(order)
        mega = self.batch_size * self.mega_batch_mult
        batches = []
        for s in range(0, len(order), mega):
            group = sorted(order[s : s + mega], key=lambda i: -self.lengths[i])
            batches += [group[b : b + self.batch_size] for b in range(0, len(group), self.batch_size)]
        if self.shuffle:
            rng.shuffle(batches)
        return batches

    def _num_global_batches(self) -> int:
        return math.ceil(len(self.lengths) / self.batch_size)

    def padding_efficiency(self, epoch: int | None = None) -> float:
        """Real tokens / padded slots (batch size * longest) over one epoch's batches (default: current epoch)."""
        batches = self._global_batches(self.epoch if epoch is None else epoch)
        slots = sum(len(b) * max(self.lengths[i] for i in b) for b in batches)
        return sum(self.lengths) / slots
