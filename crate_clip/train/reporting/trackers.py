"""Where a run's numbers go besides metrics.jsonl / results.jsonl: the trackers of `logging.report_to`.

    tensorboard  tensorboard/: scalars, the run config (text), per-class results (text), a grid of training images
    wandb        Weights & Biases (wandb/ under the run folder; WANDB_MODE=offline keeps it there), the same but
                 the image grid; text as string values
    csv          metrics.csv (one row per logged step), results.csv (one row per evaluation)

Each tracker is imported only when named: TensorBoard's writer pulls in tensorboard and protobuf, wandb starts a
service process. Only rank 0 builds them (MetricsLog).
"""
from __future__ import annotations

import csv
import json
import uuid
from pathlib import Path
from typing import Iterable, Optional

from crate_clip.checkpoint_io.run_layout import METRICS_CSV, RESULTS_CSV, TENSORBOARD_DIR, WANDB_DIR, WANDB_ID_FILE
from crate_clip.core.errors import ConfigError

# metrics.csv columns: the step's place and its numbers (throughput figures follow, from the ThroughputRecord)
STEP_COLUMNS = ("stage_index", "stage_name", "step", "global_step", "samples_seen", "image_size", "loss", "lr",
                "logit_scale", "grad_norm", "samples_per_s", "nonfinite_skipped", "skipped", "time")
RESULT_COLUMNS = ("stage_index", "stage_name", "at", "eval", "image_size", "stage_image_size", "patch_size",
                  "resize", "samples_seen", "global_step", "top1", "top5", "mean_per_class", "mean_per_class_recall",
                  "n_images", "skipped", "weights")   # weights: 'ema' for train.ema's rows, empty for the live


class TrackerError(ConfigError):
    """A tracker that cannot start (wandb without a login or network); rank 0 starts the trackers and says it, every
    rank stops (stage_loop._open_log)."""
    once_per_job = True


class Tracker:
    """What every tracker takes (each ignores what it cannot show)."""

    def scalars(self, values: dict, x: int) -> None: ...
    def step_row(self, row: dict) -> None: ...
    def eval_row(self, row: dict) -> None: ...
    def text(self, tag: str, text: str, x: int = 0) -> None: ...
    def images(self, tag: str, grid, x: int = 0) -> None: ...
    def flush(self) -> None: ...
    def close(self) -> None: ...


class TensorBoardTracker(Tracker):
    def __init__(self, run_dir: Path):
        from torch.utils.tensorboard import SummaryWriter
        self._w = SummaryWriter(str(run_dir / TENSORBOARD_DIR))

    def scalars(self, values: dict, x: int) -> None:
        for tag, value in values.items():
            self._w.add_scalar(tag, value, x)

    def text(self, tag: str, text: str, x: int = 0) -> None:
        # TensorBoard renders text as markdown: indented by 4, it keeps its lines and spacing
        self._w.add_text(tag, "\n".join("    " + line for line in text.splitlines()), x)

    def images(self, tag: str, grid, x: int = 0) -> None:
        self._w.add_image(tag, grid, x)   # CHW floats in [0, 1]

    def flush(self) -> None:
        self._w.flush()

    def close(self) -> None:
        self._w.close()


class WandbTracker(Tracker):
    """One W&B run per run folder: its id is kept in wandb_run_id.txt so a resume continues the same run."""

    def __init__(self, run_dir: Path, config: dict, project: Optional[str], name: str):
        import wandb   # the optional extra: check_runtime refused report_to: [wandb] without it
        self._wandb = wandb
        id_file = run_dir / WANDB_ID_FILE
        run_id = id_file.read_text().strip() if id_file.is_file() else uuid.uuid4().hex[:12]
        id_file.write_text(run_id + "\n")
        try:
            self._run = wandb.init(project=project or "crate-clip", name=name, id=run_id, resume="allow",
                                   dir=str(run_dir), config=config,
                                   settings=wandb.Settings(console="off", silent=True, x_disable_stats=True))
        except wandb.errors.Error as exc:   # no API key, no network: one line, before the first step
            raise TrackerError(f"logging.report_to: wandb could not start its run: {exc} (fix: `wandb login`, or "
                              "WANDB_MODE=offline to write it under the run folder and `wandb sync` it later)") from None
        self._run.define_metric("*", step_metric="samples_seen")   # x of every chart: samples, as in TensorBoard

    def scalars(self, values: dict, x: int) -> None:
        self._run.log({**values, "samples_seen": x})

    # text as a plain string value and no images: wandb's media objects (Html, Image) go through a temporary folder
    # that wandb makes once at its import, which a forked launcher's first finished process removes for all
    def text(self, tag: str, text: str, x: int = 0) -> None:
        self._run.log({tag: text, "samples_seen": x})

    def close(self) -> None:
        self._run.finish()


class CsvTracker(Tracker):
    """metrics.csv and results.csv with fixed columns; a resumed run appends after the rows of its checkpoint's
    step, the later ones set aside to *.superseded.csv first (metrics_log.set_aside_rows_after), as in metrics.jsonl."""

    def __init__(self, run_dir: Path, throughput_columns: Iterable[str]):
        self._steps = _CsvFile(run_dir / METRICS_CSV, (*STEP_COLUMNS, *throughput_columns))
        self._results = _CsvFile(run_dir / RESULTS_CSV, RESULT_COLUMNS)

    def step_row(self, row: dict) -> None:
        self._steps.append(row)

    def eval_row(self, row: dict) -> None:
        self._results.append(row)


class _CsvFile:
    def __init__(self, path: Path, columns: tuple):
        self.path, self.columns = path, columns

    def append(self, row: dict) -> None:
        new = not self.path.is_file() or self.path.stat().st_size == 0
        with open(self.path, "a", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=self.columns, extrasaction="ignore")
            if new:
                writer.writeheader()
            writer.writerow({k: _cell(row.get(k)) for k in self.columns})


def _cell(value):
    return "" if value is None else json.dumps(value) if isinstance(value, (dict, list)) else value


def build_trackers(run_dir: Path, report_to: Iterable[str], *, config: dict, name: str,
                   wandb_project: Optional[str] = None, throughput_columns: Iterable[str] = ()) -> list[Tracker]:
    """The trackers `report_to` names, in its order."""
    makers = {"tensorboard": lambda: TensorBoardTracker(run_dir),
              "wandb": lambda: WandbTracker(run_dir, config, wandb_project, name),
              "csv": lambda: CsvTracker(run_dir, throughput_columns)}
    return [makers[kind]() for kind in dict.fromkeys(report_to)]


def per_class_table(results: dict) -> Optional[str]:
    """An evaluation's per-class numbers (zero-shot's `per_class` rows) as a text table; None when it has none."""
    rows = results.get("per_class")
    if not (isinstance(rows, list) and rows and all(isinstance(r, dict) and "class" in r for r in rows)):
        return None
    width = max(len(str(r["class"])) for r in rows)
    return "\n".join(f"{str(r['class']):<{width}}  top-1 " + ("   n/a " if r.get("top1") is None else
                     f"{100 * r['top1']:6.2f}%") + f"  ({r.get('n', '?')} images)" for r in rows)
