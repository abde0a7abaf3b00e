"""The evaluations after each stage: which are due, running them on all ranks, recording them in results.jsonl.

A stage's evaluations are due at its own image size and, after a low-resolution stage, at the full size in each
way whose patches tile it exactly: with the patch grid grown (resize 'grid', position embeddings resampled) when
the stage's patch size divides it, and with the grid kept and the patch kernel PI-resized (resize 'patch',
patch_change.set_resolution_by_patch) when the grid does; the images are resized to that size in both.
results.jsonl is the record of which are done, so a run killed between two of them runs exactly the missing
ones on resume from the stage's final checkpoint, which rotation never removes (CheckpointManager.prune).

With train.ema on, the same evaluations run again on the stage's EMA weights (evaluate_ema_after_stage: the final
checkpoint's, from its rank 0 file, on every rank); their rows say `"weights": "ema"` (rows without it are the live
weights'), and each kind of weights has its own record of what is done.
"""
from __future__ import annotations

from dataclasses import dataclass, fields
from pathlib import Path
from typing import Optional

import torch.distributed as tdist

from crate_clip.checkpoint_io.checkpoint_record import Progress
from crate_clip.checkpoint_io.ema_state import ema_state_of_checkpoint, with_ema
from crate_clip.checkpoint_io.run_layout import checkpoint_tag, eval_cache_dir
from crate_clip.core.errors import UserError
from crate_clip.models.model_patch_size import image_patch_size
from crate_clip.models.patch_change import (patch_for_image_size, patch_input_size, set_resolution_by_patch,
                                           tower_patch_size)
from crate_clip.train.stage_setup.engine import DistInfo
from crate_clip.train.reporting.metrics_log import RESULTS_FILE, MetricsLog, read_jsonl
from crate_clip.train.run.run_config import RunConfig
from crate_clip.train.stage_setup.stage_model import ResolvedStage
from crate_clip.eval.model_loading import check_finite_weights
from crate_clip.eval.registry import summary_line
from crate_clip.eval.stage_hook import evaluate_stage


LIVE, EMA = "live", "ema"   # which weights an evaluation row measured (EvalRecord.weights)


class EvalRefusedError(UserError, RuntimeError):
    """A stage's evaluation refused its result (unreadable images, class folders that match no class name, weights
    holding NaN/inf) or could not read its data. The stage's final checkpoint is kept (its evaluations are
    pending), so a resume runs exactly the missing ones."""
    once_per_job = True   # every rank raises it (lock-step evaluation, the same data and weights): rank 0 says it


@dataclass(frozen=True)
class EvalRecord:
    """One evaluation of a stage's weights, a results.jsonl row: where it was taken (the fields) and what it
    measured (`results`, the task's numbers, lists and names)."""
    stage_index: int
    stage_name: str
    eval: str
    image_size: int
    stage_image_size: int
    patch_size: Optional[int]
    resize: str                    # how the weights reached image_size: 'grid' (also: at their own size) or 'patch'
    context_length: int
    samples_seen: int
    global_step: int
    results: dict
    at: str = "stage_end"          # or 'mid_stage' (eval.every_samples / every_steps; rows without it: stage_end)
    weights: str = LIVE            # or 'ema' (train.ema's average); a row without it: the live weights

    def as_dict(self) -> dict:
        """The row: the fields (`weights` only for EMA rows: the live weights' rows are as they always were), then
        the results beside them."""
        row = {f.name: getattr(self, f.name) for f in fields(self) if f.name != "results"}
        if row["weights"] == LIVE:
            del row["weights"]
        return {**row, **self.results}


def evaluate_after_stage(cfg: RunConfig, stage: ResolvedStage, weights: dict, progress: Progress,
                         log: MetricsLog, dist: DistInfo, kind: str = LIVE) -> list[dict]:
    """Zero-shot evaluation of the stage's consolidated weights on all ranks (images split across them),
    at the stage's resolution and, after a low-resolution stage, also at the full resolution; evaluations
    already in results.jsonl are not repeated; returns their rows. The fp32 weights run under autocast in the
    training precision (bf16 matmuls are several times faster on GPUs and CPUs with bf16 instructions; on a CPU
    without them, AVX2 only, about 20x slower than fp32: BENCHMARKS.md, "Test suite"). `kind`: which weights these
    are (LIVE, or EMA: train.ema's average), recorded in each row."""
    spec_types = {e.name: e.type for e in cfg.eval.evals}
    records = []
    for (size, resize), evals in agreed_missing_evals(cfg, stage.index, dist, kind).items():
        try:
            model = build_eval_model(stage, weights, size, resize).to(dist.device).eval()
        except ValueError as exc:   # 'patch': the tower cannot keep its grid at `size` (recorded, not retried)
            records += _skipped(stage, evals, size, resize, progress, log, str(exc), kind)
            continue
        pixels = size if resize == "grid" else patch_input_size(model)   # both = size: the points tile exactly
        try:
            check_finite_weights(model, f"stage {stage.index} ({stage.name})")
            results = evaluate_stage(model, model_name=cfg.model.name, evals=evals,
                                     image_size=pixels, device=dist.device, precision=cfg.precision,
                                     cache_dir=str(eval_cache_dir(cfg.run_dir)), progress=dist.is_main,
                                     bert_vocab=cfg.model.bert_vocab)
        except (ValueError, FileNotFoundError) as exc:   # the evaluations' refusals and data errors
            raise EvalRefusedError(
                f"stage {stage.index} ({stage.name}) evaluation at {size} px"
                f"{'' if size == stage.image_size else f' ({resize})'}: {exc}. The stage's final "
                f"checkpoint {checkpoint_tag(stage.index, stage.steps)} is kept; once this is fixed, --resume latest "
                "runs the missing evaluations") from exc
        for name, res in results.items():
            record = EvalRecord(stage.index, stage.name, name, size, stage.image_size, tower_patch_size(model),
                                resize, stage.context_length, progress.samples_seen, progress.global_step,
                                {k: v for k, v in res.items() if isinstance(v, (int, float, str, list)) or v is None},
                                weights=kind)
            records.append(record.as_dict())
            log.log_eval(record, summary_line(res, eval_type=spec_types[name]))
        del model
    return records


def _skipped(stage: ResolvedStage, evals: list, size: int, resize: str, progress: Progress, log: MetricsLog,
             reason: str, kind: str = LIVE) -> list[dict]:
    """Rows saying why the evaluations at (size, resize) were not run (they count as done)."""
    rows = []
    for spec in evals:
        record = EvalRecord(stage.index, stage.name, spec.name, size, stage.image_size, stage.patch_size, resize,
                            stage.context_length, progress.samples_seen, progress.global_step, {"skipped": reason},
                            weights=kind)
        rows.append(record.as_dict())
        log.log_eval(record, f"skipped: {reason}")
    return rows


def evaluate_stage_end(cfg: RunConfig, stage: ResolvedStage, tag_dir: Path, weights: dict, progress: Progress,
                       log: MetricsLog, dist: DistInfo) -> list[dict]:
    """The evaluations of a stage's final checkpoint `tag_dir` (its consolidated `weights`): the live weights', then,
    with train.ema on, the EMA weights' it holds."""
    return (evaluate_after_stage(cfg, stage, weights, progress, log, dist)
            + evaluate_ema_after_stage(cfg, stage, tag_dir, weights, progress, log, dist))


def evaluate_ema_after_stage(cfg: RunConfig, stage: ResolvedStage, tag_dir: Path, weights: dict, progress: Progress,
                             log: MetricsLog, dist: DistInfo) -> list[dict]:
    """train.ema on: the stage's evaluations of its EMA weights (those saved in its final checkpoint `tag_dir`, read
    on every rank, in place of the live `weights`' trained parameters), rows `"weights": "ema"`; [] when train.ema
    is off or they are done. A checkpoint without them (the stage ended before train.ema.start_step) is said."""
    if not (cfg.train.ema.on and agreed_missing_evals(cfg, stage.index, dist, EMA)):
        return []
    ema = ema_state_of_checkpoint(tag_dir)
    if ema is None:
        log.print(f"[warn] stage {stage.index} ({stage.name}): train.ema is on but {tag_dir} holds no EMA weights "
                  "(train.ema turned on after the stage ended?): only its live weights are evaluated")
        return []
    return evaluate_after_stage(cfg, stage, with_ema(weights, ema), progress, log, dist, kind=EMA)


def build_eval_model(stage: ResolvedStage, weights: dict, size: int, resize: str):
    """The stage's weights at `size`: the grid resized to it ('grid'), or the grid kept and the kernel PI-resized
    ('patch')."""
    if resize == "grid":
        return stage.build_model(weights, image_size=size, train=False)
    model = stage.build_model(weights, train=False)
    set_resolution_by_patch(model, size)
    return model


def eval_points(cfg: RunConfig, stage_index: int) -> list[tuple[int, str]]:
    """(image size, resize) of the stage's evaluations: its own size; after a low-resolution stage the full size
    in each way whose patches tile it exactly: by grid growth when the stage's patch size divides it, by patch
    resize when its patch grid does (the config check refuses a full size that neither tiles)."""
    stage = cfg.stages[stage_index]
    full = cfg.full_image_size
    if full == stage.image_size:
        return [(stage.image_size, "grid")]
    points = [(stage.image_size, "grid")]
    patch = cfg.patch_size_at(stage_index) or image_patch_size(cfg.model.name)
    if patch and full % patch == 0:
        points.append((full, "grid"))
    try:
        patch_for_image_size(stage.image_size // patch, full)
        points.append((full, "patch"))
    except (ValueError, TypeError):   # no whole-patch fit (or no known patch size): grid growth only
        pass
    return points


def missing_evals(cfg: RunConfig, stage_index: int, kind: str = LIVE) -> dict[tuple[int, str], list]:
    """(image size, resize) -> the declared evaluations of the stage not yet in results.jsonl there at the stage's
    last step, of the `kind` of weights (rows of earlier versions, without 'resize', are grid rows; without
    'weights', the live weights')."""
    if not (cfg.eval.after_each_stage and cfg.eval.evals) or (kind == EMA and not cfg.train.ema.on):
        return {}
    end = sum(s.steps for s in cfg.stages[:stage_index + 1])   # a stage made longer by an allowed change to its
    rows = [r for r in read_jsonl(cfg.run_dir / RESULTS_FILE)    # samples (config_changes.py) is evaluated again
            if r.get("stage_index") == stage_index and r.get("global_step", end) == end
            and r.get("weights", LIVE) == kind]
    done = {(r.get("eval"), r.get("image_size"), r.get("resize", "grid")) for r in rows}
    missing = {point: [e for e in cfg.eval.evals if (e.name, *point) not in done]
               for point in eval_points(cfg, stage_index)}
    return {point: evals for point, evals in missing.items() if evals}


def stage_end_missing(cfg: RunConfig, stage_index: int, dist: DistInfo) -> bool:
    """Whether any of the stage's end evaluations is missing from results.jsonl: the live weights', or (train.ema on)
    the EMA weights' (a run killed between the two kinds); every rank answers as rank 0."""
    return bool(agreed_missing_evals(cfg, stage_index, dist) or agreed_missing_evals(cfg, stage_index, dist, EMA))


def agreed_missing_evals(cfg: RunConfig, stage_index: int, dist: DistInfo,
                         kind: str = LIVE) -> dict[tuple[int, str], list]:
    """missing_evals as rank 0 (which writes results.jsonl) sees it, on every rank: all run the same ones."""
    return rank0s(missing_evals(cfg, stage_index, kind), dist)


# ---------------------------------------------------------------- during a stage (eval.every_samples / every_steps)
def mid_stage_due(cfg: RunConfig, progress: Progress, samples_per_step: int, last: bool) -> bool:
    """Whether the step just trained crosses an eval.every_samples (or every_steps) mark of its stage; never its
    last step (the stage-end evaluations follow it)."""
    every_samples, every_steps = cfg.eval.every_samples, cfg.eval.every_steps
    if last or not cfg.eval.evals or not (every_samples or every_steps):
        return False
    stage_samples = progress.step * samples_per_step
    return bool((every_samples and stage_samples // every_samples > (stage_samples - samples_per_step) // every_samples)
                or (every_steps and progress.step % every_steps == 0))


def evaluate_mid_stage(cfg: RunConfig, stage: ResolvedStage, engine, progress: Progress, log: MetricsLog,
                       dist: DistInfo) -> list[dict]:
    """The declared evaluations of the weights being trained (the engine's own: no copy, any ZeRO stage), on all
    ranks, at the stage's image size; rows `at: mid_stage` in results.jsonl and the trackers. A refusal is an
    EvalRefusedError, as after a stage."""
    spec_types = {e.name: e.type for e in cfg.eval.evals}
    engine.eval()
    try:
        results = evaluate_stage(engine, model_name=cfg.model.name, evals=cfg.eval.evals,
                                 image_size=stage.image_size, device=dist.device, precision=cfg.precision,
                                 cache_dir=str(eval_cache_dir(cfg.run_dir)), progress=dist.is_main,
                                 bert_vocab=cfg.model.bert_vocab)
    except (ValueError, FileNotFoundError) as exc:
        raise EvalRefusedError(f"stage {stage.index} ({stage.name}) mid-stage evaluation at step {progress.step}: "
                               f"{exc}; fix it, then --resume latest") from exc
    finally:
        engine.train()
    records = []
    for name, res in results.items():
        record = EvalRecord(stage.index, stage.name, name, stage.image_size, stage.image_size,
                            tower_patch_size(engine.module), "grid", stage.context_length, progress.samples_seen,
                            progress.global_step,
                            {k: v for k, v in res.items() if isinstance(v, (int, float, str, list)) or v is None},
                            at="mid_stage")
        records.append(record.as_dict())
        log.log_eval(record, summary_line(res, eval_type=spec_types[name]))
    return records


class EvalBudget:
    """Keeps the mid-stage evaluations under `share` of the training time: one whose expected cost (the last one's)
    would take the evaluations' total past it is deferred to a later step, said once per mark. The first runs
    and measures the cost. Rank 0 decides for every rank (lock-step evaluation)."""

    def __init__(self, share: float):
        self.share, self.eval_s, self.last_cost_s = share, 0.0, None
        self._said_for: Optional[int] = None

    def allows(self, train_s: float) -> bool:
        """Whether an evaluation may run now, after `train_s` seconds of training in this stage."""
        return self.last_cost_s is None or self.eval_s + self.last_cost_s <= self.share * train_s

    def deferral(self, train_s: float, mark: int) -> Optional[str]:
        """The line saying a deferral (once per mark, `mark` the samples seen when it came due)."""
        if self._said_for == mark:
            return None
        self._said_for = mark
        return (f"[eval] mid-stage evaluation due at {mark} samples deferred: another ~{self.last_cost_s:.1f} s would "
                f"bring evaluations to {self.eval_s + self.last_cost_s:.1f} s, over eval.max_time_share "
                f"{self.share:.0%} of the {train_s:.1f} s trained")

    def spent(self, seconds: float, train_s: float) -> str:
        """Record an evaluation's cost; returns the line that prints it."""
        self.eval_s += seconds
        self.last_cost_s = seconds
        share = self.eval_s / train_s if train_s > 0 else float("inf")
        return (f"[eval] mid-stage evaluation took {seconds:.1f} s (evaluations {self.eval_s:.1f} s = {share:.1%} of "
                f"{train_s:.1f} s of training; eval.max_time_share {self.share:.0%})")


def agreed(decision: bool, dist: DistInfo) -> bool:
    """Rank 0's decision on every rank (their clocks differ)."""
    return bool(rank0s(decision, dist))


def rank0s(value, dist: DistInfo):
    """Rank 0's `value` (any picklable object) on every rank: what rank 0 alone reads or keeps, decided alike."""
    if dist.world_size == 1:
        return value
    box = [value]
    tdist.broadcast_object_list(box, src=0)
    return box[0]
