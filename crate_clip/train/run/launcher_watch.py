"""A training process started by a launcher (torchrun, the DeepSpeed launcher, `accelerate launch`) stops within
seconds when the launcher is gone, instead of training on unsupervised (a resume started meanwhile would be a
second writer).

On Linux, prctl(PR_SET_PDEATHSIG, SIGTERM) asks the kernel to send SIGTERM when the parent exits; its default
action ends the process at once, even in the middle of a collective. Everywhere, and for a launcher above the
parent (the `deepspeed` runner above its launch.py), a watchdog thread checks every WATCH_S seconds that the
watched processes still run; when one is gone it says so on stderr and ends the process. A process that finds
itself orphaned already (its launcher died while it started) ends at once. The kernel sends the signal when the
parent *thread* that started the process exits; the launchers start their workers from their main thread.

Whatever moment this comes at, the last complete checkpoint is kept (saves are atomic); a save cut short leaves a
`.saving` folder that the next save or resume removes, and rank 0 releases its run-folder lock before it ends (a
lock left by SIGKILL is stale: its PID is gone, and the resume takes it over).
"""
from __future__ import annotations

import ctypes
import os
import signal
import sys
import threading
import time
from typing import Optional

from crate_clip.train.run.process_info import command_line, is_running, parent_pid, process_start

WATCH_S = 1.0
PR_SET_PDEATHSIG = 1
# set in the processes the launchers start (torchrun and accelerate's multi-process launch: TORCHELASTIC_RUN_ID;
# the DeepSpeed launcher: CROSS_RANK; accelerate's one-process launch: ACCELERATE_USE_CPU)
LAUNCHED_ENV = ("TORCHELASTIC_RUN_ID", "CROSS_RANK", "ACCELERATE_USE_CPU")
EXIT_LAUNCHER_GONE = 1
_watching = False
_parent: list[int] = []   # the launcher process watched (this process's parent when it started)


def launched() -> bool:
    """True in a process a launcher started."""
    return any(k in os.environ for k in LAUNCHED_ENV)


def watch_launcher() -> None:
    """Under a launcher, end this process when the launcher is gone (once per process; nothing otherwise)."""
    global _watching
    if _watching or not launched():
        return
    _watching = True
    parent = os.getppid()
    _parent.append(parent)
    _set_parent_death_signal()
    watched = [(pid, process_start(pid)) for pid in (parent, _runner_above(parent)) if pid]
    if parent == 1 or os.getppid() != parent:   # gone before the kernel could be asked to tell
        _stop(parent)
    threading.Thread(target=_watch, args=(parent, watched), name="launcher-watch", daemon=True).start()


def launcher_gone() -> bool:
    """True in a launched process whose launcher has exited (the parent-death SIGTERM then means: stop now)."""
    return bool(_parent) and os.getppid() != _parent[0]


def stop_orphan() -> None:
    """End this process as the watchdog does when its launcher is gone (the lock released first); never returns."""
    _stop(_parent[0] if _parent else os.getppid())


def _set_parent_death_signal() -> None:
    """Linux: SIGTERM from the kernel when the parent exits (elsewhere the watchdog alone)."""
    if not sys.platform.startswith("linux"):
        return
    try:
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)
    except (OSError, AttributeError):
        pass


def _runner_above(parent: int) -> Optional[int]:
    """The `deepspeed` runner above DeepSpeed's launch.py (killing the runner leaves launch.py running)."""
    if "deepspeed.launcher.launch" not in command_line(parent):
        return None
    runner = parent_pid(parent)
    return runner if runner and runner != 1 else None


def _watch(parent: int, watched: list[tuple[int, Optional[str]]]) -> None:
    while True:
        time.sleep(WATCH_S)
        gone = [pid for pid, started in watched if not is_running(pid, started)]
        if os.getppid() != parent or gone:
            _stop(gone[0] if gone else parent)


def _stop(pid: int) -> None:
    rank = os.environ.get("RANK", "?")
    print(f"crate-clip train: rank {rank}: its launcher (PID {pid}) is gone; stopping. The last complete checkpoint "
          "is kept: relaunch with --resume latest", file=sys.stderr, flush=True)
    from crate_clip.train.run.run_lock import release_held_locks   # here: the watchdog needs it only when it acts

    release_held_locks()   # os._exit skips the `finally` that would: the relaunch finds the folder free
    os._exit(EXIT_LAUNCHER_GONE)
