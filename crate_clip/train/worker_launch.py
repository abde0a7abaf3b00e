"""Start the training processes with torch's elastic launcher (what `torchrun` runs) and exit with what they
exited with: the code of the first process that failed (2 for a config, 4 for a resume, 5 for a locked run
folder, ...; docs/exit_codes.md), where `torchrun` itself says 1 for any failure and prints a ChildFailedError
block after the worker's own one line. Used by `crate-clip train --nproc N` and by the demo:

    python -m crate_clip.train.worker_launch --nproc_per_node 2 -m crate_clip.train.cli --config C.yaml

The trainer's save signals (`--save-on-signal`, USR1 and TERM by default) are passed on to the workers, which
finish their step, save and exit 8; the launcher then exits with that 8. torchrun itself would turn a SIGTERM into
SIGTERM for the workers and its own 143, and die of a SIGUSR1 it does not handle, so those signals are taken out of
the set it handles (`--signals-to-handle`) and forwarded here instead: blocked in this process (and so in the
workers it starts, until their handlers are in place: train/run/save_signals.py), and taken by a thread that passes
each on to the workers, also to the ones that start after it came. A signal at any moment of the launch, twice
included, is a stop with a save.
"""
from __future__ import annotations

import signal
import sys
import threading

TRAIN_MODULE = "crate_clip.train.cli"
TORCHRUN_SIGNALS = ("SIGTERM", "SIGINT", "SIGHUP", "SIGQUIT")   # what torchrun handles by default
DEFAULT_SAVE_SIGNALS = "USR1,TERM"   # crate-clip train's --save-on-signal default


def worker_exit_code(exitcode: int) -> int:
    """A worker's code as a shell reports it: a process ended by signal N (torch says -N) is 128 + N."""
    return 128 - exitcode if exitcode < 0 else exitcode


def run_workers(torchrun_args: list[str]) -> int:
    """Run torchrun's launch (its own arguments, then the module or script and its arguments) in this process;
    returns the first failed worker's exit code, 0 when every worker succeeded."""
    forwarder = _Forwarder(save_signals(torchrun_args))   # first: a signal during the imports below is kept too
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
    finally:
        forwarder.close()
    return 0


def save_signals(args: list[str]) -> tuple[int, ...]:
    """The signals the trainer saves on, read from its `--save-on-signal` among `args` (the default otherwise)."""
    from crate_clip.train.run.save_signals import parse_signals

    text = DEFAULT_SAVE_SIGNALS
    for i, arg in enumerate(args):
        if arg == "--save-on-signal" and i + 1 < len(args):
            text = args[i + 1]
        elif arg.startswith("--save-on-signal="):
            text = arg.split("=", 1)[1]
    try:
        return parse_signals(text)
    except ValueError:   # the trainer refuses it in one line; torchrun keeps its own handling meanwhile
        return ()


class _Forwarder:
    """The save signals, blocked in the launcher and taken by a thread that passes each one on to the workers (this
    process's children): to those running when it comes and to those that start later."""

    def __init__(self, signums: tuple[int, ...]):
        self.signums, self.received = signums, []
        self._sent: set[tuple[int, int]] = set()   # (worker PID, signal) passed on
        self._done = threading.Event()
        self._thread, self._previous = None, None
        if signums:
            # blocked before any thread or worker starts: they inherit it (the workers until their handlers exist)
            self._previous = signal.pthread_sigmask(signal.SIG_BLOCK, signums)
            self._thread = threading.Thread(target=self._run, name="save-signal-forwarder", daemon=True)
            self._thread.start()

    def _run(self) -> None:
        while not self._done.is_set():
            signum = signal.sigtimedwait(self.signums, 0.2)
            if signum is not None and signum.si_signo not in self.received:
                self.received.append(signum.si_signo)
            if self.received:
                self._pass_on()

    def _pass_on(self) -> None:
        import psutil

        for child in psutil.Process().children():
            for signum in self.received:
                if (child.pid, signum) not in self._sent:
                    self._sent.add((child.pid, signum))
                    try:
                        child.send_signal(signum)
                    except psutil.NoSuchProcess:   # a worker that has just ended
                        pass

    def close(self) -> None:
        """The workers have ended: stop forwarding; a save signal that came meanwhile is dropped (the launcher exits
        with the workers' code), and the signal mask is what it was."""
        self._done.set()
        if self._thread is not None:
            self._thread.join()
            while signal.sigtimedwait(self.signums, 0) is not None:
                pass
            signal.pthread_sigmask(signal.SIG_SETMASK, self._previous)


def torchrun_args(nproc: int, train_args: list[str]) -> list[str]:
    """torchrun's arguments for `nproc` training processes on this host, each running `crate-clip train`; the
    trainer's save signals are left out of the set torchrun handles (run_workers forwards them)."""
    from crate_clip.train.stage_setup.engine import _free_port

    forwarded = {signal.Signals(s).name for s in save_signals(train_args)}
    handled = ",".join(name for name in TORCHRUN_SIGNALS if name not in forwarded)
    return ["--nproc_per_node", str(nproc), "--master_addr", "127.0.0.1", "--master_port", str(_free_port()),
            "--signals-to-handle", handled, "-m", TRAIN_MODULE, *train_args]


def launch_command(nproc: int, train_args: list[str]) -> list[str]:
    """The command line that runs this launcher for `nproc` processes of `crate-clip train train_args`."""
    return [sys.executable, "-m", "crate_clip.train.worker_launch", *torchrun_args(nproc, train_args)]


if __name__ == "__main__":
    sys.exit(run_workers(sys.argv[1:]))
