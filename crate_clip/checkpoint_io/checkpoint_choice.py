"""Which checkpoint is meant: the one decision behind train --resume (and --resume auto), the config-change check of
a resume, plan --resume, export (--stage N), eval and inspect (--model / --pretrained naming a checkpoint) and the
consolidation of a checkpoint folder. choose_checkpoint(named, use) answers with a CheckpointChoice: the tag folder,
how it was named, whether it is complete. Listing the checkpoints and their lineage is checkpoint_record.py's.

The forms each use accepts ("folder": a checkpoints folder, or a run folder standing for its checkpoints/):

    form                                      RESUME    PLAN    EXPORT    EVAL
    `latest` (the run's own checkpoints)      yes       -       -         -
    `auto` (latest, else a fresh start)       yes       -       -         -
    a tag folder (complete crate_clip.json)   yes       yes     yes       yes
    a tag folder of DeepSpeed files only      -         -       -         yes (a checkpoint from elsewhere)
    a checkpoints folder                      yes       yes     yes       yes
    a run folder                              yes (*)   yes     yes       - (eval names the fix)
    a stage's final checkpoint (--stage N)    -         -       yes       -
    a checkpoints folder and a tag            -         -       -         yes (consolidation)

How a folder's checkpoint is picked (the reading of `latest`):
    RESUME, PLAN   the checkpoint `latest` names when complete, else the one saved last (a missing, garbled or
                   stale `latest` too): a resume after a crash must go on unattended (latest_complete_tag)
    EXPORT         `latest` must exist and name a complete checkpoint, else refused naming the complete ones: an
                   export is of what the user named, never of an older checkpoint taken silently
    EVAL           the tag `latest` names (DeepSpeed's files suffice: a checkpoint from elsewhere has no
                   crate_clip.json), else the newest complete one; an unreadable `latest` (a FIFO, too large) is
                   refused; a folder without `latest` is taken as one tag folder
Links: RESUME and PLAN refuse a tag folder that links outside its run folder; EXPORT also a checkpoints folder that
does (another run's weights would be filed under this run). The config-change check reads the RESUME choice and
takes "none" for any refusal (the resume's own check says why).

Where the six functions this replaces disagreed, and what is chosen here:
  (*) a run folder: `--resume RUN` was refused ("not a complete checkpoint"), while plan --resume, the config-change
      check of the same --resume and export took its checkpoints/: RESUME takes it too, so plan and the config check
      judge the checkpoint the resume loads.
  - plan --resume did not refuse a checkpoint linked from another run, which train --resume refuses: PLAN refuses it
    too (plan says what train would do).
  - the config-change check read `latest`/`auto` from the run folder's checkpoints/ or, lacking one, the run folder
    itself; the resume reads only checkpoints/: both read checkpoints/ now.
  - a folder holding both a complete crate_clip.json and a `latest` file was a checkpoints folder for a resume and a
    tag folder for export: a complete record makes a tag folder for every use.
  - the reading of `latest` (above) and the links refused stay different by use: each is what its command
    documents and tests (tests/test_export_source_latest.py, test_checkpoint_rotation.py, test_cli_errors.py).
Every refusal is one line in the caller's error class (its exit code), worded as before. What stays outside is not
a choice of checkpoint: `--resume auto` in a folder without one is a fresh start, unless the folder holds a finished
run's export or results (elastic_resume.resolve_auto refuses it, ExistingRunError).
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from crate_clip.checkpoint_io.bounded_reads import UnreadableRecordError
from crate_clip.checkpoint_io.checkpoint_record import (INFO_FILE, INFO_MISSING, complete_tags_in, latest_complete_tag,
                                                        latest_problem, newest_complete_tag, read_info,
                                                        read_info_checked, read_latest_tag, stage_final_tag)
from crate_clip.checkpoint_io.run_layout import CHECKPOINTS_DIR, LATEST_FILE, checkpoints_in, linked_outside
from crate_clip.core.file_kinds import special_file

RESUME, PLAN, EXPORT, EVAL = "resume", "plan", "export", "eval"   # the uses (table above)
LATEST, AUTO = "latest", "auto"                                   # the words a resume may name
# how a choice was named (CheckpointChoice.named_by)
BY_LATEST, BY_AUTO, BY_TAG, BY_FOLDER, BY_STAGE = "latest", "auto", "tag", "folder", "stage"


@dataclass(frozen=True)
class CheckpointChoice:
    """The checkpoint a user's words name."""
    tag_dir: Optional[Path]   # None: `auto` in a run without a complete checkpoint (a fresh start in place)
    named_by: str             # BY_LATEST, BY_AUTO, BY_TAG (the folder itself), BY_FOLDER (its `latest`), BY_STAGE
    complete: bool            # its crate_clip.json is present and well formed

    @classmethod
    def of(cls, tag_dir: Optional[Path], named_by: str) -> "CheckpointChoice":
        return cls(tag_dir, named_by, tag_dir is not None and read_info(tag_dir) is not None)


def choose_checkpoint(named: str | Path, use: str, *, run_checkpoints: Optional[Path] = None,
                      stage: Optional[int] = None, tag: Optional[str] = None,
                      error: type[Exception] = ValueError) -> CheckpointChoice:
    """The checkpoint `named` names for `use` (RESUME, PLAN, EXPORT, EVAL: the table above). `run_checkpoints`: the
    run's own checkpoints folder, which `latest` and `auto` name (RESUME); `stage`: that stage's final checkpoint
    (EXPORT); `tag`: that tag folder of the checkpoints folder `named` (EVAL). Raises `error` (one line) when it
    names none; EVAL raises FileNotFoundError / UnreadableRecordError as the consolidation always did."""
    if use == EVAL:
        return _for_eval(Path(named), tag)
    if use == RESUME and str(named) in (LATEST, AUTO) and run_checkpoints is not None:
        return _latest_of_run(Path(run_checkpoints), str(named), error)
    path = Path(named)
    if use == EXPORT:
        return _for_export(path, stage, error)
    return _for_resume(path, str(named), use, error)


def _latest_of_run(root: Path, word: str, error: type[Exception]) -> CheckpointChoice:
    """`latest`: the newest complete checkpoint of the run (refused when there is none); `auto`: the same, or no
    checkpoint (a fresh start)."""
    found = latest_complete_tag(root)
    if found is None:
        if word == AUTO:
            return CheckpointChoice(None, BY_AUTO, False)
        raise error(f"--resume latest: no complete checkpoint in {root}; fix: start without --resume (with "
                    "--overwrite if the folder holds the files of a run cut short before its first checkpoint: they "
                    "are moved aside)")
    _resume_not_linked_outside(root / found, LATEST, error)   # worded as for `latest`, which `auto` resumes
    return CheckpointChoice(root / found, BY_AUTO if word == AUTO else BY_LATEST, True)


# ------------------------------------------------------------------------------------------------ RESUME, PLAN
def _for_resume(path: Path, named: str, use: str, error: type[Exception]) -> CheckpointChoice:
    """A tag folder, a checkpoints folder or a run folder (its checkpoints/) for train --resume or plan --resume."""
    if read_info(path) is None:
        path = checkpoints_in(path)   # a run folder: its checkpoints/
    if read_info(path) is None and _holds_checkpoints(path, use):
        found = latest_complete_tag(path)
        if found is None:
            raise error(_no_checkpoint_in(path, use))
        _resume_not_linked_outside(path / found, named, error)
        return CheckpointChoice(path / found, BY_FOLDER, True)
    info, why = read_info_checked(path)
    if info is None:
        if use == PLAN:
            raise error(_no_checkpoint_in(path, use))
        what = (f"its {INFO_FILE} {why}: damaged" if why != INFO_MISSING else
                f"no {INFO_FILE}: missing or an interrupted save")
        raise error(f"--resume {named}: not a complete checkpoint ({what}); fix: pass a checkpoint folder or 'latest'")
    _resume_not_linked_outside(path, named, error)
    return CheckpointChoice(path, BY_TAG, True)


def _holds_checkpoints(path: Path, use: str) -> bool:
    """Whether `path` (not itself a complete checkpoint) is read as a checkpoints folder: for a resume, one with a
    `latest` file or a complete checkpoint in it (else it is a tag folder, refused saying why); plan takes any."""
    if use == PLAN or (path / LATEST_FILE).is_file():
        return True
    return path.is_dir() and any(read_info(p) for p in path.iterdir() if p.is_dir())


def _no_checkpoint_in(path: Path, use: str) -> str:
    if use == PLAN:
        return (f"{path}: no complete checkpoint ({INFO_FILE}) there; fix: pass a run folder, its checkpoints folder "
                "or one checkpoint folder")
    return (f"--resume latest: no complete checkpoint in {path}; fix: start without --resume (with --overwrite if "
            "the folder holds the files of a run cut short before its first checkpoint: they are moved aside)")


def _resume_not_linked_outside(tag_dir: Path, named: str, error: type[Exception]) -> None:
    """`error` when `tag_dir` is a link leaving its checkpoints and run folder: a resume from it would continue
    another run's checkpoint under this run's name without a word."""
    target = linked_outside(tag_dir)
    if target is not None:
        raise error(f"--resume {named}: {tag_dir} is a symbolic link to {target}, outside its run folder (another "
                    f"run's checkpoint); fix: remove the link, or pass --resume {target} to continue from that "
                    "checkpoint knowingly")


# ------------------------------------------------------------------------------------------------ EXPORT
def _for_export(path: Path, stage: Optional[int], error: type[Exception]) -> CheckpointChoice:
    """A run folder or its checkpoints/ folder (the checkpoint `latest` names), one tag folder, or with `stage`
    that stage's last checkpoint on the line of the latest one."""
    if not path.is_dir():   # a FIFO or a device is said to be one, not to be missing
        what = f"{special_file(path) or 'a file'}, not a folder" if os.path.exists(path) else "no such folder"
        raise error(f"{path}: {what} (a run folder, its checkpoints/ folder, or one checkpoint folder is exported)")
    is_tag = read_info(path) is not None
    root = path.parent if is_tag else checkpoints_in(path)
    if not is_tag:
        _checkpoints_not_linked_outside(root, error)
    if stage is not None:
        found = stage_final_tag(root, stage)
        if found is None:
            raise error(f"{root}: no complete final checkpoint of stage {stage} on the line of its latest checkpoint "
                        f"({latest_complete_tag(root) or 'none'}: the run has not finished the stage since it "
                        f"resumed, or it was pruned); complete checkpoints: {complete_tags_in(root) or 'none'}")
        return _export_not_linked_outside(CheckpointChoice(root / found, BY_STAGE, True), error)
    if is_tag:
        return _export_not_linked_outside(CheckpointChoice(path, BY_TAG, True), error)
    if os.path.lexists(root / LATEST_FILE):   # a link to nothing is a broken `latest`, said so below
        # bounded and checked like a resume's read: a FIFO, a huge file or a tag naming a path outside the
        # checkpoints folder ("../x") is refused, not followed
        found = read_latest_tag(root)
        if found is None:
            why = latest_problem(root) or "not one checkpoint folder's name"
            raise error(f"{root / LATEST_FILE}: {why}; pass one of "
                        f"{complete_tags_in(root) or 'the checkpoint folders'} instead")
        if read_info(root / found) is None:
            raise error(f"{root / LATEST_FILE} names {found!r}, which is not a complete checkpoint; "
                        f"pass one of {complete_tags_in(root) or 'the checkpoint folders'} instead")
        return _export_not_linked_outside(CheckpointChoice(root / found, BY_FOLDER, True), error)
    raise error(f"{path}: not a checkpoint (no {INFO_FILE}) and no {LATEST_FILE} file; pass a run folder, "
                f"its checkpoints/ folder or one of {complete_tags_in(root) or 'its checkpoint folders'}")


def _checkpoints_not_linked_outside(root: Path, error: type[Exception]) -> None:
    """`error` when the checkpoints folder `root` is a symbolic link leaving its run folder (another run's
    checkpoints): exporting through it would file that run's weights under this one."""
    target = linked_outside(root) if root.name == CHECKPOINTS_DIR else None
    if target is not None:
        raise error(f"{root}: a symbolic link to {target}, outside its run folder (another run's checkpoints); fix: "
                    f"export {target} itself, or replace the link by the run's own folder")


def _export_not_linked_outside(choice: CheckpointChoice, error: type[Exception]) -> CheckpointChoice:
    """`choice`, unless its folder links outside its run folder: its results.jsonl and exports/ would be this
    run's; refused, not followed silently."""
    target = linked_outside(choice.tag_dir)
    if target is not None:
        raise error(f"{choice.tag_dir}: a symbolic link to {target}, outside its run folder (another run's "
                    f"checkpoint); fix: export {target} itself, or remove the link")
    return choice


# ------------------------------------------------------------------------------------------------ EVAL
def _is_tag_dir(path: Path) -> bool:
    return path.is_dir() and (any(path.glob("*mp_rank_*_model_states.pt")) or (path / INFO_FILE).is_file())


def is_deepspeed_checkpoint(path: str | Path | None) -> bool:
    """True for a DeepSpeed checkpoint folder (with a `latest` file) or one of its tag folders: what EVAL reads."""
    if path is None or str(path).startswith("local-dir:"):
        return False
    path = Path(path)
    return os.path.lexists(path / LATEST_FILE) or _is_tag_dir(path)


def _for_eval(path: Path, tag: Optional[str]) -> CheckpointChoice:
    """`path/<tag>`, `path/<contents of latest>`, or `path` itself when it is a tag folder; a `latest` that cannot
    be read as text names the newest complete checkpoint instead."""
    if tag is None and latest_problem(path):
        raise UnreadableRecordError(f"{path / LATEST_FILE}: {latest_problem(path)}, not the text file naming the "
                                    f"newest checkpoint; fix: replace it (echo TAG > {path / LATEST_FILE}) or pass "
                                    "a checkpoint tag folder")
    if tag is not None:
        tag_dir, named_by = path / tag, BY_TAG
    elif (path / LATEST_FILE).is_file():
        found = read_latest_tag(path) or newest_complete_tag(path)
        if found is None:
            raise FileNotFoundError(f"{path}: its {LATEST_FILE} file names no checkpoint and no folder in it holds "
                                    f"a complete one ({INFO_FILE}); pass a checkpoint tag folder")
        tag_dir, named_by = path / found, BY_FOLDER
    else:
        tag_dir, named_by = path, BY_TAG
    if not _is_tag_dir(tag_dir):
        raise FileNotFoundError(f"{tag_dir} is not a DeepSpeed checkpoint folder (no *model_states.pt files)")
    return CheckpointChoice.of(tag_dir, named_by)
