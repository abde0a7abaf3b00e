"""The size and sha256 of every file of a checkpoint, recorded when it is committed, verified before a resume.

The record sits in the checkpoint's crate_clip.json under `file_checksums`, in the form an export uses
(file_checksums.py): {"mp_rank_00_model_states.pt": {"bytes": ..., "sha256": ...}, ...}, names relative to the tag
folder. crate_clip.json itself is not listed (it holds the record; a damaged one does not parse).

The hashing is shared by the ranks that wrote the files: `share_of` gives each rank about 1/world of the bytes
(largest file first to the least-loaded rank), so a save or a resume hashes no more per rank than it writes or
reads, right after the save wrote it (from the page cache). What that costs for a B/16 checkpoint, against
writing it: bench/bench_checkpoint_checksums.py, BENCHMARKS.md.
"""
from __future__ import annotations

from pathlib import Path

from crate_clip.checkpoint_io.checkpoint_record import INFO_FILE
from crate_clip.checkpoint_io.file_checksums import CHECKSUMS_KEY, checksum_problem, file_checksum


def checkpoint_files(tag_dir: Path) -> dict[str, int]:
    """Every file under `tag_dir` but crate_clip.json and temporary files: relative name -> size in bytes."""
    tag_dir = Path(tag_dir)
    return {p.relative_to(tag_dir).as_posix(): p.stat().st_size for p in sorted(tag_dir.rglob("*"))
            if p.is_file() and p.name != INFO_FILE and not p.name.startswith(".")}


def share_of(sizes: dict[str, int], rank: int, world_size: int) -> list[str]:
    """The names rank `rank` hashes: largest first, each to the rank with the fewest bytes so far (ties: lowest
    rank); every rank computes the same split from the same sizes."""
    load, mine = [0] * world_size, []
    for name, size in sorted(sizes.items(), key=lambda item: (-item[1], item[0])):
        least = min(range(world_size), key=lambda r: (load[r], r))
        load[least] += size
        if least == rank:
            mine.append(name)
    return mine


def checksum_share(tag_dir: Path, rank: int, world_size: int) -> dict[str, dict]:
    """The records (bytes, sha256) of this rank's share of the files under `tag_dir`."""
    return {name: file_checksum(Path(tag_dir) / name)
            for name in share_of(checkpoint_files(tag_dir), rank, world_size)}


def damage_in_share(tag_dir: Path, info: dict, rank: int, world_size: int) -> list[str]:
    """What differs from the record in crate_clip.json, for this rank's share of the recorded files: one phrase
    per damaged file (missing, another size, another sha256); [] when the checkpoint records no checksums."""
    records = info.get(CHECKSUMS_KEY) or {}
    problems = []
    for name in share_of({name: r.get("bytes", 0) for name, r in records.items()}, rank, world_size):
        problem = checksum_problem(Path(tag_dir) / name, records[name], INFO_FILE)
        if problem:
            problems.append(f"{name}: {problem}")
    return problems
