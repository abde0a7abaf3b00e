"""Watching a run (issue 42): evaluations during a stage within a share of the training time, progress lines when
the console is not a terminal (rank 0 only, DeepSpeed's chatter in the run's log file), the trackers of
logging.report_to (TensorBoard, Weights & Biases offline, CSV) and a curve whose points say how they were taken."""
from __future__ import annotations

import csv
import json
import sys

import pytest

from train_fixtures import ranks_cmd, read_jsonl, run_job, tiny_config, write_config


# ---------------------------------------------------------------- cheap: the pieces
def test_mid_stage_marks_fall_on_every_samples_and_never_on_the_last_step():
    from crate_clip.train.checkpointing.checkpoints import Progress
    from crate_clip.train.run.run_config import config_from_dict
    from crate_clip.train.loop.stage_evals import mid_stage_due

    cfg = config_from_dict({"data": {"sources": ["/data/{00000000..00000009}.tar"]},
                            "stages": [{"name": "s", "image_size": 16, "samples": 160, "global_batch": 16}],
                            "eval": {"every_samples": 40, "evals": [{"name": "pets", "dataset": "pets",
                                                                      "data": "/data/pets"}]}}, check_paths=False)
    due = [step for step in range(1, 11) if mid_stage_due(cfg, Progress(step=step), 16, last=step == 10)]
    assert due == [3, 5, 8]   # 48 >= 40, 80 >= 80, 128 >= 120; 160 is the stage's end (its own evaluations)
    cfg.eval.every_samples, cfg.eval.every_steps = 0, 4
    assert [s for s in range(1, 11) if mid_stage_due(cfg, Progress(step=s), 16, last=s == 10)] == [4, 8]


def test_the_budget_defers_an_evaluation_over_its_share_and_says_so_once():
    from crate_clip.train.loop.stage_evals import EvalBudget

    budget = EvalBudget(0.05)
    assert budget.allows(train_s=1.0)   # the first runs: it measures the cost
    assert "took 2.0 s" in budget.spent(2.0, train_s=10.0) and "20.0% of 10.0 s" in budget.spent(0.0, 10.0)
    budget.last_cost_s = 2.0
    assert not budget.allows(train_s=60.0)   # 2 + 2 s > 5% of 60 s
    line = budget.deferral(60.0, mark=320)
    assert line.startswith("[eval] mid-stage evaluation due at 320 samples deferred") and "5%" in line
    assert budget.deferral(61.0, mark=320) is None   # said once per mark
    assert budget.allows(train_s=80.0)   # 4 s <= 5% of 80 s: it runs later


def test_progress_is_a_plain_line_every_n_seconds_off_a_terminal(capsys):
    from crate_clip.train.reporting.progress_display import StageProgress

    display = StageProgress("stage 0 low @16px", total_steps=4, done_steps=0, samples_per_step=16, every_s=3600,
                            bar=False)
    display.update(1, 2.5, rate=20.0, postfix={})
    display.update(2, None, rate=20.0, postfix={})
    assert capsys.readouterr().out == ""   # not yet due
    display.every_s = 0
    display.update(3, 2.25, rate=16.0, postfix={})
    display.close()   # the stage's last line only when the last step was not printed
    lines = capsys.readouterr().out.splitlines()
    assert lines == ["[progress] stage 0 low @16px: step 3/4 (75%), 48/64 samples, loss 2.2500, 16 samples/s, "
                     "ETA 0:00:01"]


def test_the_curve_labels_each_point_and_keeps_both_ways_to_full_resolution(tmp_path):
    from crate_clip.train.reporting.training_curve import (eval_series, point_label, series_label, stage_spans,
                                                           write_plot)

    steps = [{"stage_index": i, "stage_name": n, "step": s, "samples_seen": x, "image_size": p, "loss": 3.0 - x / 100}
             for i, n, p, xs in ((0, "low", 16, (16, 32, 48)), (1, "full", 28, (64, 80))) for s, x in enumerate(xs, 1)]
    row = {"eval": "fmnist", "top1": 0.4}
    results = [{**row, "stage_index": 0, "image_size": 16, "stage_image_size": 16, "patch_size": 4, "resize": "grid",
                "samples_seen": 32, "at": "mid_stage"},
               {**row, "stage_index": 0, "image_size": 16, "stage_image_size": 16, "patch_size": 4, "resize": "grid",
                "samples_seen": 48},
               {**row, "stage_index": 0, "image_size": 28, "stage_image_size": 16, "patch_size": 4, "resize": "grid",
                "samples_seen": 48, "top1": 0.418},
               {**row, "stage_index": 0, "image_size": 28, "stage_image_size": 16, "patch_size": 7,
                "resize": "patch", "samples_seen": 48, "top1": 0.859},
               {**row, "stage_index": 1, "image_size": 28, "stage_image_size": 28, "patch_size": 4, "resize": "grid",
                "samples_seen": 80, "top1": 0.848}]
    series = eval_series(results)
    # the grid-grown 41.8% is never joined to the fine-tune's 84.8%: each stage-0 way is a point of its own
    assert [r["top1"] for r in series[("trained",)]] == [0.4, 0.4, 0.848]
    assert series_label((0, 28, "grid"), series[(0, 28, "grid")]) == "stage 0 -> 28 px, grid grown (p4)"
    assert series_label((0, 28, "patch"), series[(0, 28, "patch")]) == "stage 0 -> 28 px, kernel resized (p7)"
    assert [point_label(r) for r in results] == ["16px p4", "16px p4", "28px p4 grid grown", "28px p7 kernel resized",
                                                 "28px p4"]
    assert stage_spans(steps) == [(0, "low", 16, 16, 48), (1, "full", 28, 48, 80)]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in steps))
    (tmp_path / "results.jsonl").write_text("".join(json.dumps(r) + "\n" for r in results))
    assert write_plot(tmp_path).stat().st_size > 10_000


def test_report_to_wandb_without_wandb_installed_is_one_line(monkeypatch):
    from crate_clip.train.run.run_config import config_from_dict, runtime_problems

    monkeypatch.setitem(sys.modules, "wandb", None)   # what an install without the extra imports: nothing
    cfg = config_from_dict({"data": {"sources": ["/data/{00000000..00000009}.tar"]},
                            "stages": [{"name": "s", "image_size": 16, "samples": 16, "global_batch": 16}],
                            "logging": {"report_to": ["tensorboard", "wandb"]}}, check_paths=False)
    assert runtime_problems(cfg, 1) == ["logging.report_to: names wandb, which is not installed; fix: pip install "
                                        "wandb (or remove wandb from logging.report_to)"]


@pytest.mark.multiproc
def test_wandb_without_a_login_stops_every_rank_with_one_line(tiny_fmnist, tmp_path, monkeypatch):
    pytest.importorskip("wandb")
    for key in ("WANDB_MODE", "WANDB_API_KEY"):
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))   # no ~/.netrc, no wandb settings: a machine never logged in
    monkeypatch.setenv("WANDB_CONFIG_DIR", str(tmp_path / "wandb-config"))
    monkeypatch.setenv("FORK_RANKS_OUTPUT_DIR", str(tmp_path))
    cfg = tiny_config(tmp_path / "run", tiny_fmnist, precision="fp32", stages=WATCH_STAGES[:1],
                      logging={"report_to": ["wandb"]})
    proc = run_job(ranks_cmd(2, "--config", str(write_config(cfg, tmp_path / "run.yaml")),
                             module="crate_clip.train.cli"), timeout=200)
    assert proc.returncode == 2
    assert (tmp_path / "rank0.err").read_text().splitlines() == [
        "crate-clip train: logging.report_to: wandb could not start its run: No API key configured. Use `wandb login` "
        "to log in. (fix: `wandb login`, or WANDB_MODE=offline to write it under the run folder and `wandb sync` it "
        "later)"]
    assert all((tmp_path / f"rank{r}.{k}").read_text() == "" for r, k in ((0, "out"), (1, "out"), (1, "err")))
    assert not (tmp_path / "run" / "metrics.jsonl").exists()   # before the first step


# ---------------------------------------------------------------- one tiny run: every tracker, mid-stage evals
WATCH_STAGES = [   # 4 steps at 16 px (a mid-stage evaluation at 32 samples), then 2 at 28 px
    {"name": "low", "image_size": 16, "context_length": 16, "samples": 64, "global_batch": 16, "lr": 2e-3,
     "warmup_steps": 1},
    {"name": "full", "image_size": 28, "context_length": 16, "samples": 32, "global_batch": 16, "lr": 2e-4,
     "warmup_steps": 1},
]


@pytest.mark.slow
@pytest.mark.multiproc
def test_a_run_reports_mid_stage_evaluations_to_every_tracker(tiny_fmnist, tmp_path, monkeypatch):
    pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("FORK_RANKS_OUTPUT_DIR", str(tmp_path))
    run = tmp_path / "run"
    cfg = tiny_config(run, tiny_fmnist, precision="fp32", stages=WATCH_STAGES,
                      logging={"every_steps": 1, "progress": True, "progress_every_s": 0.01,
                               "report_to": ["tensorboard", "wandb", "csv"]})
    cfg["eval"].update(every_samples=32, max_time_share=1.0)   # the tiny run's evaluations cost more than its steps
    proc = run_job(ranks_cmd(2, "--config", str(write_config(cfg, tmp_path / "run.yaml")),
                             module="crate_clip.train.cli"), timeout=400)
    out = {r: (tmp_path / f"rank{r}.out").read_text() + (tmp_path / f"rank{r}.err").read_text() for r in (0, 1)}
    assert proc.returncode == 0, out[0][-3000:] + out[1][-3000:]

    results = read_jsonl(run / "results.jsonl")
    assert [(r["stage_index"], r.get("at"), r["samples_seen"], r["image_size"], r["resize"]) for r in results] == [
        (0, "mid_stage", 32, 16, "grid"), (0, "stage_end", 64, 16, "grid"), (0, "stage_end", 64, 28, "grid"),
        (0, "stage_end", 64, 28, "patch"), (1, "stage_end", 96, 28, "grid")]
    with open(run / "metrics.csv") as f:   # one row per logged step
        rows = list(csv.DictReader(f))
    assert [(r["stage_index"], r["step"], r["samples_seen"]) for r in rows] == [
        ("0", "1", "16"), ("0", "2", "32"), ("0", "3", "48"), ("0", "4", "64"), ("1", "1", "80"), ("1", "2", "96")]
    assert all(float(r["loss"]) > 0 and float(r["samples_per_s"]) > 0 for r in rows)
    with open(run / "results.csv") as f:
        assert [r["at"] for r in csv.DictReader(f)] == [r["at"] for r in results]

    import wandb_offline   # the offline run, read back from wandb's own transaction log
    log = wandb_offline.offline_run(run)
    history = wandb_offline.history(log)
    assert [h["train/loss"] for h in history if "train/loss" in h] == [float(r["loss"]) for r in rows]
    assert [h["samples_seen"] for h in history if "eval/fmnist@16px/top1" in h] == [32, 64]
    assert any("eval/fmnist@28px-patch/top1" in h for h in history)
    assert wandb_offline.run_record(log).display_name == "test"
    assert wandb_offline.config(log)["eval"]["every_samples"] == 32

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    events = EventAccumulator(str(run / "tensorboard"), size_guidance={"images": 0, "tensors": 0}).Reload()
    assert [e.step for e in events.Scalars("eval/fmnist@16px/top1")] == [32, 64]
    assert {"train_samples/stage0_low", "train_samples/stage1_full"} <= set(events.Tags()["images"])
    assert {"config/run_config.yaml/text_summary", "eval/fmnist@16px/per_class/text_summary"} <= set(
        events.Tags()["tensors"])

    lines = [line for line in out[0].splitlines() if line.startswith("[progress] stage ")]
    assert any(line.startswith("[progress] zero-shot images: done") for line in out[0].splitlines())   # evals too
    assert lines[0].startswith("[progress] stage 0 low @16px: step 1/4 (25%), 16/64 samples, loss ")
    assert "samples/s, ETA " in lines[0] and lines[-1].startswith("[progress] stage 1 full @28px: step 2/2 (100%)")
    assert "[eval] mid-stage evaluation took " in out[0]
    assert out[1] == ""   # rank 1 prints nothing: no progress, no DeepSpeed chatter
    assert "Processing zero checkpoint" not in out[0]
    assert "Processing zero checkpoint" in (run / "logs" / "deepspeed-rank1.log").read_text()

    # a probe measured after the run (the demo's linear probe of its export) joins the run's TensorBoard and CSV
    from crate_clip.train.reporting.metrics_log import log_probe
    assert log_probe(run, {"top1": 0.5, "top5": 0.9, "n_train": 60}) == ["tensorboard", "csv"]
    events = EventAccumulator(str(run / "tensorboard")).Reload()
    assert [(e.step, e.value) for e in events.Scalars("probe/linear_probe/top1")] == [(96, 0.5)]
    with open(run / "results.csv") as f:
        assert list(csv.DictReader(f))[-1]["at"] == "after_run"


def test_a_resume_sets_the_csv_rows_after_its_checkpoint_aside(tmp_path):
    """The csv tracker's files on resume, as metrics.jsonl's: the rows a cut-short segment wrote after the checkpoint
    it resumes from move to *.superseded.csv (under a header), a torn last line to *.torn.txt; what stays is one row
    per step up to the checkpoint, and the resumed run's rows follow on lines of their own (issue 42)."""
    from crate_clip.train.reporting.metrics_log import set_aside_rows_after
    from crate_clip.train.reporting.trackers import CsvTracker

    tracker = CsvTracker(tmp_path, ("tokens_per_s",))
    for step in (10, 20, 30, 40):
        tracker.step_row({"stage_index": 0, "step": step, "global_step": step, "loss": 1.0 / step, "skipped": None})
    tracker.eval_row({"stage_index": 0, "at": "mid_stage", "global_step": 30, "top1": 0.5})
    with open(tmp_path / "metrics.csv", "a") as f:
        f.write("0,,50,5")   # a kill in the middle of a row's write
    assert set_aside_rows_after(tmp_path, 20) == 4   # steps 30 and 40, the torn line, the evaluation at 30

    def rows(name):
        with open(tmp_path / name) as f:
            return list(csv.DictReader(f))

    assert [r["global_step"] for r in rows("metrics.csv")] == ["10", "20"]
    assert [r["global_step"] for r in rows("metrics.superseded.csv")] == ["30", "40"]
    assert (tmp_path / "metrics.torn.txt").read_text() == "0,,50,5\n"
    assert rows("results.csv") == [] and [r["top1"] for r in rows("results.superseded.csv")] == ["0.5"]
    tracker.step_row({"stage_index": 0, "step": 30, "global_step": 30, "loss": 0.5})   # the redone step
    assert [r["global_step"] for r in rows("metrics.csv")] == ["10", "20", "30"]
    assert set_aside_rows_after(tmp_path, 30) == 0 and len(rows("metrics.superseded.csv")) == 2   # nothing later
