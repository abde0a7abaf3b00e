"""Data-source strings, parsed in one place for training (data_pipelines), evaluation (eval/) and run-config
validation: a brace pattern (`/data/{00000000..00139827}.tar`), a folder of .tar files, a glob, a single
tar, a URL, or a `pipe:` command (`pipe:aws s3 cp s3://bucket/{00000000..00139827}.tar -`)."""
from __future__ import annotations

import glob
import os
from pathlib import Path

import braceexpand

REMOTE_PREFIXES = ("pipe:", "http://", "https://", "gs://", "ais://", "sftp://", "hf://")


class ShardListError(ValueError):
    """A source pattern that names no shard."""


def is_remote(url: str) -> bool:
    """Whether a shard is read through a command or a network URL rather than a local path."""
    return url.startswith(REMOTE_PREFIXES)


def expand_source(source: str) -> list[str]:
    """Shard URLs named by one source: brace pattern, directory, glob, file, URL or pipe: command."""
    source = os.path.expandvars(os.path.expanduser(str(source)))
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
