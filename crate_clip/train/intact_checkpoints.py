"""Resume only from a checkpoint whose files are the ones its save wrote.

Every save records the size and sha256 of its files in crate_clip.json (checkpoint_io/checkpoint_manifest.py). A
resume verifies the checkpoint it is about to load, the ranks sharing the hashing. `--resume latest` (or a run's
checkpoints folder) takes the newest intact checkpoint and says in one line which newer ones are damaged (a file
missing, truncated or changed; a crate_clip.json that is missing, does not parse or does not match its schema,
manifest_schema.py); `--resume <tag folder>` of a damaged checkpoint is an error: another one is never taken
silently. A checkpoint of an earlier version, which records no
checksums, is not verified.
"""
from __future__ import annotations

import re
from pathlib import Path

import torch.distributed as tdist

from crate_clip.checkpoint_io.checkpoint_manifest import damage_in_share
from crate_clip.checkpoint_io.deepspeed_checkpoints import INFO_FILE, read_info, read_info_checked
from crate_clip.train.checkpoints import CheckpointManager, ResumeError

_TAG = re.compile(r"^stage(\d+)-step(\d+)$")


def checkpoint_damage(ckpts: CheckpointManager, tag_dir: Path) -> list[str]:
    """What differs from the record in `tag_dir`'s crate_clip.json, one phrase per file, the same list on every rank
    (each hashes its share; a collective when the job has several processes)."""
    info, why = read_info_checked(tag_dir)
    if info is None:
        return [f"{INFO_FILE} {why}"]
    if ckpts.world_size == 1 or not tdist.is_initialized():
        return damage_in_share(tag_dir, info, 0, 1)
    mine = damage_in_share(tag_dir, info, ckpts.rank, ckpts.world_size)
    shares = [None] * ckpts.world_size
    tdist.all_gather_object(shares, mine)
    return sorted(problem for share in shares for problem in share)


def _damaged_infos_after(root: Path, tag_dir: Path) -> list[str]:
    """Checkpoint folders newer than `tag_dir` (by their stage-step tag) whose crate_clip.json is missing, does not
    parse or does not match its schema: a damaged record, not an interrupted save (a save is renamed to its tag
    only after its crate_clip.json is written; until then it is `.<tag>.saving`)."""
    chosen = _TAG.match(tag_dir.name)
    newer = []
    for path in sorted(root.iterdir()):
        match = _TAG.match(path.name)
        if match and chosen and tuple(map(int, match.groups())) > tuple(map(int, chosen.groups())) and path.is_dir():
            info, why = read_info_checked(path)
            if info is None:
                newer.append(f"{path.name} is damaged ({INFO_FILE} {why})")
    return newer


def intact_checkpoint(ckpts: CheckpointManager, tag_dir: Path, resume: str) -> Path:
    """The checkpoint to resume from: `tag_dir` when intact; for --resume latest (or a checkpoints folder) the
    newest intact one at or before it, said in one line on rank 0; raises ResumeError for a damaged explicit tag
    folder or when no checkpoint is intact."""
    explicit = resume != "latest" and Path(resume).resolve() == tag_dir.resolve()
    root = tag_dir.parent
    damaged = _damaged_infos_after(root, tag_dir)
    manager = ckpts if root == ckpts.root else CheckpointManager(root, ckpts.keep_last, ckpts.rank, ckpts.world_size)
    step = _global_step(tag_dir)
    earlier = [root / t for t in reversed(manager.complete_tags()) if _global_step(root / t) < step]
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


def _global_step(tag_dir: Path) -> int:
    """The global step a checkpoint was saved at (the order complete_tags sorts in)."""
    return (read_info(tag_dir) or {}).get("global_step", 0)
