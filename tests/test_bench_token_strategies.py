"""bench/bench_token_strategies.py (issue 53 item 1): every arm's stages are a valid run config with the same samples,
and the image tower of each stage sees the patch tokens the arm's table says (counted by the step meter's own
forward, not from the arm's description)."""
import sys

import pytest
import yaml

from train_fixtures import REPO_ROOT

sys.path.insert(0, str(REPO_ROOT))


@pytest.mark.parametrize("arm", ["full", "resize-grow-9", "resize-keep-4", "random-9", "block-4", "grid-4"])
def test_each_arm_trains_the_same_samples_on_the_tokens_it_names(arm, tmp_path):
    from bench.bench_inverse_scaling import run_config
    from bench.bench_token_strategies import WIDTHS, arm_stages, arm_tokens
    from bench.demo_runs import DEMO_CONFIG
    from crate_clip.train.run.run_config import config_from_dict
    from crate_clip.train.stage_setup.stage_model import resolve_stage

    base = yaml.safe_load(DEMO_CONFIG.read_text())
    stages = arm_stages(arm, 640, 128, base)
    # the run config the study trains (its checks pass: patches tile each stage's input, ...)
    cfg = config_from_dict(run_config(WIDTHS["w128"], 0, stages, tmp_path / "run", base, 0, tmp_path),
                           check_paths=False)
    assert [s.samples for s in cfg.stages] == [640, 128]
    assert cfg.stages[1].lr == pytest.approx(cfg.stages[0].lr / 10) and cfg.stages[1].image_mask == "none"
    # the step meter's count reads the tokens at the first image block: the class token and the patches kept
    seen = [resolve_stage(cfg, i).counts.image_tokens - 1 for i in range(2)]
    assert " -> ".join(map(str, seen)) == arm_tokens(arm)
    assert seen[1] in (4, 9, 16) and (seen[0] < 16) == (arm != "full")
