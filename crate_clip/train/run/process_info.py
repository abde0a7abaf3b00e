"""What Linux's /proc says about a process (its parent, start time, state, command line), for telling a live
process from a gone one: a PID can be reused, and a process that exited stays a zombie until its parent reaps it.
Elsewhere these return None and callers fall back to os.kill(pid, 0)."""
from __future__ import annotations

import os
from pathlib import Path
from typing import Optional


def _stat_fields(pid: int) -> Optional[list[str]]:
    """The fields of /proc/<pid>/stat after the command name (state first), None when unreadable."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None


def process_start(pid: int) -> Optional[str]:
    """When process `pid` started (clock ticks since boot): two processes of one PID differ in it."""
    fields = _stat_fields(pid)
    return fields[19] if fields and len(fields) > 19 else None


def parent_pid(pid: int) -> Optional[int]:
    """The parent of process `pid`."""
    fields = _stat_fields(pid)
    return int(fields[1]) if fields else None


def command_line(pid: int) -> str:
    """The command line of process `pid`, its arguments joined by spaces ('' when unreadable)."""
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()
    except OSError:
        return ""


def is_running(pid: int, started: Optional[str] = None) -> bool:
    """True when process `pid` runs (not a zombie) and, if `started` is given, is the one that started then."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:   # another user's process
        pass
    fields = _stat_fields(pid)
    if fields is None:
        return True   # no /proc: os.kill's answer
    if fields[0] in ("Z", "X"):   # exited, not yet reaped
        return False
    return started is None or len(fields) <= 19 or fields[19] == started
