"""Stop, save, exit: a preemption signal (or a data source given up on) stops the run at a step boundary with a
checkpoint of the last completed step, instead of ending it at once and losing the work since the last periodic save.

    signal handler / data stream:  request_stop(reason, exit_code)    # only sets module state (async-signal-safe)
    the stage loop, once per step: agreed_stop(dist) -> (reason, code) # every rank the same answer, at the same step

A Slurm job is warned before its end: `#SBATCH --signal=B:USR1@120` sends SIGUSR1 120 s before the time limit, and a
cancel, a preemption (GraceTime) or `scontrol requeue` sends SIGTERM some seconds (KillWait, GraceTime) before
SIGKILL. `crate-clip train --save-on-signal USR1,TERM` (the default) turns both into a stop request: every rank
finishes its step (a save in progress is finished, not cut short), saves a checkpoint, rank 0 releases the run
folder's lock, and the process exits with EXIT_PREEMPTED (8; docs/exit_codes.md). With `--requeue` rank 0 then
requeues its Slurm job (`scontrol requeue $SLURM_JOB_ID`), which resumes with `--resume auto`.

Every process of a job may be signalled, or only one: Slurm signals every process of a job step (the DataLoader
workers too), a launcher its workers, a user one PID. A DataLoader worker turns the signal into a stop request of its
trainer, a remote read in progress is broken off at once (data_pipelines/read_stops.py), and a thread of each rank
passes the request on to the other ranks and to its workers (stop_sharing.py), so that a rank held in a retried or
dripping read stops too. After the stop, the save signals are ignored until the process exits: a second signal
cannot cut the requeue or the exit short.
"""
from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import threading
from typing import Iterator, Optional

import torch
import torch.distributed as tdist

from crate_clip.core.errors import EXIT_PREEMPTED, UserError
from crate_clip.train.loop.stop_sharing import StopSharing, new_token
from crate_clip.train.run.launcher_watch import launcher_gone, stop_orphan
from crate_clip.train.run.save_signals import DEFAULT_SIGNALS, parse_signals  # noqa: F401 (the names tests use)
from crate_clip.data import read_stops

_request: list = []        # [(reason, exit_code)] once a stop is requested; the first request wins
_sharing: list[StopSharing] = []   # the watching thread of the run in progress (stop_sharing.py)


class StopRequested(UserError, RuntimeError):
    """The run stopped on request after saving; the message says why, where it is saved and how to go on."""
    once_per_job = True   # every rank stops at the same step with the same message: rank 0 says it

    def __init__(self, message: str, exit_code: int = EXIT_PREEMPTED):
        super().__init__(message)
        self.exit_code = exit_code


@contextlib.contextmanager
def stop_signals_handled(signums: tuple[int, ...], ignore_after_stop: bool = False,
                         requeue_when_lost: bool = False) -> Iterator[None]:
    """For the body (the training run): each signal in `signums` is a stop request (exit code 8), in this process and
    in its DataLoader workers; afterwards the previous handlers are back and no request is left (a later run in the
    same process starts clean). `ignore_after_stop` (the CLI): after a stop the signals are ignored instead, so a
    second one cannot end the process before it has exited with its code. `requeue_when_lost` (--requeue): a rank
    that ends the job for a lost rank (exit 9, peer_watch.py) requeues its Slurm job first."""
    previous = {}
    if threading.current_thread() is threading.main_thread():
        for signum in signums:
            previous[signum] = signal.signal(signum, _on_signal)
        if signums:
            _sharing.append(StopSharing(signums, on_lost=requeue_slurm_job if requeue_when_lost else None))
            # a launcher blocks them while it starts its workers (worker_launch.py): pending ones are delivered now
            signal.pthread_sigmask(signal.SIG_UNBLOCK, signums)
    read_stops.set_stop_signals(tuple(previous))
    try:
        yield
    finally:
        while _sharing:   # first: its thread must not deliver a signal once the handlers below are gone
            _sharing.pop().close()
        stopped = bool(_request)
        for signum, handler in previous.items():
            signal.signal(signum, signal.SIG_IGN if stopped and ignore_after_stop else handler)
        read_stops.set_stop_signals(())
        read_stops.clear()
        _request.clear()


def share_between_ranks(dist, lost_after_s: Optional[float] = None) -> None:
    """Every rank, once the run's process group is up: stops pass between the ranks through the job's store at once,
    not only at the next step boundary, and a rank not heard from for `lost_after_s` ends the job (stop_sharing.py,
    peer_watch.py). A collective: every rank calls it at the same point."""
    if dist.world_size == 1 or not tdist.is_initialized():
        return
    token = [new_token() if dist.is_main else None]
    tdist.broadcast_object_list(token, src=0)
    for sharing in _sharing:
        sharing.between_ranks(dist.rank, token[0], dist.world_size, lost_after_s)


def _on_signal(signum, frame) -> None:
    """A stop request; the run releases its folder's lock on its way out (run_lock leaves this handler in place). A
    remote read in progress is broken off (read_stops.note_stop raises inside it)."""
    if launcher_gone():   # the kernel's parent-death SIGTERM: the other ranks are stopping too, no save can be agreed
        stop_orphan()
    name = signal.Signals(signum).name
    origin = next((s.origin for s in _sharing if s.origin), None)
    received = f", received by {origin}" if origin else ""
    request_stop(f"stopped by {name} (a preemption, requeue or time-limit notice{received})", EXIT_PREEMPTED)
    read_stops.note_stop(signum)


def request_stop(reason: str, exit_code: int) -> None:
    """Ask the run to save and exit with `exit_code` at its next step boundary (async-signal-safe: sets state only)."""
    if not _request:
        _request.append((reason, int(exit_code)))


_on_signal.releases_lock_itself = True   # read by run_lock: it leaves this signal's handler in place


def pending() -> Optional[tuple[str, int]]:
    """This process's stop request (or one of its DataLoader workers'), if any."""
    if not _request and read_stops.worker_stop():   # the watching thread has it on its way; say it now
        name = read_stops.signal_name(read_stops.worker_stop())
        request_stop(f"stopped by {name} (a preemption, requeue or time-limit notice, received by a DataLoader "
                     "worker)", EXIT_PREEMPTED)
    return _request[0] if _request else None


def agreed_stop(dist) -> Optional[tuple[str, int]]:
    """Once per step on every rank: (reason, exit code) when any rank was asked to stop, else None. One tiny
    all-reduce of the highest code asked for, so every rank stops at the same step (the signal may reach the ranks
    of a job moments apart); the reason is the first rank's that asked for that code."""
    mine = pending()
    if dist.world_size == 1 or not tdist.is_initialized():
        return mine
    device = dist.device if tdist.get_backend() == "nccl" else "cpu"
    flag = torch.tensor([mine[1] if mine else 0], dtype=torch.int64, device=device)
    tdist.all_reduce(flag, op=tdist.ReduceOp.MAX)
    code = int(flag.item())
    if code == 0:
        return None
    reasons = [None] * dist.world_size
    tdist.all_gather_object(reasons, mine)
    return next(r for r in reasons if r is not None and r[1] == code)


def stops_with_checkpoint(exc: BaseException) -> bool:
    """True for an error that asks for a checkpoint before the run exits (a data source given up on, task 38B's
    ShardSourceUnavailable): class attribute `checkpoint_before_exit` and an int `exit_code`."""
    return bool(getattr(exc, "checkpoint_before_exit", False)) and isinstance(getattr(exc, "exit_code", None), int)


def requeue_slurm_job() -> int:
    """`scontrol requeue $SLURM_JOB_ID` (rank 0, after the save and the lock's release: Slurm ends the job's processes
    at once); returns scontrol's exit code, after a line saying what failed."""
    job = os.environ.get("SLURM_JOB_ID")
    if not job:
        print("[warn] --requeue: not in a Slurm job (no SLURM_JOB_ID); resume with --resume latest", flush=True)
        return 1
    state = _slurm_job_state(job)
    if state != "RUNNING":   # `scontrol requeue` or scancel sent the signal: Slurm requeues or ends the job itself
        print(f"--requeue: Slurm job {job} is {state or 'not found'}, not requeued again", flush=True)
        return 0
    print(f"requeueing Slurm job {job} (scontrol requeue): it resumes from this checkpoint with --resume auto",
          flush=True)
    sys.stderr.flush()
    try:
        done = subprocess.run(["scontrol", "requeue", job], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired) as exc:
        said, code = str(exc), 1
    else:
        said, code = " ".join((done.stderr or done.stdout).split()) or f"exit code {done.returncode}", done.returncode
    if code != 0:
        print(f"[warn] --requeue: scontrol requeue {job} failed ({said}); resume with --resume latest", flush=True)
    return code


def _slurm_job_state(job: str) -> Optional[str]:
    """The job's JobState in `scontrol show job` (RUNNING, COMPLETING while it is being requeued or cancelled)."""
    try:
        done = subprocess.run(["scontrol", "show", "job", "-o", job], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired):
        return None
    fields = dict(f.split("=", 1) for f in done.stdout.split() if "=" in f)
    return fields.get("JobState")
