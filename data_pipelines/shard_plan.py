"""Shard plan: the shard groups of every canonical stream, plus data set sizes and in-group mixing.

A pure function of the stream's settings (seed, epoch, sources, known sizes, canonical stream count), not
of the ranks or DataLoader workers that read the streams, so a stream's position is two integers that
any process layout can continue from.
- resampled mode: group g of stream c holds `group_size` shards drawn with replacement (by source
  weight) with a generator seeded by (seed, c, epoch, g);
- epoch mode: the shard list shuffled by (seed, epoch) is dealt to the streams in that order, each shard
  to the stream holding the fewest known samples so far (ties: fewer shards, then the lower index). With
  `overflow`, a stream that runs out of its own shards continues into round-robin shares
  (shard i of the permutation of epoch e+1, e+2, ... to stream i mod C), which need no sizes.
"""
from __future__ import annotations

import heapq
import math
import random
from dataclasses import dataclass, field
from typing import Iterator


@dataclass
class ShardPlan:
    """Deterministic shard groups of the canonical streams of one training stream."""

    shards_by_source: list[list[str]]
    weights: list[float]
    sizes: dict[str, int]
    mode: str
    seed: int
    epoch: int
    streams: int      # canonical stream count C
    group_size: int
    overflow: bool    # epoch mode with whole slices: a stream past its shards continues into later epochs'
    generation: int = 0  # bumped by an inexact resume so that restarted draws differ from the first ones
    _cache: dict = field(default_factory=dict, repr=False, compare=False)  # permutations and deals

    @property
    def rng_seed(self) -> str:
        """Seed component of every random choice: the configured seed, plus the resume generation."""
        return f"{self.seed}" if self.generation == 0 else f"{self.seed}g{self.generation}"

    @property
    def all_shards(self) -> list[str]:
        """Every shard of every source, in source order."""
        return [s for shards in self.shards_by_source for s in shards]

    def update_sizes(self, sizes: dict[str, int]) -> None:
        """Adopt measured shard sizes; later deals are balanced with them."""
        self.sizes.update(sizes)
        self._cache = {k: v for k, v in self._cache.items() if k[0] != "deal"}

    def permutation(self, epoch: int) -> list[int]:
        """Epoch mode: the order of all shards in `epoch` (indices into all_shards)."""
        key = ("perm", epoch, self.rng_seed)
        if key not in self._cache:  # ~140k shards: permute once per epoch, not per group
            n = len(self.all_shards)
            self._cache[key] = random.Random(f"epoch-{self.rng_seed}-{epoch}").sample(range(n), n)
        return self._cache[key]

    def deal(self, epoch: int) -> list[list[str]]:
        """Epoch mode: every canonical stream's own shards in `epoch`, balanced by the known sizes."""
        key = ("deal", epoch, self.rng_seed, self.streams)
        if key not in self._cache:
            shards = self.all_shards
            dealt: list[list[str]] = [[] for _ in range(self.streams)]
            heap = [(0, 0, c) for c in range(self.streams)]   # (samples, shards, stream)
            for i in self.permutation(epoch):
                samples, count, c = heapq.heappop(heap)
                dealt[c].append(shards[i])
                heapq.heappush(heap, (samples + self.sizes.get(shards[i], 0), count + 1, c))
            self._cache[key] = dealt
        return self._cache[key]

    def _overflow_share(self, epoch: int, stream: int) -> list[str]:
        """Epoch mode: the round-robin share of `stream` in the permutation of `epoch` (no sizes needed)."""
        shards = self.all_shards
        return [shards[i] for i in self.permutation(epoch)[stream::self.streams]]

    def group_shards(self, stream: int, group: int) -> list[str] | None:
        """Shards of group `group` of canonical stream `stream`, or None once the stream's data has ended."""
        if self.mode == "resampled":
            rng = random.Random(f"shards-{self.rng_seed}-{stream}-{self.epoch}-{group}")
            picks = []
            for _ in range(self.group_size):
                src = rng.choices(range(len(self.shards_by_source)), weights=self.weights)[0]
                picks.append(rng.choice(self.shards_by_source[src]))
            return picks
        own = self.deal(self.epoch)[stream]
        epoch = self.epoch
        while True:
            groups = [own[i:i + self.group_size] for i in range(0, len(own), self.group_size)]
            if group < len(groups):
                return groups[group]
            if not self.overflow or not groups:
                return None
            group -= len(groups)
            epoch += 1
            own = self._overflow_share(epoch, stream)

    def stream_sizes(self) -> list[int]:
        """Epoch mode: the known sample count of every canonical stream's own shards this epoch."""
        return [sum(self.sizes.get(s, 0) for s in shards) for shards in self.deal(self.epoch)]

    def steps_per_epoch(self, slice_size: int, whole_slices: bool) -> int:
        """Epoch mode: global batches in this epoch, from the known sizes; every stream gives one slice per
        step. Whole slices: as many as the smallest stream fills; else as many as the largest starts."""
        sizes = self.stream_sizes()
        if whole_slices:
            return min(sizes) // slice_size
        return max(math.ceil(n / slice_size) for n in sizes)


def interleave(iterators: list[Iterator], rng: random.Random) -> Iterator:
    """Samples of several shards, each next one taken from a random still-open shard."""
    active = list(iterators)
    while active:
        i = rng.randrange(len(active))
        try:
            yield next(active[i])
        except StopIteration:
            active.pop(i)
