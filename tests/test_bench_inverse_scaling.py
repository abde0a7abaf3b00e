"""bench/bench_inverse_scaling.py: arms at equal step-meter FLOPs, the FLOPs-to-accuracy reading, and a smoke run
of the whole script (two real trainer runs, their checkpoints evaluated, table + JSON + plot written)."""
import importlib.util
import json
import sys
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]


def _bench():
    spec = importlib.util.spec_from_file_location("bench_inverse_scaling", ROOT / "bench" / "bench_inverse_scaling.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def test_the_clipa_arm_spends_the_full_arms_flops_as_the_step_meter_counts_them():
    bench = _bench()
    base = yaml.safe_load(bench.DEMO_CONFIG.read_text())
    for model in bench.WIDTHS.values():
        full = bench.arm_stages("full", model, 12800, base)
        f_full = bench.flops_per_sample({**base, "model": {"name": model}, "stages": full})
        spent_full = sum(s["samples"] * f for s, f in zip(full, f_full))
        lows = {}
        for arm, (size, patch) in (("clipa", (28, 7)), ("clipa-p9", (27, 9))):   # fine-tunes whose patches tile
            clipa = bench.arm_stages(arm, model, 12800, base)
            f_clipa = bench.flops_per_sample({**base, "model": {"name": model}, "stages": clipa})
            spent_clipa = sum(s["samples"] * f for s, f in zip(clipa, f_clipa))
            assert abs(spent_clipa - spent_full) <= base["stages"][0]["global_batch"] * f_clipa[0]   # one batch
            low, fine = clipa
            assert (low["image_size"], low["patch_size"], low["context_length"], low["text_mask"]) == (21, 7, 8,
                                                                                                      "random")
            assert (fine["image_size"], fine["patch_size"], fine["context_length"]) == (size, patch, 16)
            assert fine["lr"] < low["lr"] and fine["samples"] == pytest.approx(bench.FINETUNE_SHARE * 12800, abs=64)
            assert f_clipa[0] < 0.7 * f_full[0]   # fewer image and text tokens per sample
            lows[arm] = low["samples"]
        assert lows["clipa-p9"] > lows["clipa"]   # its 3x3 fine-tune is cheaper: the first stage gets the rest


def test_flops_to_reach_reads_the_first_crossing_linearly():
    bench = _bench()
    points = [{"flops": 10.0, "top1": 0.5}, {"flops": 20.0, "top1": 0.7}, {"flops": 30.0, "top1": 0.65}]
    assert bench.flops_to_reach(points, 0.6) == pytest.approx(15.0)
    assert bench.flops_to_reach(points, 0.7) == pytest.approx(20.0)
    assert bench.flops_to_reach(points, 0.8) is None
    assert bench.flops_to_reach(points, 0.3) == pytest.approx(10.0 * (0.3 - 0.1) / (0.5 - 0.1))


def test_the_final_models_flops_count_from_where_the_curve_stays_above_the_target():
    """Issue 39 item 3: an arm whose low-resolution checkpoint crosses the full arm's final top-1 and whose
    fine-tune then loses it has reached it at its first crossing, but its final model has not."""
    bench = _bench()
    dips = [{"flops": 10.0, "top1": 0.5}, {"flops": 20.0, "top1": 0.7}, {"flops": 30.0, "top1": 0.55},
            {"flops": 40.0, "top1": 0.65}]
    assert bench.flops_to_reach(dips, 0.6) == pytest.approx(15.0)
    assert bench.flops_to_stay(dips, 0.6) == pytest.approx(35.0)   # back above it between the last two points
    assert bench.flops_to_stay(dips, 0.7) is None                  # the final model ends below it
    assert bench.flops_to_stay(dips[:2], 0.6) == pytest.approx(15.0)
    assert bench.flops_to_stay(dips[:1], 0.3) == pytest.approx(10.0 * (0.3 - 0.1) / (0.5 - 0.1))


def test_each_arms_final_is_compared_with_the_full_arms_on_the_same_images():
    bench = _bench()

    def run(arm, seed, correct, curve):
        return {"width": "w64", "arm": arm, "seed": seed, "total_flops": 100.0, "samples": [64], "stages": None,
                "correct": correct, "points": [{"flops": f, "top1": t} for f, t in curve]}

    full = [1, 1, 0, 0, 1, 0, 1, 0]
    runs = [run("full", 0, full, [(50.0, 0.4), (100.0, 0.5)]),
            run("clipa-p9", 0, [1, 1, 1, 0, 1, 0, 1, 1], [(40.0, 0.55), (80.0, 0.45), (100.0, 0.75)]),
            run("clipa", 0, [1, 0, 0, 0, 1, 0, 1, 0], [(40.0, 0.6), (100.0, 0.375)])]
    rows = {r["arm"]: r for r in bench.summarize(runs)}
    # clipa-p9: d = [0,0,1,0,0,0,0,1]: +0.25, SE sqrt(3/14/8); it crosses 0.5 first at 40 * 0.4 / 0.45 and,
    # after its dip, for good at 80 + 20 * 0.05 / 0.3
    assert (rows["clipa-p9"]["vs_full_mean"], rows["clipa-p9"]["vs_full_se"]) == pytest.approx(
        (25.0, 100 * (3 / 14 / 8) ** 0.5))
    assert rows["clipa-p9"]["flops_share_mean"] == pytest.approx(40 * 0.4 / 0.45 / 100)
    assert rows["clipa-p9"]["final_share_mean"] == pytest.approx((80 + 20 * 0.05 / 0.3) / 100)
    # clipa: reached at its first checkpoint, lost after: its final model has not reached it
    assert rows["clipa"]["reached"] == 1 and rows["clipa"]["final_reached"] == 0
    assert rows["clipa"]["final_share_mean"] is None and rows["clipa"]["vs_full_mean"] == pytest.approx(-12.5)
    assert "vs_full_mean" not in rows["full"]


@pytest.mark.slow
@pytest.mark.multiproc
def test_smoke_run_trains_both_arms_and_writes_the_table_and_plot(tmp_path, tiny_fmnist, monkeypatch):
    """The study's --smoke, then the inverse-scaling sweep's --quick in the same folders: its 16-token run is the
    study's full arm, reused (one more trainer run, at 4 tokens), and each script writes its own section."""
    from train_fixtures import warm_subprocess

    bench, law = _bench(), _law()
    for module in (bench, law.study):   # their trainer processes forked warm: a fresh one spends ~10 s of CPU in
        warm_subprocess(monkeypatch, module)   # imports and start-up
    # the session's small data set (1,200 training pairs, 50 test images), not the demo's 70,000 images
    common = ["--out", str(tmp_path), "--nproc", "1", "--data-dir", str(tiny_fmnist)]
    assert bench.main(["--smoke", *common]) == 0
    record = json.loads((tmp_path / "docs" / "inverse_scaling.json").read_text())
    assert [(r["arm"], r["seeds"]) for r in record["rows"]] == [("full", 1), ("clipa-p9", 1)]
    assert all(len(run["points"]) >= 2 and 0 <= run["points"][-1]["top1"] <= 1 for run in record["runs"])
    assert record["runs"][-1]["points"][-1]["images"] == 100   # the final model: every test image (50 here)
    full, clipa = record["runs"]
    assert abs(full["total_flops"] - clipa["total_flops"]) < 0.15 * full["total_flops"]   # whole batches
    assert -100 <= record["rows"][1]["vs_full_mean"] <= 100 and record["rows"][1]["vs_full_se"] >= 0
    table = (tmp_path / "docs" / "inverse_scaling.md").read_text()
    assert "smoke run: measures nothing" in table and "| CRATE-alpha-CLIPA-tiny-w64 | clipa-p9 | 1 |" in table
    assert (tmp_path / "docs" / "inverse_scaling.png").stat().st_size > 1000

    full_run = (tmp_path / "w64_full_s0.done").read_text(), (tmp_path / "w64_full_s0.log").stat().st_mtime_ns
    assert law.main(["--quick", *common]) == 0
    assert ((tmp_path / "w64_full_s0.done").read_text(), (tmp_path / "w64_full_s0.log").stat().st_mtime_ns) == full_run
    sweep = json.loads((tmp_path / "docs" / "inverse_scaling_law.json").read_text())
    assert [(r["tokens"], r["image_size"]) for r in sweep["rows"]] == [(4, 14), (16, 28)]
    assert sweep["rows"][1]["top1_mean"] == pytest.approx(100 * full["points"][-1]["top1"])   # the same model
    short = sweep["rows"][0]
    assert short["samples"] > 2 * 256 and -100 <= short["change_mean"] <= 100 and short["change_se"] >= 0
    page = (tmp_path / "docs" / "inverse_scaling.md").read_text()
    assert "quick run: measures nothing" in page and "| CRATE-alpha-CLIPA-tiny-w64 | 4 | 14 |" in page
    assert "smoke run: measures nothing" in page   # the study's section kept
    assert (tmp_path / "docs" / "inverse_scaling_law.png").stat().st_size > 1000


def test_a_data_dir_without_the_demos_data_is_refused_in_one_line(tmp_path):
    with pytest.raises(SystemExit) as exc:
        _bench().main(["--smoke", "--out", str(tmp_path), "--data-dir", str(tmp_path / "nothing")])
    assert "no train/ shards and test/classnames.txt there; fix:" in str(exc.value)
    assert not (tmp_path / "docs").exists()


# bench/bench_inverse_scaling_law.py: image tokens x tower width at equal FLOPs (issue 39 item 5)

def _law():
    _bench()   # the study module it imports, by its file (bench/ is no package the suite imports)
    spec = importlib.util.spec_from_file_location("bench_inverse_scaling_law",
                                                  ROOT / "bench" / "bench_inverse_scaling_law.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_each_token_length_spends_its_widths_flops_on_a_grid_the_patches_tile():
    law = _law()
    base = yaml.safe_load(law.study.DEMO_CONFIG.read_text())
    batch = base["stages"][0]["global_batch"]
    for width in ("w64", "w256"):   # the narrowest and the widest tower (each FLOPs count builds a model on meta)
        model = law.WIDTHS[width]
        stages = law.token_stages(model, [4, 9, 16], 12800, base)
        flops = law.study.flops_per_sample({**base, "model": {"name": model}, "stages": list(stages.values())})
        spent = {t: s["samples"] * f for (t, s), f in zip(stages.items(), flops)}
        for tokens, stg in stages.items():
            assert abs(spent[tokens] - spent[16]) <= batch * flops[0] / 2, (width, tokens)   # whole batches
            side = stg["image_size"] // stg["patch_size"]
            assert stg["image_size"] % stg["patch_size"] == 0 and side * side == tokens
            assert (stg["context_length"], stg["text_mask"], stg["lr"]) == (16, "truncate", base["stages"][0]["lr"])
        assert stages[4]["samples"] > stages[9]["samples"] > stages[16]["samples"] == 12800
        # the 16-token run is the study's full arm: one run serves both scripts
        assert stages[16] == law.study.arm_stages("full", model, 12800, base)[0]


def test_the_change_and_the_width_contrast_are_paired_per_image():
    law = _law()
    ref = [1, 1, 1, 1, 0, 0, 1, 0]
    runs = [{"width": "w64", "tokens": 16, "seed": 0, "correct": ref},
            {"width": "w64", "tokens": 4, "seed": 0, "correct": [1, 0, 0, 1, 0, 0, 1, 0]},      # 2 lost
            {"width": "w256", "tokens": 16, "seed": 0, "correct": ref},
            {"width": "w256", "tokens": 4, "seed": 0, "correct": [1, 1, 0, 1, 1, 0, 1, 0]}]     # 1 lost, 1 won
    for r in runs:
        r.update(model=law.WIDTHS[r["width"]], samples=100, total_flops=1.0, top1=sum(r["correct"]) / 8)
    summary = law.summarize(runs)
    changes = {(r["width"], r["tokens"]): (r.get("change_mean"), r.get("change_se")) for r in summary["rows"]}
    # w64: d = [0,-1,-1,0,0,0,0,0]: mean -0.25, sample variance 3/14 -> SE sqrt(3/14/8)
    assert changes[("w64", 4)] == pytest.approx((-25.0, 100 * (3 / 14 / 8) ** 0.5))
    assert changes[("w256", 4)][0] == pytest.approx(0.0) and changes[("w64", 16)] == (None, None)
    (contrast,) = summary["contrasts"]
    # per image: (w256 change) - (w64 change) = [0,+1,0,0,+1,0,0,0]: mean +0.25, SE sqrt(3/14/8)
    assert (contrast["small"], contrast["large"], contrast["tokens"]) == ("w64", "w256", 4)
    assert (contrast["difference"], contrast["se"]) == pytest.approx((25.0, 100 * (3 / 14 / 8) ** 0.5))
    assert contrast["per_seed"] == pytest.approx([25.0])


def test_the_sweep_needs_the_16_token_run_it_compares_with(capsys):
    with pytest.raises(SystemExit) as exc:
        _law().parse_args(["--tokens", "4", "9"])
    assert exc.value.code == 2 and "--tokens must include 16" in capsys.readouterr().err


def test_a_study_page_shows_its_command_without_one_machines_folders():
    _law()   # puts the checkout on sys.path, as the bench scripts run
    from bench.report import shown_command

    shown = shown_command("python bench/x.py --seeds 3 --data-dir /d --out=/o --docs /p --label 'a b'")
    # the label left out too: the section prints it in bold above the command
    assert shown == "`python bench/x.py --seeds 3` (its data, runs and docs folders passed as options)"
    assert shown_command("python bench/x.py --out /o") == "`python bench/x.py` (its runs folder passed as options)"
    assert shown_command("python bench/x.py --quick") == "`python bench/x.py --quick`"


# the spread of a contrast over its training seeds (issue 53 item 3)

def test_a_contrasts_spread_over_seeds_is_a_t_on_seeds_minus_one_df():
    _bench()   # puts the checkout on sys.path, as the bench scripts run
    from bench.seed_spread import sd, seed_spread

    assert sd([1.0, 2.0, 3.0]) == pytest.approx(1.0) and sd([5.0]) == 0.0   # ddof 1 (ddof 0 would give 0.82)
    # the demo's fine-tune gain per seed: +0.48 with a paired SE of 0.10 over images, but over its seeds
    gain = seed_spread([-0.09, 0.69, 0.84])
    assert (gain.mean, gain.se, gain.t, gain.df) == pytest.approx((0.48, 0.2883, 1.665, 2), abs=1e-3)
    assert (gain.low, gain.high) == pytest.approx((0.48 - 4.3027 * 0.2883, 0.48 + 4.3027 * 0.2883), abs=1e-3)
    assert not gain.supported and "t +1.7 on 2 df, 95% interval -0.76 to +1.72" in gain.text()
    width = seed_spread([-0.63, -2.09, -1.75])    # the width contrast at 4 tokens: every seed below zero, yet
    assert width.t == pytest.approx(-3.38, abs=0.01) and not width.supported   # 95% interval -3.39 to +0.41
    assert seed_spread([2.2, 2.7, 3.1]).supported and seed_spread([-8.9, -8.1, -8.6]).supported
    assert seed_spread([0.5]).text() == "1 seed: no spread over seeds"


def test_the_pages_tables_are_what_the_scripts_give_from_the_stored_records(tmp_path):
    """docs/inverse_scaling.md's two sections are rewritten from docs/inverse_scaling*.json alone (no training):
    the committed page is what the scripts give now (one ddof, the seeds' spread beside each paired SE)."""
    law = _law()
    for name in ("inverse_scaling.md", "inverse_scaling.json", "inverse_scaling_law.json"):
        (tmp_path / name).write_text((ROOT / "docs" / name).read_text())
    assert law.study.main(["--from-record", "--docs", str(tmp_path)]) == 0
    assert law.main(["--from-record", "--docs", str(tmp_path)]) == 0
    assert (tmp_path / "inverse_scaling.md").read_text() == (ROOT / "docs" / "inverse_scaling.md").read_text()
    rows = json.loads((tmp_path / "inverse_scaling.json").read_text())["rows"]
    finals = {(r["width"], r["arm"]): r for r in rows}
    full = finals[("w128", "full")]
    assert full["final_top1_std"] > 0 and "vs_full_seeds" not in full
    spread = finals[("w128", "clipa-p9")]["vs_full_seeds"]
    assert len(spread["per_seed"]) == 3 and spread["df"] == 2 and spread["low"] < spread["high"]


def test_the_demo_seeds_table_gives_the_mean_gain_over_images_and_over_seeds():
    _bench()
    spec = importlib.util.spec_from_file_location("demo_seeds", ROOT / "bench" / "demo_seeds.py")
    seeds = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(seeds)
    rows = [{"seed": s, "stage0_21": None, "stage0_27": a, "final_27": b, "probe": None, "gain": b - a, "se": se}
            for s, (a, b, se) in enumerate([(0.8649, 0.8640, 0.0016), (0.8605, 0.8674, 0.0019),
                                            (0.8572, 0.8656, 0.0018)])]
    mean = seeds.table(rows).splitlines()[-1]
    assert mean.startswith("| mean ± SD over seeds | - | 86.09 ± 0.39 | 86.57 ± 0.17 | - |")
    assert "+0.48 ± 0.10 (z +4.7); ± 0.29 SE over 3 seeds, t +1.7 on 2 df, 95% interval -0.76 to +1.72" in mean
