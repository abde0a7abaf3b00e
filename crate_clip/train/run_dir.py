"""A run's output folder holds one run: a second `crate-clip train` into it is refused unless it resumes the
run (--resume) or moves it aside first (--overwrite); the demo starts over the same way."""
from __future__ import annotations

import os
from pathlib import Path
from typing import Optional

from crate_clip.checkpoint_io.run_layout import RUN_FILES
from crate_clip.core.errors import UserError


class ExistingRunError(UserError, RuntimeError):
    """run.output_dir already holds a run, and the command neither resumes it nor moves it aside."""


def run_files(run_dir: Path) -> list[str]:
    """The run files present in `run_dir`."""
    return [name for name in RUN_FILES if (Path(run_dir) / name).exists()]


def aside_path(run_dir: Path) -> Path:
    """Where move_run_aside puts the run: `<run_dir>.previous`, else the first free `.previous-N`."""
    run_dir = Path(run_dir)
    candidate, n = run_dir.with_name(run_dir.name + ".previous"), 1
    while candidate.exists():
        n += 1
        candidate = run_dir.with_name(f"{run_dir.name}.previous-{n}")
    return candidate


def check_run_dir(run_dir: Path, resume: Optional[str], overwrite: bool) -> list[str]:
    """The run files already in `run_dir`; raises ExistingRunError when starting there would mix two runs."""
    if resume and overwrite:
        raise ExistingRunError("--resume and --overwrite exclude each other: --resume continues the run in "
                               f"{run_dir}, --overwrite moves it aside and starts over; pass one of them")
    found = run_files(run_dir)
    if found and not resume and not overwrite:
        raise ExistingRunError(
            f"run.output_dir {run_dir} already holds a run ({', '.join(found)}); fix: continue it with "
            f"--resume latest, or start over with --overwrite (moves it to {aside_path(run_dir)}), or set "
            "run.output_dir to another folder")
    return found


def move_run_aside(run_dir: Path) -> Path:
    """Rename the run in `run_dir` to aside_path(run_dir), so nothing of it is lost; returns where it went."""
    target = aside_path(run_dir)
    os.rename(run_dir, target)
    return target
