"""Shard plan: which shard groups each (rank, worker) reads, plus data set sizes and in-group mixing.

A pure function of the stream's settings (seed, epoch, rank, world size, worker count), so every rank
can compute every other rank's share without communicating, and a worker's position is two integers.
"""
from __future__ import annotations

import math
import random
import tarfile
from dataclasses import dataclass, field
from typing import Iterator

from webdataset.tariterators import base_plus_ext

from .shard_reader import is_remote, shard_sizes


@dataclass
class ShardPlan:
    """Deterministic assignment of shard groups to (rank, worker) for one stream."""

    shards_by_source: list[list[str]]
    weights: list[float]
    sizes: dict[str, int]
    mode: str
    seed: int
    epoch: int
    rank: int
    world_size: int
    num_workers: int
    group_size: int
    overflow: bool  # epoch mode, several ranks: a worker past its own shards continues into the next epoch's
    generation: int = 0  # bumped by an inexact resume so that restarted draws differ from the first ones
    _orders: dict = field(default_factory=dict, repr=False, compare=False)  # epoch -> shard permutation

    @property
    def rng_seed(self) -> str:
        """Seed component of every random choice: the configured seed, plus the resume generation."""
        return f"{self.seed}" if self.generation == 0 else f"{self.seed}g{self.generation}"

    @property
    def all_shards(self) -> list[str]:
        """Every shard of every source, in source order."""
        return [s for shards in self.shards_by_source for s in shards]

    def worker_shards(self, epoch: int, worker: int, rank: int | None = None) -> list[str]:
        """Epoch mode: the shards `worker` of `rank` reads in `epoch`."""
        shards = self.all_shards
        key = (epoch, self.rng_seed)
        if key not in self._orders:  # ~140k shards x every rank and worker: permute once per epoch
            self._orders[key] = random.Random(f"epoch-{self.rng_seed}-{epoch}").sample(range(len(shards)), len(shards))
        order = self._orders[key]
        rank = self.rank if rank is None else rank
        mine = [shards[i] for i in order[rank::self.world_size]]
        return mine[worker::self.num_workers]

    def group_shards(self, worker: int, group: int) -> list[str] | None:
        """Shards of a worker's group `group`, or None once the worker's stream has ended."""
        if self.mode == "resampled":
            rng = random.Random(f"shards-{self.rng_seed}-{self.rank}-{worker}-{self.epoch}-{group}")
            picks = []
            for _ in range(self.group_size):
                src = rng.choices(range(len(self.shards_by_source)), weights=self.weights)[0]
                picks.append(rng.choice(self.shards_by_source[src]))
            return picks
        epoch = self.epoch
        while True:
            mine = self.worker_shards(epoch, worker)
            groups = [mine[i:i + self.group_size] for i in range(0, len(mine), self.group_size)]
            if group < len(groups):
                return groups[group]
            if not self.overflow or not groups:
                return None
            group -= len(groups)
            epoch += 1

    def expected_batches(self, batch_size: int, drop_last: bool, rank: int) -> int:
        """Epoch mode: batches `rank` yields in one pass, from the known shard sizes."""
        total = 0
        for w in range(self.num_workers):
            n = sum(self.sizes.get(s, 0) for s in self.worker_shards(self.epoch, w, rank))
            total += n // batch_size if drop_last else math.ceil(n / batch_size)
        return total


def interleave(iterators: list[Iterator], rng: random.Random) -> Iterator:
    """Samples of several shards, each next one taken from a random still-open shard."""
    active = list(iterators)
    while active:
        i = rng.randrange(len(active))
        try:
            yield next(active[i])
        except StopIteration:
            active.pop(i)


def count_tar_samples(shard: str) -> int:
    """Samples (distinct keys) in a local tar, reading headers only."""
    keys = set()
    with tarfile.open(shard, "r") as tar:
        for member in tar:
            if member.isreg():
                key, _ = base_plus_ext(member.name)
                if key is not None and not key.split("/")[-1].startswith("__"):
                    keys.add(key)
    return len(keys)


def resolve_sizes(shards: list[str]) -> tuple[dict[str, int], bool]:
    """Known or estimated sample count of every shard; the flag says some were estimated."""
    sizes, estimated = shard_sizes(shards)
    unknown = [i for i, n in enumerate(sizes) if n is None and not is_remote(shards[i])]
    # Shards without img2dataset stats (someone else's webdataset): count headers, or a sample of them.
    probe = unknown if len(unknown) <= 1000 else unknown[:: max(1, len(unknown) // 16)][:16]
    counted = {}
    for i in probe:
        try:
            counted[i] = count_tar_samples(shards[i])
        except (OSError, tarfile.TarError):
            counted[i] = 0
    for i, n in counted.items():
        sizes[i] = n
    if len(probe) < len(unknown):
        estimated = True
        mean = round(sum(counted.values()) / max(1, len(counted)))
        for i in unknown:
            sizes[i] = counted.get(i, mean)
    known = [n for n in sizes if n is not None]
    if len(known) < len(sizes):
        estimated = True
        mean = round(sum(known) / len(known)) if known else 0
        sizes = [mean if n is None else n for n in sizes]
    return dict(zip(shards, sizes)), estimated
