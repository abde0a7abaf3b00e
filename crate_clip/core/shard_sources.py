"""Data-source strings, parsed in one place for training (data_pipelines), evaluation (eval/) and run-config
validation: a brace pattern (`/data/{00000000..00139827}.tar`), a folder of .tar files, a glob, a single
tar, a URL, or a `pipe:` command (`pipe:aws s3 cp s3://bucket/{00000000..00139827}.tar -`).

A `pipe:` source runs a shell command per shard (webdataset's convention): a run config is as trusted as a
script, and `shell_commands` lists what one will run (`crate-clip train --validate` prints it).

A brace pattern is counted before it is expanded (`brace_count`, from the pattern's structure): one that names more
than MAX_SOURCE_SHARDS shards is refused in one line naming it (braceexpand builds every name of a range at once: a
pattern of 10^9 names took 4.9 GB before a MemoryError)."""
from __future__ import annotations

import glob
import os
import re
from pathlib import Path

import braceexpand

from crate_clip.core.errors import UserError
from crate_clip.core.read_bounds import MAX_SOURCE_SHARDS

PIPE = "pipe:"
STATS_PROBES = 8   # remote shards whose _stats.json is read to estimate the data set size (shard_reader.py)
REMOTE_PREFIXES = (PIPE, "http://", "https://", "gs://", "ais://", "sftp://", "hf://")


class ShardListError(ValueError):
    """A source pattern that names no shard."""


class TooManyShardsError(UserError, ValueError):
    """A source (brace pattern, nshards.txt) that names more shards than MAX_SOURCE_SHARDS; the message names it."""


def brace_count(pattern: str) -> int:
    """How many names `braceexpand(pattern)` yields, counted from the pattern without expanding it (its parser's
    rules: ranges `{1..9..2}` `{a..z}`, lists `{a,b}`, nesting, backslash escapes). ShardListError for a pattern
    braceexpand cannot expand (unbalanced braces, nesting deeper than Python recurses, a number of 4,300 digits)."""
    try:
        return _pattern_count(pattern)
    except (ValueError, RecursionError) as exc:   # braceexpand.UnbalancedBracesError is a ValueError
        raise ShardListError(f"{pattern[:200]!r} is no brace pattern braceexpand expands "
                             f"({type(exc).__name__})") from None


def check_shard_count(count: int, what: str) -> int:
    """`count` when at most MAX_SOURCE_SHARDS, else TooManyShardsError naming `what` (the pattern or file)."""
    if count > MAX_SOURCE_SHARDS:
        raise TooManyShardsError(f"{what} names {count:,} shards, more than the {MAX_SOURCE_SHARDS:,} a data set may "
                                 "name (DataComp's largest pool: 1.28M); fix: correct the pattern or count")
    return count


def _pattern_count(pattern: str) -> int:
    """braceexpand.parse_pattern, counting: the product of its parts' counts."""
    start = pos = depth = 0
    count = 1
    while pos < len(pattern):
        if pattern[pos] == "\\":
            pos += 2
            continue
        if pattern[pos] == "{":
            start = pos if depth == 0 and pos > start else start
            depth += 1
        elif pattern[pos] == "}":
            depth -= 1
            if depth == 0:
                expr = pattern[start + 1:pos]
                inner = _expression_count(expr)
                count *= _pattern_count(expr) if inner is None else inner
                start = pos + 1
        pos += 1
    if depth != 0:
        raise braceexpand.UnbalancedBracesError(pattern)
    return count


_INT_RANGE = re.compile(r"^(-?\d+)\.\.(-?\d+)(?:\.\.-?(\d+))?$")   # braceexpand's int_range_re and char_range_re
_CHAR_RANGE = re.compile(r"^([A-Za-z])\.\.([A-Za-z])(?:\.\.-?(\d+))?$")


def _expression_count(expr: str) -> int | None:
    """braceexpand.parse_expression, counting: a range's length, a list's summed counts; None when `expr` is neither
    (its braces are then literal)."""
    ints = _INT_RANGE.match(expr)
    if ints:
        first, last, step = int(ints.group(1)), int(ints.group(2)), (int(ints.group(3) or 1) or 1)
        return abs(last - first) // step + 1
    chars = _CHAR_RANGE.match(expr)
    if chars:
        return len(braceexpand.make_char_range(*chars.groups()))
    parts, start, pos, depth = [], 0, 0, 0
    while pos < len(expr):   # braceexpand.parse_sequence: the commas outside nested braces
        if expr[pos] == "\\":
            pos += 2
            continue
        depth += {"{": 1, "}": -1}.get(expr[pos], 0)
        if expr[pos] == "," and depth == 0:
            parts.append(expr[start:pos])
            start = pos + 1
        pos += 1
    if depth != 0 or not parts:
        return None
    return sum(_pattern_count(part) for part in parts + [expr[start:]])


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


def pattern_count(source: str) -> int | None:
    """The shards a brace pattern or URL source names, counted without expanding it (TooManyShardsError above
    MAX_SOURCE_SHARDS); None for a folder, glob or single file, whose shards are what is on disk."""
    source = _resolved(source)
    if not (is_remote(source) or ("{" in source and not Path(source).is_dir())):
        return None
    return check_shard_count(brace_count(source), f"source {source!r}")


def expand_source(source: str) -> list[str]:
    """Shard URLs named by one source: brace pattern, directory, glob, file, URL or pipe: command."""
    source = _resolved(source)
    refusal = refused_source(source)
    if refusal:
        raise ShardListError(refusal)
    pattern_count(source)   # refused above the bound, before anything is expanded
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
        count = brace_count(source)
        lines.append(f"{key}.{i}: {source[len(PIPE):]}   ({count:,} command{'s' if count > 1 else ''}, one per shard)")
        lines.append(f"{key}.{i}: {stats_url(source)[len(PIPE):]}   (up to {min(count, STATS_PROBES)} "
                     "of these, for the shards' sample counts)")
    return lines
