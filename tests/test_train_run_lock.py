"""One writer per run folder (crate_clip/train/run/run_lock.py): a live holder is refused by name, a lock of a process
of this host that is gone is taken over and said so, another host's lock is respected until it has not been
refreshed for STALE_AFTER_S, the holder refreshes it, and a holder whose lock was taken over stops.
The runs that use it end to end: test_train_run_safety.py (two trainers at once, --resume / --overwrite of a live
run) and test_train_orphans.py (a killed launcher's lock is stale)."""
from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from dataclasses import asdict, replace

import pytest

from train_fixtures import REPO_ROOT, run_env


def _write_lock(path, holder) -> None:
    path.write_text(json.dumps(asdict(holder)))


def test_a_live_holder_is_refused_by_name_and_released(tmp_path):
    from crate_clip.train.run.run_lock import RunLock, RunLockedError, lock_path

    run_dir = tmp_path / "run"
    lock, note = RunLock.acquire(run_dir)
    try:
        assert note is None and lock.path == lock_path(run_dir) == tmp_path / "run.lock"
        with pytest.raises(RunLockedError) as refused:   # this process is alive: a second writer is refused
            RunLock.acquire(run_dir)
        message = str(refused.value)
        assert message.startswith(f"run.output_dir {run_dir} is in use by another run: PID {os.getpid()} on this host")
        assert f"lock {lock.path}" in message and "fix: wait for that run to end" in message
        assert refused.value.exit_code == 5
    finally:
        lock.release()
    assert not lock.path.exists()
    RunLock.acquire(run_dir)[0].release()   # free again


def test_the_lock_of_a_process_that_is_gone_is_taken_over_and_said_so(tmp_path):
    from crate_clip.train.run.run_lock import LockHolder, RunLock

    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()   # reaped: its PID runs nothing now
    run_dir = tmp_path / "run"
    _write_lock(tmp_path / "run.lock", replace(LockHolder.of_this_process(), pid=gone.pid, process_start=None))
    lock, note = RunLock.acquire(run_dir)
    lock.release()
    assert note.startswith(f"run.output_dir {run_dir}: took over the stale lock {tmp_path / 'run.lock'} of PID "
                           f"{gone.pid} on this host ({socket.gethostname()}), started ")
    assert note.endswith("(no longer running)")

    # a PID that now runs another process (started at another time) is gone too
    _write_lock(tmp_path / "run.lock", replace(LockHolder.of_this_process(), process_start="1"))
    lock, note = RunLock.acquire(run_dir)
    lock.release()
    assert note and note.endswith("(no longer running)")


def test_another_hosts_lock_is_respected_until_it_is_no_longer_refreshed(tmp_path):
    from crate_clip.train.run.run_lock import STALE_AFTER_S, LockHolder, RunLock, RunLockedError

    run_dir, path = tmp_path / "run", tmp_path / "run.lock"
    _write_lock(path, replace(LockHolder.of_this_process(), host="node-b", pid=1))
    with pytest.raises(RunLockedError, match=r"in use by another run: PID 1 on host node-b, started .* refreshed 0 s"):
        RunLock.acquire(run_dir)
    old = time.time() - STALE_AFTER_S - 60
    os.utime(path, (old, old))
    lock, note = RunLock.acquire(run_dir)
    lock.release()
    assert note.startswith(f"run.output_dir {run_dir}: took over the stale lock {path} of PID 1 on host node-b")
    assert "not refreshed for 6" in note and f"more than the {STALE_AFTER_S:.0f} s" in note


HOLDER = """
import os, sys, time
sys.path.insert(0, {repo!r})
import crate_clip.train.run.run_lock as run_lock
run_lock.HEARTBEAT_S = 0.1
lock, _ = run_lock.RunLock.acquire({run_dir!r})
print("held", flush=True)
time.sleep(30)
"""


def test_the_holder_refreshes_its_lock_and_stops_when_it_was_taken_over(tmp_path):
    """A holder stopped for longer than STALE_AFTER_S (here: its lock rewritten by a successor) ends at its next
    heartbeat rather than write beside the new holder."""
    from crate_clip.train.run.run_lock import LockHolder

    run_dir, path = tmp_path / "run", tmp_path / "run.lock"
    proc = subprocess.Popen([sys.executable, "-c", HOLDER.format(repo=str(REPO_ROOT), run_dir=str(run_dir))],
                            env=run_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "held"
        os.utime(path, (0, 0))
        deadline = time.time() + 10
        while path.stat().st_mtime == 0 and time.time() < deadline:
            time.sleep(0.05)
        assert path.stat().st_mtime > time.time() - 60   # refreshed by the heartbeat
        _write_lock(path, LockHolder.of_this_process())   # a successor took it over
        assert proc.wait(timeout=10) == 5
    finally:
        proc.kill()
        proc.wait()
    assert f"the lock {path} of this run was taken over by PID {os.getpid()}" in proc.stderr.read()
