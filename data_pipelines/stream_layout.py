"""Which canonical streams a rank and each of its DataLoader workers read, and the stream-state table.

The global batch of every step is cut from `C` canonical streams, `global_batch / C` samples each, in
stream order. Rank r of W reads the contiguous streams [r*C/W, (r+1)*C/W), so the rank batches in rank
order are the global batch for any W. Within a rank, DataLoader worker k of K reads the contiguous block
of local streams [k*L/K, (k+1)*L/K) (L = C/W) and yields, per step, one item holding the slices of its
streams in stream order; the DataLoader takes the workers in turn, so the items of a step in worker order
are the rank batch. Hence C must be a multiple of W x K (workers used: at most C/W) and a divisor of the
global batch.

The stream state saved by a rank holds one record per canonical stream it reads (position, skips, shard
sizes measured so far) next to the counters every rank shares (epoch, steps, measured sizes).
`merge_stream_states` joins the states saved by all ranks into one table of all C streams;
`split_stream_state` gives a rank of any world size its part of that table.
"""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Optional

STATE_VERSION = 2
# Identical on every rank of one save; a merge refuses states that differ in one of them.
SHARED_KEYS = ("mode", "seed", "generation", "epoch", "batches", "canonical_streams", "global_batch")
# Per-rank counters that belong to no stream (device-decode fallbacks counted in the trainer's process,
# skips carried over from an older state format): they travel with the state's lowest stream.
RANK_COUNTERS = ("decode_main", "done_skips")
KEY = "data.canonical_streams"


class LayoutError(ValueError):
    """A canonical stream count that does not fit the world size, the workers or the global batch."""


@dataclass(frozen=True)
class StreamLayout:
    """The canonical streams of one rank and of each of its DataLoader workers."""

    streams: int        # C
    global_batch: int
    world_size: int
    rank: int
    workers: int        # DataLoader worker processes (0: the streams are read in the trainer's process)

    @property
    def slice_size(self) -> int:
        """Samples each canonical stream gives to one global batch."""
        return self.global_batch // self.streams

    @property
    def local_streams(self) -> range:
        """The canonical streams this rank reads, in the order of its batch."""
        per_rank = self.streams // self.world_size
        return range(self.rank * per_rank, (self.rank + 1) * per_rank)

    def worker_streams(self, worker: int) -> range:
        """The canonical streams DataLoader worker `worker` reads (worker 0 when in-process)."""
        local, per_worker = self.local_streams, len(self.local_streams) // max(1, self.workers)
        return range(local[0] + worker * per_worker, local[0] + (worker + 1) * per_worker)


def default_stream_count(world_size: int, num_workers: int, rank_batch: int, max_streams: Optional[int]) -> int:
    """world_size x the most workers (<= num_workers) whose count divides the rank batch; with
    `max_streams` (epoch mode: the shard count) no more streams than that, where the world size allows."""
    for k in range(max(1, num_workers), 0, -1):
        if rank_batch % k == 0 and (max_streams is None or world_size * k <= max_streams or k == 1):
            return world_size * k
    return world_size


DEFAULT_SHUFFLE_BUFFER = 1000   # raw samples per canonical stream when neither buffer key is set


@dataclass(frozen=True)
class StreamSettings:
    """Every setting of one rank's training stream that a run decides (count, buffer, workers), decided once a launch
    by stream_settings(): the stream reads it, and so do the planner, the host line and the checkpoint's record."""

    streams: int          # C canonical streams of the run
    world_size: int
    ranks_per_host: int   # processes sharing one host's memory (LOCAL_WORLD_SIZE)
    workers: int          # DataLoader worker processes used per rank (at most its streams)
    shuffle_buffer: int   # raw samples held per canonical stream
    prefetch_factor: int  # rank batches each worker prepares ahead
    shards_per_group: int = 2   # shards a stream interleaves: its buffer never holds more than their samples
    host_shuffle_buffer: Optional[int] = None   # data.host_shuffle_buffer (what a first launch splits per stream)

    @property
    def per_rank(self) -> int:
        """Canonical streams one rank reads."""
        return self.streams // self.world_size

    @property
    def per_host(self) -> int:
        """Canonical streams one host's ranks read, each with its shuffle buffer."""
        return self.per_rank * self.ranks_per_host


def stream_count(cfg, world_size: int, rank_batch: int, max_streams: Optional[int] = None,
                 recorded: Optional[int] = None) -> int:
    """C: data.canonical_streams, else the count a checkpoint resumed recorded, else default_stream_count (what a
    first launch settles)."""
    return cfg.canonical_streams or recorded or default_stream_count(world_size, cfg.num_workers, rank_batch,
                                                                     max_streams)


def per_stream_buffer(cfg, streams: int, world_size: int, ranks_per_host: int, recorded: Optional[int] = None) -> int:
    """Raw samples each canonical stream holds: data.shuffle_buffer when set, else the buffer a checkpoint resumed
    recorded (the value its first launch settled: the sample order depends on it), else data.host_shuffle_buffer
    shared by the streams of one host, else DEFAULT_SHUFFLE_BUFFER."""
    if cfg.shuffle_buffer is not None:
        return cfg.shuffle_buffer
    if recorded is not None:
        return recorded
    if cfg.host_shuffle_buffer is not None:
        return cfg.host_shuffle_buffer // max(1, streams // world_size * min(ranks_per_host, world_size))
    return DEFAULT_SHUFFLE_BUFFER


def stream_settings(cfg, world_size: int, rank_batch: int, max_streams: Optional[int] = None,
                    ranks_per_host: Optional[int] = None, recorded_streams: Optional[int] = None,
                    recorded_buffer: Optional[int] = None) -> StreamSettings:
    """The stream settings of a launch of `world_size` processes, `ranks_per_host` a host (default: all), from the
    run's `data` section (a StreamConfig); `rank_batch`: the rank's share of the global batch (of every stage: their
    greatest common divisor); `max_streams`: epoch mode's shard count; `recorded_*`: the canonical stream count and
    shuffle buffer a checkpoint resumed was written with (they stand where the config leaves the keys unset)."""
    hosts = min(ranks_per_host or world_size, world_size)
    streams = stream_count(cfg, world_size, rank_batch, max_streams, recorded_streams)
    return StreamSettings(streams, world_size, hosts, min(cfg.num_workers, max(1, streams // world_size)),
                          per_stream_buffer(cfg, streams, world_size, hosts, recorded_buffer), cfg.prefetch_factor,
                          cfg.shards_per_group, cfg.host_shuffle_buffer)


def resolve_layout(streams: int, global_batch: int, world_size: int, rank: int, num_workers: int,
                   origin: str = "") -> StreamLayout:
    """The layout of `rank`, or a LayoutError naming data.canonical_streams and the fix; `origin` says
    where the count came from (e.g. ' (recorded in the checkpoint)')."""
    name, wanted = f"{KEY}={streams}{origin}", world_size * max(1, num_workers)
    if streams < 1:
        raise LayoutError(f"{name}: must be >= 1")
    if global_batch % streams:
        raise LayoutError(f"{name} does not divide the global batch {global_batch} (each canonical stream gives "
                          f"global_batch / canonical_streams samples per step); fix: a divisor of {global_batch}"
                          f"{_suggestion(global_batch, wanted)}")
    if streams % world_size:
        raise LayoutError(f"{name} is not a multiple of world_size={world_size}; fix: a multiple of every world "
                          f"size the run is launched with{_suggestion(global_batch, wanted)}")
    per_rank = streams // world_size
    workers = min(num_workers, per_rank)   # a worker without a stream would idle
    if workers and per_rank % workers:
        raise LayoutError(f"{name} is not divisible by world_size x num_workers = {world_size} x {num_workers} "
                          f"({per_rank} streams per rank cannot be shared evenly by the workers); fix: "
                          f"data.num_workers a divisor of {per_rank}{_suggestion(global_batch, wanted, f' or {KEY}:')}")
    return StreamLayout(streams, global_batch, world_size, rank, workers)


def _suggestion(global_batch: int, multiple_of: int, lead: str = ", e.g.") -> str:
    """', e.g. N': the smallest multiple of `multiple_of` that divides the global batch (or nothing)."""
    fits = [n for n in range(multiple_of, global_batch + 1, multiple_of) if global_batch % n == 0]
    return f"{lead} {fits[0]}" if fits else ""


# --------------------------------------------------------------------------------------------------------
# The stream-state table
# --------------------------------------------------------------------------------------------------------
def merge_stream_states(states: list[dict]) -> dict:
    """One table of all canonical streams from the stream states saved by every rank of one checkpoint."""
    if not states:
        raise ValueError("merge_stream_states: no stream state given")
    first = states[0]
    for state in states:
        if state.get("version") != STATE_VERSION:
            raise ValueError(f"stream state version {state.get('version')} cannot be merged (version "
                             f"{STATE_VERSION} only); resume it with the world size and workers it was saved with")
        differ = [k for k in SHARED_KEYS if state.get(k) != first.get(k)]
        if differ:
            raise ValueError(f"stream states differ in {differ} ({[first.get(k) for k in differ]} vs "
                             f"{[state.get(k) for k in differ]}): they are not from one checkpoint")
    streams: dict[str, dict] = {}
    counters = {name: Counter() for name in RANK_COUNTERS}
    measured: dict = {}
    for state in states:
        repeated = set(streams) & set(state["streams"])
        if repeated:
            raise ValueError(f"canonical streams {sorted(map(int, repeated))} appear in two stream states")
        streams.update(state["streams"])
        measured.update(state.get("measured_sizes", {}))
        for name in RANK_COUNTERS:
            counters[name].update(state.get(name, {}))
    missing = sorted(set(range(first["canonical_streams"])) - set(map(int, streams)))
    if missing:
        raise ValueError(f"the stream states lack canonical streams {missing}; pass the states saved by every rank")
    table = {**{k: first[k] for k in SHARED_KEYS}, "version": STATE_VERSION, "rank": None, "world_size": None,
             "streams": {str(c): streams[str(c)] for c in sorted(map(int, streams))}, "measured_sizes": measured}
    table["samples"] = first["batches"] * first["global_batch"]
    return {**table, **{name: dict(counters[name]) for name in RANK_COUNTERS}}


def split_stream_state(table: dict, rank: int, world_size: int) -> dict:
    """The stream state of `rank` of `world_size` ranks, from a table of all canonical streams."""
    layout = resolve_layout(table["canonical_streams"], table["global_batch"], world_size, rank, 0,
                            " (recorded in the stream state)")
    own = {str(c): table["streams"][str(c)] for c in layout.local_streams}
    state = {**table, "rank": rank, "world_size": world_size, "streams": own}
    return {**state, **{name: (table.get(name, {}) if rank == 0 else {}) for name in RANK_COUNTERS}}


def takes_rank_counters(state: dict, local_streams: range) -> bool:
    """Whether this rank adopts the state's per-rank counters: it reads the state's lowest stream."""
    return min(map(int, state["streams"])) == local_streams[0]
