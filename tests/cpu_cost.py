"""A pytest plugin (loaded by conftest.py): the CPU time of each test, its launched processes included, and the
15 costliest tests printed at the end of every run beside pytest's --durations (every test's, as JSON, into the file
named by $CRATE_CLIP_TEST_COSTS when it is set). On a 2-core machine the suite's cost is CPU, not wall time: a test
that launches a 4-process job costs several times its wall time.

A test's CPU is its process's user + system time over the test's setup, call and teardown, plus that of the child
processes reaped meanwhile (getrusage(RUSAGE_CHILDREN) counts a child with the children it reaped, so a launched
job counts with its ranks) and that of the commands warm_python.py forked that ended meanwhile (the warm
interpreter's own import counts for no test). A module- or session-scoped fixture counts for the first test using
it (its teardown for the last). Measured where the test runs and carried on the teardown report, so it works in the
pytest-xdist workers as in one process; the suite's CPU is the sum over its tests (collection and start-up aside)."""
from __future__ import annotations

import json
import os
import resource
import sys
import time

import pytest

SHOWN = 15
KEY = "cpu_seconds"   # user property of a teardown report: (CPU s, of it in launched processes)
_START = pytest.StashKey[tuple]()
_costs: list[tuple[float, float, str]] = []   # (CPU s, of it in launched processes, test id)
_wall: dict = {}


def _cpu() -> tuple[float, float]:
    own, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    warm = sys.modules.get("warm_python")   # commands forked by the warm interpreter: its children, not ours
    return own.ru_utime + own.ru_stime, kids.ru_utime + kids.ru_stime + (warm.launched_cpu_s() if warm else 0.0)


def pytest_sessionstart(session):
    _wall["start"] = time.monotonic()


@pytest.hookimpl(hookwrapper=True, tryfirst=True)
def pytest_runtest_setup(item):
    item.stash[_START] = _cpu()
    yield


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    if call.when == "teardown" and _START in item.stash:
        (own0, kids0), (own1, kids1) = item.stash[_START], _cpu()
        outcome.get_result().user_properties.append((KEY, ((own1 - own0) + (kids1 - kids0), kids1 - kids0)))


def pytest_runtest_logreport(report):
    if report.when == "teardown":
        for key, value in report.user_properties:
            if key == KEY:
                _costs.append((value[0], value[1], report.nodeid))


def pytest_terminal_summary(terminalreporter):
    if not _costs:
        return
    tr = terminalreporter
    tr.write_sep("=", f"{SHOWN} tests with the most CPU time (launched processes included)")
    for cpu, kids, nodeid in sorted(_costs, reverse=True)[:SHOWN]:
        tr.write_line(f"{cpu:7.1f}s cpu ({kids:6.1f}s in launched processes)  {nodeid}")
    wall = time.monotonic() - _wall.get("start", time.monotonic())
    total, launched = sum(c for c, _, _ in _costs), sum(k for _, k, _ in _costs)
    if os.environ.get("CRATE_CLIP_TEST_COSTS"):
        rows = [{"test": n, "cpu_s": round(c, 2), "launched_s": round(k, 2)} for c, k, n in sorted(_costs, reverse=True)]
        with open(os.environ["CRATE_CLIP_TEST_COSTS"], "w") as out:
            json.dump({"wall_s": round(wall, 1), "tests": rows}, out, indent=0)
    tr.write_line(f"suite: {len(_costs)} tests, {wall:.0f} s wall, {total:.0f} s CPU in its tests "
                  f"({launched:.0f} s in launched processes)")
