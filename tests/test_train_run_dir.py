"""Nothing in a run's output folder is lost: a second `crate-clip train` into it is refused (or moves the
earlier run aside), a kill between the two evaluations of a low-resolution stage is finished on resume, a
rejected resume leaves run_config.yaml alone, re-saving a checkpoint keeps the old one until the new one is
complete, a resumed run has one metrics row per step, and resuming in stage 1 does not read model.pretrained.

One process, the tiny model, 4 + 3 steps of batch 8; kills are injected at precise points (run_dir_workers.py).
"""
from __future__ import annotations

import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

import warm_python
from file_snapshots import snapshot
from train_fixtures import REPO_ROOT, read_jsonl, run_env, tiny_config, write_config

pytestmark = [pytest.mark.slow]

WORKERS = Path(__file__).resolve().parent / "run_dir_workers.py"
STAGES = [  # stage 0: 4 steps at 16 px (checkpoints at 2, 4); stage 1: 3 steps at 28 px (checkpoints at 2, 3)
    {"name": "low", "image_size": 16, "context_length": 16, "samples": 32, "global_batch": 8, "lr": 2e-3,
     "warmup_steps": 1},
    {"name": "full", "image_size": 28, "context_length": 16, "samples": 24, "global_batch": 8, "lr": 2e-4,
     "warmup_steps": 1},
]


def _config(run_dir: Path, data: Path, pretrained: Path, stages=STAGES, evals: bool = True) -> dict:
    # fp32: what is tested is the run folder, not the precision (this CPU has no native bf16: 3.5x slower)
    cfg = tiny_config(run_dir, data, precision="fp32", stages=stages, every_steps=2, evals=evals,
                      model={"pretrained": str(pretrained)}, logging={"tensorboard": False, "plot": False})
    cfg["checkpoint"]["keep_last"] = 2
    for e in cfg["eval"]["evals"]:
        e["max_images"] = 50
    return cfg


def _run(*args: str, timeout: int = 900) -> subprocess.CompletedProcess:
    return warm_python.run([sys.executable, *args], env=run_env(), cwd=REPO_ROOT, capture_output=True, text=True,
                          timeout=timeout)


def _train(config: Path, *extra: str) -> subprocess.CompletedProcess:
    return _run("-m", "crate_clip.train.cli", "--config", str(config), *extra)


def _show(proc: subprocess.CompletedProcess) -> str:
    return proc.stdout[-3000:] + proc.stderr[-6000:]


@pytest.fixture(scope="module")
def resumed_run(tmp_path_factory, tiny_fmnist):
    """A run killed between stage 0's two evaluations (16 px recorded, 28 px not), then resumed to the end."""
    import open_clip
    import torch
    from safetensors.torch import save_file

    import crate_clip  # noqa: F401

    root = tmp_path_factory.mktemp("run_dir")
    pretrained = root / "pretrained.safetensors"
    model = open_clip.create_model("CRATE-alpha-CLIPA-tiny")
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(pretrained))
    config = write_config(_config(root / "run", tiny_fmnist, pretrained), root / "run.yaml")
    run_dir = root / "run"

    killed = _run(str(WORKERS), "kill_between_evals", str(config))
    assert killed.returncode == -signal.SIGKILL, _show(killed)
    assert [(r["stage_index"], r["image_size"]) for r in read_jsonl(run_dir / "results.jsonl")] == [(0, 16)]
    assert (run_dir / "checkpoints" / "latest").read_text() == "stage0-step00000004"

    resumed = _train(config, "--resume", "latest")
    assert resumed.returncode == 0, _show(resumed)
    return {"root": root, "run_dir": run_dir, "config": config, "pretrained": pretrained, "log": resumed.stdout}


def test_kill_between_evaluations_is_finished_on_resume(resumed_run):
    results = read_jsonl(resumed_run["run_dir"] / "results.jsonl")
    # each evaluation exactly once: the missing 28 px one of stage 0 was run, the 16 px one not repeated
    # after the low-resolution stage the full size is evaluated twice: grid grown and patch kernel resized
    assert [(r["stage_index"], r["image_size"], r["resize"]) for r in results] == [
        (0, 16, "grid"), (0, 28, "grid"), (0, 28, "patch"), (1, 28, "grid")]
    assert [r["global_step"] for r in results] == [4, 4, 4, 7]
    ckpts = resumed_run["run_dir"] / "checkpoints"
    assert sorted(p.name for p in ckpts.iterdir() if (p / "crate_clip.json").is_file()) == [   # keep_last=2 and
        "stage0-step00000004", "stage1-step00000002", "stage1-step00000003"]   # every finished stage's last one
    assert (resumed_run["run_dir"] / "export" / "open_clip_model.safetensors").is_file()


def test_train_into_a_finished_run_is_refused(resumed_run, capsys):
    from crate_clip.core.errors import EXIT_CONFIG
    from crate_clip.train.cli import main

    run_dir = resumed_run["run_dir"]
    before = snapshot(run_dir)
    for checked in ([], ["--validate"], ["--validate", "--nproc", "2"]):   # --validate says what the launch says
        assert main(["--config", str(resumed_run["config"]), *checked]) == EXIT_CONFIG
        err = capsys.readouterr().err
        assert err.count(f"run.output_dir {run_dir} already holds a run") == 1, err
        assert "--resume latest" in err and "--overwrite" in err
    assert snapshot(run_dir) == before  # nothing written, moved or deleted


def test_rejected_resume_leaves_run_config_alone(resumed_run):
    from crate_clip.train.checkpointing.checkpoints import ResumeError
    from crate_clip.train.stage_setup.engine import DistInfo
    from crate_clip.train.run.run_config import load_run_config
    from crate_clip.train.loop.stage_loop import run_training

    run_dir = resumed_run["run_dir"]
    before = (run_dir / "run_config.yaml").read_bytes()
    cfg = load_run_config(resumed_run["config"], ["run.seed=5", "data.canonical_streams=2"])
    with pytest.raises(ResumeError, match=r"written with data\.canonical_streams=1 .* the run config sets 2"):
        # checked before any collective, so a world of two is safe to claim in this process; the changes named
        # (else refused before, test_train_config_changes), so that the checkpoint's own check is reached
        run_training(cfg, resume="latest", dist=DistInfo(rank=0, world_size=2, local_rank=0, device="cpu"),
                     allow_changes=("run.seed", "data.canonical_streams"))
    assert (run_dir / "run_config.yaml").read_bytes() == before
    assert not (run_dir / "config_changes.jsonl").exists()   # a refused resume records no change
    assert yaml.safe_load(before)["run"]["seed"] == 3


def test_overwrite_moves_the_earlier_run_aside(resumed_run, tiny_fmnist, tmp_path):
    earlier = tmp_path / "run"
    earlier.mkdir()
    for name in ("run_config.yaml", "metrics.jsonl", "results.jsonl"):
        shutil.copy(resumed_run["run_dir"] / name, earlier / name)
    kept = snapshot(earlier)
    one_step = [dict(STAGES[0], samples=8, warmup_steps=0)]
    config = write_config(_config(earlier, tiny_fmnist, resumed_run["pretrained"], stages=one_step, evals=False),
                          tmp_path / "one_step.yaml")
    proc = _train(config, "--overwrite")
    assert proc.returncode == 0, _show(proc)
    previous = tmp_path / "run.previous"
    assert f"moved to {previous}" in proc.stdout
    assert snapshot(previous) == kept  # the earlier run, untouched, beside the new one
    assert [r["step"] for r in read_jsonl(earlier / "metrics.jsonl")] == [1]
    assert not (earlier / "results.jsonl").exists()


def test_resave_mid_stage_1_keeps_the_old_checkpoint_and_one_metrics_row_per_step(resumed_run):
    """Resume in stage 1 from its step-2 checkpoint with model.pretrained now holding weights of no tensor of the
    model (a resumed stage takes every weight from the checkpoint; the file is still well-formed, as the config check
    asks), then die while DeepSpeed writes the step-3 checkpoint a second time."""
    import torch
    from safetensors.torch import save_file

    from crate_clip.train.checkpointing.checkpoints import read_info

    run_dir = resumed_run["run_dir"]
    save_file({"unrelated": torch.zeros(1)}, str(resumed_run["pretrained"]))
    old = run_dir / "checkpoints" / "stage1-step00000003"
    before, info = snapshot(old), read_info(old)
    proc = _run(str(WORKERS), "kill_in_save", str(resumed_run["config"]), "stage1-step00000003",
                str(run_dir / "checkpoints" / "stage1-step00000002"))
    assert proc.returncode == -signal.SIGKILL, _show(proc)
    assert snapshot(old) == before and read_info(old) == info  # the complete old checkpoint is still there
    # `latest` names the checkpoint the run went back to (its line from now on); the cut-short save never moved it
    assert (run_dir / "checkpoints" / "latest").read_text() == "stage1-step00000002"

    rows = read_jsonl(run_dir / "metrics.jsonl")
    keys = [(r["stage_index"], r["step"]) for r in rows]
    assert keys == [(0, 1), (0, 2), (0, 3), (0, 4), (1, 1), (1, 2), (1, 3)]  # step (1, 3) once: the re-run's
    superseded = read_jsonl(run_dir / "metrics.superseded.jsonl")
    assert [(r["stage_index"], r["step"]) for r in superseded] == [(1, 3)]  # the cut-short segment's row, kept
    assert [(r["stage_index"], r["image_size"], r["resize"]) for r in read_jsonl(run_dir / "results.jsonl")] == [
        (0, 16, "grid"), (0, 28, "grid"), (0, 28, "patch")]
