"""The one owner of a run folder's layout (run.output_dir): what a run writes there and where, so a naming change
touches this module only. The trainer writes it, the export, the demo and `--resume` read it.

    <run>/checkpoints/<tag>/   DeepSpeed checkpoints (stage<i>-step<n>), `latest` naming the newest complete one;
                               `.<tag>.saving/` a save in progress, `<tag>.damaged/` a damaged one moved aside
    <run>/metrics.jsonl        one record per logged step;   <run>/results.jsonl   one row per evaluation
    <run>/run_config.yaml      the resolved run config of the first start (never rewritten)
    <run>/run_reads.json       what its path keys name as the run reads them (variables expanded, absolute)
    <run>/config_changes.jsonl the config changes resumes made since (step, key, old, new)
    <run>/tensorboard/         TensorBoard events;   <run>/metrics.csv, results.csv   the csv tracker's tables
    <run>/wandb/, wandb_run_id.txt   Weights & Biases' offline files and the run id a resume continues
    <run>/logs/                DeepSpeed's log of each rank (deepspeed-rank<r>.log)
    <run>/eval_cache/          the evaluations' cache (zero-shot classifiers, linear-probe features)
    <run>/linear_probe.json    the demo's linear probe of the final model
    <run>/training_curve.png   the loss curve at the end
    <run>/export/              the trainer's final export;   <run>/exports/<tag>/  `crate-clip export` of a checkpoint
    <run>.lock                 beside the folder: the lock the run's rank 0 holds
"""
from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Optional

CHECKPOINTS_DIR = "checkpoints"
LATEST_FILE = "latest"              # DeepSpeed's name: the tag of the newest complete checkpoint
METRICS_FILE = "metrics.jsonl"
RESULTS_FILE = "results.jsonl"
PLOT_FILE = "training_curve.png"
RUN_CONFIG_FILE = "run_config.yaml"
# what resumes changed of run_config.yaml (train/checkpointing/config_changes.py)
CONFIG_CHANGES_FILE = "config_changes.jsonl"
# the rows of a config_changes.jsonl whose run_config.yaml was lost, set aside when a resume records a new one
ORPHANED_CHANGES_FILE = "config_changes.orphaned.jsonl"
# the path keys' values as the run reads them (config_changes.py): environment variables expanded, absolute
RUN_READS_FILE = "run_reads.json"
TENSORBOARD_DIR = "tensorboard"
METRICS_CSV = "metrics.csv"         # the csv tracker (train/reporting/trackers.py)
RESULTS_CSV = "results.csv"
WANDB_DIR = "wandb"
WANDB_ID_FILE = "wandb_run_id.txt"
LOG_DIR = "logs"                    # DeepSpeed's per-rank logs (train/reporting/deepspeed_output.py)
EVAL_CACHE_DIR = "eval_cache"       # the stage evaluations' and the demo's cache
DEMO_PROBE_FILE = "linear_probe.json"   # the demo's linear probe of the final model
EXPORT_DIR = "export"               # the final export of a run
EXPORTS_DIR = "exports"             # `crate-clip export` of one checkpoint: exports/<tag>/
LOCK_SUFFIX = ".lock"
# what a run writes into its folder; any of them means the folder already holds a run
RUN_FILES = (CHECKPOINTS_DIR, METRICS_FILE, RESULTS_FILE, RUN_CONFIG_FILE, CONFIG_CHANGES_FILE, EXPORT_DIR,
             TENSORBOARD_DIR)
# everything in its folder a run reads, rewrites or removes (a resume's set-aside rows and torn lines included)
RUN_PARTS = (*RUN_FILES, RUN_READS_FILE, ORPHANED_CHANGES_FILE, METRICS_CSV, RESULTS_CSV, WANDB_DIR, WANDB_ID_FILE,
             LOG_DIR, EVAL_CACHE_DIR, DEMO_PROBE_FILE, PLOT_FILE, EXPORTS_DIR,
             *(f"{stem}.{kind}" for stem in ("metrics", "results")
               for kind in ("superseded.jsonl", "superseded.csv", "torn.txt")))


# What the trainer names its own checkpoints and the staging folders of its saves: rotation and the clean-up of
# interrupted saves touch nothing else in checkpoints/ (a user's `my-backup/`, `.notes/` stay where they are).
_TAG = re.compile(r"^stage(\d+)-step(\d{8,})$")
STAGING_SUFFIX = ".saving"
REPLACED_SUFFIX = ".replaced"
DAMAGED_SUFFIX = ".damaged"       # a checkpoint whose record is damaged, moved aside by the rotation, never deleted


def checkpoint_tag(stage_index: int, step: int) -> str:
    """Tag of the checkpoint after `step` optimizer steps of stage `stage_index` (sorts by time)."""
    return f"stage{stage_index}-step{step:08d}"


def tag_position(name: str) -> Optional[tuple[int, int]]:
    """(stage index, step) of a name the trainer gives its checkpoints; None for any other name."""
    match = _TAG.match(name)
    return (int(match.group(1)), int(match.group(2))) if match else None


def staging_name(tag: str) -> str:
    """The folder a save of `tag` is written into before it is renamed to `tag`."""
    return f".{tag}{STAGING_SUFFIX}"


def is_own_staging(path: Path) -> bool:
    """True for a real folder named as a save's staging folder (`.stage<i>-step<n>.saving`): an interrupted save."""
    path = Path(path)
    name = path.name
    return (name.startswith(".") and name.endswith(STAGING_SUFFIX) and path.is_dir() and not path.is_symlink()
            and tag_position(name[1:-len(STAGING_SUFFIX)]) is not None)


def linked_outside(tag_dir: Path) -> Optional[Path]:
    """Where a checkpoint folder that is a symbolic link points, when that is outside the checkpoints folder holding
    the link and outside its run folder (another run's checkpoint); None for a real folder or a link within."""
    tag_dir = Path(tag_dir)
    if not tag_dir.is_symlink():
        return None
    target, parent = tag_dir.resolve(), tag_dir.parent
    holders = (parent.resolve(), parent.parent.resolve()) if parent.name == CHECKPOINTS_DIR else (parent.resolve(),)
    return None if any(target.is_relative_to(h) and target != h for h in holders) else target


def linked_run_parts(run_dir: Path) -> list[tuple[str, Path]]:
    """(name, target) of each part of `run_dir` a run reads, rewrites or removes (RUN_PARTS) that is a symbolic link
    leading outside the run folder: through it a resume would read, and rotation delete, another run's files. A
    link within the folder, and the run folder itself being a link, are the user's layout and fine."""
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        return []
    root, found = run_dir.resolve(), []
    for name in RUN_PARTS:
        part = run_dir / name
        if not part.is_symlink():
            continue
        try:
            target = part.resolve()
        except (OSError, RuntimeError):   # a loop of links
            target = Path(os.readlink(part))
        if target == root or not target.is_relative_to(root):
            found.append((name, target))
    return found


def rank_state_file(tag_dir: Path, rank: int) -> Path:
    """A checkpoint's per-rank state file (the parts' states of train/loop/parts: stream, RNG, progress, EMA ...)."""
    return Path(tag_dir) / f"train_state_rank{rank:05d}.pt"


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


def eval_cache_dir(run_dir: Path) -> Path:
    """Where a run's evaluations cache their classifiers and features."""
    return Path(run_dir) / EVAL_CACHE_DIR


def export_dir(run_dir: Path) -> Path:
    """Where the trainer writes the run's final export."""
    return Path(run_dir) / EXPORT_DIR


def checkpoint_export_dir(tag_dir: Path, ema: bool = False) -> Path:
    """Where `crate-clip export` writes a checkpoint's export by default: <run>/exports/<tag> (its EMA weights:
    <tag>-ema)."""
    return run_dir_of(tag_dir) / EXPORTS_DIR / (Path(tag_dir).name + ("-ema" if ema else ""))


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
