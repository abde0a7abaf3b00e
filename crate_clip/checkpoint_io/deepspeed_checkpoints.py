"""A DeepSpeed checkpoint's files on disk, verified and consolidated, used by the trainer and the evaluator (its
record, crate_clip.json: checkpoint_record.py; which checkpoint a path names: checkpoint_choice.py).

    <run_dir>/checkpoints/latest        the tag of the newest complete checkpoint (DeepSpeed's convention)
    <run_dir>/checkpoints/<tag>/        DeepSpeed's files, train_state_rank<r>.pt, and crate_clip.json:
                                        written last, it marks the checkpoint complete and says what it holds

Checkpoints of any ZeRO stage consolidate to fp32: stage 0 keeps the whole model in
`mp_rank_00_model_states.pt["module"]`; stages 1-3 are merged from their partitions by DeepSpeed's zero_to_fp32.
Every file is read with weights_only=True and DeepSpeed's allow-list (safe_unpickling.py): a folder from
elsewhere is data, not code. crate_clip.json and `latest` are read size-bounded and only as regular files
(bounded_reads.py); a crate_clip.json that does not match its schema (checkpoint_record.py) counts as damaged, and
a consolidation verifies the files against the sizes and sha256 it records before reading any of them.
"""
from __future__ import annotations

from pathlib import Path

from crate_clip.checkpoint_io.bounded_reads import read_small_json
# the record and the finding of checkpoints are checkpoint_record.py's; named here too for this layer's callers
from crate_clip.checkpoint_io.checkpoint_choice import EVAL, choose_checkpoint
from crate_clip.checkpoint_io.checkpoint_record import (INFO_FILE, INFO_MISSING, CheckpointInfo,  # noqa: F401
                                                        complete_tags_in, is_stage_end, latest_complete_tag,
                                                        newest_complete_tag, read_info, read_info_checked, read_record)
from crate_clip.checkpoint_io.deepspeed_notices import deepspeed_notices_off
from crate_clip.checkpoint_io.file_checksums import (CHECKSUMS_KEY, ChecksumMismatchError, checksum_problem,
                                                     verify_recorded_checksums)
from crate_clip.checkpoint_io.run_layout import LATEST_FILE  # noqa: F401
from crate_clip.checkpoint_io.safe_unpickling import deepspeed_reads, load_torch_file

STAGE0_MODEL_FILE = "mp_rank_00_model_states.pt"
# a checkpoint's converted copy for another world size (train/checkpointing/elastic_resume.py)
UNIVERSAL_DIR = "universal"


class DamagedCheckpointError(ChecksumMismatchError):
    """A checkpoint whose crate_clip.json is malformed or whose files differ from its record (exit code 2)."""


def verify_checkpoint(tag_dir: Path) -> CheckpointInfo | None:
    """The checkpoint's record (None when it has none: a DeepSpeed checkpoint from elsewhere) once every file it
    records has the recorded size and sha256; DamagedCheckpointError naming each difference or a malformed record.
    Checkpoints of an earlier version, without the record, are not verified."""
    tag_dir = Path(tag_dir)
    info, why = read_info_checked(tag_dir)
    if info is None:
        if why == INFO_MISSING:
            return None
        raise DamagedCheckpointError(f"{tag_dir}: damaged checkpoint: its {INFO_FILE} {why}; fix: use another "
                                     "checkpoint of the run (--resume latest takes the newest intact one)")
    problems = [f"{name}: {problem}" for name, record in (info.get(CHECKSUMS_KEY) or {}).items()
                if (problem := checksum_problem(tag_dir / name, record, INFO_FILE))]
    if problems:
        raise DamagedCheckpointError(f"{tag_dir}: damaged checkpoint: {'; '.join(problems)}; it was changed after "
                                     "it was written: use an earlier checkpoint or a copy")
    return CheckpointInfo.from_dict(info)


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
                                     verify: bool = True) -> tuple[dict, CheckpointInfo]:
    """fp32 state dict of a DeepSpeed checkpoint of any ZeRO stage, and its record (crate_clip.json; every field
    None for a checkpoint from elsewhere, which has none); the files are verified against its checksums first
    (`verify=False`: the caller just did, or just wrote them), DamagedCheckpointError when they differ. A file
    needing a class outside the allow-list raises UntrustedCheckpointError (unless inside trusted_checkpoints())."""
    tag_dir = choose_checkpoint(path, EVAL, tag=tag).tag_dir
    record = (verify_checkpoint(tag_dir) if verify else read_record(tag_dir)) or CheckpointInfo.from_dict({})
    if any(tag_dir.glob("*zero_pp_rank_*_optim_states.pt")):
        with deepspeed_notices_off():   # a first import of DeepSpeed announces its accelerator
            from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint
        with deepspeed_reads(tag_dir):   # zero_to_fp32 unpickles with weights_only=False otherwise
            state = get_fp32_state_dict_from_zero_checkpoint(str(tag_dir.parent), tag=tag_dir.name)
    else:
        # ZeRO stage 0 (zero_to_fp32 refuses it): the whole module is in the model-states file.
        states = load_torch_file(tag_dir / STAGE0_MODEL_FILE)
        state = states["module"]
    return {k: v.float() if v.is_floating_point() else v for k, v in state.items()}, record


def consolidated_state_dict(tag_dir: Path, verify: bool = True) -> dict:
    """Plain fp32 state dict of one complete checkpoint folder (any ZeRO stage), logit_scale as saved ([1]);
    verified first unless `verify=False`."""
    tag_dir = Path(tag_dir)
    return consolidate_deepspeed_checkpoint(tag_dir.parent, tag=tag_dir.name, verify=verify)[0]
