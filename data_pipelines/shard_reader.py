"""Shard lists and tar reading: expand sources, find data set sizes, iterate raw samples, count bad data.

Sources are parsed by crate_clip.core.shard_sources (brace pattern, folder, glob, tar, URL, `pipe:` command).
Remote shards are opened by remote_retry.py (outages ridden out), members read by webdataset's tar iterator; grouping
members into samples is done here so that truncated tars, unreadable shards and duplicate keys become
counted skips instead of exceptions.
"""
from __future__ import annotations

import json
import subprocess
import tarfile
from collections import Counter
from pathlib import Path
from typing import Iterator

from webdataset.gopen import gopen
from webdataset.tariterators import base_plus_ext, tar_file_iterator

from crate_clip.core.shard_sources import (PIPE, REMOTE_PREFIXES, STATS_PROBES, ShardListError,  # noqa: F401
                                     expand_source, is_remote, stats_url)

from .remote_retry import RetryPolicy, ShardSourceUnavailable, open_remote_shard

SKIP_REASONS = ("truncated_tar", "unreadable_shard", "undecodable_image", "zero_size_image",
                "decompression_bomb", "missing_image", "missing_caption", "empty_caption",
                "non_utf8_caption", "duplicate_key")
IMAGE_EXTS = ("jpg", "jpeg", "png", "webp")
def check_some_shard_exists(sources: list[str], shards: list[str]) -> None:
    """Raise ShardListError when every shard is a local path and none exists (a mistyped source).

    A few missing shards among existing ones are counted skips (DataComp downloads have gaps)."""
    if shards and not any(is_remote(s) or Path(s).exists() for s in shards):
        raise ShardListError(f"data source {', '.join(map(str, sources))} does not exist: give a folder of .tar "
                             f"shards, a brace pattern or a glob of existing files, or a pipe: command")


def _stats_path(shard: str) -> str:
    """img2dataset's per-shard stats file beside a tar: 00000012.tar -> 00000012_stats.json."""
    return shard[: -len(".tar")] + "_stats.json" if shard.endswith(".tar") else shard + "_stats.json"


def _read_sizes_json(folder: Path) -> dict[str, int]:
    """{basename: count} from a webdataset-style sizes.json, or {} if there is none."""
    f = folder / "sizes.json"
    if not f.is_file():
        return {}
    data = json.loads(f.read_text())
    return {Path(k).name: int(v) for k, v in data.items()}


def local_shard_size(shard: str, sizes_cache: dict) -> int | None:
    """Number of samples in a local shard from its _stats.json ('successes') or sizes.json; None if unknown."""
    folder = Path(shard).parent
    if folder not in sizes_cache:
        sizes_cache[folder] = _read_sizes_json(folder)
    if Path(shard).name in sizes_cache[folder]:
        return sizes_cache[folder][Path(shard).name]
    stats = Path(_stats_path(shard))
    if stats.is_file():
        try:
            return int(json.loads(stats.read_text())["successes"])
        except (ValueError, KeyError, json.JSONDecodeError):
            return None
    return None


def remote_shard_size(shard: str, timeout: float = 60.0) -> int | None:
    """Samples in a remote shard, read from its _stats.json through the same command/URL; None if unknown."""
    url = stats_url(shard)
    try:
        if url.startswith(PIPE):
            raw = subprocess.run(url[len(PIPE):], shell=True, capture_output=True, timeout=timeout, check=True).stdout
        else:
            with gopen(url) as f:
                raw = f.read()
        return int(json.loads(raw)["successes"])
    except Exception:  # a missing stats file just means "unknown"
        return None


def shard_sizes(shards: list[str], max_remote_probes: int = STATS_PROBES) -> tuple[list[int | None], bool]:
    """Per-shard sample counts (None where unknown) and whether remote ones were extrapolated."""
    cache: dict = {}
    sizes: list[int | None] = [None if is_remote(s) else local_shard_size(s, cache) for s in shards]
    remote = [i for i, s in enumerate(shards) if is_remote(s)]
    if not remote:
        return sizes, False
    # Reading ~140k stats files over the network would take longer than training starts are worth:
    # probe a few spread over the list and extrapolate their mean.
    step = max(1, len(remote) // max_remote_probes)
    probes = [n for n in (remote_shard_size(shards[i]) for i in remote[::step][:max_remote_probes]) if n is not None]
    if probes:
        mean = round(sum(probes) / len(probes))
        for i in remote:
            sizes[i] = mean
    return sizes, True


def _open_shard(url: str, retry: RetryPolicy | None = None):
    """A readable byte stream for a shard URL (local path, pipe: command, http(s), ...)."""
    if is_remote(url):
        return open_remote_shard(url, retry)
    return open(url, "rb", buffering=1 << 20)


def iter_shard_samples(url: str, skips: Counter, retry: RetryPolicy | None = None) -> Iterator[dict]:
    """Raw samples ({'__key__', '__url__', ext: bytes}) of one shard; bad data counted in `skips`; a remote shard's
    transient failures retried by `retry` (ShardSourceUnavailable when it gives up)."""
    try:
        stream = _open_shard(url, retry)
    except ShardSourceUnavailable:
        raise   # the source is gone, not the shard: the trainer saves and stops (exit code 7)
    except Exception:
        skips["unreadable_shard"] += 1
        return
    seen: set[str] = set()
    current: dict | None = None
    members = tar_file_iterator(stream, skip_meta=r"__[^/]*__($|/)")
    try:
        for member in members:
            key, ext = base_plus_ext(member["fname"])
            if key is None:
                continue
            ext = ext.lower()
            if current is not None and key == current["__key__"]:
                if ext in current:
                    current["__duplicate__"] = True
                current[ext] = member["data"]
                continue
            if current is not None:
                yield from _finish(current, seen, skips)
            current = {"__key__": key, "__url__": url, ext: member["data"]}
        if current is not None:
            yield from _finish(current, seen, skips)
        current = None
    except ShardSourceUnavailable:
        raise
    except (tarfile.ReadError, EOFError, OSError) as exn:
        # A stream that never produced a member was not a tar at all; otherwise it stopped mid-way.
        skips["truncated_tar" if current is not None or "unexpected end" in str(exn) else "unreadable_shard"] += 1
    except Exception:
        skips["unreadable_shard"] += 1
    finally:
        try:
            stream.close()
        except Exception:
            pass  # a pipe whose command failed reports it on close: already counted or harmless
    # The sample being assembled when the tar broke off is kept if its image and caption were complete.
    if current is not None and sample_image_bytes(current) is not None and "txt" in current:
        yield from _finish(current, seen, skips)


def _finish(sample: dict, seen: set, skips: Counter) -> Iterator[dict]:
    """Yield a completed sample unless its key repeats within the shard (counted as duplicate_key)."""
    key = sample["__key__"]
    if sample.pop("__duplicate__", False) or key in seen:
        skips["duplicate_key"] += 1
        seen.add(key)
        return
    seen.add(key)
    yield sample


def sample_image_bytes(sample: dict) -> bytes | None:
    """The encoded image member of a raw sample (jpg, jpeg, png or webp), or None."""
    for ext in IMAGE_EXTS:
        if ext in sample:
            return sample[ext]
    return None


def sample_caption(sample: dict) -> tuple[str | None, str | None]:
    """(caption, None) for a usable caption, else (None, skip reason)."""
    raw = sample.get("txt")
    if raw is None:
        return None, "missing_caption"
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        return None, "non_utf8_caption"
    text = text.strip()
    if not text:
        return None, "empty_caption"
    return text, None
