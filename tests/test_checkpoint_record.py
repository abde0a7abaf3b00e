"""crate_clip.checkpoint_io.checkpoint_record, the one owner of crate_clip.json and of finding checkpoints: the
record the trainer writes is the record the schema checks, and every listing and resolver orders checkpoints by
global step, not by folder name."""
import json
from pathlib import Path

import pytest

from crate_clip.checkpoint_io.checkpoint_choice import EXPORT, choose_checkpoint
from crate_clip.checkpoint_io.checkpoint_record import (INFO_FIELDS, INFO_FILE, CheckpointInfo, Progress,
                                                        complete_tags_in, info_problem, read_record, stage_final_tag)


def _record(stage: int, step: int, global_step: int, stage_steps: int = 4) -> CheckpointInfo:
    progress = Progress(stage_index=stage, step=step, global_step=global_step)
    return CheckpointInfo("CRATE-alpha-CLIPA-B-16", 32, 16, 16, 0, f"stage{stage}", stage_steps, "fp32", {},
                          {"mean": [0.5], "std": [0.5]}, {}, progress)


def _info(stage: int, step: int, global_step: int, stage_steps: int = 4) -> dict:
    """crate_clip.json as a save writes it: the trainer's record, the world size and the lineage the save adds."""
    return {**_record(stage, step, global_step, stage_steps).as_dict(), "world_size": 1, "save_number": global_step,
            "lineage": []}


def _checkpoint(root: Path, name: str, info: dict) -> Path:
    (root / name).mkdir(parents=True)
    (root / name / INFO_FILE).write_text(json.dumps(info))
    return root / name


def test_the_written_record_is_the_checked_record():
    info = _info(0, 4, 4)
    assert set(info) == set(INFO_FIELDS) and info_problem(info) is None
    assert "global_step is a string" in info_problem({**info, "global_step": "4"})
    assert info_problem({**info, "step": -1}) == "step is negative (-1)"
    assert info_problem({**info, "save_number": -2}) == "save_number is negative (-2)"
    assert info_problem({**info, "lineage": [{"tag": "stage0-step00000001", "save_number": None}]}) is None
    for entry in ({"tag": "../other-run/stage0-step00000001", "save_number": 1}, {"tag": "stage0-step00000001"},
                  "stage0-step00000001", {"tag": "stage0-step00000001", "save_number": "1"}):
        assert info_problem({**info, "lineage": [entry]}).startswith("lineage[0] is "), entry


def test_the_record_read_back_is_the_dataclass_written(tmp_path):
    """Export and eval read crate_clip.json as CheckpointInfo: what the trainer wrote comes back equal; a record of
    an earlier version reads with its missing fields None (objects {}, counts 0), and only a stage's last step ends
    it."""
    written = _checkpoint(tmp_path, "stage0-step00000004", _info(0, 4, 4))
    record = read_record(written)
    assert record.as_dict() == _info(0, 4, 4) and record.world_size == 1 and record.lineage == []
    assert not {"world_size", "save_number", "lineage"} & set(_record(0, 4, 4).as_dict())   # the save adds them
    assert record.ends_stage and not CheckpointInfo.from_dict(_info(0, 3, 3)).ends_stage
    old = CheckpointInfo.from_dict({"model_name": "RN50", "image_size": 224, "step": 7})
    assert (old.model_name, old.image_size, old.patch_size, old.stage_steps) == ("RN50", 224, None, None)
    assert old.run_config == old.normalisation == old.tokenizer == {} and old.progress == Progress(step=7)
    assert not old.ends_stage   # no stage length recorded: not taken for a stage's final
    assert read_record(tmp_path / "missing") is None


def test_listing_and_a_stages_final_go_by_step_not_by_name(tmp_path):
    ckpts = tmp_path / "run" / "checkpoints"
    # copies a user named: by name "z-early" sorts last, by step it is the first
    _checkpoint(ckpts, "z-early", _info(0, 4, 4))
    _checkpoint(ckpts, "a-late", _info(0, 4, 9))
    _checkpoint(ckpts, "m-middle", _info(1, 2, 6))
    assert complete_tags_in(ckpts) == ["z-early", "m-middle", "a-late"]
    assert stage_final_tag(ckpts, 0) == "a-late"
    assert stage_final_tag(ckpts, 1) is None   # step 2 of 4: not the stage's final
    assert choose_checkpoint(tmp_path / "run", EXPORT, stage=0).tag_dir == ckpts / "a-late"
    with pytest.raises(ValueError, match="no complete final checkpoint of stage 1 .*'z-early', 'm-middle', 'a-late'"):
        choose_checkpoint(tmp_path / "run", EXPORT, stage=1)
