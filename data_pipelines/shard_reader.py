"""Shard lists and tar reading: expand sources, iterate raw samples, count bad data.

Sources are parsed by crate_clip.core.shard_sources (brace pattern, folder, glob, tar, URL, `pipe:` command).
Remote shards are opened by remote_retry.py (outages ridden out); members are read and grouped into samples within
bounds by crate_clip.core.tar_samples (uncompressed tars only, members above their cap and samples above their
budget passed over unread), the reader the evaluation sets use too; here truncated tars, unreadable shards,
oversized members and duplicate keys become counted skips instead of exceptions. Data set sizes: shard_census.py.
"""
from __future__ import annotations

import tarfile
from collections import Counter
from pathlib import Path
from typing import Iterator

from crate_clip.core.file_kinds import special_file
from crate_clip.core.shard_sources import (PIPE, REMOTE_PREFIXES, STATS_PROBES, ShardListError,  # noqa: F401
                                     expand_source, is_remote, stats_url)
from crate_clip.core.tar_members import CompressedTarError, TruncatedTarError
from crate_clip.core.tar_samples import SampleCaps, TarSamples

from .remote_retry import RetryPolicy, ShardSourceUnavailable, open_remote_shard

SKIP_REASONS = ("truncated_tar", "unreadable_shard", "undecodable_image", "zero_size_image",
                "decompression_bomb", "missing_image", "missing_caption", "empty_caption",
                "non_utf8_caption", "duplicate_key", "compressed_shard", "oversized_member", "oversized_caption",
                "oversized_sample")
IMAGE_EXTS = ("jpg", "jpeg", "png", "webp")
SPECIAL_CHECKED = 16   # per source, spread over its list: shards stat-ed at the start for being special files


def check_some_shard_exists(sources: list[str], shards: list[str]) -> None:
    """Raise ShardListError when every shard is a local path and none exists (a mistyped source), or when a
    shard a source names, or one of a sample spread over its list, is a FIFO, device or socket (reading one
    would block or never end).

    A few missing shards among existing ones are counted skips (DataComp downloads have gaps); a special file
    outside the sample is a counted unreadable shard when it comes to be read."""
    local = [s for s in shards if not is_remote(s)]
    step = max(1, len(local) // SPECIAL_CHECKED)
    for shard in dict.fromkeys(local[::step][:SPECIAL_CHECKED] + [s for s in sources if s in local]):
        kind = special_file(shard, name_link=False)
        if kind:
            raise ShardListError(f"shard {shard} is {kind}, not a regular file: give .tar files (a FIFO would "
                                 f"block the reader)")
    if shards and not any(is_remote(s) or Path(s).exists() for s in shards):
        raise ShardListError(f"data source {', '.join(map(str, sources))} does not exist: give a folder of .tar "
                             f"shards, a brace pattern or a glob of existing files, or a pipe: command")


def _open_shard(url: str, retry: RetryPolicy | None = None):
    """A readable byte stream for a shard URL (local path, pipe: command, http(s), ...)."""
    if is_remote(url):
        return open_remote_shard(url, retry)
    return open(url, "rb", buffering=1 << 20)


def iter_shard_samples(url: str, skips: Counter, caps: SampleCaps = SampleCaps(),
                       retry: RetryPolicy | None = None) -> Iterator[dict]:
    """Raw samples ({'__key__', '__url__', ext: bytes}) of one shard; bad data counted in `skips`, members above
    `caps` never read; a remote shard's transient failures retried by `retry` (ShardSourceUnavailable when it
    gives up)."""
    if not is_remote(url) and special_file(url, name_link=False):
        skips["unreadable_shard"] += 1   # a FIFO would block the open for ever; a device reads without end
        return
    try:
        stream = _open_shard(url, retry)
    except ShardSourceUnavailable:
        raise   # the source is gone, not the shard: the trainer saves and stops (exit code 7)
    except Exception:
        skips["unreadable_shard"] += 1
        return
    samples = TarSamples(stream, caps, url)
    try:
        yield from _counted(samples, skips)
    except ShardSourceUnavailable:
        raise
    except CompressedTarError:
        skips["compressed_shard"] += 1
    except TruncatedTarError:
        skips["truncated_tar"] += 1
    except (tarfile.ReadError, EOFError, OSError):
        # A stream that never produced a member was not a tar at all; otherwise it broke off mid-way.
        skips["truncated_tar" if samples.started else "unreadable_shard"] += 1
    except Exception:
        skips["unreadable_shard"] += 1
    finally:
        try:
            stream.close()
        except Exception:
            pass  # a pipe whose command failed reports it on close: already counted or harmless
    # The sample being assembled when the tar broke off is kept if its image and caption were complete.
    pending = samples.pending
    if pending is not None and sample_image_bytes(pending) is not None and "txt" in pending:
        yield from _counted([samples.finish_pending()], skips)


def _counted(samples, skips: Counter) -> Iterator[dict]:
    """The samples that are not skipped; each skipped one counted under its reason."""
    for sample in samples:
        reason = sample.get("__skip__")
        if reason:
            skips[reason] += 1
        else:
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
