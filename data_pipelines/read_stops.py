"""A stop request breaks off a remote read: a preemption must not wait for a shard that is being retried or drips.

The trainer turns its save signals (`crate-clip train --save-on-signal`, USR1 and TERM by default) into a stop at the
next step boundary (crate_clip/train/loop/stop_requests.py). A step ends only once its batch is read, and a remote
shard retried through an outage (up to data.remote_retry_total_s) or a transfer that stalls would hold it past
Slurm's KillWait (30 s), after which the job is killed unsaved. So every process that reads shards notes the signal
here, and the remote reads (remote_retry.py) run inside `interruptible()`:

    signal handler:   note_stop(signum)       # raises ReadInterrupted when the process is inside interruptible()
    remote read:      with interruptible():   # a stop noted before or during it raises ReadInterrupted
                          connect / recv / wait before the next attempt

Raising from the handler cuts a blocking connect, recv or sleep short at once (as Ctrl-C does); nothing outside a
remote read is ever interrupted, and the stream's position is only advanced by batches the trainer consumed, so the
checkpoint saved on the stop is exact.

DataLoader workers are processes of their own. `LoaderStop` joins one DataLoader's workers to their trainer: a worker
that receives a save signal itself (Slurm signals every process of a job step) notes it and tells the trainer through
shared memory; a trainer that receives one passes it on to its workers (`forward`). Without that, torch's worker
ends on SIGTERM, and the trainer dies with "DataLoader worker (pid N) is killed by signal: Terminated".
"""
from __future__ import annotations

import contextlib
import multiprocessing
import os
import signal
from typing import Iterator, Optional

_noted: list[int] = []        # the save signal this process received (the first one), inherited by forked workers
_depth = [0]                  # > 0 inside interruptible(): the handler raises
_stop_signals: list[int] = []  # the trainer's save signals, which its DataLoader workers handle too
_loaders: list["LoaderStop"] = []   # in the trainer: its DataLoaders' shared stop state


class ReadInterrupted(BaseException):
    """A stop request inside a remote read (a BaseException: no `except Exception` on the way swallows it);
    remote_retry.py turns it into the error the trainer stops on."""

    def __init__(self, signum: int):
        super().__init__(signum)
        self.signum = signum


def signal_name(signum: int) -> str:
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"


def set_stop_signals(signums: tuple[int, ...]) -> None:
    """The trainer's save signals: the DataLoader workers started from now on handle them as stop requests."""
    _stop_signals[:] = list(signums)


def note_stop(signum: int) -> None:
    """A save signal reached this process (called by its handler): remember it, and break off the remote read in
    progress, if any (ReadInterrupted, raised from the handler)."""
    if not _noted:
        _noted.append(int(signum))
    if _depth[0] > 0:
        raise ReadInterrupted(_noted[0])


def stop_noted() -> Optional[int]:
    """The save signal this process received, if any."""
    return _noted[0] if _noted else None


def clear() -> None:
    """Forget a noted stop (a later run in the same process starts clean)."""
    _noted.clear()


@contextlib.contextmanager
def interruptible() -> Iterator[None]:
    """A remote read (connect, transfer, wait before the next attempt) that a stop request breaks off: ReadInterrupted
    at once when a stop was noted already, else when one is noted during the body."""
    if _noted:
        raise ReadInterrupted(_noted[0])
    _depth[0] += 1
    try:
        yield
    finally:
        _depth[0] -= 1


class LoaderStop:
    """The stop state one DataLoader's workers share with their trainer: the save signal a worker received (0: none),
    each worker's PID (for `forward`), and whether the trainer is closing the loader."""

    def __init__(self, workers: int):
        ctx = multiprocessing.get_context("fork")
        self._signum = ctx.RawValue("i", 0)
        self._closing = ctx.RawValue("i", 0)
        self._pids = ctx.RawArray("i", max(1, workers))
        self._signums = tuple(_stop_signals)
        _loaders.append(self)

    def worker_init(self, worker_id: int) -> None:
        """In DataLoader worker `worker_id`, as it starts (its worker_init_fn): the save signals become stop requests
        instead of torch's worker handler, which ends the worker on SIGTERM."""
        signal.set_wakeup_fd(-1)   # the trainer's wake-up pipe (stop_requests.py) is the trainer's own
        self._pids[worker_id] = os.getpid()
        for signum in self._signums:
            signal.signal(signum, self._on_worker_signal)
        if self._signums:   # blocked by the trainer while it started the workers (open_loader): delivered now
            signal.pthread_sigmask(signal.SIG_UNBLOCK, self._signums)

    def _on_worker_signal(self, signum, frame) -> None:
        if self._closing.value:   # the trainer is shutting the loader down (torch's terminate): end, as torch would
            os._exit(0)
        if not self._signum.value:
            self._signum.value = signum
        note_stop(signum)

    def worker_signal(self) -> Optional[int]:
        """In the trainer: the save signal one of the workers received, if any."""
        return self._signum.value or None

    def forward(self, signum: int) -> None:
        """In the trainer: pass a save signal on to the workers (their remote reads stop; they go on otherwise)."""
        for pid in list(self._pids):
            if pid > 0:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.kill(pid, signum)

    def close(self) -> None:
        """In the trainer, before the DataLoader shuts its workers down: a signal from now on ends a worker."""
        self._closing.value = 1
        with contextlib.suppress(ValueError):
            _loaders.remove(self)


@contextlib.contextmanager
def workers_starting() -> Iterator[None]:
    """Around the start of DataLoader workers: the save signals are blocked in this thread, so that a worker cannot
    receive one before its handler is in place (LoaderStop.worker_init unblocks them in the worker)."""
    blocked = tuple(_stop_signals)
    if not blocked:
        yield
        return
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, blocked)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)


def open_loaders() -> list[LoaderStop]:
    """In the trainer: the stop states of its open DataLoaders."""
    return list(_loaders)


def worker_stop() -> Optional[int]:
    """In the trainer: the save signal one of its DataLoader workers received, if any."""
    return next((s for s in (loader.worker_signal() for loader in open_loaders()) if s), None)


def forward_to_workers(signum: int) -> None:
    """In the trainer: pass a save signal on to the workers of every open DataLoader."""
    for loader in open_loaders():
        loader.forward(signum)
