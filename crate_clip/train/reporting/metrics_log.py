"""Training metrics: progress on rank 0, the trackers (trackers.py), metrics.jsonl / results.jsonl, the PNG plot."""
from __future__ import annotations

import csv
import json
import os
import time
from dataclasses import asdict, fields
from pathlib import Path
from typing import Optional

import torch
import yaml

from crate_clip.checkpoint_io.atomic_files import atomic_write, atomic_write_text
# the run folder's file names and its JSONL reader (run_layout.py), imported here by the log's callers too
from crate_clip.checkpoint_io.run_layout import (METRICS_CSV, METRICS_FILE, PLOT_FILE, RESULTS_CSV,  # noqa: F401
                                                 RESULTS_FILE, RUN_CONFIG_FILE, TENSORBOARD_DIR, read_jsonl)
from crate_clip.train.reporting.progress_display import StageProgress
from crate_clip.train.reporting.throughput import ThroughputRecord
from crate_clip.train.reporting.trackers import Tracker, build_trackers, per_class_table
# the curve is drawn by training_curve.py; its names are imported from here by the log's callers too
from crate_clip.train.reporting.training_curve import latest_per_step, write_plot  # noqa: F401
from crate_clip.train.reporting.whitebox_log import whitebox_scalars




def flop_rate(tflops_per_rank: float, on_gpu: bool) -> tuple[str, str]:
    """(label, value) of a per-rank FLOP rate in the unit that fits: TFLOP/s from 1 TFLOP/s up, GFLOP/s below
    (a CPU's rate, which TFLOP/s with one decimal shows as 0.0); per gpu on GPUs, per rank on CPUs."""
    per = "gpu" if on_gpu else "rank"
    if tflops_per_rank >= 1:
        return f"TFLOP/s/{per}", f"{tflops_per_rank:.1f}"
    return f"GFLOP/s/{per}", f"{1000 * tflops_per_rank:.3g}"

class MetricsLog:
    """Everything a run reports; only rank 0 writes and prints, other ranks get a no-op log. The trackers are those
    `report_to` names (trackers.py; default: TensorBoard unless `tensorboard` is false)."""

    def __init__(self, run_dir: Path, *, enabled: bool, progress: bool = True, tensorboard: bool = True,
                 report_to: Optional[list] = None, progress_every_s: float = 30.0, config: Optional[dict] = None,
                 run_name: str = "run", wandb_project: Optional[str] = None):
        self.run_dir = Path(run_dir)
        self.enabled = enabled
        self.use_progress = progress
        self.progress_every_s = progress_every_s
        self._bar: Optional[StageProgress] = None
        self._perf_post: dict = {}
        self.trackers: list[Tracker] = []
        if enabled:
            self.run_dir.mkdir(parents=True, exist_ok=True)
            kinds = [k for k in (report_to if report_to is not None else ["tensorboard"])
                     if k != "tensorboard" or tensorboard]
            self.trackers = build_trackers(self.run_dir, kinds, config=config or {}, name=run_name,
                                           wandb_project=wandb_project,
                                           throughput_columns=[f.name for f in fields(ThroughputRecord)])
            if config:
                self._each("text", "config/run_config.yaml", yaml.safe_dump(config, sort_keys=False), 0)

    def _each(self, method: str, *args) -> None:
        for tracker in self.trackers:
            getattr(tracker, method)(*args)

    # ------------------------------------------------------------ console
    def start_stage(self, stage_name: str, total_steps: int, done_steps: int, samples_per_step: int) -> None:
        """Open the stage's progress display (resumed stages start part-way)."""
        self._samples_per_step = samples_per_step
        self._t0, self._step0 = time.perf_counter(), done_steps
        self._paused = 0.0
        if self.enabled and self.use_progress:
            self._bar = StageProgress(stage_name, total_steps, done_steps, samples_per_step,
                                      every_s=self.progress_every_s)

    def pause(self, seconds: float) -> None:
        """Time the stage spent on something else (a mid-stage evaluation): not counted in its samples/s."""
        self._paused += seconds

    def samples_per_second(self, step: int) -> float:
        """Throughput of this process's job since the stage (or resume) started, evaluations excluded."""
        elapsed = time.perf_counter() - self._t0 - getattr(self, "_paused", 0.0)
        return (step - self._step0) * self._samples_per_step / elapsed if elapsed > 0 else 0.0

    def advance(self, loss: float | None, lr: float, step: int) -> None:
        """One step done: move the bar (samples/s, loss, LR, ETA) or print the plain line when it is due."""
        if self._bar is not None:
            post = {"samples/s": f"{self.samples_per_second(step):.0f}", "lr": f"{lr:.2e}"}
            if loss is not None:
                post["loss"] = f"{loss:.4f}"
            post.update(self._perf_post)
            self._bar.update(step, loss, self.samples_per_second(step), post)

    def show_throughput(self, perf) -> None:
        """Keep the latest MFU / TFLOP/s / data-wait figures (a ThroughputRecord) for the progress bar."""
        keys = (("mfu", "mfu", "{:.0%}"), ("data_wait_frac", "wait", "{:.0%}"))
        self._perf_post = {label: fmt.format(getattr(perf, k)) for k, label, fmt in keys
                           if getattr(perf, k) is not None}
        if getattr(perf, "tflops_per_gpu", None) is not None:
            label, value = flop_rate(perf.tflops_per_gpu, on_gpu=torch.cuda.is_available())
            self._perf_post[label] = value

    def end_stage(self) -> None:
        """Close the stage's progress display (a plain display prints the stage's last line)."""
        if self._bar is not None:
            self._bar.close()
            self._bar = None

    def print(self, text: str) -> None:
        """A console line from rank 0 (kept clear of the progress bar)."""
        if not self.enabled:
            return
        if self._bar is not None:
            self._bar.write(text)
        else:
            print(text, flush=True)

    # ------------------------------------------------------------ files
    def log_step(self, record: dict, perf) -> None:
        """Append one training record and its throughput (a ThroughputRecord, whose fields become the row's and the
        trackers' `throughput/*`) to metrics.jsonl, and their numbers to the trackers."""
        if not self.enabled:
            return
        throughput = asdict(perf)
        with open(self.run_dir / METRICS_FILE, "a") as f:
            f.write(json.dumps({**throughput, **record}) + "\n")
        scalars = {f"train/{key}": record.get(key) for key in ("loss", "lr", "logit_scale", "samples_per_s",
                                                                "nonfinite_skipped", "grad_norm")}
        scalars.update({f"throughput/{key}": value for key, value in throughput.items()})
        scalars.update({f"data_skips/{key}": value for key, value in (record.get("data_skips") or {}).items()})
        scalars.update(whitebox_scalars(record))
        self._each("scalars", {k: v for k, v in scalars.items() if v is not None}, record["samples_seen"])
        self._each("step_row", {**throughput, **record})

    def log_images(self, tag: str, images: torch.Tensor, x: int, mean, std, count: int = 16) -> None:
        """A grid of the first `count` images of a batch (normalized with mean/std) to the trackers."""
        if not (self.enabled and self.trackers) or not images.is_floating_point():   # device decode: raw bytes
            return
        self._each("images", tag, image_grid(images[:count], mean, std), x)

    def log_eval(self, record, summary: str | None = None) -> None:
        """Append one evaluation (an EvalRecord) to results.jsonl; every number it measured and its per-class table
        go to the trackers, and `summary` (the task's one line; default: the numbers) to the console."""
        if not self.enabled:
            return
        with open(self.run_dir / RESULTS_FILE, "a") as f:
            f.write(json.dumps(record.as_dict()) + "\n")
        numbers = {k: v for k, v in record.results.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}
        tag = eval_tag(record)
        self._each("scalars", {f"{tag}/{key}": value for key, value in numbers.items()}, record.samples_seen)
        self._each("eval_row", record.as_dict())
        table = per_class_table(record.results)
        if table:
            self._each("text", f"{tag}/per_class", table, record.samples_seen)
        self._each("flush")
        summary = summary or "  ".join(f"{k} {v:.4g}" for k, v in numbers.items())
        how = " (patch grid kept, kernel PI-resized)" if record.resize == "patch" else ""
        when = f", mid-stage at {record.samples_seen} samples" if getattr(record, "at", "") == "mid_stage" else ""
        when += ", EMA weights" if getattr(record, "weights", "live") == "ema" else ""
        self.print(f"[eval] stage {record.stage_index} ({record.stage_name}{when}) {record.eval} at "
                   f"{record.image_size} px{how}: {summary}")

    def close(self) -> None:
        """Close the progress display and the trackers (a tracker that fails to close is said, not raised: the run's
        own outcome comes first)."""
        self.end_stage()
        trackers, self.trackers = self.trackers, []
        for tracker in trackers:
            try:
                tracker.close()
            except Exception as exc:   # noqa: BLE001 - e.g. wandb's service gone; the files are already written
                print(f"[warn] {type(tracker).__name__} did not close cleanly: {exc}", flush=True)


def eval_tag(record) -> str:
    """The trackers' tag of an evaluation: its name, size, (kernel-resized) how and (EMA) weights:
    `eval/fmnist@28px-patch`, `eval/fmnist@28px-ema`."""
    return (f"eval/{record.eval}@{record.image_size}px" + ("-patch" if record.resize == "patch" else "")
            + ("-ema" if getattr(record, "weights", "live") == "ema" else ""))


def image_grid(images: torch.Tensor, mean, std, columns: int = 8) -> torch.Tensor:
    """NCHW normalized images -> one CHW grid in [0, 1] (a 1-pixel gap), as TensorBoard and wandb show it."""
    x = images.detach().float().cpu() * torch.tensor(std).view(1, -1, 1, 1) + torch.tensor(mean).view(1, -1, 1, 1)
    x = x.clamp(0, 1)
    n, c, h, w = x.shape
    cols = min(columns, n)
    rows = -(-n // cols)
    grid = torch.ones(c, rows * (h + 1) - 1, cols * (w + 1) - 1)
    for i in range(n):
        r, k = divmod(i, cols)
        grid[:, r * (h + 1):r * (h + 1) + h, k * (w + 1):k * (w + 1) + w] = x[i]
    return grid


def set_aside_rows_after(run_dir: Path, global_step: int) -> int:
    """Move the metrics.jsonl / results.jsonl rows written after `global_step` (by a segment that was cut short
    and is redone from its checkpoint) to metrics.superseded.jsonl / results.superseded.jsonl, and lines that
    are not a whole row (a kill in the middle of a write tears the last one) to metrics.torn.txt /
    results.torn.txt, so every reader sees one row per step, the next row starts on a line of its own, and nothing
    is lost; the csv tracker's metrics.csv / results.csv the same way (_set_aside_csv_rows_after). Returns how many
    rows and fragments moved."""
    moved = sum(_set_aside_csv_rows_after(Path(run_dir) / name, global_step) for name in (METRICS_CSV, RESULTS_CSV))
    for name in (METRICS_FILE, RESULTS_FILE):
        path = Path(run_dir) / name
        rows, torn, ends_a_line = _rows_and_fragments(path)
        later = [r for r in rows if r.get("global_step", 0) > global_step]
        if not (later or torn) and ends_a_line:
            continue
        # first the copies (a kill loses nothing), then the file rewritten with the rows kept
        _append_durably(path.with_name(path.stem + ".superseded.jsonl"), "".join(json.dumps(r) + "\n" for r in later))
        _append_durably(path.with_name(path.stem + ".torn.txt"), "".join(line + "\n" for line in torn))
        kept = [r for r in rows if r.get("global_step", 0) <= global_step]
        atomic_write_text(path, "".join(json.dumps(r) + "\n" for r in kept))
        moved += len(later) + len(torn)
    return moved


def _set_aside_csv_rows_after(path: Path, global_step: int) -> int:
    """set_aside_rows_after for one of the csv tracker's files: rows whose global_step is later go to
    <name>.superseded.csv (under its own header line), lines that are not a whole row to <name>.torn.txt."""
    if not path.is_file() or path.stat().st_size == 0:
        return 0
    text = path.read_text(encoding="utf-8", errors="replace")
    header, *lines = text.split("\n")
    columns = next(csv.reader([header]))
    if "global_step" not in columns:   # not a file this tracker wrote: left as it is
        return 0
    kept, later, torn = [], [], []
    for line in lines:
        if not line.strip():
            continue
        cells = next(csv.reader([line]), [])
        step = cells[columns.index("global_step")] if len(cells) == len(columns) else ""
        if not step.isdigit():
            torn.append(line)
        else:
            (later if int(step) > global_step else kept).append(line)
    if not (later or torn) and text.endswith("\n"):
        return 0
    superseded = path.with_name(path.stem + ".superseded.csv")
    head = "" if superseded.is_file() and superseded.stat().st_size else header + "\n"
    _append_durably(superseded, head + "".join(line + "\n" for line in later) if later else "")
    _append_durably(path.with_name(path.stem + ".torn.txt"), "".join(line + "\n" for line in torn))
    atomic_write_text(path, "".join(line + "\n" for line in [header, *kept]))
    return len(later) + len(torn)


def _rows_and_fragments(path: Path) -> tuple[list[dict], list[str], bool]:
    """The rows of a JSONL file, its lines that are not a JSON row (a whole row cut short only of its newline is a
    row), and whether the file ends with a newline (the next row appended starts a line of its own)."""
    if not path.is_file():
        return [], [], True
    text = path.read_text(encoding="utf-8", errors="replace")
    rows, torn = [], []
    for line in text.split("\n"):
        try:
            row = json.loads(line) if line.strip() else None
        except json.JSONDecodeError:
            row = None
        if isinstance(row, dict):
            rows.append(row)
        elif line.strip():
            torn.append(line)
    return rows, torn, text.endswith("\n") or not text


def _append_durably(path: Path, text: str) -> None:
    if not text:
        return
    with open(path, "a") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())


def log_probe(run_dir: Path, metrics: dict, name: str = "linear_probe") -> list[str]:
    """A probe measured after the run (the demo's linear probe of its export) into the run's TensorBoard and CSV
    trackers (those of run_config.yaml's logging.report_to; a W&B run is not reopened for it): its numbers as
    `probe/<name>/*` at the run's last samples_seen, its one-line summary as text; returns the trackers written."""
    run_dir = Path(run_dir)
    if not (run_dir / RUN_CONFIG_FILE).is_file():   # an export without its run: no trackers to join
        return []
    logging_cfg = (yaml.safe_load((run_dir / RUN_CONFIG_FILE).read_text()) or {}).get("logging", {})
    kinds = [k for k in logging_cfg.get("report_to", ["tensorboard"]) if k != "wandb"
             and (k != "tensorboard" or logging_cfg.get("tensorboard", True))]
    steps = read_jsonl(run_dir / METRICS_FILE)
    x = max((r.get("samples_seen", 0) for r in steps), default=0)
    numbers = {f"probe/{name}/{k}": v for k, v in metrics.items()
               if isinstance(v, (int, float)) and not isinstance(v, bool)}
    trackers = build_trackers(run_dir, kinds, config={}, name=name)
    for tracker in trackers:
        tracker.scalars(numbers, x)
        tracker.text(f"probe/{name}", json.dumps(numbers, indent=1), x)
        tracker.eval_row({"stage_name": "final", "at": "after_run", "eval": name, "samples_seen": x, **metrics})
        tracker.close()
    return kinds
