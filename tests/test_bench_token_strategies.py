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


def test_the_record_keeps_a_paired_difference_only_for_the_seeds_it_pooled(tmp_path):
    """A checkout without some seeds' per-image scores: a recorded paired difference over all of a row's seeds is
    kept; one over fewer seeds than the row has now is not, and the row pools the seeds it can, naming them."""
    import json

    from bench.bench_token_strategies import write_docs

    def run(arm, seed, top1, correct=None):
        return {"width": "w128", "arm": arm, "seed": seed, "tokens": "16 -> 16", "samples": [8, 2], "stages": [],
                "top1": top1, "total_flops": 1e12, "wall_seconds": 1.0, **({"correct": correct} if correct else {})}

    ones, some = [1, 1, 1, 1], [1, 0, 1, 0]
    runs = [run("full", 0, 0.8), run("random-4", 0, 0.7),   # seed 0: scores in another checkout
            run("full", 1, 0.8, ones), run("random-4", 1, 0.5, some),
            run("full", 2, 0.8, ones), run("random-4", 2, 0.5, some)]
    meta = {"date": "d", "machine": "m", "command": "c", "label": "", "samples": 8, "finetune_samples": 2,
            "final_images": 4, "wall_seconds": 1.0, "docs": tmp_path}
    (tmp_path / "inverse_scaling.md").write_text("# page\n")
    earlier = [{"width": "w128", "arm": "random-4", "seeds": 1, "vs_full_mean": -9.0, "vs_full_se": 0.4}]
    write_docs(meta, runs, earlier)
    row = next(r for r in json.loads((tmp_path / "token_strategies.json").read_text())["rows"]
               if r["arm"] == "random-4")
    assert row["vs_full_paired_seeds"] == [1, 2] and row["vs_full_mean"] == pytest.approx(-50.0)
    assert "-50.00 ± " in (tmp_path / "inverse_scaling.md").read_text() and "(seeds 1, 2)" in \
        (tmp_path / "inverse_scaling.md").read_text()
    earlier[0]["seeds"] = 3   # a record that pooled all three seeds: kept
    write_docs(meta, runs, earlier)
    row = next(r for r in json.loads((tmp_path / "token_strategies.json").read_text())["rows"]
               if r["arm"] == "random-4")
    assert (row["vs_full_mean"], row["vs_full_paired_seeds"]) == (-9.0, [0, 1, 2])
