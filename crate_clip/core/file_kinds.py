"""What kind of file a path is, said in words, and text files read only when they are regular files of bounded size:
a FIFO given as a config would block its reader for ever, a device (/dev/zero) would be read without end, and
"does not exist" would be the wrong answer for both. Part of the bottom layer: it imports nothing of crate_clip."""
from __future__ import annotations

import os
import stat
from pathlib import Path
from typing import Optional

_KINDS = {stat.S_ISFIFO: "a FIFO", stat.S_ISDIR: "a folder", stat.S_ISCHR: "a character device",
          stat.S_ISBLK: "a block device", stat.S_ISSOCK: "a socket"}


def file_kind(mode: int) -> str:
    """'a FIFO', 'a folder', ... for a stat mode; 'a regular file' for one."""
    return next((name for test, name in _KINDS.items() if test(mode)), "a regular file" if stat.S_ISREG(mode)
                else "a special file")


def special_file(path: str | Path, name_link: bool = True) -> Optional[str]:
    """'a FIFO', 'a character device (a link to /dev/zero)' (the link part only with `name_link`), ... when `path`
    exists and is neither a regular file nor a folder; None otherwise (missing, regular or a folder: the caller's
    own checks say which; a name no path can have, with a NUL byte, counts as missing). The shard lists
    (crate_clip.data) check their shards with it."""
    try:
        mode = os.stat(path).st_mode
    except (OSError, ValueError):
        return None
    if stat.S_ISREG(mode) or stat.S_ISDIR(mode):
        return None
    kind = file_kind(mode)
    return f"{kind} (a link to {os.path.realpath(path)})" if name_link and os.path.islink(path) else kind


def read_regular_text(path: str | Path, limit: int, what: str) -> str:
    """The UTF-8 text of regular file `path` of at most `limit` bytes (links followed); FileNotFoundError when it
    does not exist, ValueError in one line naming `what` ('--config') when it is another kind of file, larger, or
    not UTF-8 text. The open does not block on a FIFO swapped in after the check."""
    mode = os.stat(path).st_mode   # FileNotFoundError for a missing file or a dangling link
    if not stat.S_ISREG(mode):
        raise ValueError(f"{what}: {str(path)!r} is {special_file(path) or file_kind(mode)}, not a regular file")
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))
    with os.fdopen(fd, "rb") as f:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise ValueError(f"{what}: {str(path)!r} is {file_kind(os.fstat(fd).st_mode)}, not a regular file")
        data = f.read(limit + 1)
    if len(data) > limit:
        raise ValueError(f"{what}: {str(path)!r} holds more than {limit:,} bytes, more than such a file may hold")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ValueError(f"{what}: {str(path)!r} is not UTF-8 text (byte {exc.start:,}); fix: save it as "
                         "UTF-8") from None
