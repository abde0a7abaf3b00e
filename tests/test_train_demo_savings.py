"""The demo's saving lines: the run's own FLOPs (the step meter's records) and accuracy against the same samples all
at its last stage's input; bench/bench_demo_recipe.py's comparison with full-resolution training at equal FLOPs only
for a run of the recorded recipe, otherwise the way the run differs from it."""
import json

from crate_clip.train.demo import recipe_difference, run_recipe, savings_lines, training_flops

DEMO_ARM = run_recipe([{"image_size": 21, "patch_size": 7, "image_mask": "random", "image_mask_ratio": 0.67,
                        "context_length": 8, "text_mask": "syntax", "global_batch": 64, "samples": 8000, "lr": 2e-3},
                       {"image_size": 27, "patch_size": 9, "image_mask": "none", "image_mask_ratio": 0.0,
                        "context_length": 16, "text_mask": "truncate", "global_batch": 64, "samples": 2000,
                        "lr": 2e-3 * 0.1}])


def _metrics(run_dir, rows):
    run_dir.mkdir()
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))


def _record(path, recipe=DEMO_ARM, model="M"):
    path.write_text(json.dumps({
        "date": "2026-12-07 21:00 UTC", "model": model, "recipe": recipe, "demo_flops": 0.6e12, "full_samples": 4480,
        "full_shape": {"image_size": 28, "patch_size": 7},
        "summary": {"seeds": 3, "demo_mean": 86.6, "demo_sd": 0.2, "full_mean": 81.1, "full_sd": 0.3,
                    "full_minus_demo": -5.5, "paired_se": 0.2,
                    "over_seeds": "± 0.20 SE over 3 seeds, t -27.5 on 2 df, 95% interval -6.36 to -4.64"}}))
    return path


def test_the_run_reports_its_own_flops_and_accuracy_from_the_meter(tmp_path):
    run = tmp_path / "run"
    _metrics(run, [{"stage_index": 0, "samples_seen": 640, "flops_per_sample": 5e7},
                   {"stage_index": 0, "samples_seen": 8000, "flops_per_sample": 5e7},
                   {"stage_index": 0, "loss": 1.0},   # a record without the meter's fields
                   {"stage_index": 1, "samples_seen": 10000, "flops_per_sample": 1e8}])
    assert training_flops(run) == (8000 * 5e7 + 2000 * 1e8, 10000, 1e8)
    assert savings_lines(run, 0.85, "M", DEMO_ARM, record=tmp_path / "absent.json") == [
        "this run: zero-shot top-1 85.00% after 0.60 TFLOP of training (step meter, 10,000 samples), 60% of what "
        "the same samples cost at its last stage's input (27 px / patch 9, 16 text tokens)"]


def test_the_equal_flops_comparison_only_for_a_run_of_the_recorded_recipe(tmp_path):
    run = tmp_path / "run"
    _metrics(run, [{"stage_index": 0, "samples_seen": 8000, "flops_per_sample": 5e7},
                   {"stage_index": 1, "samples_seen": 10000, "flops_per_sample": 1e8}])
    record = _record(tmp_path / "demo_recipe.json")
    own, claim = savings_lines(run, 0.85, "M", DEMO_ARM, record=record)
    assert own.startswith("this run: zero-shot top-1 85.00% after 0.60 TFLOP")
    assert claim == ("at equal FLOPs (0.60 TFLOP): this recipe ended at 86.60 ± 0.20%, full-resolution training "
                     "(28 px / patch 7, every image token, 4,480 samples) at 81.10 ± 0.30% (± SD over 3 seeds; "
                     "full - this recipe -5.50 ± 0.20 paired over images, ± 0.20 SE over 3 seeds, t -27.5 on 2 df, "
                     "95% interval -6.36 to -4.64; bench/bench_demo_recipe.py, 2026-12-07 21:00 UTC)")
    smoke = run_recipe([{**DEMO_ARM[0], "samples": 640}, {**DEMO_ARM[1], "patch_size": None, "samples": 64}])
    assert smoke[1]["patch_size"] == 7   # a stage without one keeps the patch set before it
    own, refusal = savings_lines(run, 0.85, "M", smoke, record=record)
    assert "81.10" not in refusal and refusal == (
        "the comparison at equal FLOPs (demo_recipe.json) is not claimed for this run: stage 0 samples 640, the "
        "record's 8000")
    assert savings_lines(run, 0.85, "other", DEMO_ARM, record=record)[1].endswith("the record trained M")


def test_recipe_difference_names_the_first_differing_key():
    assert recipe_difference(DEMO_ARM, DEMO_ARM) is None
    assert recipe_difference(DEMO_ARM, DEMO_ARM[:1]) == "2 stages, the record's 1"
    assert recipe_difference(DEMO_ARM, [DEMO_ARM[0], {**DEMO_ARM[1], "context_length": 8}]) == (
        "stage 1 context_length 16, the record's 8")
    assert recipe_difference(DEMO_ARM, [{**DEMO_ARM[0], "image_mask": "none"}, DEMO_ARM[1]]) == (
        "stage 0 image_mask random, the record's none")


def test_the_shipped_record_is_the_demo_configs_recipe():
    """docs/demo_recipe.json (bench/bench_demo_recipe.py) measured the demo config as shipped, so `make demo` prints
    its comparison at equal FLOPs; a changed config has to be measured again."""
    from crate_clip.train.demo import DEMO_CONFIG, RECIPE_RESULTS, _run_config

    cfg = _run_config(str(DEMO_CONFIG), [])
    record = json.loads(RECIPE_RESULTS.read_text())
    assert record["model"] == cfg["model"]["name"]
    assert recipe_difference(run_recipe(cfg["stages"]), record["recipe"]) is None
