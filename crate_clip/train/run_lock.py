"""One writer per run folder: rank 0 of a training job holds `<run_dir>.lock` for the run's life.

The lock file sits beside the run folder (so `--overwrite` can rename the folder aside while holding it). It is
created with O_CREAT|O_EXCL, atomic on local file systems and on NFS (v3 and later) and Lustre, where flock may not
work, and names its holder: host, PID, the process's start time, when it was taken. A thread of the holder
refreshes the file's modification time every HEARTBEAT_S seconds. Another process that finds the file judges it:

  - held by a live process of this host: refused, naming the holder;
  - held by a process of this host that is gone (no such PID, an exited one not yet reaped, the PID now runs a
    process started at another time, or the host rebooted since): stale, said so and taken over;
  - held by another host, or unreadable: refused while its modification time is less than STALE_AFTER_S old;
    older, its holder stopped refreshing it (crashed, or its node is gone): stale, said so and taken over. Ages are
    measured on the file system's clock (a file touched beside the lock), not this host's.

Taking over renames the stale file aside (of two processes taking over at once, one rename wins) and creates a new
one. A holder whose lock was taken over (it was stopped for longer than STALE_AFTER_S) exits at its next heartbeat
rather than write beside the new holder.
"""
from __future__ import annotations

import contextlib
import json
import os
import socket
import sys
import threading
import time
import uuid
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Iterator, Optional

import torch.distributed as tdist

from crate_clip.checkpoint_io.run_layout import lock_path
from crate_clip.core.errors import EXIT_LOCKED, UserError
from crate_clip.train.process_info import is_running, process_start

HEARTBEAT_S = 30.0
STALE_AFTER_S = 600.0
NAME_WAIT_S = 2.0   # how long a lock just created may take to name its holder (create, then write and fsync)


class RunLockedError(UserError, RuntimeError):
    """The run folder is held by another live run; the message names the holder."""
    exit_code = EXIT_LOCKED
    once_per_job = True   # rank 0 decides for every rank: rank 0 says it


def _boot_id() -> Optional[str]:
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        return None


@dataclass(frozen=True)
class LockHolder:
    """What a lock file says about its holder."""
    host: str
    pid: int
    started: str                    # when the lock was taken (local time, for people)
    process_start: Optional[str]    # when the PID's process started: a reused PID is another process
    boot_id: Optional[str]          # the holder's boot: after a reboot every PID is another process
    token: str                      # tells this holder's file from a successor's

    @classmethod
    def of_this_process(cls) -> "LockHolder":
        """The record this process writes when it takes a lock."""
        return cls(socket.gethostname(), os.getpid(), time.strftime("%Y-%m-%d %H:%M:%S"), process_start(os.getpid()),
                   _boot_id(), uuid.uuid4().hex)

    def describe(self) -> str:
        """`PID 123 on this host (h1)` / `PID 123 on host h2`, and since when."""
        where = f"this host ({self.host})" if self.host == socket.gethostname() else f"host {self.host}"
        return f"PID {self.pid} on {where}, started {self.started}"

    def gone(self) -> bool:
        """True when the holder is a process of this host that no longer runs."""
        if self.host != socket.gethostname():
            return False
        if self.boot_id and _boot_id() and self.boot_id != _boot_id():
            return True
        return not is_running(self.pid, self.process_start)


def _read_holder(path: Path) -> Optional[LockHolder]:
    """The holder a lock file names; None when it is unreadable (its writer was killed while writing it)."""
    try:
        return LockHolder(**json.loads(path.read_text(encoding="utf-8")))
    except (OSError, ValueError, TypeError):
        return None


def _holder_once_named(path: Path) -> Optional[LockHolder]:
    """The holder of a lock file, waiting up to NAME_WAIT_S for one created a moment ago to name it: a second
    trainer started together with the first finds the file between its creation and its write."""
    deadline = time.monotonic() + NAME_WAIT_S
    while (holder := _read_holder(path)) is None and path.exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    return holder


def _age_s(path: Path) -> float:
    """Seconds since `path` was last modified, by the clock of the file system it is on."""
    probe = path.with_name(f".{path.name}.clock{os.getpid()}")
    try:
        probe.touch()
        now = probe.stat().st_mtime
    except OSError:   # a read-only folder: this host's clock
        now = time.time()
    finally:
        probe.unlink(missing_ok=True)
    return now - path.stat().st_mtime


class RunLock:
    """The lock this process holds on a run folder; `release()` (or the end of `run_folder_lock`) gives it up."""

    def __init__(self, path: Path, holder: LockHolder):
        self.path, self.holder = path, holder
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._heartbeat, name="run-lock-heartbeat", daemon=True)

    @classmethod
    def acquire(cls, run_dir: Path) -> tuple["RunLock", Optional[str]]:
        """Take the lock of `run_dir` (waiting for nothing): returns it and, when a stale lock was taken over, the
        line that says so; raises RunLockedError naming a live holder."""
        path = lock_path(run_dir)
        path.parent.mkdir(parents=True, exist_ok=True)
        holder, note = LockHolder.of_this_process(), None
        for _ in range(3):   # a stale lock taken over by another process meanwhile: judge the new one
            if _create(path, holder):
                lock = cls(path, holder)
                lock._thread.start()
                return lock, note
            note = _take_over_if_stale(path, run_dir)
        raise RunLockedError(f"run.output_dir {run_dir}: could not take its lock {path} (other processes keep "
                             "taking it over); fix: start one training per run folder")

    def _heartbeat(self) -> None:
        while not self._stop.wait(HEARTBEAT_S):
            current = _read_holder(self.path)
            if current is None or current.token != self.holder.token:
                print(f"crate-clip train: the lock {self.path} of this run was taken over by "
                      f"{current.describe() if current else 'another process'} (this process was stopped for longer "
                      f"than {STALE_AFTER_S:.0f} s?); stopping so that one run writes into the folder",
                      file=sys.stderr, flush=True)
                os._exit(EXIT_LOCKED)
            with contextlib.suppress(OSError):   # a file system hiccup: the next beat tries again
                os.utime(self.path)

    def release(self) -> None:
        """Stop the heartbeat and remove the lock file, if it is still this process's."""
        self._stop.set()
        if self._thread.is_alive():   # a beat in progress must not find the file gone and take that for a takeover
            self._thread.join()
        current = _read_holder(self.path)
        if current is not None and current.token == self.holder.token:
            self.path.unlink(missing_ok=True)


def _create(path: Path, holder: LockHolder) -> bool:
    """Create the lock file naming `holder`; False when it exists."""
    try:
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
    except FileExistsError:
        return False
    try:
        os.write(fd, json.dumps(asdict(holder)).encode())
        os.fsync(fd)
    except BaseException:
        os.close(fd)
        path.unlink(missing_ok=True)
        raise
    os.close(fd)
    return True


def _take_over_if_stale(path: Path, run_dir: Path) -> Optional[str]:
    """Remove the lock at `path` when its holder is gone (the line that says so); raise RunLockedError naming a live
    one."""
    holder = _holder_once_named(path)
    try:
        age = _age_s(path)
    except FileNotFoundError:   # released meanwhile
        return None
    if holder is not None and holder.gone():
        why = "no longer running"
    elif age > STALE_AFTER_S:
        why = f"not refreshed for {age:.0f} s, more than the {STALE_AFTER_S:.0f} s after which a lock is stale"
    else:
        who = holder.describe() if holder else "a process that has not yet written its name into it"
        raise RunLockedError(
            f"run.output_dir {run_dir} is in use by another run: {who} (lock {path}, refreshed {age:.0f} s ago); "
            f"fix: wait for that run to end or stop it, or set run.output_dir to another folder (a lock not "
            f"refreshed for {STALE_AFTER_S:.0f} s counts as stale)")
    aside = path.with_name(f".{path.name}.stale{os.getpid()}")
    try:
        os.rename(path, aside)
    except FileNotFoundError:   # another process took it over first
        return None
    if _read_holder(aside) != holder:   # the file renamed is a new holder's, created after it was judged
        with contextlib.suppress(FileExistsError):
            os.link(aside, path)
        aside.unlink(missing_ok=True)
        return None
    aside.unlink(missing_ok=True)
    who = holder.describe() if holder else "an unreadable lock"
    return f"run.output_dir {run_dir}: took over the stale lock {path} of {who} ({why})"


@contextlib.contextmanager
def run_folder_lock(run_dir: Path, dist) -> Iterator[Optional[RunLock]]:
    """Hold the run folder's lock for the body: rank 0 takes it and tells every rank (a refusal raises
    RunLockedError on all of them) before anything is written; released on the way out."""
    lock, refusal = None, None
    if dist.is_main:
        try:
            lock, note = RunLock.acquire(run_dir)
            if note:
                print(note, flush=True)
        except (RunLockedError, OSError) as exc:   # a live holder; a folder that cannot be written
            refusal = exc
    if dist.world_size > 1 and tdist.is_initialized():
        box = [refusal]
        tdist.broadcast_object_list(box, src=0)
        refusal = box[0]
    if refusal is not None:
        raise refusal
    try:
        yield lock
    finally:
        if lock is not None:
            lock.release()
