"""Tests only: an offline Weights & Biases run read back from its transaction log (run-<id>.wandb).

wandb 0.31 ships no Python reader of its own any more (wandb.sdk.internal.datastore is gone; `wandb sync --view`
was removed), so this reads the file's framing, LevelDB's log format behind wandb's ':W&B' header, and decodes each
record with wandb's own protobuf schema (wandb.proto.wandb_internal_pb2.Record), as wandb-core writes it."""
from __future__ import annotations

import json
import struct
from pathlib import Path

HEADER = 7            # ':W&B' + 2-byte magic + 1-byte version
BLOCK = 32 * 1024     # LevelDB log blocks; a record's chunk header: crc32c (4), length (2), type (1)
FULL, FIRST, MIDDLE, LAST = 1, 2, 3, 4


def records(path: Path) -> list:
    """The Record protobufs of a .wandb file, in order."""
    from wandb.proto import wandb_internal_pb2 as pb

    data = Path(path).read_bytes()
    assert data[:4] == b":W&B", f"{path} is not a wandb transaction log"
    out, pos, parts = [], HEADER, b""
    while pos + 7 <= len(data):
        left_in_block = BLOCK - pos % BLOCK
        if left_in_block < 7:   # a block's tail too short for a header is padding
            pos += left_in_block
            continue
        _, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        chunk, pos = data[pos + 7:pos + 7 + length], pos + 7 + length
        if kind == 0 and length == 0:
            continue
        parts = chunk if kind in (FULL, FIRST) else parts + chunk
        if kind in (FULL, LAST):
            record = pb.Record()
            record.ParseFromString(parts)
            out.append(record)
    return out


def offline_run(run_dir: Path) -> Path:
    """The one offline run's .wandb file under run_dir/wandb."""
    (found,) = sorted(Path(run_dir).glob("wandb/offline-run-*/run-*.wandb"))
    return found


def history(path: Path) -> list[dict]:
    """Each logged row (wandb.log) as {key: value}."""
    rows = []
    for record in records(path):
        if record.WhichOneof("record_type") == "history":
            rows.append({item.key or "/".join(item.nested_key): json.loads(item.value_json)
                         for item in record.history.item})
    return rows


def run_record(path: Path):
    """The run's RunRecord: its id, display name, project and config (config.update items)."""
    (run,) = [r.run for r in records(path) if r.WhichOneof("record_type") == "run"]
    return run


def config(path: Path) -> dict:
    """The run's config (top-level keys), as wandb.init recorded it."""
    return {item.key: json.loads(item.value_json) for item in run_record(path).config.update}
