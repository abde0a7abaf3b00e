"""A contrast between runs over its training seeds: the spread the paired image-level standard error does not hold.

The one convention of the pages (docs/inverse_scaling.md, "How to read ±"): a spread over seeds is the sample
standard deviation (ddof 1, "SD"); the uncertainty of a mean over n seeds is SD / sqrt(n) ("SE over seeds"), read
with Student's t on n - 1 degrees of freedom; a claim about a contrast stands only where its 95% t interval over
seeds leaves out zero.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from scipy import stats

LEVEL = 0.95   # the interval a claim needs to leave out zero


@dataclass(frozen=True)
class SeedSpread:
    """mean, SD (ddof 1) and SE = SD / sqrt(n) of one value per seed; t = mean / SE on n - 1 df and the 95% t
    interval of the mean (nan where fewer than two seeds give no spread)."""
    n: int
    mean: float
    sd: float
    se: float
    t: float
    low: float
    high: float

    @property
    def df(self) -> int:
        return self.n - 1

    @property
    def supported(self) -> bool:
        """The interval leaves out zero: the seeds establish the contrast's sign."""
        return self.low > 0 or self.high < 0

    def text(self, digits: int = 2) -> str:
        """'± 0.44 SE over 3 seeds, t -3.4 on 2 df, 95% interval -3.39 to +0.41' (what a page prints beside the
        paired image-level SE)."""
        if self.n < 2:
            return f"{self.n} seed: no spread over seeds"
        return (f"± {self.se:.{digits}f} SE over {self.n} seeds, t {self.t:+.1f} on {self.df} df, "
                f"{LEVEL:.0%} interval {self.low:+.{digits}f} to {self.high:+.{digits}f}")


def seed_spread(values: list[float]) -> SeedSpread:
    """The spread over seeds of one contrast, given its value for each seed (e.g. each seed's top-1 of arm A minus
    the same seed's top-1 of arm B)."""
    n = len(values)
    mean = sum(values) / n
    if n < 2:
        nan = float("nan")
        return SeedSpread(n, mean, nan, nan, nan, nan, nan)
    sd = math.sqrt(sum((v - mean) ** 2 for v in values) / (n - 1))
    se = sd / math.sqrt(n)
    half = float(stats.t.ppf(0.5 + LEVEL / 2, n - 1)) * se
    t = mean / se if se else float("nan")   # seeds that agree exactly: no t
    return SeedSpread(n, mean, sd, se, t, mean - half, mean + half)


def sd(values: list[float]) -> float:
    """The sample standard deviation over seeds (ddof 1): the pages' one convention for a spread; 0 for one seed."""
    return seed_spread(values).sd if len(values) > 1 else 0.0


def mean_paired_se(ses: list[float]) -> float:
    """The SE paired over images of a mean over seeds of per-seed contrasts, each with its own paired SE: the seeds'
    test-set noise, independent fits, so sqrt(sum se^2) / n. It holds no spread between the training runs."""
    return math.sqrt(sum(se ** 2 for se in ses)) / len(ses)
