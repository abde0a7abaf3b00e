"""Preemption under a real Slurm (slurm-wlm on localhost, tests/slurm_cluster.py), with the batch script that
docs/training.md shows (configs/slurm/train.sbatch), in the configuration users run (DataLoader workers on: 1 and 8):
the time limit's early warning (`--signal=B:USR1@120`, sent by slurmctld itself), a plain `scancel`, an external
`scontrol requeue`, and a `scancel` while a remote shard is retried through an outage each save the step in progress
and end the job's trainer with exit code 8; resumed or requeued, the run ends with the weights of an undisturbed run.
A second job on the same run folder is refused with exit code 5, its own; the lock names the Slurm job and its restart
count.

The jobs' trainers are forked from the suite's warm interpreter (warm_python.py) by a `crate-clip` stand-in first on
the job's PATH, which exits with the trainer's code: the job runs the documented script unchanged, without paying
torch's import in every job step. Slurm signals every process of a job step (proctrack/linuxproc: the processes below
slurmstepd); the forked trainer and its DataLoader workers are not below it, so the stand-in passes each signal Slurm
sends it on to all of them, as Slurm would."""
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
from data_fixtures import write_numbered_shards
from processes import status
from remote_servers import HttpServerProcess
from slurm_cluster import slurm_cluster
from train_fixtures import REPO_ROOT, read_jsonl, run_env, run_job, tiny_config, write_config

pytestmark = [pytest.mark.multiproc, pytest.mark.slow]

SCRIPT = REPO_ROOT / "configs" / "slurm" / "train.sbatch"
STEPS = 20
STAGES = [{"name": "low", "image_size": 16, "context_length": 16, "samples": 16 * STEPS, "global_batch": 16,
           "lr": 2e-3, "warmup_steps": 2}]
STREAMS = 8   # data.canonical_streams: the sample order of every run here, whatever its DataLoader workers
SHIM = """#!{python}
# tests/test_slurm_preemption.py: `crate-clip ARGS` forked from the suite's warm interpreter; each signal Slurm sends
# passed on to the trainer and every process below it (its DataLoader workers), as Slurm signals a job step's processes
import os, signal, sys
sys.path.insert(0, {tests!r})
import warm_python
from processes import descendants
warm_python.attach(os.environ["WARM_PYTHON_SOCKET"])
proc = warm_python.Popen([sys.executable, "-m", "crate_clip.cli", *sys.argv[1:]])

def pass_on(signum, frame):
    for pid in [proc.pid, *descendants(proc.pid)]:
        try:
            os.kill(pid, signum)
        except ProcessLookupError:
            pass

for signum in (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT):
    signal.signal(signum, pass_on)
code = proc.wait()
with open(os.environ["WARM_CPU_FILE"], "a") as f:
    f.write(f"{{warm_python.launched_cpu_s()}}\\n")
sys.exit(code if code >= 0 else 128 - code)
"""


def test_the_docs_show_the_submitted_script():
    """docs/training.md shows configs/slurm/train.sbatch as it is (the script these tests submit)."""
    docs = (REPO_ROOT / "docs" / "training.md").read_text()
    assert SCRIPT.read_text().strip() in docs


def _config(root: Path, data: Path, workers: int, source: str | None = None) -> Path:
    cfg = tiny_config(root / "run", data, precision="fp32", stages=STAGES, evals=False,
                      logging={"every_steps": 1, "progress": False, "tensorboard": False, "plot": False})
    cfg["data"].update(num_workers=workers, canonical_streams=STREAMS, sources=[source or str(data / "train")],
                       remote_backoff_base_s=0.5, remote_backoff_max_s=2)
    return write_config(cfg, root / "run.yaml")


@pytest.fixture(scope="module")
def reference(tmp_path_factory, tiny_fmnist):
    """The undisturbed run (one process, its streams read in the trainer, outside Slurm): final weights and losses."""
    root = tmp_path_factory.mktemp("undisturbed")
    done = run_job([sys.executable, "-m", "crate_clip.cli", "train", str(_config(root, tiny_fmnist, 0))], timeout=300)
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


def _submit(cluster, env, tmp_path: Path, config: Path, *extra: str, time_limit: str | None = None) -> str:
    limit = [f"--time={time_limit}"] if time_limit else []
    return cluster.sbatch([f"--output={tmp_path}/job-%j.out", *limit, str(SCRIPT), str(config), *extra], env,
                          REPO_ROOT)


def _loader_workers(pid: int) -> list[int]:
    from processes import children

    return children(pid)


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


def _stopped(run_dir: Path, tmp_path: Path, job: str, signame: str, logged: int | None) -> int:
    """The trainer's one line: stopped by `signame` at the step in progress (`logged`, or the one after it; None:
    any), saved; the lock released. The step saved."""
    out = _output(tmp_path, job)
    saved = _latest_step(run_dir)
    assert (logged is None or saved in (logged, logged + 1)) and _steps(run_dir)[-1] == saved, out
    assert f"stopped by {signame}" in out and f"step{saved:08d}" in out, out
    assert "Traceback" not in out and "killed by signal" not in out and not run_dir.with_suffix(".lock").exists(), out
    return saved


def test_the_time_limit_warning_and_scancel_save_the_step_with_loader_workers_and_the_run_ends_as_undisturbed(
        cluster, job_env, reference, tiny_fmnist, tmp_path):
    run_dir = tmp_path / "run"
    # 1. a time limit of 1 minute: the script's --signal=B:USR1@120 is due at once; slurmctld sends USR1 to the batch
    #    shell (srun), which passes it to the job step. Saved, exit 8, and --requeue (the script's) requeues the job
    config = _config(tmp_path, tiny_fmnist, workers=1)
    job = _submit(cluster, job_env, tmp_path, config, time_limit="1")
    pid, logged = _pause(run_dir, 3, cluster, job)
    holder = json.loads(run_dir.with_suffix(".lock").read_text())
    assert (holder["job"], holder["attempt"]) == (f"slurm:{job}", [0, 0])
    _go_on_once_received(pid, signal.SIGUSR1)   # sent by slurmctld on its own, within its 30-s checks
    record = cluster.wait_state(job, {"PENDING", "COMPLETED", "FAILED"})
    out = _output(tmp_path, job)
    assert record["JobState"] == "PENDING" and record["Restarts"] == "1", out   # requeued by the trainer
    assert "requeueing Slurm job" in out, out
    saved = _stopped(run_dir, tmp_path, job, "SIGUSR1", logged)

    # 2. the requeued attempt, with 8 DataLoader workers (a free change) and time: a plain scancel, SIGTERM to every
    #    process of the job, then SIGKILL after KillWait (30 s). Saved, exit 8; the job is cancelled, not requeued
    _config(tmp_path, tiny_fmnist, workers=8)
    cluster.command("scontrol", "update", f"JobId={job}", "TimeLimit=10")
    cluster.start_now(job)
    pid, logged = _pause(run_dir, saved + 2, cluster, job)
    assert len(status(pid)) and len(_loader_workers(pid)) == 8
    cluster.command("scancel", job)
    _go_on_once_received(pid, signal.SIGTERM)
    cluster.wait_state(job, {"CANCELLED"})
    _wait_for(lambda: _latest_step(run_dir) >= logged and not run_dir.with_suffix(".lock").exists(), "the save")
    saved = _stopped(run_dir, tmp_path, job, "SIGTERM", logged)
    assert "not requeued again" in _output(tmp_path, job)

    # 3. the same script again: resumed, it ends with the weights and the loss of the undisturbed run
    job = _submit(cluster, job_env, tmp_path, config)
    record = cluster.wait_state(job, {"COMPLETED", "FAILED"})
    assert record["ExitCode"] == "0:0", _output(tmp_path, job)
    _same_weights(run_dir, reference)
    assert _losses(run_dir)[STEPS] == _losses(reference)[STEPS]


def test_an_external_requeue_resumes_bit_exactly_and_a_second_job_is_refused_with_5(
        cluster, job_env, reference, tiny_fmnist, tmp_path):
    config = _config(tmp_path, tiny_fmnist, workers=1)
    run_dir, lock = tmp_path / "run", tmp_path / "run.lock"
    job = _submit(cluster, job_env, tmp_path, config)
    pid, logged = _pause(run_dir, 2, cluster, job)   # held while the second job tries the folder
    second = _submit(cluster, job_env, tmp_path, config)   # another job, the same run folder
    record = cluster.wait_state(second, {"COMPLETED", "FAILED"})
    assert record["ExitCode"] == "5:0", _output(tmp_path, second)
    assert "is in use by another run" in _output(tmp_path, second) and f"job slurm:{job}" in _output(tmp_path, second)

    cluster.command("scontrol", "requeue", job)   # SIGTERM to the job's processes; Slurm requeues it
    _go_on_once_received(pid, signal.SIGTERM)
    record = cluster.wait_state(job, {"PENDING"})
    _stopped(run_dir, tmp_path, job, "SIGTERM", logged)
    assert "not requeued again" in _output(tmp_path, job) and record["Restarts"] == "1"
    cluster.start_now(job)
    # the second attempt holds the lock from its start to its end: the job's id and its restart count
    _wait_for(lambda: lock.exists() and json.loads(lock.read_text() or "{}").get("attempt") == [1, 0],
              f"the lock of attempt 2 of job {job}")
    assert json.loads(lock.read_text())["job"] == f"slurm:{job}"
    record = cluster.wait_state(job, {"COMPLETED", "FAILED"})
    assert record["ExitCode"] == "0:0", _output(tmp_path, job)
    _same_weights(run_dir, reference)


def test_scancel_during_a_retried_outage_saves_and_exits_8_before_slurm_kills(
        cluster, job_env, tiny_fmnist, fashion_mnist_dir, tmp_path):
    """Shards of 8 samples (a stream opens new ones every few steps) from an http server that goes away mid-run, retried
    for the default 20 minutes by the loader worker: `scancel` (SIGTERM, then SIGKILL after KillWait, 30 s) ends the
    retry at once; the last completed step is saved."""
    write_numbered_shards(tmp_path / "shards", 96, 8, fashion_mnist_dir)
    server = HttpServerProcess(tmp_path / "shards").start()
    try:
        config = _config(tmp_path, tiny_fmnist, workers=1, source=f"{server.url}/{{00000000..00000011}}.tar")
        run_dir = tmp_path / "run"
        job = _submit(cluster, job_env, tmp_path, config, "--no-requeue")
        _wait_step(run_dir, 1, cluster, job)
        server.stop()
        _wait_for(lambda: "next attempt in" in _output(tmp_path, job), "a retry of the shard")
        cluster.command("scancel", job)
        cluster.wait_state(job, {"CANCELLED"})
        _wait_for(lambda: not run_dir.with_suffix(".lock").exists(), "the trainer's end", timeout=30)
        _stopped(run_dir, tmp_path, job, "SIGTERM", None)
    finally:
        server.stop()
