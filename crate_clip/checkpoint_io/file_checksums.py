"""Size and sha256 of written files, recorded by their writer and verified by readers before they trust them.

An export records them in its open_clip_config.json under CHECKSUMS_KEY:
    "file_checksums": {"open_clip_model.safetensors": {"bytes": 123456, "sha256": "<64 hex digits>"}}
A reader verifies every file listed there (`verify_recorded_checksums`); a config without the key is not checked.
"""
from __future__ import annotations

import hashlib
from pathlib import Path

from crate_clip.checkpoint_io.manifest_schema import checksum_records_problem
from crate_clip.core.errors import UserError
from crate_clip.core.file_kinds import special_file

CHECKSUMS_KEY = "file_checksums"
CHUNK_BYTES = 1 << 22


class ChecksumMismatchError(UserError, ValueError):
    """A file whose size or sha256 is not what its writer recorded; the message names it and the fix."""


def file_sha256(path: str | Path) -> str:
    """Hex sha256 of a file's bytes (read in chunks)."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(CHUNK_BYTES):
            digest.update(chunk)
    return digest.hexdigest()


def file_checksum(path: str | Path) -> dict:
    """The record of one file: {"bytes": size, "sha256": hex digest}."""
    return {"bytes": Path(path).stat().st_size, "sha256": file_sha256(path)}


def checksum_problem(path: str | Path, expected: dict, recorded_in: str | Path) -> str | None:
    """How `path` differs from `expected` (missing, another size, another sha256), None when it does not."""
    path = Path(path)
    if not path.is_file():   # a FIFO or a device where the file was is said to be one, and never read
        kind = special_file(path)
        return f"{kind} where a file was, and {recorded_in} records its checksum" if kind else \
            f"missing, but {recorded_in} records its checksum"
    size = path.stat().st_size
    if "bytes" in expected and size != expected["bytes"]:
        return f"{size:,} bytes where {recorded_in} records {expected['bytes']:,}"
    if "sha256" in expected and file_sha256(path) != expected["sha256"]:
        return f"sha256 differs from the one {recorded_in} records"
    return None


def verify_file_checksum(path: str | Path, expected: dict, recorded_in: str | Path) -> None:
    """ChecksumMismatchError when `path` is missing or its size or sha256 differs from `expected`."""
    problem = checksum_problem(path, expected, recorded_in)
    if problem:
        raise ChecksumMismatchError(f"{path}: {problem}; it was changed or damaged after it was written: copy or "
                                    "export it again")


def verify_recorded_checksums(folder: str | Path, config: dict, recorded_in: str | Path) -> int:
    """Verify every file that `config[CHECKSUMS_KEY]` lists (names relative to `folder`, which they may not leave);
    returns how many. A malformed record is refused like a mismatch."""
    records = config.get(CHECKSUMS_KEY, {})
    problem = checksum_records_problem(records)
    if problem:
        raise ChecksumMismatchError(f"{recorded_in}: {problem}; the record is damaged: copy or export it again")
    for name, expected in records.items():
        verify_file_checksum(Path(folder) / name, expected, recorded_in)
    return len(records)
