"""A killed launcher's workers stop: SIGKILL of the torchrun process of a 2-process run ends both training processes
within seconds (crate_clip/train/run/launcher_watch.py) instead of leaving them to train unsupervised; the last complete
checkpoint is kept, and `--resume latest` continues the run (the run-folder lock was released by the stopping rank 0).
"""
from __future__ import annotations

import os
import signal
import time

import pytest

import warm_python
from processes import children
from train_fixtures import REPO_ROOT, ranks_cmd, read_jsonl, run_env, run_job, tiny_config, torchrun_cmd, write_config

pytestmark = [pytest.mark.multiproc, pytest.mark.slow]

STAGE = {"name": "low", "image_size": 16, "context_length": 16, "samples": 160, "global_batch": 16, "lr": 2e-3,
         "warmup_steps": 1}   # 10 steps, a checkpoint every 2


def test_sigkill_of_the_launcher_stops_its_workers_and_the_run_resumes(tiny_fmnist, tmp_path):
    from crate_clip.train.run.process_info import is_running

    run_dir = tmp_path / "run"
    lock = tmp_path / "run.lock"   # crate_clip.train.run.run_lock.lock_path(run_dir)
    cfg = tiny_config(run_dir, tiny_fmnist, precision="fp32", stages=[STAGE], every_steps=2, evals=False,
                      logging={"tensorboard": False, "plot": False})
    cfg["data"]["num_workers"] = 0   # the loader in the trainer: no worker process to start
    config = write_config(cfg, tmp_path / "run.yaml")
    cmd = torchrun_cmd(2, "--config", str(config), module="crate_clip.train.cli")
    with open(tmp_path / "killed.log", "w") as log:
        launcher = warm_python.Popen(cmd, env=run_env(), cwd=REPO_ROOT, stdout=log, stderr=log,
                                     start_new_session=True)   # the launcher forked warm; its workers fresh
        try:
            deadline = time.time() + 300
            while time.time() < deadline and launcher.poll() is None:
                rows = read_jsonl(run_dir / "metrics.jsonl") if (run_dir / "metrics.jsonl").exists() else []
                if rows and rows[-1]["step"] >= 3:
                    break
                time.sleep(0.05)
            workers = children(launcher.pid)
            assert launcher.poll() is None and len(workers) == 2, (tmp_path / "killed.log").read_text()[-4000:]
            os.kill(launcher.pid, signal.SIGKILL)   # the launcher only: its workers are left to notice
            launcher.wait()
            killed_at = time.time()
            while any(is_running(pid) for pid in workers) and time.time() < killed_at + 30:
                time.sleep(0.05)
            stopped_after = time.time() - killed_at
        finally:
            for pid in workers if "workers" in locals() else []:
                if is_running(pid):
                    os.kill(pid, signal.SIGKILL)
    assert stopped_after < 3, f"workers ran on for {stopped_after:.1f} s after their launcher was killed"
    steps = [r["step"] for r in read_jsonl(run_dir / "metrics.jsonl")]
    assert max(steps) < 10 and not (run_dir / "export").exists()   # they did not train on unsupervised
    assert not lock.exists()   # rank 0 released it on its way out (the parent-death SIGTERM, or the watchdog)
    latest = (run_dir / "checkpoints" / "latest").read_text()
    assert latest in ("stage0-step00000002", "stage0-step00000004", "stage0-step00000006")

    resumed = run_job(ranks_cmd(2, "--config", str(config), "--resume", "latest", module="crate_clip.train.cli"))
    assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-6000:]
    out = resumed.stdout + resumed.stderr
    assert "took over the stale lock" not in out and f"resuming from {run_dir / 'checkpoints' / latest}" in out
    assert [r["step"] for r in read_jsonl(run_dir / "metrics.jsonl")] == list(range(1, 11))
    assert (run_dir / "export" / "open_clip_model.safetensors").is_file() and not lock.exists()
