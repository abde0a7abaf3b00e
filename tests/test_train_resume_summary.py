"""`crate-clip plan` of a run in progress (elastic_resume.resume_summary) takes the ZeRO stage the launch's
ResolvedStage decides, as the resume itself does (issue 28: nothing re-reads what the ResolvedStage decided)."""
import json

import pytest

from crate_clip.train.checkpointing.elastic_resume import resume_summary
from crate_clip.train.run.run_config import config_from_dict
from crate_clip.train.stage_setup.stage_model import resolve_stage


def _config(zero_stage):
    return config_from_dict({
        "model": {"name": "CRATE-alpha-CLIPA-tiny"}, "data": {"sources": ["unused"], "num_workers": 1},
        "precision": "fp32", "deepspeed": {"zero_stage": zero_stage},
        "stages": [{"name": "s", "image_size": 16, "context_length": 16, "samples": 64, "global_batch": 8,
                    "lr": 1e-3}]}, check_paths=False)


@pytest.mark.parametrize("zero_stage,universal", [(1, "none"), (2, "converted by rank 0 at the resume")])
def test_plan_of_a_checkpoint_uses_the_resolved_stages_zero_stage(tmp_path, zero_stage, universal):
    tag_dir = tmp_path / "checkpoints" / "stage0-step4"
    tag_dir.mkdir(parents=True)
    (tag_dir / "crate_clip.json").write_text(json.dumps({
        "stage_index": 0, "step": 4, "stage_steps": 8, "global_step": 4, "world_size": 2, "zero_stage": 1,
        "run_config": {"data": {"canonical_streams": 2}}}))
    (tag_dir / "bf16_zero_pp_rank_0_mp_rank_00_optim_states.pt").touch()   # ZeRO-1 partitions (only listed here)
    cfg = _config(zero_stage)
    summary = resume_summary(tag_dir, cfg, 2)
    assert summary["zero_stage"] == resolve_stage(cfg, 0, 2).zero_stage == zero_stage
    assert summary["written_zero_stage"] == 1 and summary["universal"] == universal
