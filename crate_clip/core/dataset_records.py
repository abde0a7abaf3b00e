"""A data folder's name for people: `dataset.json` beside the shards (or in an eval folder) records what the data
is ("Fashion-MNIST", its Hugging Face Hub id, the split, a URL), so that a model card can name it instead of a
path. The shard writers record it; a user's own folder gets one from `crate-clip shards ... --dataset-name NAME`."""
from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, fields, replace
from pathlib import Path

from crate_clip.core.shard_sources import PIPE, REMOTE_PREFIXES

DATASET_FILE = "dataset.json"
MAX_RECORD_BYTES = 64 << 10   # a few names and a URL; a larger file is not ours


@dataclass(frozen=True)
class DatasetRecord:
    """What a data folder holds, in words a model card can publish."""
    name: str                   # "Fashion-MNIST"
    hub_id: str | None = None   # the Hugging Face Hub data set ("zalando-datasets/fashion_mnist"), for `datasets:`
    split: str | None = None    # "train", "test"
    url: str | None = None      # where the data set is described


FASHION_MNIST = DatasetRecord("Fashion-MNIST", hub_id="zalando-datasets/fashion_mnist",
                              url="https://github.com/zalandoresearch/fashion-mnist")
# the evaluations' built-in data sets (eval's `dataset` key), named when their folder records nothing
BUILTIN_EVAL_SETS = {"fashion_mnist": replace(FASHION_MNIST, split="test"),
                     "imagenet1k": DatasetRecord("ImageNet-1k", hub_id="ILSVRC/imagenet-1k", split="validation",
                                                 url="https://www.image-net.org")}


def write_dataset_record(folder: str | Path, record: DatasetRecord) -> Path:
    """Write `record` as folder/dataset.json (replacing an earlier one whole: a reader never sees half a file)."""
    path = Path(folder) / DATASET_FILE
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{DATASET_FILE}.tmp{os.getpid()}")
    tmp.write_text(json.dumps({k: v for k, v in asdict(record).items() if v is not None}, indent=1) + "\n")
    os.replace(tmp, path)
    return path


def read_dataset_record(source: str | Path) -> DatasetRecord | None:
    """The record of a local data source (a folder, or the folder of a shard pattern or file); None for a remote
    source, a source without one, or a file that is not a record."""
    text = str(source)
    if text.startswith((PIPE, *REMOTE_PREFIXES)) or "://" in text:
        return None
    path = Path(text).expanduser()
    folder = path if path.is_dir() else path.parent
    record = folder / DATASET_FILE
    try:
        if not record.is_file() or record.stat().st_size > MAX_RECORD_BYTES:
            return None
        data = json.loads(record.read_text())
    except (OSError, ValueError):
        return None
    known = {f.name for f in fields(DatasetRecord)}
    if not isinstance(data, dict) or not isinstance(data.get("name"), str):
        return None
    return DatasetRecord(**{k: v for k, v in data.items() if k in known and (v is None or isinstance(v, str))})
