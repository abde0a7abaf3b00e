"""A lost node ends the job in a bounded time, not after the process group's 30-minute timeout.

When a node crashes (or its network goes), nothing closes the other ranks' connections to it: no FIN, no RST. The
ranks left wait in their next collective until torch's process-group timeout (30 min by default), holding the run
folder's lock, and an elastic launcher cannot restart them on the nodes left until then. So each rank shows that it
lives, and watches the ranks it depends on, through the job's key-value store (the TCPStore at MASTER_ADDR, which
the launcher of node 0 serves):

    every rank, each BEAT_S (stop_sharing.py's thread):  adds 1 to its own counter in the store
    rank 0:   reads every other rank's counter;  the other ranks: rank 0's
    a counter that has not moved for `lost_after_s`, or a store that has not answered for that long (node 0 is
    gone): one line naming the rank and its host, the run folder's lock released, exit EXIT_RANK_LOST (9)

The counters are advanced by a thread, not by the steps, so a long step, save or evaluation on one rank is no loss;
a process that is stopped (SIGSTOP) or frozen for longer than `lost_after_s` is. A rank that ends normally says so
first (`left`), so the ranks still finishing their part (rank 0's export) do not count it as lost. Nothing is
saved on the way out (a save needs the lost rank): the last checkpoint is kept and `--resume latest` continues
from it, on the nodes left too (elastic_resume.py).
"""
from __future__ import annotations

import socket
import time
from typing import Optional

LEFT = 1 << 40   # added to a rank's counter when it ends normally: any larger value means "left"
RETRY_S = 10.0   # a store that failed is asked again this often, not each beat (torch logs each failure)


class PeerWatch:
    """One rank's side of the watch (called from the stop-sharing thread, see the module's docstring)."""

    def __init__(self, store, prefix: str, rank: int, world_size: int, lost_after_s: float):
        self.store, self.prefix, self.rank, self.lost_after_s = store, prefix, rank, float(lost_after_s)
        now = time.monotonic()
        self._seen = {r: (-1, now) for r in (range(1, world_size) if rank == 0 else [0])}
        self._answered_at = now
        self._retry_at = now
        store.set(self._key("host", rank), socket.gethostname())

    def beat(self) -> Optional[str]:
        """Show this rank lives and look at the others: None while all is well, else the line saying who is lost."""
        now = time.monotonic()
        if now < self._retry_at:
            return self._store_silent(now)
        try:
            self.store.add(self._key("beat", self.rank), 1)
            counts = {r: self.store.add(self._key("beat", r), 0) for r in self._seen}   # add 0: read, never wait
        except Exception:   # noqa: BLE001 - a refused or timed-out connection: the store's node may be gone
            self._retry_at = now + min(RETRY_S, self.lost_after_s / 2)
            return self._store_silent(now)
        self._answered_at = self._retry_at = now
        for r, count in counts.items():
            if count >= LEFT:
                self._seen.pop(r)
            elif count != self._seen[r][0]:
                self._seen[r] = (count, now)
            elif now - self._seen[r][1] > self.lost_after_s:
                return (f"rank {r} (host {self._host(r)}) has not been heard from for {now - self._seen[r][1]:.0f} s "
                        f"(run.lost_rank_timeout_s={self.lost_after_s:g}): its node or its network is lost")
        return None

    def _store_silent(self, now: float) -> Optional[str]:
        silent = now - self._answered_at
        if silent <= self.lost_after_s:
            return None
        return (f"the job's store (at node 0, MASTER_ADDR) has not answered for {silent:.0f} s "
                f"(run.lost_rank_timeout_s={self.lost_after_s:g}): node 0 is lost")

    def leave(self) -> None:
        """This rank ends normally: the others stop watching it."""
        try:
            self.store.add(self._key("beat", self.rank), LEFT)
        except Exception:   # noqa: BLE001 - the store has ended already (rank 0's launcher exited)
            pass

    def _host(self, rank: int) -> str:
        try:
            return self.store.get(self._key("host", rank)).decode(errors="replace")
        except Exception:   # noqa: BLE001
            return "unknown"

    def _key(self, kind: str, rank: int) -> str:
        return f"{self.prefix}/{kind}/{rank}"
