"""Data-source strings, parsed in one place for training (data_pipelines), evaluation (eval/) and run-config
validation: a brace pattern (`/data/{00000000..00139827}.tar`), a folder of .tar files, a glob, a single
tar, a URL, or a `pipe:` command (`pipe:aws s3 cp s3://bucket/{00000000..00139827}.tar -`).

A `pipe:` source runs a shell command per shard (webdataset's convention): a run config is as trusted as a
script, and `shell_commands` lists what one will run (`crate-clip train --validate` prints it)."""
from __future__ import annotations

import glob
import os
from pathlib import Path

import braceexpand

PIPE = "pipe:"
STATS_PROBES = 8   # remote shards whose _stats.json is read to estimate the data set size (shard_reader.py)
REMOTE_PREFIXES = (PIPE, "http://", "https://", "gs://", "ais://", "sftp://", "hf://")


class ShardListError(ValueError):
    """A source pattern that names no shard."""


def is_remote(url: str) -> bool:
    """Whether a shard is read through a command or a network URL rather than a local path."""
    return url.startswith(REMOTE_PREFIXES)


def stats_url(shard: str) -> str:
    """Where a shard's `_stats.json` is read from (img2dataset's layout): the same path, URL or command."""
    return shard.replace(".tar", "_stats.json", 1)


def refused_source(source: str) -> str | None:
    """Why a source is refused, with the form to use instead (s3:// goes through the aws CLI); None if it is not."""
    source = _resolved(source)
    if source.startswith("s3://"):
        return (f"{source!r}: s3:// is read through the aws CLI as a pipe: source; fix: 'pipe:aws s3 cp {source} -' "
                "(with --endpoint-url URL for another S3-compatible store; docs/data.md)")
    return None


def _resolved(source: str) -> str:
    """A source with `~` and environment variables expanded."""
    return os.path.expandvars(os.path.expanduser(str(source)))


def expand_source(source: str) -> list[str]:
    """Shard URLs named by one source: brace pattern, directory, glob, file, URL or pipe: command."""
    source = _resolved(source)
    refusal = refused_source(source)
    if refusal:
        raise ShardListError(refusal)
    if is_remote(source):
        return list(braceexpand.braceexpand(source))
    path = Path(source)
    if path.is_dir():
        shards = sorted(str(p) for p in path.glob("*.tar"))
    elif "{" in source:
        shards = list(braceexpand.braceexpand(source))
    elif any(c in source for c in "*?["):
        shards = sorted(glob.glob(source))
    else:
        shards = [source]
    if not shards:
        raise ShardListError(f"source {source!r} names no .tar shard")
    return shards


def shell_commands(sources: list[str], key: str = "data.sources") -> list[str]:
    """The shell commands `pipe:` sources run, one line per source pattern (with the number of commands it
    expands to), and the commands that read their shards' `_stats.json` for the data-set size."""
    lines = []
    for i, source in enumerate(sources):
        source = _resolved(source)
        if not source.startswith(PIPE):
            continue
        count = len(list(braceexpand.braceexpand(source)))
        lines.append(f"{key}.{i}: {source[len(PIPE):]}   ({count:,} command{'s' if count > 1 else ''}, one per shard)")
        lines.append(f"{key}.{i}: {stats_url(source)[len(PIPE):]}   (up to {min(count, STATS_PROBES)} "
                     "of these, for the shards' sample counts)")
    return lines
