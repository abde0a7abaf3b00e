"""Training metrics: a progress bar on rank 0, TensorBoard scalars, metrics.jsonl / results.jsonl, PNG plot."""
from __future__ import annotations

import json
import os
import time
from dataclasses import asdict
from pathlib import Path

import torch
from tqdm import tqdm

from crate_clip.checkpoint_io.atomic_files import atomic_write, atomic_write_text
# the run folder's file names and its JSONL reader (run_layout.py), imported here by the log's callers too
from crate_clip.checkpoint_io.run_layout import (METRICS_FILE, PLOT_FILE, RESULTS_FILE, TENSORBOARD_DIR,  # noqa: F401
                                                 read_jsonl)
from crate_clip.train.whitebox_log import draw_whitebox_curves, whitebox_keys, whitebox_scalars




def flop_rate(tflops_per_rank: float, on_gpu: bool) -> tuple[str, str]:
    """(label, value) of a per-rank FLOP rate in the unit that fits: TFLOP/s from 1 TFLOP/s up, GFLOP/s below
    (a CPU's rate, which TFLOP/s with one decimal shows as 0.0); per gpu on GPUs, per rank on CPUs."""
    per = "gpu" if on_gpu else "rank"
    if tflops_per_rank >= 1:
        return f"TFLOP/s/{per}", f"{tflops_per_rank:.1f}"
    return f"GFLOP/s/{per}", f"{1000 * tflops_per_rank:.3g}"

class MetricsLog:
    """Everything a run reports; only rank 0 writes, other ranks get a no-op log."""

    def __init__(self, run_dir: Path, *, enabled: bool, progress: bool = True, tensorboard: bool = True):
        self.run_dir = Path(run_dir)
        self.enabled = enabled
        self.use_progress = progress
        self._bar = None
        self._perf_post: dict = {}
        self._tb = None
        if enabled:
            self.run_dir.mkdir(parents=True, exist_ok=True)
            if tensorboard:
                # imported only when asked for: TensorBoard's writer pulls in tensorboard and protobuf
                from torch.utils.tensorboard import SummaryWriter
                self._tb = SummaryWriter(str(self.run_dir / TENSORBOARD_DIR))

    # ------------------------------------------------------------ console
    def start_stage(self, stage_name: str, total_steps: int, done_steps: int, samples_per_step: int) -> None:
        """Open the stage's progress bar (resumed stages start part-way)."""
        self._samples_per_step = samples_per_step
        self._t0, self._step0 = time.perf_counter(), done_steps
        if self.enabled and self.use_progress:
            self._bar = tqdm(total=total_steps, initial=done_steps, desc=stage_name, unit="step",
                             dynamic_ncols=True, mininterval=1.0)

    def samples_per_second(self, step: int) -> float:
        """Throughput of this process's job since the stage (or resume) started."""
        elapsed = time.perf_counter() - self._t0
        return (step - self._step0) * self._samples_per_step / elapsed if elapsed > 0 else 0.0

    def advance(self, loss: float | None, lr: float, step: int) -> None:
        """One step done: move the bar, show samples/s, loss and LR (tqdm shows the ETA)."""
        if self._bar is not None:
            self._bar.update(1)
            post = {"samples/s": f"{self.samples_per_second(step):.0f}", "lr": f"{lr:.2e}"}
            if loss is not None:
                post["loss"] = f"{loss:.4f}"
            post.update(self._perf_post)
            self._bar.set_postfix(post, refresh=False)

    def show_throughput(self, perf) -> None:
        """Keep the latest MFU / TFLOP/s / data-wait figures (a ThroughputRecord) for the progress bar."""
        keys = (("mfu", "mfu", "{:.0%}"), ("data_wait_frac", "wait", "{:.0%}"))
        self._perf_post = {label: fmt.format(getattr(perf, k)) for k, label, fmt in keys
                           if getattr(perf, k) is not None}
        if getattr(perf, "tflops_per_gpu", None) is not None:
            label, value = flop_rate(perf.tflops_per_gpu, on_gpu=torch.cuda.is_available())
            self._perf_post[label] = value

    def end_stage(self) -> None:
        """Close the stage's progress bar."""
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
        """Append one training record and its throughput (a ThroughputRecord, whose fields become the row's and
        TensorBoard's `throughput/*`) to metrics.jsonl, and their numbers to TensorBoard."""
        if not self.enabled:
            return
        throughput = asdict(perf)
        with open(self.run_dir / METRICS_FILE, "a") as f:
            f.write(json.dumps({**throughput, **record}) + "\n")
        if self._tb is not None:
            x = record["samples_seen"]
            scalars = {f"train/{key}": record.get(key) for key in ("loss", "lr", "logit_scale", "samples_per_s",
                                                                    "nonfinite_skipped", "grad_norm")}
            scalars.update({f"throughput/{key}": value for key, value in throughput.items()})
            scalars.update({f"data_skips/{key}": value for key, value in (record.get("data_skips") or {}).items()})
            scalars.update(whitebox_scalars(record))
            for tag, value in scalars.items():
                if value is not None:
                    self._tb.add_scalar(tag, value, x)

    def log_eval(self, record, summary: str | None = None) -> None:
        """Append one evaluation (an EvalRecord) to results.jsonl; every number it measured goes to TensorBoard,
        and `summary` (the task's one line; default: the numbers) to the console."""
        if not self.enabled:
            return
        with open(self.run_dir / RESULTS_FILE, "a") as f:
            f.write(json.dumps(record.as_dict()) + "\n")
        numbers = {k: v for k, v in record.results.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}
        if self._tb is not None:
            tag = f"eval/{record.eval}@{record.image_size}px" + ("-patch" if record.resize == "patch" else "")
            for key, value in numbers.items():
                self._tb.add_scalar(f"{tag}/{key}", value, record.samples_seen)
            self._tb.flush()
        summary = summary or "  ".join(f"{k} {v:.4g}" for k, v in numbers.items())
        how = " (patch grid kept, kernel PI-resized)" if record.resize == "patch" else ""
        self.print(f"[eval] stage {record.stage_index} ({record.stage_name}) {record.eval} at "
                   f"{record.image_size} px{how}: {summary}")

    def close(self) -> None:
        """Flush TensorBoard."""
        self.end_stage()
        if self._tb is not None:
            self._tb.close()
            self._tb = None


def set_aside_rows_after(run_dir: Path, global_step: int) -> int:
    """Move the metrics.jsonl / results.jsonl rows written after `global_step` (by a segment that was cut short
    and is redone from its checkpoint) to metrics.superseded.jsonl / results.superseded.jsonl, and lines that
    are not a whole row (a kill in the middle of a write tears the last one) to metrics.torn.txt /
    results.torn.txt, so every reader sees one row per step, the next row starts on a line of its own, and nothing
    is lost; returns how many rows and fragments moved."""
    moved = 0
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


def latest_per_step(records: list[dict]) -> list[dict]:
    """One record per (stage, step), the last written (a resumed run re-logs steps after its checkpoint)."""
    by_key = {}
    for r in records:
        by_key[(r["stage_index"], r["step"])] = r
    return [by_key[k] for k in sorted(by_key)]


def write_plot(run_dir: Path) -> Path | None:
    """PNG of the loss against samples seen, each stage's zero-shot top-1 marked at its end; below it, the white-box
    curves of each CRATE-alpha tower the run probed."""
    # imported only when a plot is drawn: matplotlib is the slowest import of a run (about half a second)
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    run_dir = Path(run_dir)
    steps = latest_per_step([r for r in read_jsonl(run_dir / METRICS_FILE) if r.get("loss") is not None])
    results = [r for r in read_jsonl(run_dir / RESULTS_FILE)   # classification, the grids the stages trained on
               if r.get("top1") is not None and r.get("resize", "grid") == "grid"]
    if not steps:
        return None
    records = latest_per_step(read_jsonl(run_dir / METRICS_FILE))
    towers = whitebox_keys(records)
    if towers:  # per-layer white-box curves of each CRATE-alpha tower under the loss (logging.diagnostics_every)
        fig = plt.figure(figsize=(9, 4.5 + 3.5 * len(towers)), dpi=110)
        grid = fig.add_gridspec(1 + len(towers), 2)
        ax = fig.add_subplot(grid[0, :])
        for row, key in enumerate(towers, start=1):
            draw_whitebox_curves(records, [fig.add_subplot(grid[row, 0]), fig.add_subplot(grid[row, 1])], key=key)
    else:
        fig, ax = plt.subplots(figsize=(8, 4.5), dpi=110)
    ax.plot([r["samples_seen"] for r in steps], [r["loss"] for r in steps], lw=1, color="tab:blue")
    ax.set_xlabel("samples seen")
    ax.set_ylabel("contrastive loss", color="tab:blue")
    ends = {}
    for r in steps:
        ends[r["stage_index"]] = (r["samples_seen"], r.get("stage_name", ""))
    for _, (x, name) in sorted(ends.items()):
        ax.axvline(x, color="grey", lw=0.6, ls=":")
    if results:
        ax2 = ax.twinx()
        ax2.set_ylabel("zero-shot top-1 (%)", color="tab:red")
        for size in sorted({r["image_size"] for r in results}):
            pts = [(r["samples_seen"], 100 * r["top1"]) for r in results if r["image_size"] == size]
            ax2.plot(*zip(*pts), "o--", ms=6, label=f"top-1 @ {size} px")
            for x, y in pts:
                ax2.annotate(f"{y:.1f}", (x, y), textcoords="offset points", xytext=(4, 4), fontsize=8)
        ax2.set_ylim(0, 100)
        ax2.legend(loc="center right", fontsize=8)
    ax.set_title(run_dir.name)
    fig.tight_layout()
    out = run_dir / PLOT_FILE
    try:   # write-then-rename: a full disk leaves the earlier plot (or none), never a 0-byte file
        atomic_write(out, lambda tmp: fig.savefig(tmp, format="png"))
    finally:
        plt.close(fig)
    return out
