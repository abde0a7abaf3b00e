"""Reading the small text files of checkpoints and exports (crate_clip.json, `latest`, open_clip_config.json,
stream tables) without trusting what is on disk: only a regular file (a FIFO would block the reader, a device
or a folder is not a record), and only up to a bound (a crate_clip.json linked to a sparse file of gigabytes is
refused from its size, without reading it)."""
from __future__ import annotations

import json
import os
import stat
from pathlib import Path

from crate_clip.core.errors import UserError
from crate_clip.core.file_kinds import file_kind  # noqa: F401  (re-exported: the readers of records name kinds)

MAX_RECORD_BYTES = 64 << 20   # crate_clip.json of a B/16 ZeRO-3 run on 64 ranks: about 100 KB


class UnreadableRecordError(UserError, ValueError):
    """A record file that is not a regular file, is larger than its bound, or is not the text / JSON it should be."""


def read_small_bytes(path: str | Path, limit: int = MAX_RECORD_BYTES) -> bytes:
    """The bytes of regular file `path` (links followed) if it holds at most `limit`; FileNotFoundError when it
    does not exist, UnreadableRecordError when it is another kind of file or larger."""
    path = Path(path)
    mode = os.stat(path).st_mode   # FileNotFoundError for a missing file or a dangling link
    if not stat.S_ISREG(mode):
        raise UnreadableRecordError(f"{path}: {file_kind(mode)}, not a regular file")
    # O_NONBLOCK: a file swapped for a FIFO after the stat still does not block the open
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))
    with os.fdopen(fd, "rb") as f:
        mode, size = os.fstat(fd).st_mode, os.fstat(fd).st_size
        if not stat.S_ISREG(mode):
            raise UnreadableRecordError(f"{path}: {file_kind(mode)}, not a regular file")
        if size > limit:
            raise UnreadableRecordError(f"{path}: {size:,} bytes, more than the {limit:,} such a file may hold")
        data = f.read(limit + 1)
    if len(data) > limit:
        raise UnreadableRecordError(f"{path}: more than the {limit:,} bytes such a file may hold")
    return data


def read_small_json(path: str | Path, limit: int = MAX_RECORD_BYTES):
    """The JSON value in regular file `path` (at most `limit` bytes); UnreadableRecordError when it is not JSON."""
    try:
        return json.loads(read_small_bytes(path, limit).decode("utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError, RecursionError) as exc:
        raise UnreadableRecordError(f"{path}: not valid JSON ({type(exc).__name__})") from None


def read_small_jsonl(path: str | Path, limit: int = MAX_RECORD_BYTES) -> list[tuple[int, object]]:
    """(line number, JSON value) of every line of the JSONL file `path` (a regular file of at most `limit` bytes);
    [] when it does not exist. A last line without its newline that is not JSON (a kill tore it) is left out; any
    other line that is not JSON is an UnreadableRecordError naming the file and the line."""
    try:
        text = read_small_bytes(path, limit).decode("utf-8", "replace")
    except FileNotFoundError:
        return []
    lines = text.split("\n")
    rows = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            rows.append((number, json.loads(line)))
        except (json.JSONDecodeError, RecursionError):
            if number == len(lines):   # the last line, not ended: torn by a kill
                continue
            raise UnreadableRecordError(f"{path}:{number}: not a JSON line ({line[:60]!r}); fix: remove the "
                                        "line") from None
    return rows
