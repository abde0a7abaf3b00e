"""DeepSpeed checkpoints that are safe to resume from: atomic completion, retention, per-rank client state.

Layout (crate_clip.checkpoint_io, shared with eval/): `<run_dir>/checkpoints/<tag>/` holds DeepSpeed's files
(written by all ranks), one `train_state_rank<r>.pt` per rank (data-stream position, RNG states), and
`crate_clip.json`. A save writes all of them into `.<tag>.saving/`, fsyncs them, and only after every rank
finished, rank 0 writes `crate_clip.json` (which marks a checkpoint complete, and records the size and sha256 of
every file: checkpoint_io/checkpoint_manifest.py), renames the folder to `<tag>` (an older `<tag>` is deleted only
after that) and then replaces DeepSpeed's `latest` file atomically; so a save interrupted at any point (SIGKILL,
power loss) never becomes the one resumed from. A write that fails on a full disk stops every rank together,
with the partial save removed (checkpoint_io/write_failures.py); a resume verifies the checksums
(checkpoint_damage / intact_checkpoint, at the end of this file). Rank 0 also writes the table of all canonical data streams into it (`stream_table.json`:
a resume at another world size continues the sample order from it, elastic_resume.py).

The record a checkpoint carries (the run's Progress, the CheckpointInfo written as crate_clip.json) and the finding
of checkpoints are checkpoint_io/checkpoint_record.py's; the ResumePoint a run starts from lives here.

Nothing read on resume runs code: DeepSpeed's files go through the allow-listed reader
(crate_clip.checkpoint_io.safe_unpickling) and the rank-state files hold only tensors, numbers, strings,
lists, tuples and dicts, read with weights_only=True and no allow-list at all.
"""
from __future__ import annotations

import json
import os
import random
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

import numpy as np
import torch
import torch.distributed as dist

from crate_clip.core.errors import EXIT_RESUME, UserError
from crate_clip.checkpoint_io.atomic_files import (atomic_torch_save, atomic_write_text, fsync_tree, replace_dir,
                                                   restore_replaced)
from crate_clip.checkpoint_io.checkpoint_manifest import checksum_share, damage_in_share
from crate_clip.checkpoint_io.checkpoint_choice import RESUME, choose_checkpoint
from crate_clip.checkpoint_io.checkpoint_record import (INFO_FILE, CheckpointInfo, Progress,  # noqa: F401
                                                        complete_records, complete_tags_in, latest_complete_tag,
                                                        line_of, lineage_fields, read_info,
                                                        read_info_checked, read_latest_tag, read_record, save_order)
from crate_clip.checkpoint_io.deepspeed_checkpoints import LATEST_FILE, consolidated_state_dict  # noqa: F401
from crate_clip.checkpoint_io.run_layout import (DAMAGED_SUFFIX, REPLACED_SUFFIX, checkpoint_tag,  # noqa: F401
                                                 is_own_staging, linked_outside, rank_state_file, staging_name,
                                                 tag_position)
from crate_clip.checkpoint_io.file_checksums import CHECKSUMS_KEY
from crate_clip.checkpoint_io.safe_unpickling import (TRUST_FLAG, UntrustedCheckpointError, check_checkpoint_folder,
                                                      deepspeed_reads, load_torch_file)
from crate_clip.checkpoint_io.write_failures import WriteFailures, is_no_space, recorded_writes
from crate_clip.train.run.disk_space import NoSpaceError, checkpoint_bytes, no_space_in_save
from crate_clip.train.run.run_config import RunConfig

# what an earlier crate-clip pickled into its rank-state files: numpy's RNG state as an array
EARLIER_RANK_STATE_CLASSES = {"numpy.core.multiarray._reconstruct", "numpy._core.multiarray._reconstruct",
                              "numpy.ndarray", "numpy.dtype"}


class CheckpointWriteError(RuntimeError):
    """A checkpoint save failed (other than for a full disk) on some rank; raised on every rank."""


class ResumeError(UserError, RuntimeError):
    """A checkpoint that cannot be resumed from (missing, incomplete, or from another job shape or model)."""
    exit_code = EXIT_RESUME


@dataclass
class ResumePoint:
    """Where the run starts: the checkpoint to continue from (None: from scratch) and its progress."""
    tag_dir: Optional[Path] = None
    progress: Progress = field(default_factory=Progress)
    stage_finished: bool = False  # the checkpoint is its stage's last: only evaluations may be left to do


def rng_state() -> dict:
    """This process's random-number generator states (torch CPU and CUDA, numpy, python), as tensors, numbers
    and tuples: what torch.load(weights_only=True) reads back without an allow-list."""
    generator, keys, pos, has_gauss, cached_gaussian = np.random.get_state()
    numpy_state = {"generator": generator, "keys": torch.from_numpy(keys.astype(np.int64)), "pos": int(pos),
                   "has_gauss": int(has_gauss), "cached_gaussian": float(cached_gaussian)}
    state = {"torch": torch.get_rng_state(), "numpy": numpy_state, "python": random.getstate()}
    if torch.cuda.is_available():  # image token masks are drawn on the training device
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict) -> None:
    """Restore what rng_state() returned (or an earlier version's form: numpy's own state tuple)."""
    torch.set_rng_state(state["torch"])
    numpy_state = state["numpy"]
    if isinstance(numpy_state, dict):
        numpy_state = (numpy_state["generator"], numpy_state["keys"].numpy().astype(np.uint32), numpy_state["pos"],
                       numpy_state["has_gauss"], numpy_state["cached_gaussian"])
    np.random.set_state(numpy_state)
    random.setstate(state["python"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


class CheckpointManager:
    """Saves, finds, prunes and loads the checkpoints of one run (`<run_dir>/checkpoints`)."""

    def __init__(self, root: Path, keep_last: int, rank: int, world_size: int):
        self.root = Path(root)
        self.keep_last = keep_last
        self.rank = rank
        self.world_size = world_size
        self.parent: Optional[str] = None   # the checkpoint the next save descends from (lineage, checkpoint_record)

    # ------------------------------------------------------------ save
    def save(self, engine, tag: str, info: dict, rank_state: dict, shared_files: Optional[dict] = None) -> Path:
        """Save on ALL ranks; returns the tag folder once it is complete and `latest` names it. The files go
        to a staging folder swapped in when complete: a checkpoint of the same tag saved before (a resume
        from an earlier checkpoint redoes its steps) stays until the new one is whole. `shared_files`
        (name -> text): files of the whole job that rank 0 writes into it (the stream-state table)."""
        self.root.mkdir(parents=True, exist_ok=True)
        staging = self.root / staging_name(tag)
        if self.rank == 0 and staging.exists():  # a leftover of an interrupted save
            shutil.rmtree(staging)
        dist.barrier()
        try:
            self._write_and_commit(engine, staging, tag, info, rank_state, shared_files or {})
        except (NoSpaceError, CheckpointWriteError):
            raise   # reported alike on every rank, the partial save removed
        except Exception as exc:   # raised by DeepSpeed itself on this rank: its partial folder goes too
            shutil.rmtree(staging, ignore_errors=True)
            if is_no_space(exc):
                last = self.latest_tag()
                raise no_space_in_save(self.root, tag, last, checkpoint_bytes(self.root / last if last else None)) \
                    from exc
            raise
        self.parent = tag
        return self.root / tag

    def _write_and_commit(self, engine, staging: Path, tag: str, info: dict, rank_state: dict,
                          shared_files: dict) -> None:
        """save's writes into `staging` on every rank, then rank 0's commit; a failed write on any rank stops all."""
        with recorded_writes(engine) as writes:   # a full disk on any rank: all finish DeepSpeed's save, then stop
            engine.save_checkpoint(str(self.root), tag=staging.name, client_state={"crate_clip": info},
                                   save_latest=False)
            path = rank_state_file(staging, self.rank)
            writes.run(path, lambda: atomic_torch_save(rank_state, path))
            for name, text in shared_files.items() if self.rank == 0 else ():
                writes.run(staging / name, lambda: atomic_write_text(staging / name, text))
            writes.run(staging, lambda: fsync_tree(staging))  # on disk, not only in the page cache
        self._stop_if_a_write_failed(writes, staging, tag)  # every rank's files are durable past this point
        checksums = self._agreed_checksums(staging)
        writes = WriteFailures()
        if self.rank == 0:
            writes.run(staging, lambda: self.commit(staging, tag, {**info, "world_size": self.world_size,
                                                                    CHECKSUMS_KEY: checksums}))
        self._stop_if_a_write_failed(writes, staging, tag)

    def _stop_if_a_write_failed(self, writes: WriteFailures, staging: Path, tag: str) -> None:
        """Collective: when a write of this save failed on any rank, remove the partial save and raise the same
        error on every rank (NoSpaceError for a full disk, naming the last complete checkpoint)."""
        failures = [None] * self.world_size
        dist.all_gather_object(failures, writes.failure())
        failed = [(rank, f) for rank, f in enumerate(failures) if f is not None]
        if not failed:
            return
        last = self.latest_tag()
        needed = checkpoint_bytes(self.root / last) if last else checkpoint_bytes(staging)
        if self.rank == 0:
            shutil.rmtree(staging, ignore_errors=True)   # it holds the space
        dist.barrier()
        rank, failure = failed[0]
        cause = writes.first[1] if writes.first else None
        if any(f.no_space for _, f in failed):
            error = no_space_in_save(self.root, tag, last, needed)
            error.once_per_job = True   # every rank raises it: rank 0 says it
            raise error from cause
        raise CheckpointWriteError(f"saving checkpoint {tag} failed on rank {rank} writing {failure.path}: "
                                   f"{failure.error}; its partial files are removed, the last complete checkpoint "
                                   f"is {last}") from cause

    def _agreed_checksums(self, staging: Path) -> dict:
        """Collective: the size and sha256 of every file of the save, each rank hashing its share."""
        shares = [None] * self.world_size
        dist.all_gather_object(shares, checksum_share(staging, self.rank, self.world_size))
        return dict(sorted(item for share in shares for item in share.items()))

    def commit(self, staging: Path, tag: str, info: dict) -> None:
        """Rank 0, once every rank's files in `staging` are durable: mark it complete (its record with its place in
        the run's lineage), swap it in as `tag`, then move `latest` to it and prune."""
        info = {**info, **lineage_fields(self.root, self.parent)}
        atomic_write_text(staging / INFO_FILE, json.dumps(info, indent=1))
        if (self.root / tag).is_dir() and not (self.root / tag).is_symlink():
            _move_aside_if_damaged(self.root / tag)   # the swap deletes the folder it replaces: only a complete one
        replace_dir(staging, self.root / tag)
        atomic_write_text(self.root / LATEST_FILE, tag)
        self.prune()

    def prune(self) -> None:
        """Rotation, after each commit: of the checkpoints this run saved (own_checkpoint) on the line of the last
        save (the one it descends from: checkpoint_record's lineage), keep the newest `keep_last` and every finished
        stage's last one (export --stage N and a resume's missing evaluations read it), and remove the others; the
        checkpoints of a line the run left by resuming from an earlier one are neither counted nor removed. Put back
        a checkpoint whose re-save was cut short between the two renames of its swap, remove the run's own
        interrupted saves and move a damaged checkpoint aside, said in one line. Nothing else in the folder is
        touched."""
        for old in self.root.glob(f".*{REPLACED_SUFFIX}"):
            if tag_position(old.name[1:-len(REPLACED_SUFFIX)]):
                restore_replaced(self.root / old.name[1:-len(REPLACED_SUFFIX)])
        latest = self.latest_tag()
        records = complete_records(self.root)
        own = {tag: record for tag in records if (record := own_checkpoint(self.root / tag))}
        head = max(own, key=lambda tag: save_order(tag, own[tag]), default=None)   # the last save
        line = [tag for tag in line_of(records, head) if tag in own]
        for tag in line[:-self.keep_last]:
            if tag != latest and not own[tag].ends_stage:
                shutil.rmtree(self.root / tag, ignore_errors=True)
        for path in sorted(self.root.iterdir()):
            if is_own_staging(path) or _swapped_out(path):
                shutil.rmtree(path, ignore_errors=True)
            elif tag_position(path.name) and path.is_dir() and not path.is_symlink():
                _move_aside_if_damaged(path)

    # ------------------------------------------------------------ find
    def complete_tags(self) -> list[str]:
        """Complete checkpoints, oldest first (by global step)."""
        return complete_tags_in(self.root)

    def latest_tag(self) -> str | None:
        """The tag `latest` names, if that checkpoint is complete; else the newest complete one."""
        return latest_complete_tag(self.root)

    def continue_from(self, tag_dir: Path) -> None:
        """Rank 0, resuming from `tag_dir` once the resume is checked: `latest` names it (a resume from an earlier
        checkpoint starts another line; killed before its first save, the run goes on from here, not from the line
        it left), and the checkpoints saved after it on another line are named in one line: they stay, rotation
        neither counts nor removes them."""
        if Path(tag_dir).parent.resolve() != self.root.resolve():
            return   # another run's checkpoint: this folder's record starts with the first save
        if read_latest_tag(self.root) != tag_dir.name:
            atomic_write_text(self.root / LATEST_FILE, tag_dir.name)
        records = complete_records(self.root)
        line = set(line_of(records, tag_dir.name))
        left = [tag for tag in complete_tags_in(self.root) if tag not in line and own_checkpoint(self.root / tag)
                and _saved_after(records, tag, tag_dir.name)]
        if left:
            print(f"[note] resuming from {tag_dir.name}, an earlier checkpoint than {', '.join(left)} (saved after it "
                  f"on another line of the run): the run goes on from {tag_dir.name} (`latest` names it; rotation and "
                  "export --stage N follow its line); those checkpoints stay, not counted by rotation: remove them "
                  "once you no longer need them", flush=True)

    def resolve(self, resume: str) -> Path:
        """`latest` -> newest complete checkpoint of this run; else a tag folder, a checkpoints folder or a run
        folder; a link to another run's checkpoint is refused (checkpoint_choice.choose_checkpoint)."""
        return choose_checkpoint(resume, RESUME, run_checkpoints=self.root, error=ResumeError).tag_dir

    # ------------------------------------------------------------ load
    @staticmethod
    def load_engine_states(engine, tag_dir: Path) -> None:
        """DeepSpeed's plain load of `tag_dir` into `engine` (all ranks): weights, optimizer and LR scheduler."""
        with deepspeed_reads(tag_dir):   # DeepSpeed's own torch.load calls pass weights_only=False
            load_path, _ = engine.load_checkpoint(str(tag_dir.parent), tag=tag_dir.name,
                                                  load_optimizer_states=True, load_lr_scheduler_states=True)
        if load_path is None:
            raise ResumeError(f"DeepSpeed could not load the checkpoint {tag_dir}")

    def check_compatible(self, tag_dir: Path) -> CheckpointInfo:
        """The checkpoint's record; raises ResumeError when it is incomplete, and UntrustedCheckpointError when one
        of its files needs a class outside the allow-list (another world size or ZeRO stage: elastic_resume.py)."""
        record = read_record(tag_dir)
        if record is None:
            raise ResumeError(f"{tag_dir}: incomplete checkpoint (no {INFO_FILE})")
        try:
            check_checkpoint_folder(tag_dir)   # every file, on every rank: all ranks refuse alike
        except UntrustedCheckpointError as exc:
            raise _earlier_rank_state(exc) from None
        return record

    def load_rank_state(self, tag_dir: Path, rank: Optional[int] = None) -> dict:
        """This rank's (or saved rank `rank`'s) states of the stage loop's parts: data-stream position, RNG states,
        progress, ..."""
        rank = self.rank if rank is None else rank
        path = rank_state_file(tag_dir, rank)
        if not path.is_file():
            raise ResumeError(f"{path}: missing; the checkpoint holds no state for rank {rank}")
        try:
            return load_torch_file(path, allow=())
        except UntrustedCheckpointError as exc:
            raise _earlier_rank_state(exc) from None


def _saved_after(records: dict, tag: str, other: str) -> bool:
    """Whether checkpoint `tag` was saved after `other` (both in `records`, complete_records)."""
    return save_order(tag, records[tag]) > save_order(other, records[other])


def own_checkpoint(tag_dir: Path) -> Optional[CheckpointInfo]:
    """The record of a complete checkpoint the trainer saved: a real folder (not a link) whose name is the tag its
    own record gives it (stage<i>-step<n>); None for anything else (a user's copy, a link, an incomplete folder)."""
    record = None if Path(tag_dir).is_symlink() else read_record(tag_dir)
    if record is None or tag_position(Path(tag_dir).name) != (record.progress.stage_index, record.progress.step):
        return None
    return record


def _swapped_out(path: Path) -> bool:
    """A checkpoint's previous copy (`.<tag>.replaced`) left by a swap cut short after the new copy took its name."""
    name = path.name
    if not (name.startswith(".") and name.endswith(REPLACED_SUFFIX)) or path.is_symlink() or not path.is_dir():
        return False
    tag = name[1:-len(REPLACED_SUFFIX)]
    return tag_position(tag) is not None and own_checkpoint(path.parent / tag) is not None


def _move_aside_if_damaged(tag_dir: Path) -> None:
    """A folder named as a checkpoint whose crate_clip.json is missing, does not parse or does not match its schema
    (a save renames its folder only after writing it, so this is damage): renamed to `<tag>.damaged` (or
    `<tag>.damaged-2`, ...), which nothing of the run reads or removes, with one line; never deleted."""
    info, why = read_info_checked(tag_dir)
    if info is not None:
        return
    target, n = tag_dir.with_name(f"{tag_dir.name}{DAMAGED_SUFFIX}"), 1
    while os.path.lexists(target):
        n += 1
        target = tag_dir.with_name(f"{tag_dir.name}{DAMAGED_SUFFIX}-{n}")
    os.rename(tag_dir, target)
    print(f"[warn] checkpoint {tag_dir.name} is damaged (its {INFO_FILE} {why}): moved to {target}, not deleted; "
          "remove it once you no longer need it", flush=True)


def _earlier_rank_state(exc: UntrustedCheckpointError) -> UntrustedCheckpointError:
    """The refusal, saying so when the file is a rank-state file of an earlier crate-clip version."""
    if not (exc.path.name.startswith("train_state_rank") and set(exc.classes) <= EARLIER_RANK_STATE_CLASSES):
        return exc
    return UntrustedCheckpointError(exc.path, exc.classes, note=(
        f" (a rank-state file written by an earlier crate-clip version, which pickled numpy's RNG state; if the "
        f"run is your own, resume with {TRUST_FLAG}: the checkpoints written from then on need no opt-in)"))


def find_resume_point(cfg: RunConfig, ckpts: CheckpointManager, resume: Optional[str]) -> ResumePoint:
    """The checkpoint `resume` names ('latest' or a path), checked against this job; raises ResumeError."""
    if not resume:
        return ResumePoint()
    tag_dir = ckpts.resolve(resume)
    progress = ckpts.check_compatible(tag_dir).progress
    if tag_dir.parent.resolve() == ckpts.root.resolve():   # the run's next save descends from it (lineage)
        ckpts.parent = tag_dir.name
    return ResumePoint(tag_dir, progress, progress.step >= cfg.stages[progress.stage_index].steps)


# Resume only from a checkpoint whose files are the ones its save wrote.
#
# Every save records the size and sha256 of its files in crate_clip.json (checkpoint_io/checkpoint_manifest.py). A
# resume verifies the checkpoint it is about to load, the ranks sharing the hashing. `--resume latest` (or a run's
# checkpoints folder) takes the newest intact checkpoint and says in one line which newer ones are damaged (a file
# missing, truncated or changed; a crate_clip.json that is missing, does not parse or does not match its schema,
# checkpoint_record.py); `--resume <tag folder>` of a damaged checkpoint is an error: another one is never taken
# silently. A checkpoint of an earlier version, which records no
# checksums, is not verified.


def checkpoint_damage(ckpts: CheckpointManager, tag_dir: Path) -> list[str]:
    """What differs from the record in `tag_dir`'s crate_clip.json, one phrase per file, the same list on every rank
    (each hashes its share; a collective when the job has several processes)."""
    info, why = read_info_checked(tag_dir)
    if info is None:
        return [f"{INFO_FILE} {why}"]
    if ckpts.world_size == 1 or not dist.is_initialized():
        return damage_in_share(tag_dir, info, 0, 1)
    mine = damage_in_share(tag_dir, info, ckpts.rank, ckpts.world_size)
    shares = [None] * ckpts.world_size
    dist.all_gather_object(shares, mine)
    return sorted(problem for share in shares for problem in share)


def _damaged_infos_after(root: Path, tag_dir: Path) -> list[str]:
    """Checkpoint folders newer than `tag_dir` (by their stage-step tag) whose crate_clip.json is missing, does not
    parse or does not match its schema: a damaged record, not an interrupted save (a save is renamed to its tag
    only after its crate_clip.json is written; until then it is `.<tag>.saving`)."""
    chosen = tag_position(tag_dir.name)
    newer = []
    for path in sorted(root.iterdir()):
        position = tag_position(path.name)
        if position and chosen and position > chosen and path.is_dir():
            info, why = read_info_checked(path)
            if info is None:
                newer.append(f"{path.name} is damaged ({INFO_FILE} {why})")
    return newer


def intact_checkpoint(ckpts: CheckpointManager, tag_dir: Path, resume: str) -> Path:
    """The checkpoint to resume from: `tag_dir` when intact; for --resume latest (or a checkpoints folder) the
    newest intact one on its line (the checkpoints it descends from: checkpoint_record's lineage), said in one line
    on rank 0; raises ResumeError for a damaged explicit tag folder or when no checkpoint is intact."""
    explicit = resume != "latest" and Path(resume).resolve() == tag_dir.resolve()
    root = tag_dir.parent
    damaged = _damaged_infos_after(root, tag_dir)
    manager = ckpts if root == ckpts.root else CheckpointManager(root, ckpts.keep_last, ckpts.rank, ckpts.world_size)
    earlier = [root / t for t in reversed(line_of(complete_records(root), tag_dir.name)[:-1])
               if linked_outside(root / t) is None]
    candidates = [tag_dir] + [c for c in earlier if c != tag_dir]
    for candidate in candidates:
        problems = checkpoint_damage(manager, candidate)
        if not problems:
            if damaged and ckpts.rank == 0:
                print(f"[warn] {'; '.join(damaged)}; resuming from {candidate.name}, the newest intact checkpoint in "
                      f"{root}", flush=True)
            return candidate
        if explicit:
            raise ResumeError(f"--resume {resume}: the checkpoint is damaged ({'; '.join(problems)}); fix: resume "
                              f"with --resume latest (the newest intact checkpoint of the run) or pass an earlier "
                              f"checkpoint folder")
        damaged.append(f"{candidate.name} is damaged ({'; '.join(problems)})")
    raise ResumeError(f"--resume {resume}: no intact checkpoint in {root}: {'; '.join(damaged)}; fix: start over "
                      "with --overwrite (the run is moved aside) or restore the checkpoints from a copy")
