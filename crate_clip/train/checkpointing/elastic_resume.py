"""Resuming a run on another number of processes or another ZeRO stage, and restarting it by itself.

A checkpoint written by W processes under ZeRO stage z holds each rank's partition of the fp32 master weights
and AdamW moments (DeepSpeed's `*optim_states.pt`), the model-states file (schedule, global step, buffers),
each rank's data-stream position and RNG states (`train_state_rank<r>.pt`) and, from rank 0, the table of all
canonical streams (`stream_table.json`). A job of W' processes, or of ZeRO stage z', continues it like this:

- weights and optimizer: DeepSpeed's universal checkpoint (deepspeed/checkpoint/ds_to_universal.py: one folder
  per parameter holding its whole fp32 value, exp_avg, exp_avg_sq and step). Rank 0 converts the checkpoint
  once into `<tag>/universal/` (written into `<tag>/.universal.converting/`, renamed when complete: a conversion
  cut short is never loaded, the next resume converts again; converted.json records the size and sha256 of
  every file, rank 0 verifies them before each load and converts again when they differ); every rank waits, then
  loads it with DeepSpeed's
  `checkpoint.load_universal` and takes its own partition. Weights, moments and step counts are the saved ones
  bit for bit. Four gaps of DeepSpeed 0.19.8's path are closed here, each by the smallest change:
  1. the converted folder gets the model-states file under the name of either loader (ZeRO 1/2 read
     `mp_rank_00_model_states.pt`, ZeRO-3 `zero_pp_rank_0_mp_rank_00_model_states.pt`), an
     `optimizer_state.pt` with the fields of both, and the per-parameter `step.pt` a ZeRO-3 conversion does
     not write, so that the stage may change at the resume (2 -> 3 to fit fewer GPUs, or back);
  2. ZeRO-3's universal loader gives every parameter group the first group's settings (our no-decay group
     would be decayed): the saved groups' settings are put back after the load;
  3. the universal loader restores parameters only: the buffers (a locked text tower is made of buffers,
     text_lock.py) are copied from the model-states file;
  4. ZeRO-3's universal loader gives all its sub-groups one and the same step tensor, which torch's AdamW
     increments in place once per group and step (the bias correction then runs ahead): each gets its own.
  The learning-rate schedule and the global step come from the model-states file, as in a plain load.
- data order: the stream-state table, split for this job (data_pipelines/stream_layout.py): the global batches
  continue exactly. `data.canonical_streams` (C) is fixed at the first launch and recorded in run_config.yaml
  and in every checkpoint; a job whose W' x workers does not divide C is refused in one line.
- random generators: at the same world size each rank gets its saved states back (bit-exact resume). At
  another, per-rank states cannot be mapped onto the new ranks; each rank seeds its generators from
  (run seed, stage, global step, rank), so a resume at W' always continues the same way, but the random image
  token masks (the training step's only draws; data augmentation is seeded by sample position) are not those
  the W-process run would have drawn.

`--resume auto` (restart by itself): the newest complete checkpoint if there is one, else a fresh start in place.
"""
from __future__ import annotations

import argparse
import contextlib
import hashlib
import io
import json
import math
import os
import shutil
from pathlib import Path
from typing import Optional

import torch
import torch.distributed as tdist

from crate_clip.checkpoint_io.atomic_files import atomic_write_text, fsync_dir, fsync_tree
from crate_clip.checkpoint_io.bounded_reads import UnreadableRecordError, read_small_json
from crate_clip.checkpoint_io.file_checksums import (CHECKSUMS_KEY, ChecksumMismatchError, file_checksum,
                                                     verify_recorded_checksums)
from crate_clip.checkpoint_io.checkpoint_choice import AUTO, LATEST, RESUME, choose_checkpoint
from crate_clip.checkpoint_io.checkpoint_record import CheckpointInfo, read_record
from crate_clip.checkpoint_io.deepspeed_checkpoints import UNIVERSAL_DIR
from crate_clip.checkpoint_io.run_layout import EXPORT_DIR, RESULTS_FILE, rank_state_file
from crate_clip.checkpoint_io.safe_unpickling import deepspeed_reads, load_torch_file
from crate_clip.core.errors import ConfigError
from crate_clip.core.shard_sources import expand_source
from crate_clip.train.checkpointing.checkpoints import CheckpointManager, ResumeError
from crate_clip.train.run.run_config import RunConfig
from crate_clip.train.run.run_dir import ExistingRunError
from crate_clip.data.stream_layout import (KEY as STREAMS_KEY, STATE_VERSION, LayoutError, StreamSettings,
                                          merge_stream_states, resolve_layout, split_stream_state, stream_settings)
from crate_clip.core.host_ranks import ranks_on_this_host

STREAM_TABLE = "stream_table.json"
CONVERTED_FILE = "converted.json"          # written last into a universal folder: the conversion is whole
MODEL_STATES_FILES = ("mp_rank_00_model_states.pt", "zero_pp_rank_0_mp_rank_00_model_states.pt")


# ---------------------------------------------------------------- --resume auto
def resolve_auto(run_dir: Path, ckpts: CheckpointManager, resume: Optional[str]) -> Optional[str]:
    """`--resume auto` -> 'latest' when the run has a complete checkpoint, else None (start, in place); any other
    value unchanged. A folder with an export or evaluations but no checkpoint is not a run cut short: refused."""
    if resume != AUTO:
        return resume
    if choose_checkpoint(AUTO, RESUME, run_checkpoints=ckpts.root, error=ResumeError).tag_dir is not None:
        return LATEST
    finished = [name for name in (EXPORT_DIR, RESULTS_FILE) if (Path(run_dir) / name).exists()]
    if finished:
        raise ExistingRunError(
            f"--resume auto: run.output_dir {run_dir} holds {', '.join(finished)} but no complete checkpoint in "
            f"{ckpts.root}, so it is not a run cut short before its first checkpoint; fix: --overwrite to move it "
            "aside and start over, or set run.output_dir to another folder")
    return None


# ---------------------------------------------------------------- canonical streams
def _saved_data(record: Optional[CheckpointInfo]) -> dict:
    # the `data` section of the run config a checkpoint was written under ({} when it records none)
    return (record.run_config.get("data") or {}) if record is not None else {}


def _saved_shape(record: Optional[CheckpointInfo], world_size: int, zero_stage: int) -> tuple[int, int]:
    # (world size, ZeRO stage) that wrote the checkpoint; this job's where an earlier version did not record them
    if record is None:
        return world_size, zero_stage
    return (int(record.world_size if record.world_size is not None else world_size),
            int(record.zero_stage if record.zero_stage is not None else zero_stage))


def saved_canonical_streams(tag_dir: Path, record: Optional[CheckpointInfo]) -> Optional[int]:
    """The canonical stream count a checkpoint's run used (its run config, else its stream states)."""
    recorded = _saved_data(record).get("canonical_streams")
    if recorded:
        return int(recorded)
    table = Path(tag_dir) / STREAM_TABLE
    if table.is_file():
        return int(read_small_json(table)["canonical_streams"])
    rank0 = rank_state_file(tag_dir, 0)
    stream = load_torch_file(rank0, allow=()).get("stream") if rank0.is_file() else None
    return int(stream["canonical_streams"]) if stream and "canonical_streams" in stream else None


def run_rank_batch(cfg: RunConfig, world_size: int) -> int:
    """The rank batch every stage's divides (their greatest common divisor): what the stream count must divide."""
    return math.gcd(*(s.global_batch // world_size for s in cfg.stages))


def launch_stream_settings(cfg: RunConfig, world_size: int, tag_dir: Optional[Path] = None, first_stage: int = 0,
                           ranks_per_host: Optional[int] = None) -> StreamSettings:
    """The stream settings of this launch, settled once: data.canonical_streams and data.shuffle_buffer as the config
    sets them, else as the checkpoint resumed (`tag_dir`) recorded them (the sample order is defined by them), else
    the first launch's (world size x the most DataLoader workers whose count divides every stage's rank batch, epoch
    mode at most one stream per shard; data.host_shuffle_buffer split over a host's streams, `ranks_per_host` a host:
    default LOCAL_WORLD_SIZE). The resolved stages carry them, the streams read them and the run's records hold them
    (RunConfig.to_dict(stream)). Raises a one-line ResumeError / ConfigError when the count does not fit this job's
    processes and workers in a stage from `first_stage` on."""
    record = read_record(tag_dir) if tag_dir is not None else None
    saved = saved_canonical_streams(tag_dir, record) if tag_dir is not None else None
    wanted = cfg.data.canonical_streams
    if saved and wanted and saved != wanted:
        raise ResumeError(f"{tag_dir}: written with {STREAMS_KEY}={saved} (the sample order is defined by it), the "
                          f"run config sets {wanted}; fix: {STREAMS_KEY}: {saved}, or remove the key")
    saved_buffer = _saved_data(record).get("shuffle_buffer")
    shards = (sum(len(expand_source(src)) for src in cfg.data.sources)
              if cfg.data.mode == "epoch" and not (wanted or saved) else None)
    settings = stream_settings(cfg.data, world_size, run_rank_batch(cfg, world_size), shards,
                               ranks_per_host or ranks_on_this_host(world_size), saved,
                               None if saved_buffer is None else int(saved_buffer))
    origin = " (recorded in the checkpoint)" if saved and not wanted else ""
    for i in range(first_stage, len(cfg.stages)):
        try:
            resolve_layout(settings.streams, cfg.stages[i].global_batch, world_size, 0, cfg.data.num_workers, origin)
        except LayoutError as exc:
            where = f"{tag_dir}: resuming with {world_size} processes: " if tag_dir is not None else ""
            error = ResumeError if tag_dir is not None else ConfigError
            raise error(f"{where}stages.{i}: {exc}") from None
    return settings


def resume_summary(tag_dir: Path, cfg: RunConfig, world_size: int) -> dict:
    """How a job of `world_size` processes with run config `cfg` would continue checkpoint `tag_dir` (its JSON files
    only); the launch's own checks, as one-line errors."""
    # here: DeepSpeed's import, for `plan` only when resuming
    from crate_clip.train.stage_setup.stage_model import resolve_stage

    record = read_record(tag_dir)
    stage = record.progress.stage_index
    streams = launch_stream_settings(cfg, world_size, tag_dir, stage).streams
    zero_stage = resolve_stage(cfg, stage, world_size).zero_stage   # what the launch decides, as run_stage uses it
    universal = needs_universal(tag_dir, world_size, zero_stage)
    converted = (Path(tag_dir) / UNIVERSAL_DIR / CONVERTED_FILE).is_file()
    return {"checkpoint": str(tag_dir), "stage_index": stage, "stage_name": record.stage_name,
            "step": record.progress.step, "stage_steps": cfg.stages[stage].steps,   # the config's (a resume may change it)
            "global_step": record.progress.global_step,
            "written_by": record.world_size, "written_zero_stage": record.zero_stage,
            "world_size": world_size, "zero_stage": zero_stage, "canonical_streams": streams,
            "universal": ("converted" if converted else "converted by rank 0 at the resume") if universal else "none"}


# ---------------------------------------------------------------- the stream-state table
def gather_stream_table(state: Optional[dict], rank: int, world_size: int) -> Optional[dict]:
    """Rank 0: the table of all canonical streams of this step (merge of every rank's stream `state`); other ranks
    and streams without canonical-stream states: None. Every rank must call it."""
    states = [None] * world_size if rank == 0 else None
    tdist.gather_object(state, states, dst=0)
    if rank != 0 or not all(s and s.get("version") == STATE_VERSION for s in states):
        return None
    return merge_stream_states(states)


def stream_state_for(tag_dir: Path, rank: int, world_size: int, saved_world_size: int) -> Optional[dict]:
    """This rank's part of the checkpoint's stream-state table for a job of `world_size` processes (the table
    merged from the rank-state files when the checkpoint has none)."""
    path = Path(tag_dir) / STREAM_TABLE
    try:
        if path.is_file():
            table = read_small_json(path)
        else:
            states = [load_torch_file(rank_state_file(tag_dir, r), allow=()).get("stream")
                      for r in range(saved_world_size)]
            if any(s is None for s in states):
                return None
            table = merge_stream_states(states)
        return split_stream_state(table, rank, world_size)
    except (LayoutError, ValueError) as exc:
        raise ResumeError(f"{tag_dir}: its data-stream positions cannot be continued by {world_size} processes: "
                          f"{exc}") from None


def resume_seed(seed: int, stage_index: int, global_step: int, rank: int) -> int:
    """The seed of a rank's random generators when a run resumes at another world size."""
    digest = hashlib.sha256(f"{seed}-{stage_index}-{global_step}-{rank}".encode()).digest()
    return int.from_bytes(digest[:8], "little") >> 1


# ---------------------------------------------------------------- weights and optimizer at another shape
def needs_universal(tag_dir: Path, world_size: int, zero_stage: int) -> bool:
    """Whether checkpoint `tag_dir` must be loaded through its universal form: written by another world size or
    ZeRO stage with partitioned optimizer states. ResumeError when no DeepSpeed path loads it into this job."""
    saved_world, saved_stage = _saved_shape(read_record(tag_dir), world_size, zero_stage)
    if (saved_world, saved_stage) == (world_size, zero_stage):
        return False
    partitioned = any(Path(tag_dir).glob("*optim_states.pt"))
    if not partitioned and zero_stage == 0:
        return False   # ZeRO-0 keeps the whole optimizer in the model-states file: any world size loads it
    if not partitioned or zero_stage == 0:
        raise ResumeError(f"{tag_dir}: written under ZeRO stage {saved_stage} by {saved_world} processes; this job "
                          f"runs ZeRO stage {zero_stage} on {world_size}: a change to or from ZeRO stage 0 is not "
                          f"supported; fix: deepspeed.zero_stage: {saved_stage}")
    return True


def load_resume_state(ckpts: CheckpointManager, engine, tag_dir: Path, rank: int, world_size: int,
                      universal: bool, job_wide: tuple = ()) -> dict:
    """Load checkpoint `tag_dir` into `engine` (every rank; `universal`: needs_universal's answer, the engine built
    with load_universal); returns this rank's states of the stage loop's parts. At another world size the saved ranks'
    own states do not fit: the `stream` position is rebuilt for this rank from the saved table, `rng` is None (the
    caller seeds with resume_seed) and the `job_wide` parts' states come from saved rank 0's file. The checkpoint was
    checked (complete, allow-listed) by find_resume_point before anything was written."""
    if universal:
        universal_checkpoint(tag_dir, rank)
        load_universal(engine, tag_dir)
    else:   # the same world size, or ZeRO-0 (nothing partitioned): DeepSpeed's plain load fits
        ckpts.load_engine_states(engine, tag_dir)
    saved_world = _saved_shape(read_record(tag_dir), world_size, 0)[0]
    if saved_world == world_size:   # the ranks' own states fit (at most the ZeRO stage changed)
        return ckpts.load_rank_state(tag_dir)
    rank0 = ckpts.load_rank_state(tag_dir, rank=0) if job_wide else {}
    return {**{name: rank0.get(name) for name in job_wide},
            "stream": stream_state_for(tag_dir, rank, world_size, saved_world), "rng": None}


def universal_damage(folder: Path) -> Optional[str]:
    """Why the universal folder `folder` cannot be loaded as it is (not converted, no record of its files as an
    earlier version wrote it, a malformed record, a file that differs from it), None when it is intact."""
    record = Path(folder) / CONVERTED_FILE
    try:
        converted = read_small_json(record)
    except FileNotFoundError:
        return "not converted"
    except UnreadableRecordError as exc:
        return str(exc)
    if not isinstance(converted, dict) or CHECKSUMS_KEY not in converted:
        return f"{record} records no checksums (an earlier version's conversion)"
    files = sorted(p.relative_to(folder).as_posix() for p in Path(folder).rglob("*") if p.is_file())
    unrecorded = [name for name in files if name != CONVERTED_FILE and name not in converted[CHECKSUMS_KEY]]
    try:
        verify_recorded_checksums(folder, converted, record)
    except ChecksumMismatchError as exc:
        return str(exc)
    return f"{unrecorded[0]}: not in {record}" if unrecorded else None


def universal_checkpoint(tag_dir: Path, rank: int) -> Path:
    """The universal form of checkpoint `tag_dir` (converted by rank 0 the first time, and again when its files
    differ from its record; every rank must call it)."""
    target = Path(tag_dir) / UNIVERSAL_DIR
    failure = None
    damage = universal_damage(target) if rank == 0 else None
    if damage is not None:
        if damage != "not converted":
            print(f"[warn] {target}: {damage}; converting the checkpoint again", flush=True)
        try:
            convert_to_universal(Path(tag_dir))
        except Exception as exc:   # reported on every rank after the barrier, not left as a hang
            failure = f"{type(exc).__name__}: {exc}"
    outcome = [failure]
    tdist.broadcast_object_list(outcome, src=0)
    if outcome[0] is not None:
        raise ResumeError(f"{tag_dir}: DeepSpeed's conversion to a universal checkpoint failed: {outcome[0]}")
    return target


def convert_to_universal(tag_dir: Path) -> Path:
    """Write `<tag_dir>/universal/` with DeepSpeed's ds_to_universal (staged, renamed when complete)."""
    import deepspeed
    from deepspeed.checkpoint import ds_to_universal

    staging, target = tag_dir / f".{UNIVERSAL_DIR}.converting", tag_dir / UNIVERSAL_DIR
    for leftover in (staging, target):   # a conversion cut short (target: renamed but never marked whole)
        if leftover.exists():
            shutil.rmtree(leftover)
    args = argparse.Namespace(input_folder=str(tag_dir), output_folder=str(staging), num_extract_workers=1,
                              num_merge_workers=1, keep_temp_folder=False, strict=True, inject_missing_state=True)
    log = io.StringIO()   # its progress bars and prints: shown only when it fails
    try:
        with deepspeed_reads(tag_dir), contextlib.redirect_stdout(log), contextlib.redirect_stderr(log):
            ds_to_universal.main(args)
    except Exception as exc:
        raise RuntimeError(f"{exc} (its output: {' '.join(log.getvalue().split()[-60:])})") from exc
    (tag_dir / "latest_universal").unlink(missing_ok=True)   # DeepSpeed's pointer; the folder is named here
    _loadable_by_any_stage(staging)
    checksums = {p.relative_to(staging).as_posix(): file_checksum(p) for p in sorted(staging.rglob("*")) if p.is_file()}
    atomic_write_text(staging / CONVERTED_FILE, json.dumps({"deepspeed": deepspeed.__version__,
                                                            CHECKSUMS_KEY: checksums}, indent=1))
    fsync_tree(staging)
    os.rename(staging, target)
    fsync_dir(tag_dir)
    return target


def _loadable_by_any_stage(folder: Path) -> None:
    """Complete a converted folder so that the ZeRO 1/2 and the ZeRO-3 loader both read it (gap 1 above): the
    model-states file under both names, the optimizer settings and step in both loaders' places, a step file per
    parameter, and every state file in the form both read ({"param": tensor})."""
    import deepspeed
    from deepspeed.checkpoint.constants import PARAM

    present = [name for name in MODEL_STATES_FILES if (folder / name).is_file()]
    for name in MODEL_STATES_FILES:
        if name not in present:   # the same file under the other loader's name
            try:
                os.link(folder / present[0], folder / name)
            except OSError:   # a file system without hard links
                shutil.copy2(folder / present[0], folder / name)
    zero = folder / "zero"
    optim = load_torch_file(zero / "optimizer_state.pt")
    if "optimizer_state_dict" in optim:   # a ZeRO-3 source: one step for all parameters
        step = optim["optimizer_state_dict"]["state"][0]["step"]
    else:                                 # a ZeRO 1/2 source: a step file per parameter, all equal
        step = load_torch_file(next(zero.glob("*/step.pt")))
        optim["optimizer_state_dict"] = {"state": {0: {"step": step}}, "param_groups": optim["param_groups"]}
    optim.setdefault("ds_version", deepspeed.__version__)   # the ZeRO 1/2 loader asserts it
    torch.save(optim, zero / "optimizer_state.pt")
    for param in (p for p in zero.iterdir() if (p / "exp_avg.pt").is_file()):
        if not (param / "step.pt").is_file():
            torch.save(step, param / "step.pt")
        for state in ("fp32", "exp_avg", "exp_avg_sq"):   # ZeRO-3 writes bare tensors, ZeRO 1/2 read {"param": ...}
            value = load_torch_file(param / f"{state}.pt")
            if torch.is_tensor(value):
                torch.save({PARAM: value}, param / f"{state}.pt")


def load_universal(engine, tag_dir: Path) -> None:
    """Load the universal form of `tag_dir` into `engine` (built with load_universal=True); every rank."""
    folder = Path(tag_dir) / UNIVERSAL_DIR
    with deepspeed_reads(folder):   # DeepSpeed's own torch.load calls pass weights_only=False
        load_path, _ = engine.load_checkpoint(str(tag_dir), tag=UNIVERSAL_DIR, load_optimizer_states=True,
                                              load_lr_scheduler_states=True)
    if load_path is None:
        raise ResumeError(f"DeepSpeed could not load the universal checkpoint {folder}")
    _restore_group_settings(engine, folder)
    _unshare_step_counts(engine)
    _restore_buffers(engine, folder)


def _restore_group_settings(engine, folder: Path) -> None:
    """Each optimizer group's saved settings (weight decay, lr, betas...): ZeRO-3's universal loader gives every
    group the first group's (gap 2 above)."""
    saved = load_torch_file(folder / "zero" / "optimizer_state.pt")["param_groups"]
    groups = getattr(engine.optimizer, "optimizer", engine.optimizer).param_groups
    if len(saved) != len(groups):
        raise ResumeError(f"{folder}: {len(saved)} optimizer parameter groups saved, this model has {len(groups)}; "
                          "fix: resume with the run config that wrote the checkpoint")
    for group, settings in zip(groups, saved):
        group.update({k: v for k, v in settings.items() if k != "params"})


def _unshare_step_counts(engine) -> None:
    """One step tensor per optimizer state: ZeRO-3's universal loader gives every sub-group the same tensor, which
    torch's AdamW increments in place, so each group's step would add to all groups' counts (gap 4 above)."""
    base = getattr(engine.optimizer, "optimizer", engine.optimizer)
    for state in base.state.values():
        if torch.is_tensor(state.get("step")):
            state["step"] = state["step"].clone()


def _restore_buffers(engine, folder: Path) -> None:
    """The saved buffers (a locked text tower, text_lock.py) into the model: the universal load skips them."""
    module = load_torch_file(folder / MODEL_STATES_FILES[0], mmap=True)["module"]   # only the buffers are read
    with torch.no_grad():
        for name, buffer in engine.module.named_buffers():
            if name in module:
                buffer.copy_(module[name])
