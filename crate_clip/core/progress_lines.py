"""The console progress of a long step (an evaluation pass, the text classifier, feature extraction, the linear
probe's fits, shard writing): a tqdm bar where stderr is a terminal; elsewhere (a Slurm .out, CI, a pipe, a file)
plain lines on stderr, never a carriage return: one every EVERY_S seconds at most while the step runs, and one
when it ends:

    [progress] zero-shot images: 40/100 batches (40%), 12.3 batches/s, ETA 0:00:05
    [progress] retrieval: 120 batches so far, 12.3 batches/s          (shards: no total known before the end)
    [progress] zero-shot images: done, 100/100 batches in 8.1 s

A step cut short by an error says nothing more (the error is the command's line). A training stage's own
progress, with its loss and samples, is crate_clip/train/reporting/progress_display.py.
"""
from __future__ import annotations

import datetime
import sys
import time
from typing import Callable, Iterable, Iterator, Optional, TypeVar

EVERY_S = 10.0   # a plain line at most this often: a Slurm log stays readable over a long evaluation

T = TypeVar("T")


def console_is_terminal() -> bool:
    """Whether stderr (where tqdm draws) is a terminal: a bar only there."""
    return bool(getattr(sys.stderr, "isatty", lambda: False)())


def _plural(unit: str, count: float) -> str:
    if count == 1:
        return unit
    return unit + ("es" if unit.endswith(("s", "x", "ch", "sh")) else "s")


class StepProgress:
    """One step's progress: a tqdm bar on a terminal (`bar=None`: decided by console_is_terminal), else plain
    lines; nothing when not `enabled` (another rank, --no-progress). `total`: None when unknown (shards).
    `update(n)` counts work done; `close(done)` ends it (its last line when `done`). A context manager too."""

    def __init__(self, desc: str, *, total: Optional[int] = None, unit: str = "batch", enabled: bool = True,
                 every_s: float = EVERY_S, bar: Optional[bool] = None, leave: bool = True,
                 clock: Callable[[], float] = time.monotonic):
        self.desc, self.total, self.unit, self.every_s, self._clock = desc, total, unit, every_s, clock
        self.count = 0
        self._t0 = self._last = clock()
        self._bar, self._lines = None, False
        if enabled and (console_is_terminal() if bar is None else bar):
            from tqdm import tqdm   # lazy: the plain lines need none of it

            self._bar = tqdm(total=total, desc=desc, unit=unit, dynamic_ncols=True, leave=leave)
        else:
            self._lines = enabled

    def update(self, n: int = 1) -> None:
        """`n` more units done; a plain line when EVERY_S passed since the last one."""
        self.count += n
        if self._bar is not None:
            self._bar.update(n)
        elif self._lines and self._clock() - self._last >= self.every_s:
            self._say(self.line())

    def line(self) -> str:
        """The plain line of now: done of total with the rate and ETA, or the count so far without a total."""
        elapsed = max(self._clock() - self._t0, 1e-9)
        rate = self.count / elapsed
        per_s = f"{rate:.3g} {_plural(self.unit, 2)}/s"
        if self.total is None:
            return f"[progress] {self.desc}: {self.count:,} {_plural(self.unit, self.count)} so far, {per_s}"
        left = max(self.total - self.count, 0)
        eta = datetime.timedelta(seconds=round(left / rate)) if rate > 0 else "?"
        return (f"[progress] {self.desc}: {self.count:,}/{self.total:,} {_plural(self.unit, self.total)} "
                f"({self.count / max(self.total, 1):.0%}), {per_s}, ETA {eta}")

    def end_line(self) -> str:
        """The plain line of the step's end."""
        of = f"/{self.total:,}" if self.total is not None else ""
        return (f"[progress] {self.desc}: done, {self.count:,}{of} {_plural(self.unit, self.total or self.count)} "
                f"in {self._clock() - self._t0:.1f} s")

    def close(self, done: bool = True) -> None:
        """End the display: the bar closed, or the last plain line when the step ended (`done`)."""
        if self._bar is not None:
            self._bar.close()
            self._bar = None
        elif self._lines and done:
            self._say(self.end_line())
        self._lines = False

    def _say(self, text: str) -> None:
        print(text, file=sys.stderr, flush=True)
        self._last = self._clock()

    def __enter__(self) -> "StepProgress":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        self.close(done=exc_type is None)


def progress(items: Iterable[T], desc: str, *, total: Optional[int] = None, unit: str = "batch",
             enabled: bool = True, every_s: float = EVERY_S, leave: bool = True) -> Iterator[T]:
    """`items`, counted by a StepProgress as each is done (`total`: len(items) when it has one); a loop left early
    or by an error says no end line."""
    if total is None and hasattr(items, "__len__"):
        total = len(items)
    with StepProgress(desc, total=total, unit=unit, enabled=enabled, every_s=every_s, leave=leave) as shown:
        for item in items:
            yield item
            shown.update()
