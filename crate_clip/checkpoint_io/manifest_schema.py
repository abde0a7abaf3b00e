"""What a well-formed crate_clip.json and a well-formed `file_checksums` record hold, checked before any value
is used: a record that parses as JSON but holds a string where a step count belongs, a list where the checksums
belong, or a file name outside its folder (`../../etc/passwd`, `/etc/passwd`) marks that checkpoint (or export)
damaged instead of breaking a comparison later or making a reader look outside the folder.

Fields are checked where present (a checkpoint of an earlier version may lack some); unknown fields are kept.
"""
from __future__ import annotations

import re
from pathlib import PurePosixPath

_SHA256 = re.compile(r"^[0-9a-f]{64}$")
_INT, _STR, _DICT = (int,), (str,), (dict,)
# crate_clip.json's fields and their JSON types (CheckpointInfo, Progress and what the save adds)
INFO_FIELDS = {
    "model_name": _STR, "image_size": _INT, "context_length": _INT, "patch_size": (int, type(None)),
    "zero_stage": _INT, "stage_name": _STR, "stage_steps": _INT, "precision": _STR, "run_config": _DICT,
    "normalisation": _DICT, "tokenizer": _DICT, "stage_index": _INT, "step": _INT, "global_step": _INT,
    "samples_seen": _INT, "nonfinite_skipped": _INT, "nonfinite_in_a_row": _INT, "world_size": _INT,
}
_NON_NEGATIVE = ("image_size", "context_length", "zero_stage", "stage_steps", "stage_index", "step", "global_step",
                 "samples_seen", "nonfinite_skipped", "nonfinite_in_a_row")


_EXPECTED = {int: "an integer", str: "a string", dict: "an object"}


def _type_name(value) -> str:
    return {dict: "an object", list: "a list", str: "a string", bool: "a boolean", type(None): "null"}.get(
        type(value), f"a {type(value).__name__}")


def _has_type(value, types: tuple) -> bool:
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
        return f"file_checksums is {_type_name(records)}, not an object of file name -> record"
    for name, record in records.items():
        problem = member_name_problem(name)
        if problem:
            return f"file_checksums: {problem}"
        if not isinstance(record, dict) or set(record) != {"bytes", "sha256"}:
            return f"file_checksums[{name!r}] is not {{\"bytes\": ..., \"sha256\": ...}}"
        if not _has_type(record["bytes"], _INT) or record["bytes"] < 0:
            return f"file_checksums[{name!r}].bytes is {record['bytes']!r}, not a byte count"
        if not isinstance(record["sha256"], str) or not _SHA256.match(record["sha256"]):
            return f"file_checksums[{name!r}].sha256 is not 64 lower-case hex digits"
    return None


def info_problem(info) -> str | None:
    """Why a parsed crate_clip.json is malformed (not an object, a field of the wrong type or negative, malformed
    checksums), or None."""
    if not isinstance(info, dict):
        return f"it holds {_type_name(info)}, not an object"
    for key, types in INFO_FIELDS.items():
        if key in info and not _has_type(info[key], types):
            return f"{key} is {_type_name(info[key])} ({str(info[key])[:40]!r}), not {_EXPECTED[types[0]]}"
    for key in _NON_NEGATIVE:
        if key in info and info[key] < 0:
            return f"{key} is negative ({info[key]})"
    if "file_checksums" in info:
        return checksum_records_problem(info["file_checksums"])
    return None
