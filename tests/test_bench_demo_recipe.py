"""bench/bench_demo_recipe.py: its full-resolution run costs the demo's training FLOPs, and its summary holds both
arms over seeds with the contrast paired over images beside the seeds' own spread."""
import sys
from pathlib import Path

import pytest
import yaml

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench import bench_demo_recipe as bench  # noqa: E402
from bench.bench_inverse_scaling import flops_per_sample  # noqa: E402


def test_the_full_resolution_run_costs_the_demos_flops(tmp_path, monkeypatch):
    """full_run's one stage reads every 28 px / patch 7 token and 16 text tokens, and its whole batches cost the
    given FLOPs to within one batch; nothing trains here (train and score_final are set aside)."""
    trained = {}
    monkeypatch.setattr(bench, "train", lambda cfg, run_dir, nproc: trained.setdefault("cfg", cfg) and 1.0)
    monkeypatch.setattr(bench, "score_final", lambda run_dir, cfg, images: {"top1": 0.5, "correct": [1, 0]})
    base = yaml.safe_load(bench.DEMO_CONFIG.read_text())
    run = bench.full_run(0, 10e12, base, tmp_path, tmp_path / "data", 2)
    (stage,) = trained["cfg"]["stages"]
    shape = (stage["image_size"], stage["patch_size"], stage["image_mask"], stage["context_length"])
    assert shape == (28, 7, "none", 16)
    per_sample = flops_per_sample({**trained["cfg"], "stages": [stage]})[0]
    assert stage["samples"] % base["stages"][0]["global_batch"] == 0 and run["samples"] == stage["samples"]
    assert abs(run["flops"] - 10e12) <= base["stages"][0]["global_batch"] * per_sample / 2
    assert run["flops"] == pytest.approx(stage["samples"] * per_sample)


def test_summary_gives_both_arms_and_the_contrast_two_ways():
    rows = [{"seed": s, "demo_top1": d, "full_top1": f, "diff": f - d, "se": 0.003}
            for s, d, f in [(0, 0.866, 0.810), (1, 0.868, 0.815), (2, 0.864, 0.812)]]
    s = bench.summary(rows)
    assert s["demo_mean"] == pytest.approx(86.6) and s["demo_sd"] == pytest.approx(0.2)
    assert s["full_minus_demo"] == pytest.approx(81.23333 - 86.6, abs=1e-4)
    assert s["paired_se"] == pytest.approx(0.3 / 3 ** 0.5)
    assert s["supported"] and s["over_seeds"].startswith("± ") and "on 2 df" in s["over_seeds"]
