"""Evaluation sets: classification shards (`.jpg` + `.cls`) and ImageNet-val-style ImageFolders.

Classification shards are laid out as CLIP_benchmark's `wds/` data sets, so its `--dataset wds/NAME
--dataset_root OUT` reads them as they are, and `crate-clip eval --data OUT` too:

    OUT/classnames.txt                           one class name per line, in label order
    OUT/zeroshot_classification_templates.txt    one prompt per line, `{c}` for the class name
    OUT/<split>/0.tar 1.tar ...                  `<key>.jpg` + `<key>.cls` (the label as ascii digits)
    OUT/<split>/nshards.txt                      the number of tars
"""
from __future__ import annotations

import io
import os
import shutil
import time
from pathlib import Path
from typing import Iterable

from PIL import Image
from webdataset import ShardWriter

from crate_clip.checkpoint_io.atomic_files import atomic_write_text

from .shard_writer import encode_jpeg, sample_key

TEMPLATES_FILE = "zeroshot_classification_templates.txt"
NSHARDS_FILE = "nshards.txt"


def _class_dir_names(classnames) -> list[str]:
    """Folder names that sort in label order: '<index, zero-padded>_<name without slashes>'."""
    width = len(str(len(classnames) - 1))
    return [f"{i:0{width}d}_{name.replace('/', '-').replace(' ', '_')}" for i, name in enumerate(classnames)]


def write_classnames(out_dir: str | Path, classnames) -> Path:
    """classnames.txt: one class name per line, in label order."""
    path = Path(out_dir) / "classnames.txt"
    atomic_write_text(path, "".join(f"{c}\n" for c in classnames))
    return path


def write_image_folder(labelled: Iterable[tuple], out_dir: str | Path, classnames) -> Path:
    """(image, label) pairs as `<root>/<classdir>/<n>.png` (sorted class dirs == label order) + classnames.txt.

    Written into a temporary folder and renamed, so an interrupted run leaves no half folder; an existing
    complete folder (classnames.txt present) is kept as is.
    """
    root = Path(out_dir)
    if (root / "classnames.txt").is_file():
        return root
    tmp = root.with_name(f".{root.name}.tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    dirs = _class_dir_names(classnames)
    for d in dirs:
        (tmp / d).mkdir(parents=True)
    for i, (img, label) in enumerate(labelled):
        if not 0 <= label < len(classnames):
            raise ValueError(f"label {label} of image {i} is outside the {len(classnames)} classes")
        img = img if isinstance(img, Image.Image) else Image.open(io.BytesIO(img))
        img.save(tmp / dirs[label] / f"{i:06d}.png")
    write_classnames(tmp, classnames)
    if root.exists():
        shutil.rmtree(root)
    root.parent.mkdir(parents=True, exist_ok=True)
    os.replace(tmp, root)
    return root


def image_folder_count(root: str | Path) -> int:
    """The images of a folder write_image_folder wrote (or kept): the files of its class folders."""
    return sum(1 for d in Path(root).iterdir() if d.is_dir() for f in d.iterdir() if f.is_file())


def write_templates(out_dir: str | Path, templates) -> Path:
    """zeroshot_classification_templates.txt: one prompt per line, `{c}` where the class name goes ('{}' in ours)."""
    path = Path(out_dir) / TEMPLATES_FILE
    atomic_write_text(path, "".join(t.replace("{}", "{c}") + "\n" for t in templates))
    return path


def write_classification_shards(labelled: Iterable[tuple], out_dir: str | Path, classnames,
                                samples_per_shard: int = 10_000, max_side: int | None = None, *,
                                split: str = "test", templates=None) -> dict:
    """(image, label) pairs as a CLIP_benchmark `wds/` data set (module doc): `<split>/N.tar` shards of
    `<key>.jpg` + `<key>.cls` and nshards.txt, classnames.txt and, given `templates` ('{}' prompts), the
    zero-shot templates file."""
    root = Path(out_dir)
    out = root / split
    out.mkdir(parents=True, exist_ok=True)
    shards, count, writer = [], 0, None

    def publish(tmp_name: str) -> None:   # each shard is written aside and renamed once complete
        final = out / Path(tmp_name).name[1:].split(".tmp")[0]
        os.replace(tmp_name, final)
        shards.append(str(final))

    for img, label in labelled:
        if writer is None:   # opened at the first sample: no samples, no shard
            writer = ShardWriter(str(out / f".%d.tar.tmp{os.getpid()}"), maxcount=samples_per_shard,
                                 maxsize=float("inf"), post=publish, verbose=0, mtime=int(time.time()))
        img = img if isinstance(img, Image.Image) else Image.open(io.BytesIO(img))
        jpg, _, _ = encode_jpeg(img, max_side=max_side)
        shard, index = divmod(count, samples_per_shard)
        writer.write({"__key__": sample_key(shard, index, samples_per_shard), "jpg": jpg, "cls": int(label)})
        count += 1
    if writer is not None:
        writer.close()
    atomic_write_text(out / NSHARDS_FILE, f"{len(shards)}\n")
    write_classnames(root, classnames)
    if templates is not None:
        write_templates(root, templates)
    pattern = str(out / f"{{0..{len(shards) - 1}}}.tar") if len(shards) > 1 else (shards[0] if shards else "")
    return {"out_dir": str(root), "shards": shards, "samples": count, "pattern": pattern,
            "classnames": str(root / "classnames.txt")}
