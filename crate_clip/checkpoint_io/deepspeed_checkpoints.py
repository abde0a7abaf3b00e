"""The one description of a DeepSpeed checkpoint on disk, used by the trainer and the evaluator.

    <run_dir>/checkpoints/latest        the tag of the newest complete checkpoint (DeepSpeed's convention)
    <run_dir>/checkpoints/<tag>/        DeepSpeed's files, train_state_rank<r>.pt, and crate_clip.json:
                                        written last, it marks the checkpoint complete and says what it holds

Checkpoints of any ZeRO stage consolidate to fp32: stage 0 keeps the whole model in
`mp_rank_00_model_states.pt["module"]`; stages 1-3 are merged from their partitions by DeepSpeed's zero_to_fp32.
Every file is read with weights_only=True and DeepSpeed's allow-list (safe_unpickling.py): a folder from
elsewhere is data, not code. crate_clip.json and `latest` are read size-bounded and only as regular files
(bounded_reads.py); a crate_clip.json that does not match its schema (manifest_schema.py) counts as damaged, and
a consolidation verifies the files against the sizes and sha256 it records before reading any of them.
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Optional

from crate_clip.checkpoint_io.bounded_reads import UnreadableRecordError, read_small_bytes, read_small_json
from crate_clip.checkpoint_io.file_checksums import (CHECKSUMS_KEY, ChecksumMismatchError, checksum_problem,
                                                     verify_recorded_checksums)
from crate_clip.checkpoint_io.manifest_schema import info_problem
from crate_clip.checkpoint_io.run_layout import LATEST_FILE
from crate_clip.checkpoint_io.safe_unpickling import deepspeed_reads, load_torch_file

INFO_FILE = "crate_clip.json"
STAGE0_MODEL_FILE = "mp_rank_00_model_states.pt"
UNIVERSAL_DIR = "universal"   # a checkpoint's converted copy for another world size (train/elastic_resume.py)
LATEST_MAX_BYTES = 4096


class DamagedCheckpointError(ChecksumMismatchError):
    """A checkpoint whose crate_clip.json is malformed or whose files differ from its record (exit code 2)."""


INFO_MISSING = "is missing"


def read_info_checked(tag_dir: Path) -> tuple[Optional[dict], Optional[str]]:
    """(crate_clip.json, None) of a complete checkpoint; (None, why) when it is not, `why` a predicate of
    "crate_clip.json ...": INFO_MISSING, "does not parse", "is a FIFO, not a regular file", "is 3,000,000,000 bytes,
    more than ...", "is malformed: global_step is a string ..." (manifest_schema.py)."""
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


def is_stage_end(info: dict) -> bool:
    """True for the checkpoint info of a stage's last step (the weights its after-stage evaluations measured)."""
    return info.get("step", 0) >= info.get("stage_steps", float("inf"))


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
    """The complete checkpoints (crate_clip.json present) in `checkpoints`, oldest first (by global step)."""
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


def verify_checkpoint(tag_dir: Path) -> dict:
    """The checkpoint's crate_clip.json ({} when it has none: a DeepSpeed checkpoint from elsewhere) once every
    file it records has the recorded size and sha256; DamagedCheckpointError naming each difference or a malformed
    record. Checkpoints of an earlier version, without the record, are not verified."""
    tag_dir = Path(tag_dir)
    info, why = read_info_checked(tag_dir)
    if info is None:
        if why == INFO_MISSING:
            return {}
        raise DamagedCheckpointError(f"{tag_dir}: damaged checkpoint: its {INFO_FILE} {why}; fix: use another "
                                     "checkpoint of the run (--resume latest takes the newest intact one)")
    problems = [f"{name}: {problem}" for name, record in (info.get(CHECKSUMS_KEY) or {}).items()
                if (problem := checksum_problem(tag_dir / name, record, INFO_FILE))]
    if problems:
        raise DamagedCheckpointError(f"{tag_dir}: damaged checkpoint: {'; '.join(problems)}; it was changed after "
                                     "it was written: use an earlier checkpoint or a copy")
    return info


EXPORT_CONFIG_FILE = "open_clip_config.json"   # an export's config, which records its files' checksums too


def verify_recorded_file(path: str | Path) -> None:
    """A single weights file read on its own (`--pretrained <export>/open_clip_model.safetensors`, a checkpoint's
    model-states file): verified against the record of the export or checkpoint it lies in, when that records
    it; ChecksumMismatchError when it differs or the record is malformed."""
    path = Path(path)
    for record_name in (INFO_FILE, EXPORT_CONFIG_FILE):
        record = path.parent / record_name
        if not record.is_file():
            continue
        config = read_small_json(record)
        if isinstance(config, dict) and path.name in (config.get(CHECKSUMS_KEY) or {}):
            verify_recorded_checksums(path.parent, {CHECKSUMS_KEY: {path.name: config[CHECKSUMS_KEY][path.name]}},
                                      record)


def consolidate_deepspeed_checkpoint(path: str | Path, tag: str | None = None,
                                     verify: bool = True) -> tuple[dict, dict]:
    """fp32 state dict of a DeepSpeed checkpoint of any ZeRO stage, and the run info from crate_clip.json; the
    files are verified against its checksums first (`verify=False`: the caller just did, or just wrote them),
    DamagedCheckpointError when they differ. A file needing a class outside the allow-list raises
    UntrustedCheckpointError (unless inside trusted_checkpoints())."""
    tag_dir = resolve_checkpoint_tag(path, tag)
    info = verify_checkpoint(tag_dir) if verify else read_info(tag_dir) or {}
    if any(tag_dir.glob("*zero_pp_rank_*_optim_states.pt")):
        from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint
        with deepspeed_reads(tag_dir):   # zero_to_fp32 unpickles with weights_only=False otherwise
            state = get_fp32_state_dict_from_zero_checkpoint(str(tag_dir.parent), tag=tag_dir.name)
        info.setdefault("zero_stage", "1-3")
    else:
        # ZeRO stage 0 (zero_to_fp32 refuses it): the whole module is in the model-states file.
        states = load_torch_file(tag_dir / STAGE0_MODEL_FILE)
        state = states["module"]
        info.setdefault("zero_stage", 0)
    state = {k: v.float() if v.is_floating_point() else v for k, v in state.items()}
    info["checkpoint"] = str(tag_dir)
    return state, info


def consolidated_state_dict(tag_dir: Path, verify: bool = True) -> dict:
    """Plain fp32 state dict of one complete checkpoint folder (any ZeRO stage), logit_scale as saved ([1]);
    verified first unless `verify=False`."""
    tag_dir = Path(tag_dir)
    return consolidate_deepspeed_checkpoint(tag_dir.parent, tag=tag_dir.name, verify=verify)[0]
