"""crate_clip.checkpoint_io.checkpoint_record, the one owner of crate_clip.json and of finding checkpoints: the
record the trainer writes is the record the schema checks, and every listing and resolver orders checkpoints by
global step, not by folder name."""
import json
from pathlib import Path

import pytest

from crate_clip.checkpoint_io.checkpoint_record import (INFO_FIELDS, INFO_FILE, CheckpointInfo, Progress,
                                                        complete_tags_in, info_problem, stage_final_tag,
                                                        user_checkpoint)


def _info(stage: int, step: int, global_step: int, stage_steps: int = 4) -> dict:
    progress = Progress(stage_index=stage, step=step, global_step=global_step)
    record = CheckpointInfo("CRATE-alpha-CLIPA-B-16", 32, 16, 16, 0, f"stage{stage}", stage_steps, "fp32", {},
                            {"mean": [0.5], "std": [0.5]}, {}, progress)
    return {**record.as_dict(), "world_size": 1}


def _checkpoint(root: Path, name: str, info: dict) -> Path:
    (root / name).mkdir(parents=True)
    (root / name / INFO_FILE).write_text(json.dumps(info))
    return root / name


def test_the_written_record_is_the_checked_record():
    info = _info(0, 4, 4)
    assert set(info) == set(INFO_FIELDS) and info_problem(info) is None
    assert "global_step is a string" in info_problem({**info, "global_step": "4"})
    assert info_problem({**info, "step": -1}) == "step is negative (-1)"


def test_listing_and_a_stages_final_go_by_step_not_by_name(tmp_path):
    ckpts = tmp_path / "run" / "checkpoints"
    # copies a user named: by name "z-early" sorts last, by step it is the first
    _checkpoint(ckpts, "z-early", _info(0, 4, 4))
    _checkpoint(ckpts, "a-late", _info(0, 4, 9))
    _checkpoint(ckpts, "m-middle", _info(1, 2, 6))
    assert complete_tags_in(ckpts) == ["z-early", "m-middle", "a-late"]
    assert stage_final_tag(ckpts, 0) == "a-late"
    assert stage_final_tag(ckpts, 1) is None   # step 2 of 4: not the stage's final
    assert user_checkpoint(tmp_path / "run", 0, ValueError) == ckpts / "a-late"
    with pytest.raises(ValueError, match="no complete final checkpoint of stage 1 .*'z-early', 'm-middle', 'a-late'"):
        user_checkpoint(tmp_path / "run", 1, ValueError)
