"""The training run, top to bottom: stages in order, each with a fresh engine; checkpoints, eval, export.

    for each stage:   model (new, or the previous stage's weights with position embeddings resized)
                      -> engine (fresh AdamW + warm-up/cosine, deepspeed.initialize)
                      -> steps: train_stage, a plain loop over steps (image mask in the tower, ClipLoss with local
                         loss + gathered features) calling the hooks of the stage's parts (parts/: metrics, probe,
                         non-finite guard, checkpoint cadence, mid-stage evals, stop agreement, EMA, ...)
                      -> the stage's final checkpoint (every part's state) -> zero-shot eval on all ranks
    export the last stage's consolidated weights for open_clip, plot the curve.
"""
from __future__ import annotations

import dataclasses
import json
import time
from pathlib import Path
from typing import Callable, Optional

import torch.distributed as tdist
from open_clip import ClipLoss

from crate_clip.checkpoint_io.checkpoint_record import CheckpointInfo, Progress, read_record
from crate_clip.checkpoint_io.deepspeed_checkpoints import consolidated_state_dict
from crate_clip.checkpoint_io.run_layout import checkpoint_tag, checkpoints_dir, export_dir
from crate_clip.checkpoint_io.safe_unpickling import TRUST_WARNING, checkpoints_trusted
from crate_clip.data.stream_layout import StreamSettings
from crate_clip.data.train_stream import build_train_stream
from crate_clip.export.writer import export_checkpoint
from crate_clip.models import tokenizer_record
from crate_clip.models.patch_change import tower_patch_size
from crate_clip.train.checkpointing.checkpoints import (CheckpointManager, ResumeError, ResumePoint,
                                                        find_resume_point, intact_checkpoint)
from crate_clip.train.checkpointing.config_changes import (ConfigChange, ResumedAt, agreed_config_changes,
                                                           record_changes, record_run)
from crate_clip.train.checkpointing.elastic_resume import (STREAM_TABLE, gather_stream_table, load_resume_state,
                                                           launch_stream_settings, needs_universal, resolve_auto)
from crate_clip.train.loop.batch_agreement import agreed_batches
from crate_clip.train.loop.parts.checkpoint_cadence import CheckpointCadence
from crate_clip.train.loop.parts.ema_weights import EmaWeights
from crate_clip.train.loop.parts.mid_stage_evals import MidStageEvals
from crate_clip.train.loop.parts.nonfinite_guard import NonfiniteGuard
from crate_clip.train.loop.parts.progress_record import ProgressRecord, advance
from crate_clip.train.loop.parts.rng_states import RngStates, seed_everything
from crate_clip.train.loop.parts.stage_part import (LoopState, StagePart, job_wide_names, load_part_states,
                                                    part_states)
from crate_clip.train.loop.parts.step_metrics import StepMetrics
from crate_clip.train.loop.parts.stop_agreement import StopAgreement, stop_stage
from crate_clip.train.loop.parts.stream_position import StreamPosition, stream_state
from crate_clip.train.loop.parts.whitebox_diagnostics import WhiteboxDiagnostics
from crate_clip.train.loop.stage_evals import evaluate_stage_end, stage_end_missing
from crate_clip.train.loop.stop_requests import agreed_stop, request_stop, share_between_ranks, stops_with_checkpoint
from crate_clip.train.loop.train_step import train_step
from crate_clip.train.reporting.deepspeed_output import (close_log, deepspeed_log_path, deepspeed_prints,
                                                         divert_deepspeed_logs, log_to, warnings_to_log)
from crate_clip.train.reporting.host_line import host_line
from crate_clip.train.reporting.metrics_log import PLOT_FILE, MetricsLog, set_aside_rows_after, write_plot
from crate_clip.train.reporting.trackers import TrackerError
from crate_clip.train.run.disk_space import check_space_for_next_save, remove_leftovers
from crate_clip.train.run.run_config import RunConfig, check_runtime
from crate_clip.train.run.run_dir import check_run_dir, move_run_aside
from crate_clip.train.run.run_lock import run_folder_lock
from crate_clip.train.stage_setup.engine import DistInfo, build_engine, init_distributed, model_dtype
from crate_clip.train.stage_setup.optim import restore_schedule_settings, schedule_settings
from crate_clip.train.stage_setup.optimizer_carry import CARRY, CarriedState, apply_state, check_carry, collect_state
from crate_clip.train.stage_setup.stage_model import ResolvedStage, compile_line, resolve_stage


# ---------------------------------------------------------------- the run (entry point)
@dataclasses.dataclass
class RunContext:
    """What every stage of one run shares: its config, the job's processes, the checkpoints, the metrics log and
    where a stage's batches come from; the stage functions take it instead of each part."""

    cfg: RunConfig
    dist: DistInfo
    ckpts: CheckpointManager
    log: MetricsLog
    stream_factory: Callable
    stream: StreamSettings   # the launch's stream settings (launch_stream_settings): every stage's, and the records'
    config_changes: list[ConfigChange] = dataclasses.field(default_factory=list)   # recorded once the resume took
    carried: Optional[CarriedState] = None   # the last stage's AdamW state, for a next stage that carries it


def run_training(cfg: RunConfig, resume: Optional[str] = None, stream_factory: Optional[Callable] = None,
                 dist: Optional[DistInfo] = None, overwrite: bool = False, take_over_lock: bool = False,
                 allow_changes: tuple = ()) -> dict:
    """Train all stages of `cfg` (resuming from `resume`: 'latest' or a checkpoint path; with `overwrite`, an
    earlier run in the output folder is moved aside first); returns a summary. One job at a time writes into a
    run folder: its rank 0 holds the folder's lock (run_lock.py) for the whole run; `take_over_lock` takes over
    a lock of another host that is still being refreshed (the user knows its run is gone). A resume may change
    what the run trains only where `allow_changes` names the key (config_changes.py)."""
    check_run_dir(cfg.run_dir, resume, overwrite)  # before anything is written, on every rank
    divert_deepspeed_logs()   # DeepSpeed's chatter to logs/deepspeed-rank<R>.log, from its first line
    dist = dist or init_distributed()
    with run_folder_lock(cfg.run_dir, dist, take_over=take_over_lock):
        changes = agreed_config_changes(cfg, resume, allow_changes, dist)   # before any work: nothing written
        return _run_holding_the_folder(cfg, resume, stream_factory, dist, overwrite, changes)


def _run_holding_the_folder(cfg: RunConfig, resume: Optional[str], stream_factory: Optional[Callable],
                            dist: DistInfo, overwrite: bool, changes: list[ConfigChange]) -> dict:
    """run_training, once this job is the run folder's one writer (`changes`: what the resume changes of the run's
    recorded config, recorded once the checkpoint loaded with them)."""
    earlier_run = check_run_dir(cfg.run_dir, resume, overwrite)  # again: a run may have ended in the meantime
    check_runtime(cfg, dist.world_size, "cuda" if dist.device.startswith("cuda") else "cpu")
    check_carry(cfg)
    stream_factory = stream_factory or default_stream_factory
    ckpts = CheckpointManager(checkpoints_dir(cfg.run_dir), cfg.checkpoint.keep_last, dist.rank, dist.world_size)
    start = find_resume_point(cfg, ckpts, _intact(ckpts, resolve_auto(cfg.run_dir, ckpts, resume)))  # before any write
    streams = launch_stream_settings(cfg, dist.world_size, start.tag_dir, start.progress.stage_index)
    if start.tag_dir is not None:   # every rank: the run's file system, once rank 0 removed what saves left
        _remove_leftovers(ckpts.root, dist)
        check_space_for_next_save(ckpts.root, start.tag_dir)
    tdist.barrier()  # every rank has read the folder before rank 0 changes it
    # from here a stop reaches every rank at once, not only at a step boundary, and a lost rank ends the job
    share_between_ranks(dist, cfg.run.lost_rank_timeout_s)
    if dist.is_main:
        _prepare_run_dir(cfg, streams, start, moved_aside=earlier_run and overwrite,
                         restarted=bool(earlier_run) and not overwrite and start.tag_dir is None)
        if start.tag_dir is not None:   # `latest` names it: a resume from an earlier checkpoint starts another line
            ckpts.continue_from(start.tag_dir)
    tdist.barrier()   # the run folder is in place (an earlier one moved aside) before any rank writes its log
    log_to(deepspeed_log_path(cfg.run_dir, dist.rank))
    if not dist.is_main:   # only rank 0 prints
        warnings_to_log()
    log = _open_log(cfg, dist, streams)
    run = RunContext(cfg, dist, ckpts, log, stream_factory, streams, changes)
    if start.tag_dir is None:   # --resume auto restarting a run cut short before its first checkpoint
        _record_config_changes(run, start)
    progress, weights, evals, tag_dir = start.progress, None, [], start.tag_dir
    t_start = time.time()
    try:
        if checkpoints_trusted():
            log.print(TRUST_WARNING)
        for note in cfg.rounding_notes():   # the steps and samples --validate prints
            log.print(f"[note] {note}")
        if start.tag_dir is not None:
            log.print(f"resuming from {start.tag_dir} (stage {progress.stage_index}, step {progress.step}, "
                      f"{progress.samples_seen} samples seen)")
        first = progress.stage_index   # 0, or the stage of the checkpoint resumed from
        for i in range(first):  # stages finished before the checkpoint resumed from
            evals += _evaluate_finished_stage(run, i)
        for i in range(first, len(cfg.stages)):
            stage = resolve_stage(cfg, i, dist.world_size, dist.device, stream=streams)
            resume_here = start if i == first and start.tag_dir is not None else None
            tag_dir, weights, records = run_stage(run, stage, weights, resume_here, progress)
            evals += records
        exported = _export(run, tag_dir, weights)
        tdist.barrier()
        return {"run_dir": str(cfg.run_dir), "export_dir": str(exported) if exported else None,
                "evals": evals, "progress": dataclasses.asdict(progress), "last_checkpoint": str(tag_dir),
                "seconds": time.time() - t_start}
    finally:
        log.close()
        close_log()
        if dist.is_main and cfg.logging.plot:
            _plot(cfg, log)


def _open_log(cfg: RunConfig, dist: DistInfo, streams: StreamSettings) -> MetricsLog:
    """The run's log; its trackers start on rank 0, and one that cannot (wandb without a login) stops every rank
    with rank 0's one line before the first step."""
    log, error = None, None
    try:
        log = MetricsLog(cfg.run_dir, enabled=dist.is_main, progress=cfg.logging.progress,
                         tensorboard=cfg.logging.tensorboard, report_to=cfg.logging.report_to,
                         progress_every_s=cfg.logging.progress_every_s, config=cfg.to_dict(streams),
                         run_name=cfg.run.name, wandb_project=cfg.logging.wandb_project)
    except Exception as exc:   # noqa: BLE001 - told to every rank first, then raised as it is on rank 0
        error = exc
    box = [None if error is None else str(error)]
    if dist.world_size > 1:
        tdist.broadcast_object_list(box, src=0)
    if error is not None:
        raise error
    if box[0]:   # another rank: rank 0 says it
        raise TrackerError(box[0])
    return log


def _intact(ckpts: CheckpointManager, resume: Optional[str]) -> Optional[str]:
    """The checkpoint `resume` names, or for 'latest' the newest intact one (checkpoints.intact_checkpoint)."""
    return resume and str(intact_checkpoint(ckpts, ckpts.resolve(resume), resume))


def _remove_leftovers(root: Path, dist: DistInfo) -> None:
    """Rank 0 (holding the run's lock) removes the partial folders of interrupted saves and conversions, said in one
    line; every rank waits for it."""
    if dist.is_main:
        removed = remove_leftovers(root)
        if removed:
            print(f"[note] removed what interrupted writes left in {root}: {', '.join(removed)}", flush=True)
    tdist.barrier()


def _plot(cfg: RunConfig, log: MetricsLog) -> None:
    """The training curve; a failure to write it (a full disk) is a warning, not an error hiding the run's own."""
    try:
        plot = write_plot(cfg.run_dir)
    except OSError as exc:
        log.print(f"[warn] {cfg.run_dir / PLOT_FILE} not written: {exc}")
        return
    if plot:
        log.print(f"wrote {plot}")


# ---------------------------------------------------------------- one stage
def run_stage(run: RunContext, stage: ResolvedStage, weights: Optional[dict], start: Optional[ResumePoint],
              progress: Progress) -> tuple[Path, dict, list[dict]]:
    """Train the stage (from the previous stage's weights, or on from `start`) and evaluate it;
    returns (its final checkpoint, its consolidated weights, the evaluation records)."""
    cfg, dist, log = run.cfg, run.dist, run.log
    if start is not None and start.stage_finished:
        # the stage had finished before the interruption: only evaluations may be missing
        with deepspeed_prints():
            weights = consolidated_state_dict(start.tag_dir, verify=False)   # verified by the resume
        _record_config_changes(run, start)
        if _next_stage_carries(cfg, stage):   # its AdamW state is in the checkpoint: load it to pass it on
            run.carried = _state_of_checkpoint(run, stage, start.tag_dir)
        return start.tag_dir, weights, evaluate_stage_end(cfg, stage, start.tag_dir, weights, progress, log, dist)
    # resuming: every weight comes from the checkpoint loaded below, the model only needs the stage's shapes
    model = stage.build_model(weights, read_files=start is None)
    log.print(compile_line(stage, dist.device))
    # another world size or ZeRO stage: DeepSpeed's universal checkpoint (elastic_resume.py)
    universal = start is not None and needs_universal(start.tag_dir, dist.world_size, stage.zero_stage)
    with deepspeed_prints():
        engine = build_engine(model, cfg, stage, dist, load_universal=universal)
    seed_everything(cfg.run.seed * 7919 + 104729 * stage.index + dist.rank)  # token masks differ per rank
    stream = run.stream_factory(cfg, stage, dist)
    line = host_line(stage)
    if line is not None:   # said by each host's first process, not rank 0 alone: its own loaders (host_line.py)
        print(line, flush=True)
    loop = LoopState(run, stage, engine, stream, progress, saver=_save)
    loop.parts = stage_parts(loop)
    if start is not None:
        settings = schedule_settings(engine.lr_scheduler)   # the run config's: an allowed change takes effect
        states = _load_checkpoint(run, engine, stage, start.tag_dir, universal, job_wide_names(loop.parts))
        restore_schedule_settings(engine.lr_scheduler, settings)
        _record_config_changes(run, start)
        load_part_states(loop.parts, states)
    else:
        progress.stage_index, progress.step, progress.nonfinite_in_a_row = stage.index, 0, 0
        if stage.config.optimizer_state == CARRY:
            _carry_into(run, stage, engine)
    tag_dir = train_stage(loop)
    run.carried = collect_state(engine) if _next_stage_carries(cfg, stage) else None
    engine.destroy()
    del engine, model, stream
    with deepspeed_prints():
        weights = consolidated_state_dict(tag_dir, verify=False)   # this job wrote and hashed it
    return tag_dir, weights, evaluate_stage_end(cfg, stage, tag_dir, weights, progress, log, dist)


def _next_stage_carries(cfg: RunConfig, stage: ResolvedStage) -> bool:
    """Whether the stage after `stage` starts from its AdamW state (stages.N.optimizer_state: carry)."""
    return stage.index + 1 < len(cfg.stages) and cfg.stages[stage.index + 1].optimizer_state == CARRY


def _state_of_checkpoint(run: RunContext, stage: ResolvedStage, tag_dir: Path) -> CarriedState:
    """The AdamW state saved in a finished stage's checkpoint (a resume between two stages): the stage's engine is
    built and loaded only to gather it."""
    universal = needs_universal(tag_dir, run.dist.world_size, stage.zero_stage)
    model = stage.build_model(None, read_files=False)
    with deepspeed_prints():
        engine = build_engine(model, run.cfg, stage, run.dist, load_universal=universal)
    _load_checkpoint(run, engine, stage, tag_dir, universal)
    carried = collect_state(engine)
    engine.destroy()
    return carried


def _carry_into(run: RunContext, stage: ResolvedStage, engine) -> None:
    """Start `stage`'s optimizer from the previous stage's AdamW state (optimizer_carry.py says what carries)."""
    if run.carried is None:   # the run config refuses carry in stage 0; a stage before this one always sets it
        raise RuntimeError(f"stage {stage.index}: optimizer_state carry without the AdamW state of stage "
                           f"{stage.index - 1}")
    report = apply_state(engine, run.carried)
    run.log.print(report.line(stage.name, run.carried.step))
    run.carried = None


def _load_checkpoint(run: RunContext, engine, stage: ResolvedStage, tag_dir: Path, universal: bool,
                     job_wide: tuple = ()) -> dict:
    """Load `tag_dir` into the stage's engine; returns this rank's states of the parts (`job_wide`: the parts whose
    state rank 0 keeps, elastic_resume.load_resume_state). Weights of other shapes than the stage's
    model (a run config changed since) are a ResumeError naming the first mismatch, not a traceback."""
    try:
        with deepspeed_prints():
            return load_resume_state(run.ckpts, engine, tag_dir, run.dist.rank, run.dist.world_size, universal,
                                     job_wide)
    except RuntimeError as exc:   # torch's load_state_dict under DeepSpeed: "size mismatch for <key>: ..."
        lines = [line.strip() for line in str(exc).splitlines()
                 if line.strip().startswith(("size mismatch", "Missing key", "Unexpected key"))]
        if not lines:
            raise
        raise ResumeError(f"{tag_dir}: its weights do not fit stage {stage.index} ({stage.name}) of this run config: "
                          f"{lines[0]}; fix: resume with the run config that wrote the checkpoint (its "
                          "crate_clip.json holds it under run_config)") from None


def _record_config_changes(run: RunContext, start: ResumePoint) -> None:
    """Rank 0 appends the config changes of this resume to config_changes.jsonl, once its checkpoint loaded with
    them (a change the checkpoint cannot take, other shapes, is refused by the load and not recorded)."""
    if run.dist.is_main and run.config_changes:
        where = start.progress
        record_changes(run.cfg.run_dir, run.config_changes,
                       ResumedAt(where.stage_index, where.step, where.global_step,
                                 start.tag_dir.name if start.tag_dir is not None else None))
        for change in run.config_changes:
            run.log.print(f"[note] config change {'allowed' if not change.free else 'that trains the same'}: "
                          f"{change.line()}")
    run.config_changes = []


def _evaluate_finished_stage(run: RunContext, i: int) -> list[dict]:
    """The evaluations of an earlier stage that are not in results.jsonl, from its final checkpoint (which
    rotation never removes: CheckpointManager.prune)."""
    cfg, dist, log = run.cfg, run.dist, run.log
    if not stage_end_missing(cfg, i, dist):   # the live weights' or train.ema's
        return []
    tag_dir = run.ckpts.root / checkpoint_tag(i, cfg.stages[i].steps)
    record = read_record(tag_dir)
    if record is None:
        log.print(f"[warn] stage {i} ({cfg.stages[i].name}): evaluations missing from results.jsonl and its "
                  f"final checkpoint {tag_dir} is gone; they cannot be run")
        return []
    stage = resolve_stage(cfg, i, dist.world_size, stream=run.stream)   # for its evaluations: no micro-batch fit
    with deepspeed_prints():
        weights = consolidated_state_dict(tag_dir)
    return evaluate_stage_end(cfg, stage, tag_dir, weights, record.progress, log, dist)


def _prepare_run_dir(cfg: RunConfig, streams: StreamSettings, start: ResumePoint, moved_aside: bool,
                     restarted: bool = False) -> None:
    """Rank 0, once the command is validated: move an earlier run aside (--overwrite), set aside the rows a
    cut-short segment logged after the checkpoint resumed from (`restarted`: --resume auto starts over a run
    cut short before its first checkpoint: all its rows), write run_config.yaml at the first start (a resume keeps
    it: config_changes.jsonl records what resumes changed)."""
    if moved_aside:
        print(f"the earlier run in {cfg.run_dir} is moved to {move_run_aside(cfg.run_dir)}", flush=True)
    if start.tag_dir is not None or restarted:
        set_aside_rows_after(cfg.run_dir, start.progress.global_step)
    cfg.run_dir.mkdir(parents=True, exist_ok=True)
    record_run(cfg, streams)   # run_config.yaml at the first start, and what its path keys read (config_changes.py)


def _export(run: RunContext, tag_dir: Path, weights: dict) -> Optional[Path]:
    """The last checkpoint as an open_clip model folder (rank 0): what `crate-clip export` writes of it."""
    if not run.dist.is_main:
        return None
    folder = export_checkpoint(tag_dir, export_dir(run.cfg.run_dir), state=weights)
    run.log.print(f"exported the final weights to {folder} "
                  f"(open_clip.create_model_and_transforms('local-dir:{folder}') after `import crate_clip`)")
    return folder


# ---------------------------------------------------------------- building blocks
def default_stream_factory(cfg: RunConfig, stage: ResolvedStage, dist: DistInfo):
    """The stage's webdataset stream (data_pipelines), each rank reading its own shards."""
    stream_cfg = cfg.stream_config(stage.index).model_copy(update={"mean": stage.mean, "std": stage.std})
    return build_train_stream(stream_cfg, image_size=stage.image_size, context_length=stage.context_length,
                              text_mask=stage.text_mask, batch_size=stage.per_rank_batch,
                              rank=dist.rank, world_size=dist.world_size,
                              tokenizer_name=cfg.model.tokenizer or cfg.model.name,
                              bert_vocab=cfg.model.bert_vocab, decode=stage.decode, device=dist.device,
                              settings=stage.stream)


def _make_loss(dist: DistInfo) -> ClipLoss:
    """open_clip's contrastive loss across the ranks."""
    # local loss + gathered features (with grad): each rank's logits are (B_local x B_global), the only
    # setting whose memory does not grow with the square of the global batch
    return ClipLoss(local_loss=True, gather_with_grad=True, cache_labels=True,
                    rank=dist.rank, world_size=dist.world_size)


# ---------------------------------------------------------------- the steps of one stage
def stage_parts(loop: LoopState) -> list[StagePart]:
    """The stage's parts, in the order their hooks run (stage_part.py): a feature of the loop is one entry here."""
    cfg, progress = loop.cfg, loop.progress
    parts = [StreamPosition(loop.stream),
             RngStates(cfg.run.seed, loop.stage.index, progress, loop.dist.rank),
             ProgressRecord(progress),
             WhiteboxDiagnostics(),                                  # before the metrics: its columns are the row's
             StepMetrics(cfg.logging.every_steps),
             NonfiniteGuard(cfg.run.max_nonfinite_in_a_row),         # after the metrics: the skipped step's row first
             EmaWeights.for_stage(cfg, loop.stage, loop.dist),       # None unless train.ema
             CheckpointCadence(cfg.checkpoint.every_steps),
             MidStageEvals(cfg.eval.max_time_share),
             StopAgreement()]                                        # last: the step's other parts are done
    return [part for part in parts if part is not None]   # a feature that is off gives None


def train_stage(loop: LoopState) -> Path:
    """Run the stage's remaining steps, calling its parts' hooks; returns the folder of its final checkpoint."""
    run, stage, engine, stream, progress = loop.run, loop.stage, loop.engine, loop.stream, loop.progress
    loss_fn, dtype = _make_loss(run.dist), model_dtype(run.cfg.precision)
    loop.first_step = progress.step   # a stop saves only once a step was trained since
    engine.train()
    batches = agreed_batches(stream, run.dist.device)   # a data error on one rank stops every rank
    run.log.start_stage(f"stage {progress.stage_index} {stage.name} @{stage.image_size}px", stage.steps,
                        progress.step, stage.global_batch)
    _hooks(loop, "on_stage_start")
    while progress.step < stage.steps:
        loop.saved, loop.measured = None, {}
        _hooks(loop, "on_step_start")
        position = stream_state(stream)   # before the fetch: a rank whose batch is dropped below must not skip it
        try:
            batches, (loop.images, tokens) = _next_batch(batches, stream, run.cfg, run.dist)
        except Exception as exc:   # a data source given up on: every rank raised at this batch (agreed_batches)
            if not stops_with_checkpoint(exc):
                raise
            request_stop(str(exc), exc.exit_code)
            stop_stage(loop, agreed_stop(run.dist), stream_state=position)
        loop.lr = engine.get_lr()[0]
        _hooks(loop, "on_batch_ready")
        loop.result = train_step(engine, loss_fn, loop.images, tokens, run.dist, dtype, run.cfg.model.attention)
        advance(progress, loop.result, stage.global_batch)
        _hooks(loop, "on_step_end")
    loop.save()   # the stage's final checkpoint
    _hooks(loop, "on_stage_end")
    run.log.end_stage()
    return loop.saved


def _hooks(loop: LoopState, hook: str) -> None:
    for part in loop.parts:
        getattr(part, hook)(loop)


def _next_batch(batches, stream, cfg: RunConfig, dist: DistInfo):
    """(the batch iterator, the step's batch); in epoch mode a pass that ends starts the next."""
    try:
        return batches, next(batches)
    except StopIteration:  # epoch mode: the next pass over the shards
        batches = agreed_batches(stream, dist.device)
        return batches, _first_batch_of_epoch(batches, cfg)


# ---------------------------------------------------------------- checkpoints
def _save(loop: LoopState, position: Optional[dict] = None) -> Path:
    """Every rank: a checkpoint of the step just trained, holding every part's state (`position`: the data
    position to record instead of the stream's now)."""
    run, stage, progress = loop.run, loop.stage, loop.progress
    cfg, ckpts = run.cfg, run.ckpts
    info = CheckpointInfo(cfg.model.name, stage.image_size, stage.context_length, tower_patch_size(loop.engine.module),
                          stage.zero_stage, stage.name, stage.steps, cfg.precision, cfg.to_dict(run.stream),
                          {"mean": list(stage.mean), "std": list(stage.std)},
                          tokenizer_record(cfg.model.tokenizer or cfg.model.name, cfg.model.bert_vocab),
                          progress)
    rank_state = part_states(loop.parts)
    if position is not None:
        rank_state[StreamPosition.name] = position
    table = gather_stream_table(rank_state.get(StreamPosition.name), ckpts.rank, ckpts.world_size)   # a collective
    return ckpts.save(loop.engine, checkpoint_tag(progress.stage_index, progress.step), info.as_dict(), rank_state,
                      shared_files={STREAM_TABLE: json.dumps(table)} if table else None)


def _first_batch_of_epoch(batches, cfg: RunConfig):
    """The first batch of a new pass; a pass that yields nothing would otherwise end the run silently."""
    try:
        return next(batches)
    except StopIteration:
        raise RuntimeError(f"data.sources {list(cfg.data.sources)}: a whole epoch gave no batch on this rank "
                           "(too few usable samples for the per-rank batch; see the stream's skip counters in "
                           "metrics.jsonl)") from None
