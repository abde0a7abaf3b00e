"""stages.N.optimizer_state: carry (crate_clip/train/stage_setup/optimizer_carry.py): a stage starts from the AdamW
moments and step count of the stage before it, gathered whole from ZeRO-2's partitions and written into the next
stage's (under ZeRO 0 in fp32, the demo's setting: read from and written into torch's own per-parameter AdamW
state); a parameter whose shape changes at the boundary (here the position embedding of a grid grown from 4x4 to
5x5) starts from zero moments. Real DeepSpeed runs on real Fashion-MNIST shards: two ranks under ZeRO-2 (the
partitions are the point), a world of one in this process under ZeRO 0."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from train_fixtures import ranks_cmd, read_jsonl, run_job, tiny_config, train_in_process, write_config

WORKER = Path(__file__).resolve().parent / "optimizer_carry_worker.py"
STEPS0, STEPS1 = 4, 2
CARRY_STAGES = [   # 4 steps at 16 px (a 4x4 grid of 4 px patches), then 2 at 20 px (5x5) from stage 0's AdamW state
    {"name": "low", "image_size": 16, "context_length": 16, "samples": 16 * STEPS0, "global_batch": 16,
     "lr": 2e-3, "warmup_steps": 1},
    {"name": "full", "image_size": 20, "context_length": 16, "samples": 16 * STEPS1, "global_batch": 16,
     "lr": 2e-4, "warmup_steps": 1, "optimizer_state": "carry"},
]


def _config(run_dir: Path, data: Path, path: Path, zero_stage: int) -> Path:
    return write_config(tiny_config(run_dir, data, zero_stage=zero_stage, precision="fp32", stages=CARRY_STAGES,
                                    evals=False, logging={"every_steps": 1, "progress": False}), path)


def _stage1_losses(run_dir: Path) -> list[float]:
    return [r["loss"] for r in read_jsonl(run_dir / "metrics.jsonl") if r.get("stage_index") == 1 and "loss" in r]


def _saved_step(tag_dir: Path, zero_stage: int) -> float:
    """The AdamW step count in a DeepSpeed checkpoint: rank 0's optimizer file under ZeRO 1/2, the model file (torch's
    own optimizer state) under ZeRO 0."""
    if zero_stage == 0:
        saved = torch.load(tag_dir / "mp_rank_00_model_states.pt", map_location="cpu", weights_only=False)
        return float(saved["optimizer"]["state"][0]["step"])
    saved = torch.load(tag_dir / "zero_pp_rank_0_mp_rank_00_optim_states.pt", map_location="cpu", weights_only=False)
    return float(saved["optimizer_state_dict"]["base_optimizer_state"]["state"][0]["step"])


@pytest.mark.slow
@pytest.mark.parametrize("zero_stage", [pytest.param(2, marks=pytest.mark.multiproc), 0])
def test_carry_moves_adamw_state_across_the_stage_change_and_from_a_finished_stages_checkpoint(tiny_fmnist, tmp_path,
                                                                                              monkeypatch, capsys,
                                                                                              zero_stage):
    monkeypatch.setenv("CARRY_CHECK_OUT", str(tmp_path / "live.json"))
    live = tmp_path / "live"
    config = _config(live, tiny_fmnist, tmp_path / "live.yaml", zero_stage)
    if zero_stage == 2:   # the moments gathered whole from two ranks' partitions: a 2-rank job
        proc = run_job(ranks_cmd(2, "--config", str(config), script=WORKER), timeout=300)
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
        said = proc.stdout + proc.stderr
    else:   # ZeRO 0 keeps torch's own per-parameter state whole on every rank: a world of one, in this process
        import crate_clip.train.loop.stage_loop as stage_loop
        from optimizer_carry_worker import checked_apply

        monkeypatch.setattr(stage_loop, "apply_state", checked_apply)
        train_in_process(config)
        said = "".join(capsys.readouterr())
    check = json.loads((tmp_path / "live.json").read_text())
    assert check["carried_step"] == check["step_after"] == STEPS0
    assert check["reset"] == ["visual.trunk.pos_embed"] and check["reset_max"] == 0.0
    assert len(check["carried"]) > 50 and check["carried_nonzero"] == len(check["carried"])
    assert check["max_diff"] == 0.0   # every carried moment is where the next stage's optimizer reads it
    assert "AdamW state carried from the previous stage (step 4" in said
    # the next stage's optimizer went on from the carried count: 4 + 2 steps, not a fresh 2
    assert _saved_step(live / "checkpoints" / f"stage1-step{STEPS1:08d}", zero_stage) == STEPS0 + STEPS1
    if zero_stage == 0:   # the suite's CPU budget: ZeRO 0's resume is DeepSpeed's loader, then the gather above
        return

    # a resume from stage 0's final checkpoint into another run folder carries the state saved there: the same steps
    monkeypatch.setenv("CARRY_CHECK_OUT", str(tmp_path / "resumed.json"))
    resumed = tmp_path / "resumed"
    resumed_cfg = _config(resumed, tiny_fmnist, tmp_path / "resumed.yaml", zero_stage)
    proc = run_job(ranks_cmd(2, "--config", str(resumed_cfg),
                             "--resume", str(live / "checkpoints" / f"stage0-step{STEPS0:08d}"), script=WORKER),
                   timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert json.loads((tmp_path / "resumed.json").read_text()) == check
    assert _stage1_losses(resumed) == _stage1_losses(live) and len(_stage1_losses(live)) == STEPS1


def test_carry_is_refused_where_there_is_nothing_to_carry_or_no_flat_partition(tmp_path):
    from crate_clip.core.errors import ConfigError
    from crate_clip.train.stage_setup.optimizer_carry import carry_problem
    from crate_clip.train.run.run_config import config_from_dict

    stages = [dict(s) for s in CARRY_STAGES]
    stages[0]["optimizer_state"] = "carry"
    with pytest.raises(ConfigError, match=r"stages.0.optimizer_state: carry, but no stage comes before it; fix: fresh"):
        config_from_dict({"data": {"sources": ["unused"]}, "stages": stages}, check_paths=False)
    cfg = config_from_dict({"data": {"sources": ["unused"]}, "stages": CARRY_STAGES}, check_paths=False)
    assert carry_problem(cfg, 2) is None and carry_problem(cfg, 1) is None
    assert carry_problem(cfg, 3) == ("stages.1.optimizer_state: carry works under ZeRO stage 1 or 2, or 0 in fp32; "
                                     "this run uses ZeRO 3 in bf16; fix: deepspeed.zero_stage 1 or 2, or "
                                     "optimizer_state fresh")
    assert carry_problem(cfg, 0) is not None   # bf16 under ZeRO 0: DeepSpeed's own wrapper holds the state
    fp32 = config_from_dict({"data": {"sources": ["unused"]}, "stages": CARRY_STAGES, "precision": "fp32"},
                            check_paths=False)
    assert carry_problem(fp32, 0) is None
