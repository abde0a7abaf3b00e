"""Remote shards that ride out outages: transient failures retried with backoff, a broken transfer resumed at
the byte it broke at, and one error (exit code 7) when the source stays away past the retry budget.

Why at the byte level: the tar reader above sees one uninterrupted byte stream, so a shard read again after a
failure yields no sample twice and none out of order, and a run that rides out an outage trains on exactly the
samples of an undisturbed one. A re-opened transfer starts at the first byte not yet delivered: by an HTTP Range
request where the server honours it, else (`python -m http.server`, `pipe:` commands) by reading and dropping
the bytes already delivered.

A transfer slower than a floor (data.remote_min_bytes_per_s over data.remote_stall_timeout_s of reading) is a
stall too: a server that drips a byte a second would otherwise hold the run for ever without one failure.

Permanent failures (HTTP 404 / 403, a missing object) are PermanentSourceError, an OSError: the shard reader
counts them as unreadable or truncated shards, as before. How each kind of source is read: remote_transport.py.
A preemption signal breaks off a read or a wait at once (read_stops.py): ReadStopped, exit code 8 once saved.
"""
from __future__ import annotations

import io
import logging
import random
import time
from dataclasses import dataclass

from crate_clip.core.errors import EXIT_PREEMPTED, EXIT_SOURCE_UNAVAILABLE, OneLineDataError

from .read_stops import ReadInterrupted, interruptible, signal_name
from .remote_transport import PermanentSourceError, TransientSourceError, open_transport, shown_source

log = logging.getLogger(__name__)
_JITTER = random.SystemRandom()   # timing only: never touches the seeded generators of the data order
_SKIP_CHUNK = 1 << 20


class ShardSourceUnavailable(OneLineDataError):
    """A remote data source stayed unreachable past the retry budget: the trainer saves a checkpoint of the last
    completed step and exits with code 7; `--resume latest` continues once the source is back."""

    exit_code = EXIT_SOURCE_UNAVAILABLE


class ReadStopped(ShardSourceUnavailable):
    """A preemption signal broke off a remote read (a transfer, a retry or the wait before one): the trainer saves the
    last completed step and exits with code 8, as for a signal between steps."""

    exit_code = EXIT_PREEMPTED


RESUME_LATEST = "continue with --resume latest"   # the advice of the lines below (the trainer adapts it)


def stopped_message(url: str, signum: int, retrying: str | None) -> str:
    """The line of a read broken off by a stop signal (`retrying`: the outage's last error, if one was retried)."""
    during = f"while {shown_source(url)} was retried (last error: {retrying})" if retrying else \
        f"while {shown_source(url)} was read"
    return f"stopped by {signal_name(signum)} {during}; {RESUME_LATEST}"


@dataclass(frozen=True)
class RetryPolicy:
    """How long and how often a transient failure of a remote shard is retried (the data.remote_* keys)."""

    total_s: float = 1200.0      # one outage, first failure to giving up (under the collectives' 30-min timeout)
    stall_s: float = 60.0        # a transfer silent this long is broken off and retried
    backoff_base_s: float = 1.0  # first wait; doubles after each failed attempt
    backoff_max_s: float = 60.0  # longest wait
    min_bytes_per_s: float = 1024.0   # slower over stall_s of reading: a stall (0: no floor)


class _Outage:
    """The retries of one outage: exponential waits with jitter, capped, until the budget is spent."""

    def __init__(self, policy: RetryPolicy):
        self.policy, self.attempts, self.deadline = policy, 0, time.monotonic() + policy.total_s

    def next_wait(self) -> float | None:
        """Seconds to wait before the next attempt, or None when the budget is spent."""
        left = self.deadline - time.monotonic()
        if left <= 0:
            return None
        full = min(self.policy.backoff_max_s, self.policy.backoff_base_s * 2 ** self.attempts)
        self.attempts += 1
        # half fixed, half random: ranks that lost the same server do not come back in lockstep
        return min(left, full * _JITTER.uniform(0.5, 1.0))


def give_up_message(url: str, error: str, policy: RetryPolicy) -> str:
    """The one line a run ends with when a source does not come back."""
    return (f"data source {shown_source(url)} still unreachable after {policy.total_s:g} s of retries "
            f"(data.remote_retry_total_s; last error: {error}); once it is back, {RESUME_LATEST}")


class _Throughput:
    """The bytes one transfer delivered and the seconds spent waiting for them; slower than the policy's floor over
    stall_s of waiting: a stall (TransientSourceError). Time the reader spends elsewhere (decoding) is not counted.
    `proven`: the transfer delivered a window's worth at the floor, so the source is back (a drip never is)."""

    def __init__(self, policy: RetryPolicy):
        self.policy, self.bytes, self.seconds, self.total = policy, 0, 0.0, 0

    def read(self, body, buffer) -> int:
        started = time.monotonic()
        n = body.readinto(buffer)
        self.seconds += time.monotonic() - started
        self.bytes += n
        self.total += n
        floor, window = self.policy.min_bytes_per_s, self.policy.stall_s
        if floor and n and self.seconds >= window:
            if self.bytes < floor * self.seconds:
                raise TransientSourceError(f"{self.bytes / self.seconds:.0f} B/s over {self.seconds:.0f} s, below "
                                           f"{floor:g} B/s (data.remote_min_bytes_per_s)")
            self.bytes, self.seconds = 0, 0.0   # the next window
        return n

    @property
    def proven(self) -> bool:
        return self.total >= max(1.0, self.policy.min_bytes_per_s * self.policy.stall_s)


class RetryingShardStream(io.RawIOBase):
    """The bytes of one remote shard, read through transient failures (wrap in io.BufferedReader)."""

    def __init__(self, url: str, policy: RetryPolicy = RetryPolicy()):
        super().__init__()
        self.url, self.policy = url, policy
        self._delivered = 0      # bytes handed to the reader: a re-opened transfer skips them
        self._outage: _Outage | None = None
        self._last_error: str | None = None   # the outage's last failure, for the line of a stop during it
        self._size: int | None = None          # the shard's size, as its first answer gave it
        self._body = None
        self._body = self._interruptible(self._reopen)

    def readable(self) -> bool:
        return True

    def readinto(self, buffer) -> int:
        return self._interruptible(self._readinto, buffer)

    def _interruptible(self, read, *args):
        """`read(*args)` broken off by a stop signal: ReadStopped naming the shard (and the outage, if one)."""
        try:
            with interruptible():
                return read(*args)
        except ReadInterrupted as stop:
            if self._body is not None:
                self._body.close()
            raise ReadStopped(stopped_message(self.url, stop.signum, self._last_error if self._outage else None)) \
                from None

    def _readinto(self, buffer) -> int:
        while True:
            try:
                n = self._rate.read(self._body, buffer)
            except TransientSourceError as exn:
                self._body.close()
                self._wait(str(exn))
                self._body = self._reopen()
                continue
            self._delivered += n
            if self._rate.proven:   # the source is back: a later failure is a new outage, with a budget of its own
                self._outage = None
            return n

    def _reopen(self):
        """A transfer positioned at the first byte not yet delivered (retried while it fails transiently)."""
        while True:
            body = None
            try:
                body = open_transport(self.url, self.policy.stall_s, self._delivered)
                self._rate = _Throughput(self.policy)
                self._check_same_file(body)
                self._discard(body, self._delivered - body.position)
                return body
            except TransientSourceError as exn:
                if body is not None:
                    body.close()
                self._wait(str(exn))
            except PermanentSourceError as exn:
                if body is not None:
                    body.close()
                if self._delivered:   # mid-way: the rest of the shard is lost; say so (the reader counts it)
                    log.warning("data source %s: %s; the rest of the shard is skipped (counted as truncated_tar)",
                                shown_source(self.url), exn)
                raise
            except BaseException:
                if body is not None:
                    body.close()
                raise

    def _check_same_file(self, body) -> None:
        """A re-opened transfer must be the rest of the same file: not from a later byte than asked for, and of the
        size the first answer gave (a proxy's error page answered 200 would otherwise be read on as the shard)."""
        if body.position > self._delivered:
            raise PermanentSourceError(f"asked for byte {self._delivered:,}, the server sent from byte "
                                       f"{body.position:,}")
        if self._size is None:
            self._size = body.total
        elif body.total is not None and body.total != self._size:
            kind = f" ({body.content_type})" if body.content_type else ""
            raise PermanentSourceError(f"the retry was answered with {body.total:,} bytes{kind}, the shard has "
                                       f"{self._size:,}: not the same file")

    def _discard(self, body, count: int) -> None:
        """Read and drop the first `count` bytes of a fresh transfer."""
        chunk = bytearray(min(_SKIP_CHUNK, max(count, 1)))
        while count > 0:
            n = self._rate.read(body, memoryview(chunk)[:min(count, len(chunk))])
            if n == 0:
                raise PermanentSourceError("the shard is shorter than when it was first read")
            count -= n

    def _wait(self, error: str) -> None:
        """Log and sleep before the next attempt; ShardSourceUnavailable once the outage's budget is spent."""
        self._outage = self._outage or _Outage(self.policy)
        self._last_error = error
        wait = self._outage.next_wait()
        if wait is None:
            raise ShardSourceUnavailable(give_up_message(self.url, error, self.policy))
        log.warning("data source %s: %s; next attempt in %.1f s (attempt %d, retrying up to %g s: "
                    "data.remote_retry_total_s)", shown_source(self.url), error, wait, self._outage.attempts + 1,
                    self.policy.total_s)
        time.sleep(wait)   # inside interruptible(): a stop signal ends it at once

    def close(self) -> None:
        if not self.closed and getattr(self, "_body", None) is not None:
            self._body.close()
        super().close()


def open_remote_shard(url: str, policy: RetryPolicy | None = None, bufsize: int = 1 << 20):
    """A buffered byte stream of a remote shard that retries transient failures; PermanentSourceError (an
    OSError) when the source says the shard is not there, ShardSourceUnavailable when the budget is spent."""
    return io.BufferedReader(RetryingShardStream(url, policy or RetryPolicy()), bufsize)
