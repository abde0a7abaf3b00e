"""One writer per run folder: rank 0 of a training job holds `<run_dir>.lock` for the run's life.

The lock file sits beside the run folder (so `--overwrite` can rename the folder aside while holding it). It is
created with O_CREAT|O_EXCL, atomic on local file systems and on NFS (v3 and later) and Lustre, where flock may not
work, and names its holder: host, PID, the process's start time, when it was taken. A thread of the holder
refreshes the file's modification time every HEARTBEAT_S seconds. Another process that finds the file judges it:

  - held by a live process of this host: refused, naming the holder;
  - held by a process of this host that is gone (no such PID, an exited one not yet reaped, the PID now runs a
    process started at another time, or the host rebooted since): stale, said so and taken over;
  - held by an earlier attempt of this same launcher job on another host (the lock records the job: Slurm's
    SLURM_JOB_ID, torchrun's TORCHELASTIC_RUN_ID when set by --rdzv_id, and their restart counts): the job was
    requeued or restarted, so that attempt is over: taken over, said so. A Slurm `--requeue` onto other nodes
    resumes at once instead of waiting STALE_AFTER_S;
  - held by another host otherwise: refused while its modification time is less than STALE_AFTER_S old; older,
    its holder stopped refreshing it (crashed, or its node is gone): stale, said so and taken over. Ages are
    measured on the file system's clock (a file touched beside the lock), not this host's. `take_over=True`
    (`crate-clip train --take-over-lock`: the user knows that run is gone) takes it over at once;
  - malformed (empty once its writer had NAME_WAIT_S to fill it, not a lock record, a folder): said so, moved
    aside to `<lock>.malformed` (kept, for a look) and taken over. A live holder always names itself within a
    moment of creating its file, and one whose file was replaced exits at its next heartbeat.

Taking over renames the stale file aside (of two processes taking over at once, one rename wins) and creates a new
one. A holder whose lock was taken over (it was stopped for longer than STALE_AFTER_S) exits at its next heartbeat
rather than write beside the new holder. SIGTERM, SIGINT and SIGUSR1 of the holder release its lock first (then
SIGTERM and SIGUSR1 end the process as before, SIGINT raises KeyboardInterrupt), unless the trainer makes them a stop
request (--save-on-signal, stop_requests.py: it saves, then releases the lock and exits); so does launcher_watch
before it ends a process whose launcher is gone; only SIGKILL, a crash of the host or another os._exit leave it.
"""
from __future__ import annotations

import contextlib
import json
import os
import signal
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
from crate_clip.core.writable_folders import unwritable_error
from crate_clip.train.run.process_info import is_running, process_start

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


def launcher_job() -> tuple[Optional[str], Optional[list[int]]]:
    """(the launcher job this process belongs to, its attempt), or (None, None) outside a job: `slurm:<SLURM_JOB_ID>`
    (kept by `scontrol requeue`, whose SLURM_RESTART_COUNT counts the attempts), else `torchelastic:<run id>` when
    torchrun was given an --rdzv_id (its default id "none" is shared by unrelated jobs). The attempt is [the Slurm
    restart count, torchrun's restart count]: a later attempt of the same job means the earlier one is over."""
    slurm, elastic = os.environ.get("SLURM_JOB_ID"), os.environ.get("TORCHELASTIC_RUN_ID")
    if slurm:
        job = f"slurm:{slurm}"
    elif elastic and elastic != "none":
        job = f"torchelastic:{elastic}"
    else:
        return None, None
    attempt = [_count(os.environ.get("SLURM_RESTART_COUNT")), _count(os.environ.get("TORCHELASTIC_RESTART_COUNT"))]
    return job, attempt


def _count(value: Optional[str]) -> int:
    return int(value) if value and value.isdigit() else 0


@dataclass(frozen=True)
class LockHolder:
    """What a lock file says about its holder."""
    host: str
    pid: int
    started: str                    # when the lock was taken (local time, for people)
    process_start: Optional[str]    # when the PID's process started: a reused PID is another process
    boot_id: Optional[str]          # the holder's boot: after a reboot every PID is another process
    token: str                      # tells this holder's file from a successor's
    job: Optional[str] = None       # the launcher job (launcher_job): a requeue of it takes the lock over
    attempt: Optional[list] = None  # [Slurm restart count, torchrun restart count] of that job

    @classmethod
    def of_this_process(cls) -> "LockHolder":
        """The record this process writes when it takes a lock."""
        job, attempt = launcher_job()
        return cls(socket.gethostname(), os.getpid(), time.strftime("%Y-%m-%d %H:%M:%S"), process_start(os.getpid()),
                   _boot_id(), uuid.uuid4().hex, job, attempt)

    def describe(self) -> str:
        """`PID 123 on this host (h1)` / `PID 123 on host h2`, and since when (and in which job)."""
        where = f"this host ({self.host})" if self.host == socket.gethostname() else f"host {self.host}"
        job = f", job {self.job} attempt {self._attempt()}" if self.job else ""
        return f"PID {self.pid} on {where}, started {self.started}{job}"

    def _attempt(self) -> tuple:
        return tuple(self.attempt or (0, 0))

    def earlier_attempt_of(self, other: "LockHolder") -> bool:
        """True when this holder is an earlier attempt of `other`'s launcher job (requeued or restarted since)."""
        return bool(self.job) and self.job == other.job and self._attempt() < other._attempt()

    def gone(self) -> bool:
        """True when the holder is a process of this host that no longer runs."""
        if self.host != socket.gethostname():
            return False
        if self.boot_id and _boot_id() and self.boot_id != _boot_id():
            return True
        return not is_running(self.pid, self.process_start)


MAX_LOCK_BYTES = 4096   # a lock record is ~300 bytes: a larger file is no lock of ours (and is not read whole)


def _parse_holder(path: Path) -> tuple[Optional[LockHolder], Optional[str]]:
    """(the holder a lock file names, None) or (None, why it names none: 'missing', 'empty', or why malformed)."""
    try:
        with open(path, "rb") as f:
            data = f.read(MAX_LOCK_BYTES + 1)
    except FileNotFoundError:
        return None, "missing"
    except IsADirectoryError:
        return None, "a folder, not a file"
    except OSError as exc:
        return None, f"unreadable ({exc.strerror or exc})"
    if not data.strip():
        return None, "empty"
    try:
        record = json.loads(data.decode("utf-8")) if len(data) <= MAX_LOCK_BYTES else None
        holder = LockHolder(**record) if isinstance(record, dict) else None
    except (ValueError, TypeError):
        holder = None
    if holder is None or not isinstance(holder.host, str) or type(holder.pid) is not int:
        shown = data[:40].decode("utf-8", "replace")
        return None, f"not a lock record ({len(data) if len(data) <= MAX_LOCK_BYTES else 'over 4096'} bytes: {shown!r})"
    return holder, None


def _read_holder(path: Path) -> Optional[LockHolder]:
    """The holder a lock file names; None when it names none."""
    return _parse_holder(path)[0]


def _holder_once_named(path: Path) -> tuple[Optional[LockHolder], Optional[str]]:
    """The holder of a lock file, waiting up to NAME_WAIT_S for one created a moment ago to name it (a second
    trainer started together with the first finds the file between its creation and its write); else why the file
    names none, as _parse_holder says."""
    deadline = time.monotonic() + NAME_WAIT_S
    while True:
        holder, why = _parse_holder(path)
        if holder is not None or why in ("missing", "a folder, not a file") or time.monotonic() >= deadline:
            return holder, why
        time.sleep(0.05)


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


_held: list["RunLock"] = []   # the locks this process holds, for release_held_locks


def release_held_locks() -> None:
    """Release every lock this process holds: for a thread about to end the process with os._exit (the launcher
    watchdog), which skips the `finally` that would."""
    for lock in list(_held):
        with contextlib.suppress(OSError):
            lock.release()


class RunLock:
    """The lock this process holds on a run folder; `release()` (or the end of `run_folder_lock`) gives it up."""

    def __init__(self, path: Path, holder: LockHolder):
        self.path, self.holder = path, holder
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._heartbeat, name="run-lock-heartbeat", daemon=True)
        self._previous_handlers: dict = {}

    @classmethod
    def acquire(cls, run_dir: Path, take_over: bool = False) -> tuple["RunLock", Optional[str]]:
        """Take the lock of `run_dir` (waiting for nothing): returns it and, when a stale lock was taken over, the
        line that says so; raises RunLockedError naming a live holder. `take_over`: the user says the holder is
        gone; only a running process of this host is still refused."""
        path = lock_path(run_dir)
        path.parent.mkdir(parents=True, exist_ok=True)
        holder, note = LockHolder.of_this_process(), None
        for _ in range(3):   # a stale lock taken over by another process meanwhile: judge the new one
            if _create(path, holder):
                lock = cls(path, holder)
                lock._thread.start()
                lock._release_on_signals()
                _held.append(lock)
                return lock, note
            note = _take_over_if_stale(path, run_dir, holder, take_over)
        raise RunLockedError(f"run.output_dir {run_dir}: could not take its lock {path} (other processes keep "
                             "taking it over); fix: start one training per run folder")

    def _heartbeat(self) -> None:
        while not self._stop.wait(HEARTBEAT_S):
            current = _read_holder(self.path)
            if current is None or current.token != self.holder.token:
                print(f"crate-clip train: the lock {self.path} of this run was taken over by "
                      f"{current.describe() if current else 'another process'} (this process was stopped for longer "
                      f"than {STALE_AFTER_S:.0f} s, or its job was requeued?); stopping so that one run writes into "
                      f"the folder", file=sys.stderr, flush=True)
                os._exit(EXIT_LOCKED)
            with contextlib.suppress(OSError):   # a file system hiccup: the next beat tries again
                os.utime(self.path)

    def _release_on_signals(self) -> None:
        """SIGTERM (Slurm's cancel and time limit, torchrun stopping its workers, the parent-death signal), SIGINT
        and SIGUSR1 (Slurm's usual early warning) release the lock before they act: the next run or requeue then finds
        the folder free. A signal that `crate-clip train --save-on-signal` makes a stop request (stop_requests.py) is
        left to it: the run finishes its step, saves, and releases the lock on its way out. Python runs
        the handler between bytecodes of the main thread; a process blocked in a collective is ended by
        launcher_watch's thread, and a lock left that way is stale by its PID or its job."""
        if threading.current_thread() is not threading.main_thread():
            return
        for signum in (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1):
            previous = signal.getsignal(signum)
            if getattr(previous, "releases_lock_itself", False):   # a stop request (stop_requests.py): the run
                continue                                            # saves, exits and releases the lock itself
            if previous is signal.SIG_IGN or previous is None:   # ignored (nohup), or set outside Python: kept
                continue
            self._previous_handlers[signum] = previous
            signal.signal(signum, self._on_signal)

    def _on_signal(self, signum, frame) -> None:
        previous = self._previous_handlers.get(signum, signal.SIG_DFL)
        self.release()   # restores the previous handlers
        if callable(previous):   # Python's own KeyboardInterrupt for SIGINT, or another library's handler
            previous(signum, frame)
            return
        signal.signal(signum, signal.SIG_DFL)   # the default action, as without a lock: the process ends
        os.kill(os.getpid(), signum)

    def release(self) -> None:
        """Stop the heartbeat and remove the lock file, if it is still this process's."""
        with contextlib.suppress(ValueError):
            _held.remove(self)
        self._stop.set()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join()   # a beat in progress must not find the file gone and take that for a takeover
        if threading.current_thread() is threading.main_thread():
            for signum, previous in self._previous_handlers.items():
                signal.signal(signum, previous)
            self._previous_handlers = {}
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


def _take_over_if_stale(path: Path, run_dir: Path, me: LockHolder, take_over: bool = False) -> Optional[str]:
    """Remove the lock at `path` when its holder is gone (the line that says so); raise RunLockedError naming a live
    one."""
    holder, why_unnamed = _holder_once_named(path)
    try:
        age = _age_s(path)
    except FileNotFoundError:   # released meanwhile
        return None
    if holder is None and why_unnamed == "missing":
        return None
    if holder is None and (why_unnamed != "empty" or age > NAME_WAIT_S):
        return _move_malformed_aside(path, run_dir, why_unnamed)
    why = _why_stale(holder, me, age, take_over)
    if why is None:
        raise RunLockedError(_in_use(run_dir, holder, path, age))
    aside = path.with_name(f".{path.name}.stale{os.getpid()}")
    try:
        os.rename(path, aside)
    except FileNotFoundError:   # another process took it over first
        return None
    if _read_holder(aside) != holder:   # the file renamed is a new holder's, created after it was judged
        _put_back(aside, path)
        return None
    aside.unlink(missing_ok=True)
    who = holder.describe() if holder else "an unreadable lock"
    return f"run.output_dir {run_dir}: took over the stale lock {path} of {who} ({why})"


def _in_use(run_dir: Path, holder: Optional[LockHolder], path: Path, age: float) -> str:
    """The refusal's line: the folder, the live holder, the lock and how to go on."""
    who = holder.describe() if holder else "a process that has not yet written its name into it"
    return (f"run.output_dir {run_dir} is in use by another run: {who} (lock {path}, refreshed {age:.0f} s ago); "
            f"fix: wait for that run to end or stop it, or set run.output_dir to another folder (a lock not "
            f"refreshed for {STALE_AFTER_S:.0f} s counts as stale; --take-over-lock takes it now, when you know "
            f"that run is gone)")


def in_use_problem(run_dir: Path, take_over: bool = False) -> Optional[str]:
    """The line a start would be refused with because a live run holds `run_dir`'s lock, found without taking,
    moving or waiting for the lock (`crate-clip train --validate` and the launcher, before any worker starts);
    None when there is no lock, or one a start would take over (stale, naming no holder, or `take_over`)."""
    path = lock_path(run_dir)
    holder = _read_holder(path)
    if holder is None:
        return None
    try:
        age = _age_s(path)
    except FileNotFoundError:   # released meanwhile
        return None
    if _why_stale(holder, LockHolder.of_this_process(), age, take_over) is not None:
        return None
    return _in_use(run_dir, holder, path, age)


def _why_stale(holder: Optional[LockHolder], me: LockHolder, age: float, take_over: bool) -> Optional[str]:
    """Why the lock of `holder` may be taken over by `me`; None while it may still be a live run's."""
    if holder is not None and holder.gone():
        return "no longer running"
    if holder is not None and holder.host == socket.gethostname():
        return None   # a running process of this host: never taken over, not even with --take-over-lock
    if holder is not None and holder.earlier_attempt_of(me):
        return (f"an earlier attempt of this job {me.job}: attempt {holder._attempt()} is over, this is attempt "
                f"{me._attempt()} (requeued or restarted)")
    if age > STALE_AFTER_S:
        return f"not refreshed for {age:.0f} s, more than the {STALE_AFTER_S:.0f} s after which a lock is stale"
    if take_over:
        return f"--take-over-lock: refreshed {age:.0f} s ago, taken over as asked"
    return None


def _move_malformed_aside(path: Path, run_dir: Path, why: str) -> Optional[str]:
    """A lock file that names no holder: kept as `<lock>.malformed[-N]` (nothing is deleted) and taken over."""
    aside, n = path.with_name(path.name + ".malformed"), 1
    while aside.exists():
        n += 1
        aside = path.with_name(f"{path.name}.malformed-{n}")
    try:
        os.rename(path, aside)
    except FileNotFoundError:   # another process took it over first
        return None
    if _read_holder(aside) is not None:   # a new holder's file, created after it was judged: give it back
        _put_back(aside, path)
        return None
    return (f"run.output_dir {run_dir}: the lock {path} was malformed ({why}), so it names no run holding the "
            f"folder; moved it to {aside} and took the lock")


def _put_back(aside: Path, path: Path) -> None:
    """Return a lock file renamed aside by mistake (unless yet another holder took `path` meanwhile)."""
    with contextlib.suppress(FileExistsError):
        os.link(aside, path)
    aside.unlink(missing_ok=True)


@contextlib.contextmanager
def run_folder_lock(run_dir: Path, dist, take_over: bool = False) -> Iterator[Optional[RunLock]]:
    """Hold the run folder's lock for the body: rank 0 takes it and tells every rank (a refusal raises
    RunLockedError on all of them) before anything is written; released on the way out. `take_over`:
    RunLock.acquire's."""
    lock, refusal = None, None
    if dist.is_main:
        try:
            lock, note = RunLock.acquire(run_dir, take_over)
            if note:
                print(note, flush=True)
        except RunLockedError as exc:   # a live holder
            refusal = exc
        except OSError as exc:   # a folder that cannot be written (a read-only file system): one line
            refusal = unwritable_error(exc, run_dir, "run.output_dir") or exc
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
