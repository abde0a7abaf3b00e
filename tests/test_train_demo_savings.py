"""The demo's saving lines: the run's own FLOPs (the step meter's records) and accuracy always; the study's recorded
figures only for a run of the studied recipe, otherwise the way the run differs from it."""
import json

from crate_clip.train.demo import recipe_difference, run_recipe, savings_lines, training_flops

DEMO_ARM = run_recipe([{"image_size": 21, "patch_size": 7, "context_length": 8, "text_mask": "random",
                        "global_batch": 64, "samples": 8000, "lr": 2e-3},
                       {"image_size": 27, "patch_size": 9, "context_length": 16, "text_mask": "truncate",
                        "global_batch": 64, "samples": 2000, "lr": 2e-3 * 0.1}])


def _metrics(run_dir, rows):
    run_dir.mkdir()
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))


def _study(path, rows):
    path.write_text(json.dumps({"date": "2026-12-02 04:00 UTC", "label": "REDUCED configuration (tiny)",
                                "rows": rows}))
    return path


def test_the_run_reports_its_own_flops_and_accuracy_from_the_meter(tmp_path):
    run = tmp_path / "run"
    _metrics(run, [{"stage_index": 0, "samples_seen": 640, "flops_per_sample": 5e7},
                   {"stage_index": 0, "samples_seen": 8000, "flops_per_sample": 5e7},
                   {"stage_index": 0, "loss": 1.0},   # a record without the meter's fields
                   {"stage_index": 1, "samples_seen": 10000, "flops_per_sample": 1e8}])
    assert training_flops(run) == (8000 * 5e7 + 2000 * 1e8, 10000, 1e8)
    assert savings_lines(run, 0.85, "M", DEMO_ARM, study=tmp_path / "absent.json") == [
        "this run: zero-shot top-1 85.00% after 0.60 TFLOP of training (step meter, 10,000 samples), 60% of what "
        "the same samples cost at its last stage's input (27 px / patch 9, 16 text tokens)"]


def test_the_studys_figures_only_for_a_run_of_the_studied_recipe(tmp_path):
    run = tmp_path / "run"
    _metrics(run, [{"stage_index": 0, "samples_seen": 8000, "flops_per_sample": 5e7},
                   {"stage_index": 1, "samples_seen": 10000, "flops_per_sample": 1e8}])
    rows = [{"model": "M", "arm": "full", "final_top1_mean": 44.9},
            {"model": "M", "arm": "clipa-p9", "flops_share_mean": 0.62, "flops_share_std": 0.05, "reached": 3,
             "seeds": 3, "final_top1_mean": 33.8, "stages": DEMO_ARM}]
    study = _study(tmp_path / "inverse_scaling.json", rows)
    own, claim = savings_lines(run, 0.85, "M", DEMO_ARM, study=study)
    assert own.startswith("this run: zero-shot top-1 85.00% after 0.60 TFLOP")
    assert claim == ("the CLIPA recipe as the demo runs it (fine-tune at patch 9, the 3x3 grid kept) reached the "
                     "full-resolution recipe's final top-1 with 62 ± 5% (SD over seeds) of its FLOPs (3/3 seeds; "
                     "final top-1 33.80% vs 44.90%) (bench/bench_inverse_scaling.py, 2026-12-02 04:00 UTC, 3 seeds; "
                     "REDUCED configuration)")
    smoke = run_recipe([{**DEMO_ARM[0], "samples": 640}, {**DEMO_ARM[1], "patch_size": None, "samples": 64}])
    assert smoke[1]["patch_size"] == 7   # a stage without one keeps the patch set before it
    own, refusal = savings_lines(run, 0.85, "M", smoke, study=study)
    assert "62" not in refusal and refusal == (
        "the compute-matched study's figures (docs/inverse_scaling.md) are not claimed for this run: it differs "
        "from the study's clipa-p9 arm: stage 0 samples 640, the study's 8000")
    assert savings_lines(run, 0.85, "other", DEMO_ARM, study=study)[1].endswith("the study trained no other")
    rows[1].pop("stages")   # a study written before arms recorded their recipe claims nothing
    assert "no recipe" in savings_lines(run, 0.85, "M", DEMO_ARM, study=_study(study, rows))[1]


def test_recipe_difference_names_the_first_differing_key():
    assert recipe_difference(DEMO_ARM, DEMO_ARM) is None
    assert recipe_difference(DEMO_ARM, DEMO_ARM[:1]) == "2 stages, the study's 1"
    assert recipe_difference(DEMO_ARM, [DEMO_ARM[0], {**DEMO_ARM[1], "context_length": 8}]) == (
        "stage 1 context_length 16, the study's 8")


def test_the_demo_config_is_not_the_studied_recipe_and_says_why():
    """The shipped study (docs/inverse_scaling.json) records the arms' recipes; the demo's own config differs
    from its clipa-p9 arm (16 text tokens in stage 0, the study's 8), so the demo claims none of its figures."""
    from crate_clip.train.demo import DEMO_CONFIG, STUDY_RESULTS, _run_config

    cfg = _run_config(str(DEMO_CONFIG), [])
    rows = {(r["model"], r["arm"]): r for r in json.loads(STUDY_RESULTS.read_text())["rows"]}
    arm = rows[(cfg["model"]["name"], "clipa-p9")]
    assert recipe_difference(run_recipe(cfg["stages"]), arm["stages"]) == "stage 0 context_length 16, the study's 8"
    studied = [f"stages.{i}.{k}={json.dumps(v)}" for i, s in enumerate(arm["stages"]) for k, v in s.items()]
    assert recipe_difference(run_recipe(_run_config(str(DEMO_CONFIG), studied)["stages"]), arm["stages"]) is None
