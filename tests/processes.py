"""Tests only: the machine's processes as /proc lists them (crate_clip.train.run.process_info reads one process), for
the tests that find a launcher's ranks, a process's children, a command left running, or a process's state and
pending signals."""
from __future__ import annotations

import os
from pathlib import Path
from typing import Optional

from crate_clip.train.run.process_info import parent_pid


def pids() -> list[int]:
    """Every process now listed in /proc."""
    return [int(entry.name) for entry in os.scandir("/proc") if entry.name.isdigit()]


def children(pid: int) -> list[int]:
    """The processes whose parent is `pid`."""
    return [p for p in pids() if parent_pid(p) == pid]


def descendants(pid: int) -> list[int]:
    """Every process below `pid`, parents before their children (torchrun starts its workers in sessions of their
    own, so a process group would miss them)."""
    below: dict[Optional[int], list[int]] = {}
    for p in pids():
        below.setdefault(parent_pid(p), []).append(p)
    out, todo = [], [pid]
    while todo:
        for child in below.get(todo.pop(), []):
            out.append(child)
            todo.append(child)
    return out


def _read(pid: int, name: str) -> bytes:
    try:
        return Path(f"/proc/{pid}/{name}").read_bytes()
    except OSError:   # gone meanwhile, or not ours to read
        return b""


def process_with_env(*entries: str) -> Optional[int]:
    """A process of the machine whose environment holds every one of `entries`, or None: a launcher's rank where the
    launcher is not this test's child (a stand-in's, tests/README.md)."""
    wanted = [e.encode() for e in entries]
    return next((p for p in pids() if all(e in _read(p, "environ").split(b"\0") for e in wanted)), None)


def running(cmdline: str) -> bool:
    """Whether a process whose command line (NUL-separated, as /proc shows it) contains `cmdline` is running."""
    return any(cmdline.encode() in _read(p, "cmdline") for p in pids())


def status(pid: int) -> dict[str, str]:
    """/proc/PID/status as {field: value} (State, SigPnd, ShdPnd, ...); {} once the process is gone."""
    text = _read(pid, "status").decode(errors="replace")
    return dict(line.split(":\t", 1) for line in text.splitlines() if ":\t" in line)
