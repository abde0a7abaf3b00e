"""The demo's saving line: its FLOPs from the step meter's records, the study's result from the file it writes."""
import json

from crate_clip.train.demo import savings_lines, training_flops


def _metrics(run_dir, rows):
    run_dir.mkdir()
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))


def test_the_saving_is_read_from_the_meter_and_the_studys_recorded_result(tmp_path):
    run = tmp_path / "run"
    _metrics(run, [{"stage_index": 0, "samples_seen": 640, "flops_per_sample": 5e7},
                   {"stage_index": 0, "samples_seen": 8000, "flops_per_sample": 5e7},
                   {"stage_index": 0, "loss": 1.0},   # a record without the meter's fields
                   {"stage_index": 1, "samples_seen": 10000, "flops_per_sample": 1e8}])
    assert training_flops(run) == (8000 * 5e7 + 2000 * 1e8, 10000, 1e8)
    assert savings_lines(run, 0.85, "M", study=tmp_path / "absent.json") == [
        "reached 85.00% with 0.60 TFLOP of training (step meter): 60% of the same 10,000 samples at full "
        "resolution (its last stage's)"]
    study = tmp_path / "inverse_scaling.json"
    rows = [{"model": "M", "arm": "full", "total_flops": 2e11, "samples": [1600], "seeds": 3, "final_top1_mean": 44.9},
            {"model": "M", "arm": "clipa", "flops_share_mean": 0.62, "flops_share_std": 0.05, "reached": 3, "seeds": 3,
             "final_top1_mean": 33.8}]
    study.write_text(json.dumps({"date": "2026-12-02 04:00 UTC", "label": "REDUCED configuration (tiny)",
                                 "rows": rows}))
    full_line, study_line = savings_lines(run, 0.85, "M", study=study)
    assert "48% of the same 10,000 samples at full resolution (28 px / patch 7" in full_line   # 6e11 / (1e4 * 1.25e8)
    assert study_line == ("the paper's CLIPA shape (fine-tune at patch 7, the grid grown to 4x4) reached the "
                          "full-resolution recipe's final top-1 with 62 ± 5% of its FLOPs (3/3 seeds; final top-1 "
                          "33.80% vs 44.90%) (bench/bench_inverse_scaling.py, 2026-12-02 04:00 UTC, 3 seeds; REDUCED "
                          "configuration)")
    rows[1].update(flops_share_mean=None, flops_share_std=None, reached=0)
    rows.append({"model": "M", "arm": "clipa-p9", "flops_share_mean": 0.66, "flops_share_std": 0.01, "reached": 3,
                 "seeds": 3, "final_top1_mean": 46.0})
    study.write_text(json.dumps({"date": "d", "rows": rows}))
    _, demo_arm, paper_arm = savings_lines(run, 0.85, "M", study=study)   # the demo's shape first
    assert demo_arm.startswith("the CLIPA recipe as the demo runs it (fine-tune at patch 9, the 3x3 grid kept) "
                               "reached the full-resolution recipe's final top-1 with 66 ± 1% of its FLOPs (3/3 "
                               "seeds; final top-1 46.00% vs 44.90%)")
    assert "did not reach" in paper_arm
    assert len(savings_lines(run, 0.85, "other model", study=study)) == 1   # the study measured another model
