"""Start the training processes with torch's elastic launcher (what `torchrun` runs) and exit with what they
exited with: the code of the first process that failed (2 for a config, 4 for a resume, 5 for a locked run
folder, ...; docs/exit_codes.md), where `torchrun` itself says 1 for any failure and prints a ChildFailedError
block after the worker's own one line. Used by `crate-clip train --nproc N` and by the demo:

    python -m crate_clip.train.worker_launch --nproc_per_node 2 -m crate_clip.train.cli --config C.yaml
"""
from __future__ import annotations

import sys

TRAIN_MODULE = "crate_clip.train.cli"


def worker_exit_code(exitcode: int) -> int:
    """A worker's code as a shell reports it: a process ended by signal N (torch says -N) is 128 + N."""
    return 128 - exitcode if exitcode < 0 else exitcode


def run_workers(torchrun_args: list[str]) -> int:
    """Run torchrun's launch (its own arguments, then the module or script and its arguments) in this process;
    returns the first failed worker's exit code, 0 when every worker succeeded."""
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import parse_args, run

    try:
        run(parse_args(torchrun_args))
    except ChildFailedError as exc:   # the root cause is the earliest failure; the others were stopped after it
        _, failure = exc.get_first_failure()
        return worker_exit_code(failure.exitcode)
    except SignalException as exc:   # the launcher itself was signalled (it stopped the workers first)
        return 128 + int(exc.sigval)
    return 0


def torchrun_args(nproc: int, train_args: list[str]) -> list[str]:
    """torchrun's arguments for `nproc` training processes on this host, each running `crate-clip train`."""
    from crate_clip.train.engine import _free_port

    return ["--nproc_per_node", str(nproc), "--master_addr", "127.0.0.1", "--master_port", str(_free_port()),
            "-m", TRAIN_MODULE, *train_args]


def launch_command(nproc: int, train_args: list[str]) -> list[str]:
    """The command line that runs this launcher for `nproc` processes of `crate-clip train train_args`."""
    return [sys.executable, "-m", "crate_clip.train.worker_launch", *torchrun_args(nproc, train_args)]


if __name__ == "__main__":
    sys.exit(run_workers(sys.argv[1:]))
