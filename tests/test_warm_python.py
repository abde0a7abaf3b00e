"""The suite's warm interpreter (warm_python.py) runs a command as a fresh `python` would: its arguments, folder,
environment, outputs, exit code (also from an exception, sys.exit("text") or a signal), its own PID, a timeout; and
it leaves to a fresh interpreter what it cannot run the same way."""
from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest

import warm_python
from train_fixtures import REPO_ROOT, run_env

SAYS = ("import os, sys; print(sys.argv, os.getcwd(), os.environ.get('WARM_TEST'), os.getpid()); "
        "print('to stderr', file=sys.stderr)")


def _warm(code: str, *args: str, **kwargs) -> subprocess.CompletedProcess:
    return warm_python.run([sys.executable, "-c", code, *args], env=kwargs.pop("env", run_env()), cwd=kwargs.pop(
        "cwd", REPO_ROOT), capture_output=True, text=True, timeout=kwargs.pop("timeout", 120), **kwargs)


def test_a_command_gets_its_arguments_folder_environment_and_outputs(tmp_path):
    done = _warm(SAYS, "a", "b c", env=dict(run_env(), WARM_TEST="yes"), cwd=tmp_path)
    argv, folder, var, pid = done.stdout.rsplit(" ", 3)
    assert (argv, folder, var) == ("['-c', 'a', 'b c']", str(tmp_path), "yes") and done.returncode == 0
    assert done.stderr == "to stderr\n" and int(pid) != os.getpid()


def test_exit_codes_are_a_fresh_interpreters():
    assert _warm("import sys; sys.exit(3)").returncode == 3
    failed = _warm("raise KeyError('x')")
    assert failed.returncode == 1 and failed.stderr.rstrip().endswith("KeyError: 'x'")
    said = _warm("import sys; sys.exit('a message')")
    assert said.returncode == 1 and said.stderr == "a message\n"
    assert _warm("import os, signal; os.kill(os.getpid(), signal.SIGKILL)").returncode == -signal.SIGKILL


def test_the_pid_is_the_commands_own_and_a_timeout_ends_it():
    proc = warm_python.Popen([sys.executable, "-c", "import os, time; print(os.getpid(), flush=True); time.sleep(60)"],
                             env=run_env(), cwd=REPO_ROOT, stdout=subprocess.PIPE, text=True)
    assert isinstance(proc, warm_python.WarmProcess) and int(proc.stdout.readline()) == proc.pid
    with pytest.raises(subprocess.TimeoutExpired):
        proc.wait(timeout=0.2)
    os.kill(proc.pid, signal.SIGTERM)
    assert proc.wait(timeout=60) == -signal.SIGTERM
    with pytest.raises(subprocess.TimeoutExpired):
        _warm("import time; time.sleep(60)", timeout=1)


def test_what_it_cannot_run_alike_runs_in_a_fresh_interpreter():
    env = run_env()
    cases = {"interpreter option": ([sys.executable, "-X", "importtime", "-c", "pass"], env),
             "load-time variable": ([sys.executable, "-c", "pass"], dict(env, MALLOC_ARENA_MAX="2")),
             "another program": (["true"], env)}
    for what, (cmd, cmd_env) in cases.items():
        proc = warm_python.Popen(cmd, env=cmd_env, cwd=REPO_ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        assert isinstance(proc, subprocess.Popen) and proc.wait(timeout=120) == 0, what
