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


@pytest.mark.slow
@pytest.mark.multiproc
def test_smoke_run_trains_both_arms_and_writes_the_table_and_plot(tmp_path, tiny_fmnist, monkeypatch):
    from train_fixtures import warm_subprocess

    bench = _bench()
    warm_subprocess(monkeypatch, bench)   # its two trainer processes forked warm: a fresh one spends ~10 s of CPU
    # in imports and start-up
    # the session's small data set (1,200 training pairs, 50 test images), not the demo's 70,000 images
    assert bench.main(["--smoke", "--out", str(tmp_path), "--nproc", "1", "--data-dir", str(tiny_fmnist)]) == 0
    record = json.loads((tmp_path / "docs" / "inverse_scaling.json").read_text())
    assert [(r["arm"], r["seeds"]) for r in record["rows"]] == [("full", 1), ("clipa-p9", 1)]
    assert all(len(run["points"]) >= 2 and 0 <= run["points"][-1]["top1"] <= 1 for run in record["runs"])
    full, clipa = record["runs"]
    assert abs(full["total_flops"] - clipa["total_flops"]) < 0.15 * full["total_flops"]   # whole batches
    table = (tmp_path / "docs" / "inverse_scaling.md").read_text()
    assert "smoke run: measures nothing" in table and "| CRATE-alpha-CLIPA-tiny-w64 | clipa-p9 | 1 |" in table
    assert (tmp_path / "docs" / "inverse_scaling.png").stat().st_size > 1000


def test_a_data_dir_without_the_demos_data_is_refused_in_one_line(tmp_path):
    with pytest.raises(SystemExit) as exc:
        _bench().main(["--smoke", "--out", str(tmp_path), "--data-dir", str(tmp_path / "nothing")])
    assert "no train/ shards and test/classnames.txt there; fix:" in str(exc.value)
    assert not (tmp_path / "docs").exists()
