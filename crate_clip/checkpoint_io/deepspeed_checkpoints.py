"""The one description of a DeepSpeed checkpoint on disk, used by the trainer and the evaluator.

    <run_dir>/checkpoints/latest        the tag of the newest complete checkpoint (DeepSpeed's convention)
    <run_dir>/checkpoints/<tag>/        DeepSpeed's files, train_state_rank<r>.pt, and crate_clip.json:
                                        written last, it marks the checkpoint complete and says what it holds

Checkpoints of any ZeRO stage consolidate to fp32: stage 0 keeps the whole model in
`mp_rank_00_model_states.pt["module"]`; stages 1-3 are merged from their partitions by DeepSpeed's zero_to_fp32.
Every file is read with weights_only=True and DeepSpeed's allow-list (safe_unpickling.py): a folder from
elsewhere is data, not code.
"""
from __future__ import annotations

import json
from pathlib import Path

from crate_clip.checkpoint_io.run_layout import LATEST_FILE
from crate_clip.checkpoint_io.safe_unpickling import deepspeed_reads, load_torch_file

INFO_FILE = "crate_clip.json"
STAGE0_MODEL_FILE = "mp_rank_00_model_states.pt"


def read_info(tag_dir: Path) -> dict | None:
    """The checkpoint's crate_clip.json, or None when the checkpoint is incomplete."""
    path = Path(tag_dir) / INFO_FILE
    if not path.is_file():
        return None
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError):
        return None


def read_latest_tag(checkpoints: Path) -> str | None:
    """The tag the `latest` file names; None when it is missing, empty or not text (a garbled file counts as
    missing: the newest complete checkpoint is then found by its crate_clip.json)."""
    path = Path(checkpoints) / LATEST_FILE
    try:
        tag = path.read_bytes().decode("utf-8").strip()
    except (FileNotFoundError, IsADirectoryError, UnicodeDecodeError):
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
    return (path / LATEST_FILE).is_file() or _is_tag_dir(path)


def resolve_checkpoint_tag(path: str | Path, tag: str | None = None) -> Path:
    """The tag folder: `path/<tag>`, `path/<contents of latest>`, or `path` itself when it is a tag folder; a
    `latest` that cannot be read names the newest complete checkpoint instead."""
    path = Path(path)
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


def consolidate_deepspeed_checkpoint(path: str | Path, tag: str | None = None) -> tuple[dict, dict]:
    """fp32 state dict of a DeepSpeed checkpoint of any ZeRO stage, and the run info from crate_clip.json; a file
    needing a class outside the allow-list raises UntrustedCheckpointError (unless inside trusted_checkpoints())."""
    tag_dir = resolve_checkpoint_tag(path, tag)
    info = read_info(tag_dir) or {}
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


def consolidated_state_dict(tag_dir: Path) -> dict:
    """Plain fp32 state dict of one complete checkpoint folder (any ZeRO stage), logit_scale as saved ([1])."""
    tag_dir = Path(tag_dir)
    return consolidate_deepspeed_checkpoint(tag_dir.parent, tag=tag_dir.name)[0]
