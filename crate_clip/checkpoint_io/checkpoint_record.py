"""The one owner of a checkpoint's record, crate_clip.json, and of listing checkpoints: train, export, eval and
inspect read and list checkpoints only through here (and choose one through checkpoint_choice.py).

The record: CheckpointInfo (the model and stage that wrote it) with its Progress; a save adds `world_size`, the
files' checksums (checkpoint_manifest.py) and the checkpoint's place in the run's history (`save_number`,
`lineage`: below). Its schema (INFO_FIELDS) is derived from those two dataclasses, so the
written shape and the checked shape cannot drift apart; a record that parses as JSON but does not match it counts
as damaged. Fields are checked where present (a checkpoint of an earlier version may lack some); unknown fields
are kept. Readers take the record as that dataclass (read_record, CheckpointInfo.from_dict), not as the raw dict.

Listing: complete checkpoints (crate_clip.json present and well formed) are listed by global step, everywhere.

Lineage: a resume from an earlier checkpoint starts another line of the run; the checkpoints saved after that one on
the line it left keep their higher steps. So "newest" is never judged by the step: every save records its
`save_number` (one more than any in the folder: the last save has the highest, whatever its step) and its
`lineage` (the checkpoints it descends from that were on disk when it was saved: the one the run resumed from or
saved before it, and that one's lineage). The run's line (line_of) is what rotation keeps and counts, what `latest`
and `export --stage N` follow. A checkpoint written before these fields existed has neither: it counts as saved
before every checkpoint that has them, and descends from every such earlier-version checkpoint of a lower global
step (the one line an earlier version assumed).

The two answers the choice of a checkpoint is built on (which checkpoint a user's words mean, for every command, is
checkpoint_choice.py's):
    latest_complete_tag     the tag `latest` names when complete, else the one saved last
    stage_final_tag         a stage's last checkpoint on the line of the latest one (export --stage N)
"""
from __future__ import annotations

import os
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Optional, get_type_hints

from crate_clip.checkpoint_io.bounded_reads import UnreadableRecordError, read_small_bytes, read_small_json
from crate_clip.checkpoint_io.manifest_schema import checksum_records_problem, has_json_type, json_type_name
from crate_clip.checkpoint_io.run_layout import LATEST_FILE, linked_outside, tag_position

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
    save_number: Optional[int] = None  # its place among the run's saves (the save adds it; lineage above)
    lineage: Optional[list] = None     # [{"tag", "save_number"}] it descends from, oldest first (the save adds it)

    def as_dict(self) -> dict:
        """The JSON form: the progress's fields at the top level, beside the others (what the save adds once
        saved)."""
        added = ("world_size", "save_number", "lineage")
        return {**{f.name: getattr(self, f.name) for f in fields(self)
                   if f.name != "progress" and not (f.name in added and getattr(self, f.name) is None)},
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


_JSON_TYPES = {int: (int,), str: (str,), dict: (dict,), Optional[int]: (int, type(None)),
               Optional[list]: (list, type(None))}
_EXPECTED = {int: "an integer", str: "a string", dict: "an object", list: "a list"}


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
    for key in (*_NON_NEGATIVE, "save_number"):
        if isinstance(info.get(key), int) and info[key] < 0:
            return f"{key} is negative ({info[key]})"
    if info.get("lineage") is not None:
        problem = _lineage_problem(info["lineage"])
        if problem:
            return problem
    if "file_checksums" in info:
        return checksum_records_problem(info["file_checksums"])
    return None


def _lineage_problem(lineage: list) -> str | None:
    """Why a parsed `lineage` is malformed: each entry names a folder beside the checkpoint (a name, never a path)
    and its save number (null: a checkpoint of an earlier version)."""
    for i, entry in enumerate(lineage):
        if not (isinstance(entry, dict) and set(entry) == {"tag", "save_number"} and _is_folder_name(entry["tag"])
                and (entry["save_number"] is None or (has_json_type(entry["save_number"], (int,))
                                                      and entry["save_number"] >= 0))):
            return f"lineage[{i}] is {str(entry)[:60]!r}, not {{'tag': FOLDER NAME, 'save_number': N}}"
    return None


def _is_folder_name(name) -> bool:
    return isinstance(name, str) and bool(name) and not name.startswith(".") and "/" not in name and "\0" not in name


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


def complete_records(checkpoints: Path) -> dict[str, CheckpointInfo]:
    """Tag -> record of the complete checkpoints (crate_clip.json present and well formed) in `checkpoints`."""
    if not Path(checkpoints).is_dir():
        return {}
    return {p.name: CheckpointInfo.from_dict(info) for p in Path(checkpoints).iterdir()
            if p.is_dir() and not p.name.startswith(".") and (info := read_info(p)) is not None}


def complete_tags_in(checkpoints: Path) -> list[str]:
    """The complete checkpoints (crate_clip.json present) in `checkpoints`, oldest first (by global step, then
    name): the one order every listing uses."""
    records = complete_records(checkpoints)
    return sorted(records, key=lambda tag: (records[tag].progress.global_step, tag))


def newest_complete_tag(checkpoints: Path) -> str | None:
    """The complete checkpoint saved last in `checkpoints` (by save number; among checkpoints of an earlier
    version, which record none, the highest global step); a link to another run's checkpoint is not this run's."""
    records = complete_records(checkpoints)
    return max((tag for tag in records if linked_outside(Path(checkpoints) / tag) is None),
               key=lambda tag: save_order(tag, records[tag]), default=None)


def save_order(tag: str, record: CheckpointInfo) -> tuple:
    """The order of saving: the save number (an earlier version's checkpoint: 0), then the global step; of two
    equal records (a user's copy of a checkpoint) the one under the trainer's own name."""
    own = tag_position(tag) == (record.progress.stage_index, record.progress.step)
    return record.save_number or 0, record.progress.global_step, own, tag


def latest_complete_tag(checkpoints: Path) -> str | None:
    """The tag `latest` names, if that checkpoint is complete; else the one saved last (a garbled `latest`
    counts as missing)."""
    tag = read_latest_tag(checkpoints)
    if tag is not None and read_info(Path(checkpoints) / tag) is not None:
        return tag
    return newest_complete_tag(checkpoints)


def stage_final_tag(checkpoints: Path, stage: int) -> str | None:
    """The last checkpoint of stage `stage` (the one its after-stage evaluations measured) on the line of the
    latest checkpoint (latest_complete_tag); None when that line has none."""
    records = complete_records(checkpoints)
    head = latest_complete_tag(checkpoints)
    ends = [tag for tag in line_of(records, head)
            if records[tag].progress.stage_index == stage and records[tag].ends_stage] if head else []
    return ends[-1] if ends else None


# ------------------------------------------------------------------------------------------------ lineage
def line_of(records: dict[str, CheckpointInfo], tag: Optional[str]) -> list[str]:
    """`tag` and the checkpoints among `records` (complete_records) it descends from, oldest first: those its
    lineage names that are still there under the same save number; for a checkpoint of an earlier version (no
    lineage), every such checkpoint of a lower global step. [] when `tag` is not among them."""
    record = records.get(tag)
    if record is None:
        return []
    if record.lineage is None:
        position = (record.progress.global_step, tag)
        older = sorted((r.progress.global_step, t) for t, r in records.items()
                       if r.lineage is None and (r.progress.global_step, t) < position)
        return [t for _, t in older] + [tag]
    return [entry["tag"] for entry in record.lineage if entry["tag"] != tag and entry["tag"] in records
            and records[entry["tag"]].save_number == entry["save_number"]] + [tag]


def lineage_fields(checkpoints: Path, parent: Optional[str]) -> dict:
    """What a save adds to its record (rank 0, before the commit): its save number, one more than any in the
    folder, and its lineage: `parent` (the checkpoint the run resumed from or saved before; None for its first)
    and the checkpoints on `parent`'s line."""
    records = complete_records(checkpoints)
    number = max((r.save_number or 0 for r in records.values()), default=0) + 1
    lineage = [{"tag": t, "save_number": records[t].save_number} for t in line_of(records, parent)]
    return {"save_number": number, "lineage": lineage}
