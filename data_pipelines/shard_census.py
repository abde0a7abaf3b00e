"""Data set sizes as facts: what every shard holds, read from img2dataset's `_stats.json`, a `sizes.json`, or
the tar's own headers, and what is wrong with the shards (missing, cut short, compressed, not a tar).

A local shard is looked at before its stats are believed: a missing tar holds nothing whatever its stats say,
a tar that does not end with the end-of-archive blocks was cut short and holds the complete samples before
the cut (counted from its headers, as the reader keeps them), and a compressed one is skipped by the reader.
The stats files are data from elsewhere: a count that is not a whole number from 0 to 10^9 (1e309, -3, "12",
an array for sizes.json) is one warning naming the file, and the shard is counted from its headers.
Remote shards: a few stats files are probed and extrapolated (reading ~140k over the network would take
longer than a training start is worth).
"""
from __future__ import annotations

import json
import os
import stat
import tarfile
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

from webdataset.tariterators import base_plus_ext

from crate_clip.checkpoint_io.bounded_reads import UnreadableRecordError, read_small_bytes
from crate_clip.core.tar_members import BLOCK, TruncatedTarError, compression_of, iter_members

from .remote_retry import RetryPolicy, open_remote_shard
from .shard_reader import IMAGE_EXTS, STATS_PROBES, is_remote, stats_url

COUNT_KEYS = ("count", "successes", "failed_to_download", "failed_to_resize")   # img2dataset's _stats.json
MAX_COUNT = 10 ** 9            # samples in one shard (DataComp: 10,000)
MAX_STATS_BYTES = 16 << 20     # a _stats.json with its status_dict: a few KB
HEADER_COUNT_ALL = 1000        # shards without stats counted from their headers; above, a sample of 16
LISTED = 10                    # shards named per problem in the report
LOOKERS = 16                   # threads looking at local shards (I/O bound)


class MalformedSizeError(ValueError):
    """A stats or sizes.json file whose counts are not whole numbers of samples."""


def _count(value, what: str) -> int:
    """`value` as a sample count, or MalformedSizeError naming `what`."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise MalformedSizeError(f"{what} is {json.dumps(value)[:40]}, not a whole number of samples")
    if not 0 <= value <= MAX_COUNT:
        raise MalformedSizeError(f"{what} is {value}, not a count of samples from 0 to {MAX_COUNT:,}")
    return value


def _json(raw: bytes, where: str):
    """The JSON value of `raw`; MalformedSizeError when it is not JSON."""
    try:
        return json.loads(raw)
    except (ValueError, RecursionError):   # UnicodeDecodeError and JSONDecodeError are ValueErrors
        raise MalformedSizeError(f"{where}: not valid JSON") from None


def stats_counts(raw: bytes, where: str) -> dict[str, int]:
    """img2dataset's counts ('successes' and those of COUNT_KEYS present) from a _stats.json's bytes."""
    data = _json(raw, where)
    if not isinstance(data, dict) or "successes" not in data:
        raise MalformedSizeError(f"{where}: not an img2dataset stats object (no \"successes\" count)")
    return {key: _count(data[key], f"{where}: {key}") for key in COUNT_KEYS if key in data}


def read_sizes_json(folder: Path) -> tuple[dict[str, int], list[str]]:
    """{basename: count} of a webdataset-style sizes.json ({} if there is none), and its problems."""
    f = folder / "sizes.json"
    if not f.is_file():
        return {}, []
    try:
        data = _json(read_small_bytes(f), str(f))
    except (MalformedSizeError, UnreadableRecordError, OSError) as exn:
        return {}, [str(exn)]
    if not isinstance(data, dict):
        return {}, [f"{f}: a {type(data).__name__}, not an object of shard name -> sample count"]
    sizes, problems = {}, []
    for name, value in data.items():
        try:
            sizes[Path(name).name] = _count(value, f"{f}: {name}")
        except MalformedSizeError as exn:
            problems.append(str(exn))
    return sizes, problems


def remote_shard_size(shard: str, timeout: float = 60.0) -> int | None:
    """Samples in a remote shard, read from its _stats.json through the same command/URL; None if unknown."""
    url = stats_url(shard)
    try:
        # One try, silent for at most `timeout` seconds (a size probe: unknown is an answer), through the shards'
        # own transport: at most MAX_STATS_BYTES + 1 bytes are read, and a `pipe:` command that would print more
        # is killed when the stream closes, instead of its whole output being held in memory.
        with open_remote_shard(url, RetryPolicy(total_s=0, stall_s=timeout)) as f:
            raw = f.read(MAX_STATS_BYTES + 1)
        if len(raw) > MAX_STATS_BYTES:
            return None
        return stats_counts(raw, url)["successes"]
    except Exception:  # a missing or malformed stats file just means "unknown"
        return None


def tar_ending(path: str) -> str:
    """'complete', 'truncated' (no end-of-archive blocks), or the compression ('gzip', ...) of a local tar."""
    with open(path, "rb") as f:
        head = f.read(BLOCK)
        kind = compression_of(head)
        if kind:
            return kind
        size = f.seek(0, os.SEEK_END)
        if size < 2 * BLOCK or size % BLOCK:
            return "truncated"
        f.seek(size - 2 * BLOCK)
        return "complete" if f.read(2 * BLOCK).count(0) == 2 * BLOCK else "truncated"


def count_tar_samples(path: str) -> int:
    """The samples (distinct keys) of a local tar that the reader yields, reading headers only: in a tar cut
    short, those before the cut, the one in progress at the cut kept only if its image and caption are whole."""
    size = os.path.getsize(path)
    keys: dict[str, set] = {}
    last = None
    with open(path, "rb") as f:
        try:
            for member in iter_members(f, lambda name: -1):   # every member passed over unread
                key, ext = base_plus_ext(member.name)
                if key is None:
                    continue
                if member.end > size:   # this member's data is cut
                    break
                keys.setdefault(key, set()).add(ext.lower())
                last = key
            else:
                return len(keys)
        except (TruncatedTarError, EOFError):
            pass
        except tarfile.ReadError:
            if not keys:
                raise   # not a tar at all
    whole = last is not None and "txt" in keys[last] and keys[last] & set(IMAGE_EXTS)
    return len(keys) if whole or last is None else len(keys) - 1


@dataclass
class ShardCensus:
    """Every shard's sample count and what was found wrong while counting."""

    sizes: dict[str, int] = field(default_factory=dict)
    estimated: bool = False      # some sizes extrapolated (remote shards, or a sample of headers counted)
    missing: list[str] = field(default_factory=list)
    truncated: dict[str, int] = field(default_factory=dict)   # shard -> complete samples before the cut
    compressed: list[str] = field(default_factory=list)
    unreadable: list[str] = field(default_factory=list)       # not a tar, or not a regular file
    malformed: list[str] = field(default_factory=list)        # "file: why" of stats / sizes.json counts
    img2dataset: Counter = field(default_factory=Counter)     # summed _stats.json counts, + "stats_files"

    def report(self) -> dict:
        """The census as `shards inspect` prints it (each problem: its count and the first shards)."""
        out = {"shards": len(self.sizes), "samples": sum(self.sizes.values()), "estimated": self.estimated}
        for name in ("missing", "truncated", "compressed", "unreadable", "malformed"):
            items = getattr(self, name)
            out[name] = {"count": len(items), "first": (dict(list(items.items())[:LISTED]) if isinstance(items, dict)
                                                        else list(items)[:LISTED])}
        out["img2dataset"] = {key: int(self.img2dataset.get(key, 0)) for key in ("stats_files",) + COUNT_KEYS}
        return out

    def warning(self) -> str | None:
        """One line naming what is wrong with the shards, or None."""
        parts = []
        for name, items, what in (("missing", self.missing, "count 0"),
                                  ("truncated", self.truncated, "count their complete samples before the cut"),
                                  ("compressed", self.compressed, "skipped: crate-clip reads uncompressed .tar"),
                                  ("unreadable", self.unreadable, "not tar files: count 0")):
            if items:
                parts.append(f"{len(items)} {name} ({what}; first: {next(iter(items))})")
        if self.malformed:
            parts.append(f"{len(self.malformed)} malformed stats/sizes counts (ignored, those shards counted from "
                         f"their tar headers; first: {self.malformed[0]})")
        return f"of {len(self.sizes):,} shards: " + "; ".join(parts) if parts else None


@dataclass
class _Look:
    """What one look at a local shard found: its size (None: to be counted from its headers), its problem
    ('missing', 'truncated', 'compressed', 'unreadable'), its img2dataset counts, a malformed stats file."""

    size: int | None
    problem: str | None = None
    counts: dict | None = None
    malformed: str | None = None


def _stats_of(shard: str) -> tuple[dict | None, str | None]:
    """(img2dataset counts, None) of a shard's _stats.json, (None, why) when it is malformed, (None, None) if none."""
    stats = stats_url(shard)
    if not os.path.isfile(stats):
        return None, None
    try:
        return stats_counts(read_small_bytes(stats, MAX_STATS_BYTES), stats), None
    except (MalformedSizeError, UnreadableRecordError, OSError) as exn:
        return None, str(exn)


def _look_at(shard: str, listed: int | None) -> _Look:
    """A local shard looked at before its stats (or its sizes.json entry, `listed`) are believed."""
    try:
        mode = os.stat(shard).st_mode
    except FileNotFoundError:
        return _Look(0, "missing")
    except OSError:
        mode = 0
    if not stat.S_ISREG(mode):
        return _Look(0, "unreadable")
    counts, malformed = _stats_of(shard)
    claimed = listed if listed is not None else counts["successes"] if counts else None
    try:
        ending = tar_ending(shard)
        if ending == "truncated":
            return _Look(count_tar_samples(shard), "truncated", counts, malformed)
    except (OSError, tarfile.ReadError):
        return _Look(0, "unreadable", counts, malformed)
    if ending != "complete":
        return _Look(0, "compressed", counts, malformed)
    return _Look(claimed, None, counts, malformed)


def _look_at_local(shards: list[str], census: ShardCensus) -> dict[str, int | None]:
    """Sizes of the local shards (None: unknown), looked at by a pool of threads: on a network file system
    each look waits on a few round trips, and DataComp has ~140k shards."""
    listed: dict[Path, dict] = {}
    for folder in dict.fromkeys(Path(s).parent for s in shards):
        listed[folder], problems = read_sizes_json(folder)
        census.malformed += problems
    with ThreadPoolExecutor(LOOKERS) as pool:
        looks = list(pool.map(lambda s: _look_at(s, listed[Path(s).parent].get(Path(s).name)), shards))
    for shard, look in zip(shards, looks):
        if look.problem == "truncated":
            census.truncated[shard] = look.size
        elif look.problem:
            getattr(census, look.problem).append(shard)
        if look.counts:
            census.img2dataset.update(look.counts)
            census.img2dataset["stats_files"] += 1
        if look.malformed:
            census.malformed.append(look.malformed)
    return {shard: look.size for shard, look in zip(shards, looks)}


def _count_headers(shards: list[str], unknown: list[str], sizes: dict, census: ShardCensus) -> None:
    """Sizes of local shards without stats, counted from their headers (a sample of 16 when there are many)."""
    probe = unknown if len(unknown) <= HEADER_COUNT_ALL else unknown[:: max(1, len(unknown) // 16)][:16]
    counted = {}
    for shard in probe:
        try:
            counted[shard] = count_tar_samples(shard)
        except (OSError, tarfile.ReadError):
            census.unreadable.append(shard)
            counted[shard] = 0
    sizes.update(counted)
    if len(probe) < len(unknown):
        census.estimated = True
        mean = round(sum(counted.values()) / max(1, len(counted)))
        sizes.update({s: mean for s in unknown if s not in counted})


def _probe_remote(shards: list[str], sizes: dict, census: ShardCensus, max_probes: int) -> None:
    """Remote shards: the mean of a few probed stats files, spread over the list."""
    remote = [s for s in shards if is_remote(s)]
    if not remote:
        return
    census.estimated = True
    step = max(1, len(remote) // max_probes)
    probes = [n for n in (remote_shard_size(s) for s in remote[::step][:max_probes]) if n is not None]
    if probes:
        mean = round(sum(probes) / len(probes))
        sizes.update({s: mean for s in remote})


def resolve_sizes(shards: list[str], max_remote_probes: int = STATS_PROBES) -> ShardCensus:
    """The census of `shards`: the known or estimated sample count of each, and what is wrong with them."""
    census = ShardCensus()
    local = _look_at_local([s for s in shards if not is_remote(s)], census)
    sizes: dict[str, int | None] = {s: local.get(s) for s in shards}
    _count_headers(shards, [s for s, n in sizes.items() if n is None and not is_remote(s)], sizes, census)
    _probe_remote(shards, sizes, census, max_remote_probes)
    known = [n for n in sizes.values() if n is not None]
    if len(known) < len(sizes):
        census.estimated = True
        mean = round(sum(known) / len(known)) if known else 0
        sizes = {s: mean if n is None else n for s, n in sizes.items()}
    census.sizes = {s: int(sizes[s]) for s in shards}
    return census
