"""argparse types for numbers with a range: a value outside it is refused while the command line is parsed, in one
line naming the option (`crate-clip segment: error: argument --batch-size: 0: must be at least 1`, exit code 2),
before any model is loaded or any file written. Part of the bottom layer: it imports nothing of crate_clip."""
from __future__ import annotations

import argparse
import math
from typing import Callable, Optional


def bounded(kind: type = int, *, ge: Optional[float] = None, gt: Optional[float] = None,
            le: Optional[float] = None, lt: Optional[float] = None, meaning: str = "") -> Callable[[str], float]:
    """An argparse `type=` that parses `kind` (int or float) and checks ge <= value, gt < value, value <= le,
    value < lt; `meaning` is added to the refusal (what the bound is for)."""
    def parse(text: str):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"{text!r} is not {'a whole number' if kind is int else 'a number'}") from None
        if kind is float and not math.isfinite(value):
            raise argparse.ArgumentTypeError(f"{text}: must be a finite number")
        checks = ((ge, value < (ge or 0), "at least"), (gt, value <= (gt or 0), "more than"),
                  (le, value > (le or 0), "at most"), (lt, value >= (lt or 0), "less than"))
        broken = [f"{words} {bound:g}" for bound, fails, words in checks if bound is not None and fails]
        if broken:
            why = f" ({meaning})" if meaning else ""
            raise argparse.ArgumentTypeError(f"{text}: must be {' and '.join(broken)}{why}")
        return value

    parse.__name__ = kind.__name__   # argparse names the type in its own messages
    return parse


POSITIVE_INT = bounded(int, ge=1)
NON_NEGATIVE_INT = bounded(int, ge=0)
