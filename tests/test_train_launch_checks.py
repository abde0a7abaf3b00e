"""What `crate-clip train` checks before any worker starts (train/run/launch_checks.py), and the folders a run
may not write into (crate_clip/train/run/run_dir.py), each against the real command as a subprocess:

  - `--validate --nproc N`: the config's keys (a warm-up longer than its stage), the batches against N processes,
    data and evaluation sets present, remote sources answering (a real `python -m http.server`, a closed port, a
    `pipe:` command that fails): every problem at once, one line each, exit code 2;
  - `--nproc N` exits with the worker's own code (4 for a resume with nothing to resume), not torchrun's 1;
  - run.output_dir that is, holds or lies inside a data source or an evaluation set, `/`, a home folder, and
    `--overwrite` of a folder that holds no run: one line, exit code 2, every file still where it was;
  - a folder that holds a run (without --resume or --overwrite) or whose lock a live run holds: said once by
    `--validate` and the `--nproc` launcher, before any worker starts.
"""
from __future__ import annotations

import io
import os
import socket
import subprocess
import sys
import tarfile
import threading
import time
from pathlib import Path

import pytest

import warm_python
from crate_clip.train.stage_setup.engine import _free_port
from file_snapshots import snapshot
from processes import running
from train_fixtures import REPO_ROOT, run_env, stand_in_run_env, tiny_config, write_config

STAGE = {"name": "s", "image_size": 16, "context_length": 16, "samples": 64, "global_batch": 8, "lr": 1e-3}


def _write_tar(path: Path) -> None:
    """A real one-sample shard (the config check opens a sample of the shards as tar files)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with tarfile.open(path, "w") as tar:
        for name, data in (("0.txt", b"a caption"), ("0.jpg", b"\xff\xd8 not decoded by the checks")):
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))


def _user_files(root: Path) -> Path:
    """root/data/train (two shards and a user's note), root/data/test (an evaluation set); returns root/data."""
    data = root / "data"
    for i in range(2):
        _write_tar(data / "train" / f"{i:05d}.tar")
    (data / "train" / "notes.txt").write_text("where these shards came from\n")
    (data / "test").mkdir()
    (data / "test" / "0.png").write_bytes(b"an image")
    return data


def _config(root: Path, run_dir, data: Path, **run) -> Path:
    cfg = tiny_config(Path(run_dir), data, precision="fp32", stages=[dict(STAGE)])
    cfg["run"].update(run)
    return write_config(cfg, root / "config.yaml")


def _train(config: Path, *args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return warm_python.run([sys.executable, "-m", "crate_clip.cli", "train", str(config), *args],
                           env=env or run_env(), cwd=REPO_ROOT, capture_output=True, text=True, timeout=300)


def _snapshot(root: Path) -> dict:
    """Everything under `root` but the config (file_snapshots.snapshot)."""
    return {k: v for k, v in snapshot(root).items() if Path(k).name != "config.yaml"}


def _problem_lines(stderr: str) -> list[str]:
    """The refusal's lines: the header `crate-clip train: invalid run config (...):`, then one line per problem (one
    problem: one line under the header)."""
    assert "Traceback" not in stderr and "ChildFailedError" not in stderr, stderr
    lines = [line for line in stderr.splitlines() if line.strip()]
    assert lines[0].startswith("crate-clip train: invalid run config"), stderr
    return lines


@pytest.fixture
def silent_server():
    """A real TCP server that accepts connections and never sends a byte (a stalled shard server)."""
    listener = socket.create_server(("127.0.0.1", 0))
    held, done = [], threading.Event()

    def accept():
        while not done.is_set():
            try:
                held.append(listener.accept()[0])
            except OSError:
                return
    thread = threading.Thread(target=accept, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{listener.getsockname()[1]}"
    done.set()
    listener.close()
    for conn in held:
        conn.close()


@pytest.fixture
def http_server(tmp_path):
    """A real `python -m http.server` serving an empty folder; yields its address."""
    port, served = _free_port(), tmp_path / "served"
    served.mkdir()
    proc = subprocess.Popen([sys.executable, "-m", "http.server", str(port), "--bind", "127.0.0.1"], cwd=served,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        for _ in range(100):
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                time.sleep(0.05)
        yield f"http://127.0.0.1:{port}"
    finally:
        proc.kill()
        proc.wait()


def test_every_problem_before_launch_is_said_at_once(tmp_path, http_server, silent_server):
    """`--nproc 3`: batches, a missing source, a missing evaluation set, a 404, a closed port, a server and a command
    that send nothing (within data.remote_stall_timeout_s) and a failing pipe: command, one line each, before any
    worker starts. `--validate` says the same but runs no pipe: command (it is
    how a config from elsewhere is read before it runs anything)."""
    data = _user_files(tmp_path)
    cfg = tiny_config(tmp_path / "run", data, precision="fp32", stages=[dict(STAGE)])
    closed, ran = _free_port(), tmp_path / "ran"   # nothing listens on `closed`: connection refused
    cfg["data"]["sources"] = [str(data / "train"), str(tmp_path / "no-such-shards"),
                              f"{http_server}/shard-{{00000..00003}}.tar", f"http://127.0.0.1:{closed}/0.tar",
                              f"{silent_server}/0.tar", f"pipe:touch {ran}; exit 3", "pipe:sleep 30.25"]
    cfg["data"]["remote_stall_timeout_s"] = 1
    cfg["eval"]["evals"][0]["data"] = str(tmp_path / "no-such-eval-set")
    config = write_config(cfg, tmp_path / "config.yaml")
    expected = ["stages.0.global_batch: 8 is not divisible by the 3 processes", "data.sources.1: ",
                "eval.evals.0.data: ",
                f"data.sources.2: the first shard '{http_server}/shard-00000.tar' cannot be read: HTTP 404",
                "data.sources.3: the first shard", f"data.sources.4: the first shard '{silent_server}/0.tar' cannot be "
                "read: no byte for 1 s", f"data.sources.5: the first shard 'pipe:touch {ran}; exit 3' cannot be read: "
                "exit code 3", "data.sources.6: the first shard 'pipe:sleep 30.25' cannot be read: no byte for 1 s"]
    before = _snapshot(tmp_path)
    for args, says in ((("--validate", "--nproc", "3"), expected[:-2]), (("--nproc", "3"), expected)):
        proc = _train(config, *args)
        assert proc.returncode == 2, proc.stderr
        lines = _problem_lines(proc.stderr)
        for start in says:
            assert sum(line.strip().startswith(start) for line in lines) == 1, (start, proc.stderr)
        assert len(lines) == 1 + len(says), proc.stderr   # nothing else: data.sources.0 is fine
        assert ran.exists() == ("--validate" not in args), "--validate ran a pipe: command"
    assert "valid (" not in proc.stdout and not (tmp_path / "run").exists()
    assert not running("sleep\x0030.25"), "the probed command was left running"
    assert {k: v for k, v in _snapshot(tmp_path).items() if k != "ran"} == before


def test_keys_and_batches_against_the_processes_come_together(tmp_path):
    data = _user_files(tmp_path)
    config = _config(tmp_path, tmp_path / "run", data)
    proc = _train(config, "--validate", "--nproc", "3", "--set", "stages.0.warmup_steps=8")
    assert proc.returncode == 2, proc.stderr
    lines = _problem_lines(proc.stderr)
    assert [line.strip().split(":")[0] for line in lines[1:]] == ["stages.0.warmup_steps", "stages.0.global_batch"]
    assert "but the stage has 8 steps" in lines[1]


@pytest.mark.multiproc
def test_launched_workers_exit_code_is_the_trainers_own(tmp_path, request):
    """torchrun says 1 for any failed worker; `crate-clip train --nproc` says the worker's code (4: nothing to
    resume) with the worker's one line and no ChildFailedError block."""
    data = _user_files(tmp_path)
    config = _config(tmp_path, tmp_path / "run", data)
    proc = _train(config, "--nproc", "1", "--resume", "latest", env=stand_in_run_env(request))
    assert proc.returncode == 4, proc.stderr
    assert "ChildFailedError" not in proc.stderr and "Traceback" not in proc.stderr, proc.stderr
    assert "crate-clip train: --resume latest" in proc.stderr, proc.stderr


def _user_home(tmp_path: Path) -> tuple[Path, dict]:
    """A home folder holding a user's document, and the environment that makes it $HOME."""
    home = tmp_path / "home"
    (home / "Documents").mkdir(parents=True)
    (home / "Documents" / "thesis.tex").write_text("chapter 1\n")
    return home, {"HOME": str(home)}


# (the output folder, as a function of (tmp_path, data folder), what the line says, extra args)
OUTPUT_DIRS = {
    "is the data source": (lambda root, data: data / "train", "is the data source", ()),
    "is the data source, --overwrite": (lambda root, data: data / "train", "is the data source", ("--overwrite",)),
    "holds the data": (lambda root, data: data, "holds the data source", ()),
    "inside the data source": (lambda root, data: data / "train" / "run", "lies inside the data source", ()),
    "is the evaluation set": (lambda root, data: data / "test", "is the evaluation set", ("--validate",)),
    "root": (lambda root, data: Path("/"), "is the root folder", ("--validate",)),
    "home": (lambda root, data: root / "home", "is a home folder", ("--overwrite",)),
}


@pytest.mark.parametrize("case", list(OUTPUT_DIRS))
def test_an_output_dir_among_the_data_or_a_home_is_refused(tmp_path, case):
    make, says, args = OUTPUT_DIRS[case]
    data = _user_files(tmp_path)
    _, env = _user_home(tmp_path)
    config = _config(tmp_path, make(tmp_path, data), data)
    before = _snapshot(tmp_path)
    proc = _train(config, *args, env={**run_env(), **env})
    assert proc.returncode == 2, proc.stderr
    lines = _problem_lines(proc.stderr)
    assert len(lines) == 2 and lines[1].strip().startswith("run.output_dir: ") and says in lines[1], proc.stderr
    after = _snapshot(tmp_path)   # libraries' caches under the home (matplotlib's font list) are no user file
    assert before.items() <= after.items() and all(name.startswith("home/.") for name in after.keys() - before.keys())
    assert not list(tmp_path.rglob("*.previous*")), "a user folder was moved"


def test_overwrite_moves_only_a_run_folder(tmp_path):
    """A user's folder holding `export/` (a name the trainer writes) and Documents/ is not a run: --overwrite is
    refused, with --validate too; a folder holding a run's record is accepted."""
    data = _user_files(tmp_path)
    folder = tmp_path / "mine"
    (folder / "export").mkdir(parents=True)
    (folder / "export" / "model.bin").write_bytes(b"weights")
    (folder / "Documents").mkdir()
    (folder / "Documents" / "notes.txt").write_text("keep me\n")
    config = _config(tmp_path, folder, data)
    before = _snapshot(tmp_path)
    for args in (("--overwrite",), ("--overwrite", "--validate")):
        proc = _train(config, *args)
        assert proc.returncode == 2, proc.stderr
        lines = _problem_lines(proc.stderr)
        assert len(lines) == 2 and "holds files but no run" in lines[1] and "--overwrite moves only a run folder" \
            in lines[1], proc.stderr
    assert _snapshot(tmp_path) == before and not list(tmp_path.rglob("*.previous*"))
    (folder / "run_config.yaml").write_text("run: {}\n")   # the record the trainer writes first
    proc = _train(config, "--overwrite", "--validate")
    assert proc.returncode == 0 and "valid (" in proc.stdout, proc.stderr


def test_a_folder_holding_a_run_or_held_by_a_live_run_is_refused_before_any_worker_starts(tmp_path, capsys):
    """What the workers would refuse about the output folder, `--validate` and the `--nproc` launcher say first,
    once (the launch used to start both workers, which each printed the refusal): a run already there (its
    run_config.yaml, the record a trainer writes first) without --resume or --overwrite, exit code 2; a live run's
    lock, exit code 5. Nothing is written. In-process: a refusal starts no process."""
    from crate_clip.train.cli import main
    from crate_clip.train.run.run_lock import RunLock

    data = _user_files(tmp_path)
    folder = tmp_path / "run"
    folder.mkdir()
    (folder / "run_config.yaml").write_text("run: {}\n")
    config = _config(tmp_path, folder, data)
    before = _snapshot(tmp_path)
    for args in (["--validate"], ["--validate", "--nproc", "2"], ["--nproc", "2"]):
        assert main([str(config), *args]) == 2, args
        err = capsys.readouterr().err
        assert err.count("already holds a run") == 1 and len(_problem_lines(err)) == 2, (args, err)
        assert f"run.output_dir {folder} already holds a run (run_config.yaml); fix: continue it with --resume " \
               "latest, or start over with --overwrite" in err
    assert main([str(config), "--validate", "--overwrite"]) == 0 and "valid (" in capsys.readouterr().out
    lock, _ = RunLock.acquire(folder)   # this process: a live run of this host
    try:
        for args in (["--validate", "--resume", "latest"], ["--validate", "--overwrite", "--take-over-lock"]):
            assert main([str(config), *args]) == 5, args
            (line,) = capsys.readouterr().err.strip().splitlines()
            assert line.startswith(f"crate-clip train: run.output_dir {folder} is in use by another run: PID "
                                   f"{os.getpid()} on this host"), line
    finally:
        lock.release()
    assert _snapshot(tmp_path) == before
    # --validate --resume of nothing to resume: the run's own refusal, exit 4 (a launch leaves it to its workers)
    (tmp_path / "new").mkdir()
    fresh, empty = _config(tmp_path / "new", tmp_path / "new" / "run", data), tmp_path / "new" / "run"
    for resume, said in (("latest", f"--resume latest: no complete checkpoint in {empty / 'checkpoints'}"),
                         (str(tmp_path / "nothing"), f"--resume {tmp_path / 'nothing'}: not a complete checkpoint")):
        assert main([str(fresh), "--validate", "--resume", resume]) == 4, resume
        (line,) = capsys.readouterr().err.strip().splitlines()
        assert line.startswith(f"crate-clip train: {said}"), line
    assert not empty.exists()


def _demo(*args: str) -> subprocess.CompletedProcess:
    return warm_python.run([sys.executable, "-m", "crate_clip.cli", "demo", *args], env=run_env(), cwd=REPO_ROOT,
                           capture_output=True, text=True, timeout=300)


def test_the_demo_checks_before_writing_data_or_starting_processes(tmp_path):
    """The demo's batch of 64 over 3 processes, and a --run-dir of a user's files it would have to move aside
    (--overwrite: the demo starts over): refused before any data is written or process started, exit code 2."""
    proc = _demo("--data-dir", str(tmp_path / "data"), "--run-dir", str(tmp_path / "run"), "--nproc", "3")
    assert proc.returncode == 2, proc.stderr
    lines = [line.strip() for line in proc.stderr.splitlines() if line.strip()]
    assert lines[1:] == [f"stages.{i}.global_batch: 64 is not divisible by the 3 processes; fix: use a multiple of 3"
                         for i in (0, 1)], proc.stderr
    mine = tmp_path / "mine"
    (mine / "Documents").mkdir(parents=True)
    (mine / "Documents" / "notes.txt").write_text("keep me\n")
    proc = _demo("--data-dir", str(tmp_path / "data"), "--run-dir", str(mine), "--nproc", "2")
    assert proc.returncode == 2 and len(proc.stderr.strip().splitlines()) == 2, proc.stderr
    assert "holds files but no run" in proc.stderr, proc.stderr
    assert not (tmp_path / "data").exists() and not (tmp_path / "run").exists() and "torch" not in proc.stdout
    assert (mine / "Documents" / "notes.txt").read_text() == "keep me\n" and not list(tmp_path.glob("*.previous*"))


@pytest.mark.multiproc
@pytest.mark.slow
def test_save_signals_to_the_launcher_as_it_starts_reach_its_worker_which_saves_and_the_launcher_exits_8(
        tmp_path, tiny_fmnist):
    """SIGUSR1, then SIGTERM, to `crate-clip train --nproc 1` (not to the worker) as soon as it has read its command
    line, before its worker exists: torchrun would die of USR1 (exit 138) and a worker still importing torch would die
    of either; the launcher holds them and passes them on once the worker has started, which handles them as soon as
    its handlers are in place: it trains its first step, saves it and both exit 8 (worker_launch.py)."""
    import signal

    from processes import status
    from train_fixtures import read_jsonl

    stage = dict(STAGE, samples=8 * 200, warmup_steps=1)
    cfg = tiny_config(tmp_path / "run", tiny_fmnist, precision="fp32", stages=[stage], evals=False,
                      logging={"every_steps": 1, "progress": False, "tensorboard": False, "plot": False})
    config = write_config(cfg, tmp_path / "config.yaml")
    metrics = tmp_path / "run" / "metrics.jsonl"
    blocked = (1 << (signal.SIGUSR1 - 1)) | (1 << (signal.SIGTERM - 1))
    with warm_python.Popen([sys.executable, "-m", "crate_clip.cli", "train", str(config), "--nproc", "1"],
                           env=run_env(), cwd=REPO_ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                           text=True) as proc:
        deadline = time.monotonic() + 60
        while int(status(proc.pid).get("SigBlk", "0"), 16) & blocked != blocked:   # its command line is read
            assert proc.poll() is None and time.monotonic() < deadline, "the launcher never held its save signals"
            time.sleep(0.005)
        proc.send_signal(signal.SIGUSR1)
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=180)
    assert proc.returncode == 8, err[-3000:]
    lines = [line for line in err.splitlines() if line.startswith("crate-clip train:")]
    assert len(lines) == 1 and lines[0].startswith("crate-clip train: stopped by SIGUSR1"), err[-3000:]
    steps = [r["step"] for r in read_jsonl(metrics)]
    latest = (tmp_path / "run" / "checkpoints" / "latest").read_text().strip()
    assert steps == [1] and latest == "stage0-step00000001", (latest, steps)
    assert not (tmp_path / "run.lock").exists()
