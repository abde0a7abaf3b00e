"""What a well-formed `file_checksums` record holds, and the JSON type checks crate_clip.json's schema uses
(checkpoint_record.py), checked before any value is used: a record that parses as JSON but holds a string where a
step count belongs, a list where the checksums belong, or a file name outside its folder (`../../etc/passwd`,
`/etc/passwd`) marks that checkpoint (or export) damaged instead of breaking a comparison later or making a reader
look outside the folder.
"""
from __future__ import annotations

import re
from pathlib import PurePosixPath

_SHA256 = re.compile(r"^[0-9a-f]{64}$")
_INT = (int,)


def json_type_name(value) -> str:
    """'an object', 'a list', 'a string', ... for a parsed JSON value (what a malformed field holds, said)."""
    return {dict: "an object", list: "a list", str: "a string", bool: "a boolean", type(None): "null"}.get(
        type(value), f"a {type(value).__name__}")


def has_json_type(value, types: tuple) -> bool:
    """True when a parsed JSON value is of one of `types`."""
    # JSON true/false are Python bools, which are ints too: a step count is never a boolean
    return isinstance(value, types) and not (type(value) is bool and bool not in types)


def member_name_problem(name) -> str | None:
    """Why `name` cannot name a file inside its folder (absolute, `..`, empty parts, not a string), or None."""
    if not isinstance(name, str) or not name:
        return f"file name {name!r} is not a non-empty string"
    path = PurePosixPath(name)
    if path.is_absolute() or "\\" in name or "\0" in name or name.startswith("~"):
        return f"file name {name!r} is not relative to its folder"
    if any(part in ("..", ".", "") for part in name.split("/")):
        return f"file name {name!r} leaves its folder or is not in normal form"
    return None


def checksum_records_problem(records) -> str | None:
    """Why a `file_checksums` value is malformed: not an object of name -> {"bytes": int >= 0, "sha256": 64 hex
    digits}, or a name outside its folder; None when it is well formed."""
    if not isinstance(records, dict):
        return f"file_checksums is {json_type_name(records)}, not an object of file name -> record"
    for name, record in records.items():
        problem = member_name_problem(name)
        if problem:
            return f"file_checksums: {problem}"
        if not isinstance(record, dict) or set(record) != {"bytes", "sha256"}:
            return f"file_checksums[{name!r}] is not {{\"bytes\": ..., \"sha256\": ...}}"
        if not has_json_type(record["bytes"], _INT) or record["bytes"] < 0:
            return f"file_checksums[{name!r}].bytes is {record['bytes']!r}, not a byte count"
        if not isinstance(record["sha256"], str) or not _SHA256.match(record["sha256"]):
            return f"file_checksums[{name!r}].sha256 is not 64 lower-case hex digits"
    return None
