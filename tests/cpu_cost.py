"""A pytest plugin (loaded by conftest.py): the CPU time of each test, its launched processes included, and the
15 costliest tests printed at the end of every run beside pytest's --durations. On a 2-core machine the suite's
cost is CPU, not wall time: a test that launches a 4-process torchrun job costs several times its wall time.

A test's CPU is this process's user + system time over the test's setup, call and teardown, plus that of the
child processes reaped meanwhile (getrusage(RUSAGE_CHILDREN) counts a child with the children it reaped, so a
torchrun job counts with its workers). A module- or session-scoped fixture counts for the first test using it."""
from __future__ import annotations

import resource
import time

import pytest

SHOWN = 15
_costs: list[tuple[float, float, str]] = []   # (CPU s, of it in launched processes, test id)
_start: dict = {}


def _cpu() -> tuple[float, float]:
    own, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime, kids.ru_utime + kids.ru_stime


def pytest_sessionstart(session):
    _start["cpu"], _start["wall"] = _cpu(), time.monotonic()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    own0, kids0 = _cpu()
    yield
    own1, kids1 = _cpu()
    _costs.append(((own1 - own0) + (kids1 - kids0), kids1 - kids0, item.nodeid))


def pytest_terminal_summary(terminalreporter):
    if not _costs or "cpu" not in _start:
        return
    (own0, kids0), (own1, kids1) = _start["cpu"], _cpu()
    wall = time.monotonic() - _start["wall"]
    tr = terminalreporter
    tr.write_sep("=", f"{SHOWN} tests with the most CPU time (launched processes included)")
    for cpu, kids, nodeid in sorted(_costs, reverse=True)[:SHOWN]:
        tr.write_line(f"{cpu:7.1f}s cpu ({kids:6.1f}s in launched processes)  {nodeid}")
    tr.write_line(f"suite: {len(_costs)} tests, {wall:.0f} s wall, {own1 - own0 + kids1 - kids0:.0f} s CPU "
                  f"({kids1 - kids0:.0f} s in launched processes)")
