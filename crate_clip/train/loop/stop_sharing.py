"""A stop request reaches every process of a job within about a second, whichever process the signal reached.

The ranks agree on a stop once per step (stop_requests.agreed_stop). That is enough while every rank steps, but not
when one of them cannot finish its step: a rank whose remote shard is retried through an outage, or drips, holds its
step for minutes, and the rank that was signalled waits for it in the step's collective, where its Python signal
handler cannot even run. So a thread of every rank watches for save signals as they arrive and passes them on:

    the signal, in C:   Python writes its number to this process's wake-up pipe (signal.set_wakeup_fd), at once
    this thread:        passes it on to the rank's DataLoader workers (their remote reads stop: read_stops.py)
                        and posts it in the job's key-value store (the TCPStore the process group was made from)
    every rank's thread, each POLL_S: a stop posted by another rank, or received by one of its own DataLoader
                        workers, is delivered to its own main thread as that signal (pthread_kill), so it takes
                        the same path as a signal received directly

A stop is then acted on by every process within POLL_S plus the time a read takes to notice (at once, read_stops.py):
the step in progress ends or its read is broken off, and the run saves and exits 8 as before.

The same thread keeps the watch on lost nodes every BEAT_S (peer_watch.py): a rank that is no longer heard from ends
the job with exit 9 within run.lost_rank_timeout_s, instead of the process group's 30-minute timeout.
"""
from __future__ import annotations

import contextlib
import os
import select
import signal
import sys
import threading
import time
import uuid
from datetime import timedelta
from typing import Callable, Optional

from crate_clip.core.errors import EXIT_RANK_LOST
from crate_clip.data import read_stops
from crate_clip.train.loop.peer_watch import PeerWatch

POLL_S = 0.5
BEAT_S = 2.0
STORE_TIMEOUT_S = 10.0


class StopSharing:
    """The watching thread of one process's run (started by stop_requests.stop_signals_handled)."""

    def __init__(self, signums: tuple[int, ...], on_lost: Optional[Callable[[], object]] = None):
        self.signums = frozenset(signums)
        self.on_lost = on_lost   # what else to do before the exit for a lost rank (the Slurm job's requeue)
        self.origin: Optional[str] = None      # where a stop this thread delivered came from, for its line
        self._store, self._key, self._rank = None, None, 0
        self._peers: Optional[PeerWatch] = None
        self._beat_at = 0.0
        self._posted = False
        self._delivered = False
        self._closing = threading.Event()
        self._read_fd, self._write_fd = os.pipe()
        os.set_blocking(self._write_fd, False)
        os.set_blocking(self._read_fd, False)
        self._previous_fd = signal.set_wakeup_fd(self._write_fd, warn_on_full_buffer=False)
        self._main = threading.main_thread().ident
        self._thread = threading.Thread(target=self._watch, name="stop-sharing", daemon=True)
        self._thread.start()

    def between_ranks(self, rank: int, token: str, world_size: int = 1, lost_after_s: Optional[float] = None) -> None:
        """Share stops with the other ranks of the job through its TCPStore (MASTER_ADDR:MASTER_PORT), under a key of
        this launch (`token`, the same on every rank); a store that cannot be reached leaves the per-step agreement.
        With `lost_after_s`, also keep the watch on lost ranks (peer_watch.py)."""
        import torch.distributed as tdist

        try:
            self._store = tdist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
                                         wait_for_workers=False, timeout=timedelta(seconds=STORE_TIMEOUT_S))
        except (KeyError, ValueError, RuntimeError):
            return
        self._key, self._rank = f"/crate_clip/stop/{token}", rank
        if lost_after_s and world_size > 1:
            self._peers = PeerWatch(self._store, f"/crate_clip/peers/{token}", rank, world_size, lost_after_s)

    def close(self) -> None:
        """Stop watching: the previous wake-up pipe is back, the thread has ended."""
        signal.set_wakeup_fd(self._previous_fd)
        self._closing.set()
        with contextlib.suppress(OSError):
            os.write(self._write_fd, b"\0")
        self._thread.join(timeout=5)
        if self._peers is not None:
            self._peers.leave()
        self._store = None
        for fd in (self._read_fd, self._write_fd):
            with contextlib.suppress(OSError):
                os.close(fd)

    def _watch(self) -> None:
        while not self._closing.is_set():
            with contextlib.suppress(OSError, ValueError):
                select.select([self._read_fd], [], [], POLL_S)
            for signum in self._received():
                self._pass_on(signum)
            if not self._delivered:
                self._deliver_from_elsewhere()
            self._watch_peers()

    def _watch_peers(self) -> None:
        if self._peers is None or time.monotonic() - self._beat_at < BEAT_S:
            return
        self._beat_at = time.monotonic()
        lost = self._peers.beat()
        if lost is not None and not self._closing.is_set():
            _end_for_a_lost_rank(self._rank, lost, self.on_lost)

    def _received(self) -> list[int]:
        """The save signals this process received since the last look (the wake-up pipe holds every handled one)."""
        try:
            data = os.read(self._read_fd, 512)
        except (BlockingIOError, OSError):
            return []
        return [s for s in data if s in self.signums]

    def _pass_on(self, signum: int) -> None:
        """A save signal reached this process: to its DataLoader workers, and to the other ranks (once)."""
        self._delivered = True
        read_stops.forward_to_workers(signum)
        if self._store is not None and not self._posted:
            self._posted = True
            with contextlib.suppress(Exception):   # a store gone (rank 0 ended): the per-step agreement remains
                self._store.set(self._key, f"{signum} {self._rank}")

    def _deliver_from_elsewhere(self) -> None:
        """A stop that another rank or one of this rank's DataLoader workers received: delivered to this process's
        main thread as the same signal (once)."""
        found = self._posted_elsewhere()
        worker = read_stops.worker_stop()
        if found is None and worker:
            found = (worker, "a DataLoader worker of this rank")
        if found is None:
            return
        signum, self.origin = found
        self._delivered = True
        self._posted = self._posted or found[1].startswith("rank")   # the other ranks have it already
        if not self._closing.is_set():   # the run's handlers are still in place (close() comes before they go)
            signal.pthread_kill(self._main, signum)

    def _posted_elsewhere(self) -> Optional[tuple[int, str]]:
        if self._store is None:
            return None
        try:
            if not self._store.check([self._key]):
                return None
            signum, rank = self._store.get(self._key).decode().split()
        except Exception:   # noqa: BLE001 - a store gone (rank 0 ended) or a malformed value: not a stop
            self._store = None
            return None
        return (int(signum), f"rank {rank}") if int(rank) != self._rank and int(signum) in self.signums else None


def _end_for_a_lost_rank(rank: int, why: str, then: Optional[Callable[[], object]]) -> None:
    """The job cannot go on (its collectives wait for the lost rank): one line, the lock released, `then` (the
    requeue), exit 9. Never returns. No save: it would need the lost rank's part; the last checkpoint is kept."""
    print(f"crate-clip train: rank {rank}: {why}; stopping (exit {EXIT_RANK_LOST}). The last checkpoint is kept: "
          "--resume latest continues from it, on the nodes left too", file=sys.stderr, flush=True)
    from crate_clip.train.run.run_lock import release_held_locks   # here: needed only when a rank is lost

    release_held_locks()   # os._exit skips the `finally` that would: the next attempt finds the folder free
    if then is not None:
        then()
    sys.stdout.flush()
    os._exit(EXIT_RANK_LOST)


def new_token() -> str:
    """A key for one launch's stops (rank 0 draws it, the ranks agree on it)."""
    return uuid.uuid4().hex
