"""Preemption under a real Slurm (slurm-wlm on localhost, tests/slurm_cluster.py), with the batch script that
docs/training.md shows (configs/slurm/train.sbatch): a preemption signal mid-run (Slurm's early warning, SIGUSR1 to
the batch shell; SIGTERM to the job's tasks) saves the step in progress and ends the job with exit code 8, its own;
resumed, or requeued by the trainer itself (--requeue), the run ends with the weights of an undisturbed run. An
external `scontrol requeue` mid-run resumes bit for bit; a second job on the same run folder is refused with exit
code 5, its own; the lock names the Slurm job and its restart count.

The jobs' trainers are forked from the suite's warm interpreter (warm_python.py) by a `crate-clip` stand-in first on
the job's PATH, which passes on the signals Slurm sends it and exits with the trainer's code: the job runs the
documented script unchanged, without paying torch's import in every job step."""
import json
import os
import signal
import stat
import sys
import time
from pathlib import Path

import pytest
from safetensors.torch import load_file

import warm_python
from crate_clip.checkpoint_io.run_layout import lock_path
from processes import status
from slurm_cluster import slurm_cluster
from train_fixtures import REPO_ROOT, read_jsonl, run_env, run_job, tiny_config, write_config

pytestmark = [pytest.mark.multiproc, pytest.mark.slow]

SCRIPT = REPO_ROOT / "configs" / "slurm" / "train.sbatch"
STEPS = 20
STAGES = [{"name": "low", "image_size": 16, "context_length": 16, "samples": 16 * STEPS, "global_batch": 16,
           "lr": 2e-3, "warmup_steps": 2}]
SHIM = """#!{python}
# tests/test_slurm_preemption.py: `crate-clip ARGS` forked from the suite's warm interpreter; Slurm's signals passed on
import os, signal, sys
sys.path.insert(0, {tests!r})
import warm_python
warm_python.attach(os.environ["WARM_PYTHON_SOCKET"])
proc = warm_python.Popen([sys.executable, "-m", "crate_clip.cli", *sys.argv[1:]])
for signum in (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT):
    signal.signal(signum, lambda s, f: os.kill(proc.pid, s))
code = proc.wait()
with open(os.environ["WARM_CPU_FILE"], "a") as f:
    f.write(f"{{warm_python.launched_cpu_s()}}\\n")
sys.exit(code if code >= 0 else 128 - code)
"""


def test_the_docs_show_the_submitted_script():
    """docs/training.md shows configs/slurm/train.sbatch as it is (the script these tests submit)."""
    docs = (REPO_ROOT / "docs" / "training.md").read_text()
    assert SCRIPT.read_text().strip() in docs


def _config(root: Path, data: Path) -> Path:
    cfg = tiny_config(root / "run", data, precision="fp32", stages=STAGES, evals=False,
                      logging={"every_steps": 1, "progress": False, "tensorboard": False, "plot": False})
    cfg["data"]["num_workers"] = 0
    return write_config(cfg, root / "run.yaml")


@pytest.fixture(scope="module")
def reference(tmp_path_factory, tiny_fmnist):
    """The undisturbed run (one process, outside Slurm): its final weights and losses."""
    root = tmp_path_factory.mktemp("undisturbed")
    done = run_job([sys.executable, "-m", "crate_clip.cli", "train", str(_config(root, tiny_fmnist))], timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return root / "run"


@pytest.fixture(scope="module")
def cluster():
    with slurm_cluster() as running:
        yield running


@pytest.fixture
def job_env(tmp_path, cluster):
    """The jobs' environment: the suite's, with the warm `crate-clip` stand-in first on PATH."""
    env = run_env()
    env["PATH"] = f"{Path(sys.executable).parent}:{env.get('PATH', '/usr/bin:/bin')}"
    warm_python.run([sys.executable, "-c", "pass"], env=env)   # the warm interpreter, in the jobs' environment
    if warm_python.socket_path():
        shim = tmp_path / "bin" / "crate-clip"
        shim.parent.mkdir()
        shim.write_text(SHIM.format(python=sys.executable, tests=str(Path(__file__).parent)))
        shim.chmod(shim.stat().st_mode | stat.S_IXUSR)
        env.update(PATH=f"{shim.parent}:{env['PATH']}", WARM_PYTHON_SOCKET=warm_python.socket_path(),
                   WARM_CPU_FILE=str(tmp_path / "warm-cpu"))
    yield env
    cpu = tmp_path / "warm-cpu"
    if cpu.exists():   # the forked trainers' CPU, counted as this test's (cpu_cost.py)
        warm_python.count_launched_cpu(sum(float(x) for x in cpu.read_text().split()))


def _submit(cluster, env, tmp_path: Path, config: Path, *extra: str) -> str:
    return cluster.sbatch([f"--output={tmp_path}/job-%j.out", str(SCRIPT), str(config), *extra], env, REPO_ROOT)


def _steps(run_dir: Path) -> list[int]:
    path = run_dir / "metrics.jsonl"
    return [r["step"] for r in read_jsonl(path)] if path.exists() else []


def _wait_step(run_dir: Path, step: int, cluster, job: str, timeout: float = 240.0) -> int:
    """Until the run has logged `step` (or a later one); returns the last step logged."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        steps = _steps(run_dir)
        if steps and steps[-1] >= step:
            return steps[-1]
        assert cluster.job(job)["JobState"] in ("PENDING", "RUNNING"), _output(run_dir.parent, job)
        time.sleep(0.02)
    raise AssertionError(f"step {step} not reached: {_output(run_dir.parent, job)}")


def _output(folder: Path, job: str) -> str:
    files = list(folder.glob(f"job-{job}.out")) + list(folder.parent.glob(f"*/job-{job}.out"))
    return files[0].read_text()[-4000:] if files else f"(no output of job {job})"


def _pause(run_dir: Path, step: int, cluster, job: str) -> tuple[int, int]:
    """Once the run has logged `step`, stop its trainer (SIGSTOP: the test decides when it goes on, however fast the
    steps are); returns (its PID, from the lock; the last step it logged)."""
    _wait_step(run_dir, step, cluster, job)
    pid = json.loads(lock_path(run_dir).read_text())["pid"]
    os.kill(pid, signal.SIGSTOP)
    _wait_for(lambda: status(pid).get("State", "").startswith("T"), f"trainer {pid} stopped")
    return pid, _steps(run_dir)[-1]


def _go_on_once_received(pid: int, signum: int) -> None:
    """Let the stopped trainer go on once the signal Slurm sent has reached it (pending in /proc: the whole way,
    slurmctld, slurmd, srun, the task, is done)."""
    bit = 1 << (signum - 1)
    _wait_for(lambda: any(int(status(pid).get(k, "0"), 16) & bit for k in ("SigPnd", "ShdPnd")),
              f"signal {signum} pending in trainer {pid}")
    os.kill(pid, signal.SIGCONT)


def _wait_for(condition, what: str, timeout: float = 60.0) -> None:
    deadline = time.time() + timeout
    while not condition():
        assert time.time() < deadline, f"timed out waiting for: {what}"
        time.sleep(0.01)


def _latest_step(run_dir: Path) -> int:
    return int((run_dir / "checkpoints" / "latest").read_text().strip().rsplit("step", 1)[1])


def _same_weights(run_dir: Path, reference: Path) -> None:
    ours, theirs = (load_file(str(d / "export" / "open_clip_model.safetensors")) for d in (run_dir, reference))
    assert ours.keys() == theirs.keys()
    different = [k for k in ours if not ours[k].equal(theirs[k])]
    assert not different, different[:5]


def _losses(run_dir: Path) -> dict:
    return {r["step"]: r["loss"] for r in read_jsonl(run_dir / "metrics.jsonl")}


def test_a_preemption_signal_saves_the_step_exits_8_and_the_run_resumes_to_the_same_weights(
        cluster, job_env, reference, tiny_fmnist, tmp_path):
    config = _config(tmp_path, tiny_fmnist)
    run_dir, lock = tmp_path / "run", tmp_path / "run.lock"
    # 1. Slurm's early warning (--signal=B:USR1@120) goes to the batch shell: srun, which passes it to the rank
    job = _submit(cluster, job_env, tmp_path, config, "--no-requeue")
    pid, logged = _pause(run_dir, 3, cluster, job)
    holder = json.loads(lock.read_text())
    assert (holder["job"], holder["attempt"]) == (f"slurm:{job}", [0, 0])
    cluster.command("scancel", "--signal=USR1", "--batch", job)
    _go_on_once_received(pid, signal.SIGUSR1)
    record = cluster.wait_state(job, {"COMPLETED", "FAILED", "CANCELLED"})
    out = _output(tmp_path, job)
    assert record["ExitCode"] == "8:0", out   # the job's own exit code is the trainer's
    saved = _latest_step(run_dir)
    assert saved in (logged, logged + 1) and _steps(run_dir)[-1] == saved, out   # the step in progress, saved
    assert "stopped by SIGUSR1" in out and f"step{saved:08d}" in out, out
    assert not lock.exists(), out

    # 2. resumed by the same script; SIGTERM (scancel -s TERM, as a preemption sends it) to the job's task: saved,
    #    exit 8, and --requeue (the script's) requeues the job, whose next attempt resumes and finishes
    job = _submit(cluster, job_env, tmp_path, config)
    pid, logged = _pause(run_dir, saved + 2, cluster, job)
    cluster.command("scancel", "--signal=TERM", job)
    _go_on_once_received(pid, signal.SIGTERM)
    record = cluster.wait_state(job, {"PENDING", "COMPLETED", "FAILED"})
    out = _output(tmp_path, job)
    assert record["JobState"] == "PENDING" and record["Restarts"] == "1", out   # requeued by the trainer
    assert "stopped by SIGTERM" in out and "requeueing Slurm job" in out, out
    assert _latest_step(run_dir) in (logged, logged + 1) and not lock.exists(), out
    cluster.start_now(job)
    record = cluster.wait_state(job, {"COMPLETED", "FAILED"})
    assert record["ExitCode"] == "0:0", _output(tmp_path, job)
    _same_weights(run_dir, reference)
    assert _losses(run_dir)[STEPS] == _losses(reference)[STEPS]


def test_an_external_requeue_resumes_bit_exactly_and_a_second_job_is_refused_with_5(
        cluster, job_env, reference, tiny_fmnist, tmp_path):
    config = _config(tmp_path, tiny_fmnist)
    run_dir, lock = tmp_path / "run", tmp_path / "run.lock"
    job = _submit(cluster, job_env, tmp_path, config)
    pid, logged = _pause(run_dir, 2, cluster, job)   # held while the second job tries the folder
    second = _submit(cluster, job_env, tmp_path, config)   # another job, the same run folder
    record = cluster.wait_state(second, {"COMPLETED", "FAILED"})
    assert record["ExitCode"] == "5:0", _output(tmp_path, second)
    assert "is in use by another run" in _output(tmp_path, second) and f"job slurm:{job}" in _output(tmp_path, second)

    cluster.command("scontrol", "requeue", job)   # SIGTERM to the job's tasks; Slurm requeues it
    _go_on_once_received(pid, signal.SIGTERM)
    record = cluster.wait_state(job, {"PENDING"})
    out = _output(tmp_path, job)
    assert _latest_step(run_dir) in (logged, logged + 1) and _steps(run_dir)[-1] == _latest_step(run_dir), out
    assert "stopped by SIGTERM" in out and "not requeued again" in out, out
    assert record["Restarts"] == "1"
    cluster.start_now(job)
    # the second attempt holds the lock from its start to its end: the job's id and its restart count
    _wait_for(lambda: lock.exists() and json.loads(lock.read_text() or "{}").get("attempt") == [1, 0],
              f"the lock of attempt 2 of job {job}")
    assert json.loads(lock.read_text())["job"] == f"slurm:{job}"
    record = cluster.wait_state(job, {"COMPLETED", "FAILED"})
    assert record["ExitCode"] == "0:0", _output(tmp_path, job)
    _same_weights(run_dir, reference)
