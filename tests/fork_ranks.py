"""Tests only: N ranks of a training entry point forked from one interpreter that has imported the training code,
where torchrun starts N fresh interpreters (on the 2-core machine each pays ~5 s of CPU importing torch, DeepSpeed
and open_clip before its first step; a 2-rank torchrun job ~12 s with the launcher's own import).

    python tests/fork_ranks.py NPROC -m MODULE ARGS...     # as `torchrun --nproc_per_node NPROC -m MODULE ARGS`
    python tests/fork_ranks.py NPROC SCRIPT.py ARGS...

Each rank gets the variables torchrun gives a worker (RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, MASTER_ADDR,
MASTER_PORT, GROUP_RANK) and runs the entry point as `python -m MODULE ARGS` would. When a rank fails the others
are ended (SIGTERM), as torchrun does, and the exit code is the first failing rank's (0 when all succeed). The
tests of the launchers themselves (torchrun's restarts and rendezvous, a killed launcher's orphans, the exit-code
line under torchrun) keep torchrun: train_fixtures.torchrun_cmd; the others use train_fixtures.ranks_cmd."""
from __future__ import annotations

import ctypes
import os
import signal
import sys

import warm_python

PR_SET_PDEATHSIG = 1
_children: dict[int, int] = {}   # pid -> rank


def _run_rank(rank: int, nproc: int, port: int, target: list[str], launcher: int) -> None:
    """In the forked child: become rank `rank` and run the entry point; never returns."""
    # the kernel ends the rank when this launcher dies (SIGKILL included), as torchrun's workers stop
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
    if os.getppid() != launcher:   # it died before the kernel was asked to tell
        os._exit(143)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    split = os.environ.get("FORK_RANKS_OUTPUT_DIR")   # each rank's stdout / stderr to rank<R>.out / .err there
    if split:
        for fd, ending in ((1, "out"), (2, "err")):
            path = os.path.join(split, f"rank{rank}.{ending}")
            os.dup2(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644), fd)
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(nproc), LOCAL_WORLD_SIZE=str(nproc),
                      GROUP_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    # as torchrun's worker `python -m MODULE` would run and end (a crash: its traceback, exit code 1); ending
    # here, never returning into the launcher's code
    warm_python.exit_as_the_interpreter(warm_python.run_as_main(target, os.getcwd()))


def main(argv: list[str]) -> int:
    nproc, target = int(argv[0]), argv[1:]
    # what every rank would import first (warm_python.RANK_PRELOAD), imported once before the fork so the ranks
    # start warm (not the entry point itself: run_as_main runs it afresh as __main__)
    warm_python.preload(warm_python.RANK_PRELOAD)
    warm_python.frozen_heap()   # (already frozen when forked by the warm interpreter: then only what came since)
    from crate_clip.train.stage_setup.engine import _free_port   # the trainer's own (preloaded above)

    port = _free_port()
    sys.stdout.flush()
    sys.stderr.flush()
    launcher = os.getpid()
    for rank in range(nproc):
        pid = os.fork()
        if pid == 0:
            _run_rank(rank, nproc, port, target, launcher)
        _children[pid] = rank
    first_failure = 0
    while _children:
        pid, status = os.wait()
        rank = _children.pop(pid, None)
        code = os.waitstatus_to_exitcode(status)
        if code < 0:   # said as torchrun says it, so that train_fixtures.run_job sees a SIGABRT at teardown
            print(f"fork_ranks: rank {rank} (pid {pid}) died of signal {signal.Signals(-code).name}", file=sys.stderr)
        if code != 0 and first_failure == 0:
            first_failure = code if code > 0 else 128 - code   # killed by signal N: 128 + N, as a shell says
            _end_children()
    return first_failure


def _end_children(*_) -> None:
    for pid in list(_children):
        try:
            os.kill(pid, signal.SIGTERM)
        except ProcessLookupError:
            pass


def _on_sigterm(*_) -> None:
    _end_children()
    os._exit(143)


if __name__ == "__main__":
    signal.signal(signal.SIGTERM, _on_sigterm)
    sys.exit(main(sys.argv[1:]))
