"""The one owner of a checkpoint's record, crate_clip.json, and of finding checkpoints: train, export, eval and
inspect read, list and resolve checkpoints only through here.

The record: CheckpointInfo (the model and stage that wrote it) with its Progress; a save adds `world_size` and the
files' checksums (checkpoint_manifest.py). Its schema (INFO_FIELDS) is derived from those two dataclasses, so the
written shape and the checked shape cannot drift apart; a record that parses as JSON but does not match it counts
as damaged. Fields are checked where present (a checkpoint of an earlier version may lack some); unknown fields
are kept. Readers take the record as that dataclass (read_record, CheckpointInfo.from_dict), not as the raw dict.

Listing: complete checkpoints (crate_clip.json present and well formed) are ordered by global step, everywhere.
Resolving which checkpoint is meant:
    latest_complete_tag     the tag `latest` names when complete, else the newest complete one
    stage_final_tag         a stage's last checkpoint (export --stage N)
    resolve_checkpoint_tag  a checkpoints folder (its `latest`), a tag in it, or a tag folder (eval, consolidation)
    user_checkpoint         a run folder, its checkpoints folder, a tag folder, or a stage (export)
    resume_checkpoint       `latest` of the run's own folder, a checkpoints folder or a tag folder (train --resume)
Each raises the caller's error class with one line naming the folder and the fix.
"""
from __future__ import annotations

import os
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Optional, get_type_hints

from crate_clip.checkpoint_io.bounded_reads import UnreadableRecordError, read_small_bytes, read_small_json
from crate_clip.checkpoint_io.manifest_schema import checksum_records_problem, has_json_type, json_type_name
from crate_clip.checkpoint_io.run_layout import LATEST_FILE, checkpoints_in, linked_outside
from crate_clip.core.file_kinds import special_file

INFO_FILE = "crate_clip.json"
INFO_MISSING = "is missing"
LATEST_MAX_BYTES = 4096


# ------------------------------------------------------------------------------------------------ the record
@dataclass
class Progress:
    """Where the run is; saved in every checkpoint (crate_clip.json)."""
    stage_index: int = 0
    step: int = 0                  # optimizer steps done in this stage (skipped non-finite steps included)
    global_step: int = 0
    samples_seen: int = 0
    nonfinite_skipped: int = 0
    nonfinite_in_a_row: int = 0

    @classmethod
    def from_info(cls, info: dict) -> "Progress":
        """The progress a checkpoint's crate_clip.json records."""
        return cls(**{f.name: info[f.name] for f in fields(cls) if f.name in info})


@dataclass(frozen=True)
class CheckpointInfo:
    """What crate_clip.json records besides DeepSpeed's files: the model and stage that wrote it, and the progress
    (eval/ rebuilds the model from it; a resume checks it against the job)."""
    model_name: str
    image_size: int
    context_length: int
    patch_size: Optional[int]      # the image tower's patch size in this stage (None: not a CRATE-alpha tower)
    zero_stage: int
    stage_name: str
    stage_steps: int
    precision: str
    run_config: dict
    normalisation: dict            # the training stream's image mean / std (an export's preprocessing)
    tokenizer: dict
    progress: Progress
    world_size: Optional[int] = None   # the processes that saved it: the save adds it to the file

    def as_dict(self) -> dict:
        """The JSON form: the progress's fields at the top level, beside the others (world_size once saved)."""
        skip = ("progress",) if self.world_size is not None else ("progress", "world_size")
        return {**{f.name: getattr(self, f.name) for f in fields(self) if f.name not in skip},
                **asdict(self.progress)}

    @classmethod
    def from_dict(cls, info: dict) -> "CheckpointInfo":
        """The record a parsed crate_clip.json holds (read_info's dict). A field that a checkpoint of an earlier
        version (or a DeepSpeed checkpoint from elsewhere) lacks is None, {} for the objects (run config,
        normalisation, tokenizer), 0 for the progress's counts; what a save adds beside them (world_size, the
        files' checksums) is read where it is checked."""
        hints = get_type_hints(cls)
        return cls(**{f.name: info.get(f.name, {} if hints[f.name] is dict else None)
                      for f in fields(cls) if f.name != "progress"}, progress=Progress.from_info(info))

    @property
    def ends_stage(self) -> bool:
        """True for a stage's last checkpoint (the weights its after-stage evaluations measured)."""
        return self.stage_steps is not None and self.progress.step >= self.stage_steps


_JSON_TYPES = {int: (int,), str: (str,), dict: (dict,), Optional[int]: (int, type(None))}
_EXPECTED = {int: "an integer", str: "a string", dict: "an object"}


def _schema() -> dict[str, tuple]:
    """crate_clip.json's fields and their JSON types: CheckpointInfo's and Progress's (world_size, which the save
    adds, an integer in the file)."""
    out = {}
    for cls in (CheckpointInfo, Progress):
        hints = get_type_hints(cls)
        out.update({f.name: _JSON_TYPES[hints[f.name]] for f in fields(cls) if f.name != "progress"})
    return {**out, "world_size": (int,)}


INFO_FIELDS = _schema()
# counts and sizes; world_size is checked against the job, patch_size may be null
_NON_NEGATIVE = tuple(k for k, types in INFO_FIELDS.items() if types == (int,) and k != "world_size")


def info_problem(info) -> str | None:
    """Why a parsed crate_clip.json is malformed (not an object, a field of the wrong type or negative, malformed
    checksums), or None."""
    if not isinstance(info, dict):
        return f"it holds {json_type_name(info)}, not an object"
    for key, types in INFO_FIELDS.items():
        if key in info and not has_json_type(info[key], types):
            return f"{key} is {json_type_name(info[key])} ({str(info[key])[:40]!r}), not {_EXPECTED[types[0]]}"
    for key in _NON_NEGATIVE:
        if key in info and info[key] < 0:
            return f"{key} is negative ({info[key]})"
    if "file_checksums" in info:
        return checksum_records_problem(info["file_checksums"])
    return None


def read_info_checked(tag_dir: Path) -> tuple[Optional[dict], Optional[str]]:
    """(crate_clip.json, None) of a complete checkpoint; (None, why) when it is not, `why` a predicate of
    "crate_clip.json ...": INFO_MISSING, "does not parse", "is a FIFO, not a regular file", "is 3,000,000,000 bytes,
    more than ...", "is malformed: global_step is a string ..."."""
    path = Path(tag_dir) / INFO_FILE
    try:
        info = read_small_json(path)
    except FileNotFoundError:
        return None, INFO_MISSING
    except (UnreadableRecordError, OSError) as exc:
        why = str(exc).removeprefix(f"{path}: ")
        return None, "does not parse" if why.startswith("not valid JSON") else f"is {why}"
    problem = info_problem(info)
    return (None, f"is malformed: {problem}") if problem else (info, None)


def read_info(tag_dir: Path) -> dict | None:
    """The checkpoint's crate_clip.json, or None when the checkpoint is incomplete or its record damaged."""
    return read_info_checked(tag_dir)[0]


def read_record(tag_dir: Path) -> CheckpointInfo | None:
    """The checkpoint's record, or None when the checkpoint is incomplete or its record damaged."""
    info = read_info(tag_dir)
    return None if info is None else CheckpointInfo.from_dict(info)


def is_stage_end(info: dict) -> bool:
    """True for the checkpoint info of a stage's last step (the weights its after-stage evaluations measured)."""
    return CheckpointInfo.from_dict(info).ends_stage


# ------------------------------------------------------------------------------------------------ listing
def latest_problem(checkpoints: Path) -> Optional[str]:
    """Why the `latest` file of `checkpoints` cannot be read although something has that name (a FIFO, a folder,
    a file too large), or None."""
    path = Path(checkpoints) / LATEST_FILE
    if not os.path.lexists(path):
        return None
    try:
        read_small_bytes(path, LATEST_MAX_BYTES)
    except FileNotFoundError:
        return "a link to nothing"
    except (UnreadableRecordError, OSError) as exc:
        return str(exc).removeprefix(f"{path}: ")
    return None


def read_latest_tag(checkpoints: Path) -> str | None:
    """The tag the `latest` file names; None when it is missing, empty, not text or not a small regular file (a
    garbled file counts as missing: the newest complete checkpoint is then found by its crate_clip.json)."""
    path = Path(checkpoints) / LATEST_FILE
    try:
        tag = read_small_bytes(path, LATEST_MAX_BYTES).decode("utf-8").strip()
    except (UnreadableRecordError, OSError, UnicodeDecodeError):
        return None
    return tag if tag and "/" not in tag and tag not in (".", "..") else None


def complete_tags_in(checkpoints: Path) -> list[str]:
    """The complete checkpoints (crate_clip.json present) in `checkpoints`, oldest first (by global step, then
    name): the one order every listing uses."""
    if not Path(checkpoints).is_dir():
        return []
    found = [(info.get("global_step", 0), p.name) for p in Path(checkpoints).iterdir()
             if p.is_dir() and not p.name.startswith(".") and (info := read_info(p)) is not None]
    return [name for _, name in sorted(found)]


def newest_complete_tag(checkpoints: Path) -> str | None:
    """The complete checkpoint with the highest global step in `checkpoints`."""
    complete = complete_tags_in(checkpoints)
    return complete[-1] if complete else None


def latest_complete_tag(checkpoints: Path) -> str | None:
    """The tag `latest` names, if that checkpoint is complete; else the newest complete one (a garbled `latest`
    counts as missing)."""
    tag = read_latest_tag(checkpoints)
    if tag is not None and read_info(Path(checkpoints) / tag) is not None:
        return tag
    return newest_complete_tag(checkpoints)


def stage_final_tag(checkpoints: Path, stage: int) -> str | None:
    """The last checkpoint of stage `stage` (the one its after-stage evaluations measured) among the complete ones
    in `checkpoints`, by global step; None when the stage has none."""
    ends = [tag for tag in complete_tags_in(checkpoints)
            if (info := read_info(Path(checkpoints) / tag)).get("stage_index") == stage and is_stage_end(info)]
    return ends[-1] if ends else None


# ------------------------------------------------------------------------------------------------ resolving
def _is_tag_dir(path: Path) -> bool:
    return path.is_dir() and (any(path.glob("*mp_rank_*_model_states.pt")) or (path / INFO_FILE).is_file())


def is_deepspeed_checkpoint(path: str | Path | None) -> bool:
    """True for a DeepSpeed checkpoint folder (with a `latest` file) or one of its tag folders."""
    if path is None or str(path).startswith("local-dir:"):
        return False
    path = Path(path)
    return os.path.lexists(path / LATEST_FILE) or _is_tag_dir(path)


def resolve_checkpoint_tag(path: str | Path, tag: str | None = None) -> Path:
    """The tag folder: `path/<tag>`, `path/<contents of latest>`, or `path` itself when it is a tag folder; a
    `latest` that cannot be read names the newest complete checkpoint instead."""
    path = Path(path)
    if tag is None and latest_problem(path):
        raise UnreadableRecordError(f"{path / LATEST_FILE}: {latest_problem(path)}, not the text file naming the "
                                    f"newest checkpoint; fix: replace it (echo TAG > {path / LATEST_FILE}) or pass "
                                    "a checkpoint tag folder")
    if tag is not None:
        tag_dir = path / tag
    elif (path / LATEST_FILE).is_file():
        found = read_latest_tag(path) or newest_complete_tag(path)
        if found is None:
            raise FileNotFoundError(f"{path}: its {LATEST_FILE} file names no checkpoint and no folder in it holds "
                                    f"a complete one ({INFO_FILE}); pass a checkpoint tag folder")
        tag_dir = path / found
    else:
        tag_dir = path
    if not _is_tag_dir(tag_dir):
        raise FileNotFoundError(f"{tag_dir} is not a DeepSpeed checkpoint folder (no *model_states.pt files)")
    return tag_dir


def user_checkpoint(path: Path, stage: int | None, error: type[Exception]) -> Path:
    """The tag folder a user's path names: a run folder or its checkpoints/ folder (the checkpoint `latest` names),
    one tag folder, or with `stage` that stage's last checkpoint; `error` (one line) when it names none."""
    path = Path(path)
    if not path.is_dir():   # a FIFO or a device is said to be one, not to be missing
        what = f"{special_file(path) or 'a file'}, not a folder" if os.path.exists(path) else "no such folder"
        raise error(f"{path}: {what} (a run folder, its checkpoints/ folder, or one checkpoint folder is exported)")
    is_tag = read_info(path) is not None
    root = path.parent if is_tag else checkpoints_in(path)
    if stage is not None:
        tag = stage_final_tag(root, stage)
        if tag is None:
            raise error(f"{root}: no complete final checkpoint of stage {stage} (the run has not finished it, or it "
                        f"was pruned); complete checkpoints: {complete_tags_in(root) or 'none'}")
        return root / tag
    if is_tag:
        return path
    if os.path.lexists(root / LATEST_FILE):   # a link to nothing is a broken `latest`, said so below
        # bounded and checked like a resume's read: a FIFO, a huge file or a tag naming a path outside the
        # checkpoints folder ("../x") is refused, not followed
        tag = read_latest_tag(root)
        if tag is None:
            why = latest_problem(root) or "not one checkpoint folder's name"
            raise error(f"{root / LATEST_FILE}: {why}; pass one of "
                        f"{complete_tags_in(root) or 'the checkpoint folders'} instead")
        if read_info(root / tag) is None:
            raise error(f"{root / LATEST_FILE} names {tag!r}, which is not a complete checkpoint; "
                        f"pass one of {complete_tags_in(root) or 'the checkpoint folders'} instead")
        return root / tag
    raise error(f"{path}: not a checkpoint (no {INFO_FILE}) and no {LATEST_FILE} file; pass a run folder, "
                f"its checkpoints/ folder or one of {complete_tags_in(root) or 'its checkpoint folders'}")


def resume_checkpoint(root: Path, resume: str, error: type[Exception]) -> Path:
    """The checkpoint `--resume` names: `latest` -> the newest complete checkpoint in `root` (the run's
    checkpoints folder); else a checkpoints folder (its newest complete one) or one tag folder; `error` (one line)
    when it names no complete checkpoint. A checkpoint folder that is a link to another run's checkpoint is refused
    (linked_outside)."""
    if resume == "latest":
        return _not_linked_outside(_latest_dir(root, resume, error), resume, error)
    path = Path(resume)
    if (path / LATEST_FILE).is_file() or (path.is_dir() and read_info(path) is None and
                                          any(read_info(p) for p in path.iterdir() if p.is_dir())):
        return _not_linked_outside(_latest_dir(path, resume, error), resume, error)
    info, why = read_info_checked(path)
    if info is None:
        what = (f"its {INFO_FILE} {why}: damaged" if why != INFO_MISSING else
                f"no {INFO_FILE}: missing or an interrupted save")
        raise error(f"--resume {resume}: not a complete checkpoint ({what}); fix: pass a checkpoint folder or "
                    "'latest'")
    return _not_linked_outside(path, resume, error)


def _latest_dir(root: Path, resume: str, error: type[Exception]) -> Path:
    """The newest complete checkpoint's folder in `root`; `error` when there is none."""
    tag = latest_complete_tag(root)
    if tag is None:
        raise error(f"--resume latest: no complete checkpoint in {root}; fix: start without --resume (with "
                    "--overwrite if the folder holds the files of a run cut short before its first checkpoint: they "
                    "are moved aside)")
    return Path(root) / tag


def _not_linked_outside(tag_dir: Path, resume: str, error: type[Exception]) -> Path:
    """`tag_dir`, unless it is a link leaving its checkpoints and run folder: a resume from it would continue
    another run's checkpoint under this run's name without a word; `error` naming both."""
    target = linked_outside(tag_dir)
    if target is not None:
        raise error(f"--resume {resume}: {tag_dir} is a symbolic link to {target}, outside its run folder (another "
                    f"run's checkpoint); fix: remove the link, or pass --resume {target} to continue from that "
                    "checkpoint knowingly")
    return tag_dir
