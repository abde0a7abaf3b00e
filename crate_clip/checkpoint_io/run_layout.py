"""The one owner of a run folder's layout (run.output_dir): what a run writes there and where, so a naming change
touches this module only. The trainer writes it, the export, the demo and `--resume` read it.

    <run>/checkpoints/<tag>/   DeepSpeed checkpoints (stage<i>-step<n>), `latest` naming the newest complete one
    <run>/metrics.jsonl        one record per logged step;   <run>/results.jsonl   one row per evaluation
    <run>/run_config.yaml      the resolved run config;      <run>/tensorboard/    TensorBoard events
    <run>/training_curve.png   the loss curve at the end
    <run>/export/              the trainer's final export;   <run>/exports/<tag>/  `crate-clip export` of a checkpoint
    <run>.lock                 beside the folder: the lock the run's rank 0 holds
"""
from __future__ import annotations

import json
from pathlib import Path

CHECKPOINTS_DIR = "checkpoints"
LATEST_FILE = "latest"              # DeepSpeed's name: the tag of the newest complete checkpoint
METRICS_FILE = "metrics.jsonl"
RESULTS_FILE = "results.jsonl"
PLOT_FILE = "training_curve.png"
RUN_CONFIG_FILE = "run_config.yaml"
TENSORBOARD_DIR = "tensorboard"
EXPORT_DIR = "export"               # the final export of a run
EXPORTS_DIR = "exports"             # `crate-clip export` of one checkpoint: exports/<tag>/
LOCK_SUFFIX = ".lock"
# what a run writes into its folder; any of them means the folder already holds a run
RUN_FILES = (CHECKPOINTS_DIR, METRICS_FILE, RESULTS_FILE, RUN_CONFIG_FILE, EXPORT_DIR, TENSORBOARD_DIR)


def checkpoints_dir(run_dir: Path) -> Path:
    """The run's checkpoints folder."""
    return Path(run_dir) / CHECKPOINTS_DIR


def checkpoints_in(path: Path) -> Path:
    """The checkpoints folder a user's path names: a run folder's checkpoints/ when it has one, else the path."""
    path = Path(path)
    return checkpoints_dir(path) if checkpoints_dir(path).is_dir() else path


def run_dir_of(tag_dir: Path) -> Path:
    """The run folder a checkpoint (tag folder) belongs to."""
    return Path(tag_dir).parent.parent


def export_dir(run_dir: Path) -> Path:
    """Where the trainer writes the run's final export."""
    return Path(run_dir) / EXPORT_DIR


def checkpoint_export_dir(tag_dir: Path) -> Path:
    """Where `crate-clip export` writes a checkpoint's export by default: <run>/exports/<tag>."""
    return run_dir_of(tag_dir) / EXPORTS_DIR / Path(tag_dir).name


def lock_path(run_dir: Path) -> Path:
    """The lock file of a run folder: `<run_dir>.lock`, beside it (inside, a move aside would carry it along)."""
    run_dir = Path(run_dir).absolute()
    return run_dir.with_name(run_dir.name + LOCK_SUFFIX)


def read_jsonl(path: Path) -> list[dict]:
    """Records of a JSONL file of the run (metrics.jsonl, results.jsonl): [] if missing; a torn last line from a
    killed run is ignored."""
    path = Path(path)
    if not path.is_file():
        return []
    out = []
    for line in path.read_text().splitlines():
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return out
