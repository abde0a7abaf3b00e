"""A stage's console progress on rank 0: a tqdm bar on a terminal, else (a Slurm log, CI, a pipe) a plain line every
`logging.progress_every_s` seconds and at the stage's end:

    [progress] stage 0 low @16px: step 40/100 (40%), 640/1600 samples, loss 2.1043, 212 samples/s, ETA 0:00:05
"""
from __future__ import annotations

import datetime
import time
from typing import Optional

from tqdm import tqdm

from crate_clip.core.progress_lines import console_is_terminal   # the evaluations' and shard writing's rule too


class StageProgress:
    """One stage's progress: `bar` (tqdm) or `lines` (plain lines); resumed stages start part-way."""

    def __init__(self, name: str, total_steps: int, done_steps: int, samples_per_step: int, *, every_s: float,
                 bar: Optional[bool] = None):
        self.name, self.total, self.samples_per_step, self.every_s = name, total_steps, samples_per_step, every_s
        self._t0, self._step0 = time.perf_counter(), done_steps
        self._last_line = self._t0
        self._step, self._loss, self._rate = done_steps, None, 0.0
        use_bar = console_is_terminal() if bar is None else bar
        self._bar = tqdm(total=total_steps, initial=done_steps, desc=name, unit="step", dynamic_ncols=True,
                         mininterval=1.0) if use_bar else None

    def update(self, step: int, loss: Optional[float], rate: float, postfix: dict) -> None:
        """One step done (`rate`: samples/s since the stage or resume started; `postfix`: the bar's other figures)."""
        self._step, self._rate = step, rate
        self._loss = loss if loss is not None else self._loss
        if self._bar is not None:
            self._bar.update(1)
            self._bar.set_postfix(postfix, refresh=False)
        elif time.perf_counter() - self._last_line >= self.every_s:
            self._print_line()

    def write(self, text: str) -> None:
        """A console line kept clear of the bar."""
        if self._bar is not None:
            self._bar.write(text)
        else:
            print(text, flush=True)

    def close(self) -> None:
        """The bar closed, or the stage's last line (unless one was printed for this same step)."""
        if self._bar is not None:
            self._bar.close()
            self._bar = None
        elif self._step > self._step0 and self._printed_step != self._step:
            self._print_line()

    _printed_step: Optional[int] = None

    def line(self) -> str:
        """The plain progress line of now."""
        done = self._step * self.samples_per_step
        left = (self.total - self._step) * self.samples_per_step
        eta = datetime.timedelta(seconds=round(left / self._rate)) if self._rate > 0 else "?"
        loss = f"loss {self._loss:.4f}" if self._loss is not None else "loss n/a"
        return (f"[progress] {self.name}: step {self._step}/{self.total} ({self._step / max(self.total, 1):.0%}), "
                f"{done}/{self.total * self.samples_per_step} samples, {loss}, {self._rate:.0f} samples/s, "
                f"ETA {eta}")

    def _print_line(self) -> None:
        print(self.line(), flush=True)
        self._last_line, self._printed_step = time.perf_counter(), self._step
