"""The run lock under requeues and signals (train/run/run_lock.py, issue 29 item 7): a Slurm `--requeue` of the
same job onto other nodes takes over the lock its earlier attempt left, while another job's fresh lock still refuses;
`--take-over-lock` takes it when the user knows that run is gone; SIGTERM and SIGINT release the lock; a malformed
lock file (empty, garbage, a folder) is said to be malformed and moved aside instead of blocking for 600 s."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import asdict, replace
from types import SimpleNamespace

import pytest

from train_fixtures import REPO_ROOT, run_env

JOB_ENV = ("SLURM_JOB_ID", "SLURM_RESTART_COUNT", "TORCHELASTIC_RUN_ID", "TORCHELASTIC_RESTART_COUNT")


@pytest.fixture(autouse=True)
def no_job(monkeypatch):
    for key in JOB_ENV:
        monkeypatch.delenv(key, raising=False)


def _lock_of(path, **fields):
    """A fresh lock file of a holder on another host (it refreshes it: its modification time is now)."""
    from crate_clip.train.run.run_lock import LockHolder

    holder = replace(LockHolder.of_this_process(), host="node-b", pid=4242, **fields)
    path.write_text(json.dumps(asdict(holder)))
    return holder


def test_a_slurm_requeue_onto_other_nodes_takes_over_its_earlier_attempts_lock(tmp_path, monkeypatch):
    from crate_clip.train.run.run_lock import RunLock

    run_dir, path = tmp_path / "run", tmp_path / "run.lock"
    _lock_of(path, job="slurm:7001", attempt=[0, 0])   # the first attempt, on node-b, seconds ago
    monkeypatch.setenv("SLURM_JOB_ID", "7001")
    monkeypatch.setenv("SLURM_RESTART_COUNT", "1")     # scontrol requeue: same job id, next restart count
    lock, note = RunLock.acquire(run_dir)
    try:
        assert note.startswith(f"run.output_dir {run_dir}: took over the stale lock {path} of PID 4242 on host "
                               f"node-b")
        assert "an earlier attempt of this job slurm:7001: attempt (0, 0) is over, this is attempt (1, 0)" in note
        recorded = json.loads(path.read_text())
        assert recorded["job"] == "slurm:7001" and recorded["attempt"] == [1, 0] and recorded["pid"] == os.getpid()
    finally:
        lock.release()


@pytest.mark.parametrize("holder_job, env", [
    ("slurm:7002", {"SLURM_JOB_ID": "7001", "SLURM_RESTART_COUNT": "3"}),   # another job
    ("slurm:7001", {"SLURM_JOB_ID": "7001"}),                               # the same attempt: a second srun
    (None, {"SLURM_JOB_ID": "7001", "SLURM_RESTART_COUNT": "1"}),            # a run outside any job
    ("slurm:7001", {}),                                                     # this run is in no job
], ids=["other-job", "same-attempt", "holder-in-no-job", "me-in-no-job"])
def test_a_different_live_run_still_refuses(tmp_path, monkeypatch, holder_job, env):
    from crate_clip.train.run.run_lock import RunLock, RunLockedError

    _lock_of(tmp_path / "run.lock", job=holder_job, attempt=[0, 0] if holder_job else None)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    with pytest.raises(RunLockedError, match=r"in use by another run: PID 4242 on host node-b") as refused:
        RunLock.acquire(tmp_path / "run")
    assert "--take-over-lock takes it now" in str(refused.value) and refused.value.exit_code == 5


def test_torchruns_default_run_id_names_no_job(tmp_path, monkeypatch):
    """`torchrun` without --rdzv_id gives every job the run id "none": a restart count there proves nothing."""
    from crate_clip.train.run.run_lock import RunLock, RunLockedError, launcher_job

    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "none")
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "2")
    assert launcher_job() == (None, None)
    _lock_of(tmp_path / "run.lock", job=None)
    with pytest.raises(RunLockedError):
        RunLock.acquire(tmp_path / "run")
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "crate-b16")   # an --rdzv_id: its restarts take over
    assert launcher_job() == ("torchelastic:crate-b16", [0, 2])
    _lock_of(tmp_path / "run.lock", job="torchelastic:crate-b16", attempt=[0, 1])
    lock, note = RunLock.acquire(tmp_path / "run")
    lock.release()
    assert "an earlier attempt of this job torchelastic:crate-b16" in note


def test_take_over_lock_takes_a_fresh_lock_of_another_host_but_not_a_running_local_process(tmp_path):
    from crate_clip.train.run.run_lock import LockHolder, RunLock, RunLockedError
    from crate_clip.train.run.run_lock import run_folder_lock

    run_dir, path = tmp_path / "run", tmp_path / "run.lock"
    _lock_of(path, job="slurm:1")
    with run_folder_lock(run_dir, SimpleNamespace(is_main=True, world_size=1), take_over=True) as lock:
        assert json.loads(path.read_text())["token"] == lock.holder.token
    assert not path.exists()

    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:   # a process of this host that runs: even --take-over-lock does not take it
        path.write_text(json.dumps(asdict(replace(LockHolder.of_this_process(), pid=sleeper.pid,
                                                  process_start=None))))
        with pytest.raises(RunLockedError, match=f"PID {sleeper.pid} on this host"):
            RunLock.acquire(run_dir, take_over=True)
    finally:
        sleeper.kill()
        sleeper.wait()


def test_train_has_the_take_over_lock_flag():
    from crate_clip.train.cli import build_parser

    args = build_parser().parse_args(["--config", "c.yaml", "--resume", "auto", "--take-over-lock"])
    assert args.take_over_lock is True
    assert build_parser().parse_args(["--config", "c.yaml"]).take_over_lock is False


# ---------------------------------------------------------------- malformed lock files
def _empty(path):
    path.write_bytes(b"")
    old = time.time() - 30   # its writer had more than NAME_WAIT_S to name itself
    os.utime(path, (old, old))
    return "empty", b""


def _garbage(path):
    path.write_bytes(b"\x00\x17garbage{not json")
    return "not a lock record (18 bytes: ", b"\x00\x17garbage{not json"


def _wrong_fields(path):
    path.write_text(json.dumps({"host": 3, "pid": "12"}))
    return "not a lock record", path.read_bytes()


def _folder(path):
    path.mkdir()
    (path / "kept.txt").write_text("someone's file")
    return "a folder, not a file", None


@pytest.mark.parametrize("make", [_empty, _garbage, _wrong_fields, _folder])
def test_a_malformed_lock_is_said_moved_aside_and_taken(tmp_path, make):
    from crate_clip.train.run.run_lock import RunLock

    run_dir, path = tmp_path / "run", tmp_path / "run.lock"
    why, content = make(path)
    started = time.monotonic()
    lock, note = RunLock.acquire(run_dir)
    try:
        assert time.monotonic() - started < 30   # not STALE_AFTER_S (600 s)
        aside = tmp_path / "run.lock.malformed"
        assert note.startswith(f"run.output_dir {run_dir}: the lock {path} was malformed ({why}")
        assert f"moved it to {aside} and took the lock" in note and "not yet written its name" not in note
        if content is None:
            assert (aside / "kept.txt").read_text() == "someone's file"   # nothing is deleted
        else:
            assert aside.read_bytes() == content
        assert json.loads(path.read_text())["pid"] == os.getpid()
    finally:
        lock.release()


# ---------------------------------------------------------------- signals release the lock
HOLDER = """
import sys, time
sys.path.insert(0, {repo!r})
from crate_clip.train.run.run_lock import RunLock
lock, _ = RunLock.acquire({run_dir!r})
print("held", flush=True)
time.sleep(60)
"""


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT, signal.SIGUSR1],
                         ids=["SIGTERM", "SIGINT", "SIGUSR1"])
def test_sigterm_and_sigint_release_the_lock(tmp_path, signum):
    """SIGTERM and SIGUSR1 (Slurm's early warning) still end the process by the signal (as a launcher expects) where
    the trainer does not make them a stop request (--save-on-signal none; test_slurm_preemption.py: it does by
    default); SIGINT still raises KeyboardInterrupt (which, uncaught, ends Python by SIGINT too). All first remove
    the lock, so the next run or requeue finds the folder free."""
    run_dir, path = tmp_path / "run", tmp_path / "run.lock"
    # SIGINT at its default, as a terminal gives it: a pytest-xdist worker ignores SIGINT, and a process that starts
    # with it ignored keeps it ignored (Python installs KeyboardInterrupt only where SIGINT is not ignored)
    proc = subprocess.Popen([sys.executable, "-c", HOLDER.format(repo=str(REPO_ROOT), run_dir=str(run_dir))],
                            env=run_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        assert proc.stdout.readline().strip() == "held" and path.exists()
        proc.send_signal(signum)
        assert proc.wait(timeout=30) == -signum
    finally:
        proc.kill()
        proc.wait()
    assert not path.exists(), proc.stderr.read()
    if signum == signal.SIGINT:
        assert "KeyboardInterrupt" in proc.stderr.read()
