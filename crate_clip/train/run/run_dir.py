"""A run's output folder holds one run: a second `crate-clip train` into it is refused unless it resumes the
run (--resume) or moves it aside first (--overwrite); the demo starts over the same way. --overwrite moves only
a folder holding a run's own record, and no output folder may be `/`, a home folder, or share files with a data
source or an evaluation set (a run written among the shards would later be moved away with them)."""
from __future__ import annotations

import os
from pathlib import Path
from typing import Optional

from crate_clip.checkpoint_io.checkpoint_record import INFO_FILE
from crate_clip.checkpoint_io.run_layout import (RUN_CONFIG_FILE, RUN_FILES, checkpoints_dir, linked_run_parts,
                                                 tag_position)
from crate_clip.core.errors import EXIT_CONFIG, EXIT_RESUME, ConfigError, UserError


class ExistingRunError(UserError, RuntimeError):
    """run.output_dir already holds a run, and the command neither resumes it nor moves it aside."""
    once_per_job = True   # every rank finds it: rank 0 says it


class LinkedRunPartError(ConfigError):
    """A part of the run folder that the run reads, rewrites or removes is a link leading outside it; exit code 4
    for a resume (its checkpoints would be another run's), 2 for a start."""
    once_per_job = True   # every rank finds it: rank 0 says it

    def __init__(self, message: str, resume: bool = False):
        super().__init__(message)
        self.exit_code = EXIT_RESUME if resume else EXIT_CONFIG

    def __reduce__(self):   # pickled (sent to the other ranks) with its exit code
        return type(self), (str(self), self.exit_code == EXIT_RESUME)


def check_run_links(run_dir: Path, resume: Optional[str]) -> None:
    """Refuse, before anything of the run folder is read or removed, a part of it the run reads, rewrites or
    removes (checkpoints/, logs/, export/, metrics.jsonl, run_config.yaml, ...) that is a symbolic link leading
    outside it: a resume would continue from, and rotation delete, another run's checkpoints."""
    linked = linked_run_parts(run_dir)
    if linked:
        parts = ", ".join(f"{name} is a symbolic link to {target}" for name, target in linked)
        raise LinkedRunPartError(
            f"run.output_dir {run_dir}: {parts}, outside the run folder (a run reads, rewrites and removes its "
            "own files there); fix: replace the link by a folder or file of this run's own (to keep a run on "
            "another disk, set run.output_dir there: the run folder itself may be a link)", bool(resume))


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
    if overwrite:
        problem = overwrite_problem(run_dir)
        if problem:
            raise ExistingRunError(problem)
    else:   # --overwrite moves the folder aside whole, its links as links: nothing is followed
        check_run_links(run_dir, resume)
    found = run_files(run_dir)
    if found and not resume and not overwrite:
        raise ExistingRunError(
            f"run.output_dir {run_dir} already holds a run ({', '.join(found)}); fix: continue it with "
            f"--resume latest, or start over with --overwrite (moves it to {aside_path(run_dir)}), or set "
            "run.output_dir to another folder")
    return found


def move_run_aside(run_dir: Path) -> Path:
    """Rename the run in `run_dir` to aside_path(run_dir), so nothing of it is lost; returns where it went."""
    problem = overwrite_problem(run_dir)   # checked when the config was read; again right before the move
    if problem:
        raise ExistingRunError(problem)
    target = aside_path(run_dir)
    os.rename(run_dir, target)
    return target


def is_run_folder(run_dir: Path) -> bool:
    """Whether `run_dir` holds a run's own record: the run_config.yaml the trainer writes first, or a checkpoint
    (a folder named as the trainer names them) with its crate_clip.json. Folders named like run files
    (`export/`, `checkpoints/` of something else) are not enough."""
    run_dir = Path(run_dir)
    if (run_dir / RUN_CONFIG_FILE).is_file():
        return True
    ckpts = checkpoints_dir(run_dir)
    return ckpts.is_dir() and any(tag_position(tag.name) and (tag / INFO_FILE).is_file() for tag in ckpts.iterdir())


def overwrite_problem(run_dir: Path) -> Optional[str]:
    """Why --overwrite may not move `run_dir` aside (None when it is a run, empty, or absent): it moves a run,
    never a folder of a user's other files."""
    run_dir = Path(run_dir)
    if not run_dir.is_dir() or is_run_folder(run_dir) or not any(run_dir.iterdir()):
        return None
    return (f"run.output_dir: {run_dir} holds files but no run (no {RUN_CONFIG_FILE}, no checkpoint with its "
            f"{INFO_FILE}): --overwrite moves only a run folder; fix: set run.output_dir to a new or empty folder")


def _home_folders() -> set[Path]:
    """The folders a run may never write into as a whole: the user's home, root's, and every /home/<user>."""
    homes = {Path("/"), Path("/root"), Path("/home")}
    if os.environ.get("HOME"):
        homes.add(Path(os.environ["HOME"]).resolve())
    return homes


def _is_home(folder: Path) -> bool:
    return folder in _home_folders() or folder.parent == Path("/home")


def data_folders(sources: list[str], eval_sets: list[Optional[str]]) -> list[tuple[str, Path, bool]]:
    """(what, folder, is_the_data) of each local data source and evaluation set: a folder is the data itself
    (`is_the_data`: no run may lie inside it); a file, or a pattern's shards, are held by their folder."""
    out = []
    for what, path in [*(("data source", s) for s in sources), *(("evaluation set", e) for e in eval_sets if e)]:
        if "://" in path or path.startswith("pipe:"):
            continue   # remote: nothing of the run's folder can be among it
        path = os.path.expandvars(os.path.expanduser(path))
        wildcard = min((i for i in map(path.find, "{*?[") if i >= 0), default=-1)
        if wildcard >= 0:   # the folder above the pattern: /data/{000..009}.tar -> /data
            out.append((what, Path(path[:path.rfind("/", 0, wildcard) + 1] or ".").resolve(), False))
        else:
            is_dir = Path(path).is_dir()
            out.append((what, (Path(path) if is_dir else Path(path).parent).resolve(), is_dir))
    return out


def output_dir_problems(output_dir: str, sources: list[str], eval_sets: list[Optional[str]]) -> list[str]:
    """Why `output_dir` may not hold a run: `/` or a home folder, or a folder that is, holds or (for a folder
    source) lies inside a data source or an evaluation set. One line, keyed run.output_dir."""
    out = Path(os.path.expanduser(output_dir)).resolve()
    if _is_home(out):
        return [f"run.output_dir: {output_dir!r} is {'the root folder' if out == Path('/') else 'a home folder'}; "
                "a run writes (and --overwrite moves) its whole folder; fix: a folder of its own, e.g. runs/NAME"]
    clashes = []
    for what, folder, is_the_data in data_folders(sources, eval_sets):
        if out == folder or folder.is_relative_to(out) or (is_the_data and out.is_relative_to(folder)):
            where = "is" if out == folder else ("holds" if folder.is_relative_to(out) else "lies inside")
            clashes.append(f"{where} the {what} {folder}")
    if not clashes:
        return []
    return [f"run.output_dir: {output_dir!r} {' and '.join(dict.fromkeys(clashes))}; a run writes its files there and "
            "--overwrite would move the data with it; fix: a folder of its own, outside the data, e.g. runs/NAME"]
