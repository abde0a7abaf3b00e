"""The save signals of `crate-clip train --save-on-signal` (USR1 and TERM by default): their names, and held back
from the first moments of a training process until its handlers are in place.

A signal whose handler is not installed yet takes its default action: SIGTERM and SIGUSR1 end the process, with no
save and exit code 143 or 138. A process spends seconds importing torch, DeepSpeed and open_clip before the stop
handlers of stop_requests.py exist, and a launcher's workers as long; a cancel or a preemption in that window would
end the job unsaved. So `crate-clip train` blocks them as soon as it has read its command line (and the launcher
before its workers start: worker_launch.py), and stop_requests.stop_signals_handled unblocks them once its handlers
are in place: a signal received meanwhile is delivered then, and the run stops with a save at its first step.
Light on purpose (no torch): it runs before the heavy imports.
"""
from __future__ import annotations

import contextlib
import signal
from typing import Iterator

DEFAULT_SIGNALS = "USR1,TERM"


def parse_signals(text: str) -> tuple[int, ...]:
    """`USR1,TERM` (names with or without SIG, or numbers; `none` for none) -> signal numbers; ValueError names a bad
    one."""
    if text.strip().lower() in ("", "none"):
        return ()
    out = []
    for part in (p.strip().upper() for p in text.split(",") if p.strip()):
        name = part if part.startswith("SIG") or part.isdigit() else f"SIG{part}"
        try:
            signum = signal.Signals(int(name)) if name.isdigit() else signal.Signals[name]
        except (KeyError, ValueError):
            raise ValueError(f"--save-on-signal {text!r}: {part!r} is no signal (e.g. USR1,TERM, or none)") from None
        if signum in (signal.SIGKILL, signal.SIGSTOP):
            raise ValueError(f"--save-on-signal {text!r}: {signum.name} cannot be caught; use USR1 or TERM")
        out.append(int(signum))
    return tuple(out)


@contextlib.contextmanager
def held_until_handled(signums: tuple[int, ...]) -> Iterator[None]:
    """For the body: `signums` blocked in this thread (and the threads and processes it starts) until
    stop_signals_handled unblocks them; received meanwhile, they are delivered then instead of ending the process.
    Afterwards the signal mask is what it was (`crate-clip train` called in-process returns with nothing held)."""
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, signums) if signums else None
    try:
        yield
    finally:
        if previous is not None:
            signal.pthread_sigmask(signal.SIG_SETMASK, previous)
