"""Fashion-MNIST from its idx files (Debian's dataset-fashion-mnist) as captioned samples and eval sets."""
from __future__ import annotations

import gzip
import random
from dataclasses import replace
from functools import lru_cache
from pathlib import Path
from typing import Iterator

import numpy as np
from PIL import Image

from crate_clip.core.class_names import FASHION_MNIST_CLASSNAMES as CLASSNAMES, FASHION_MNIST_TEMPLATES
from crate_clip.core.dataset_records import FASHION_MNIST, write_dataset_record
from crate_clip.data.sources.debian_packages import DEBIAN_PACKAGES

SEARCH_DIRS = ("/usr/share/datasets/fashion-mnist", "~/.cache/fashion-mnist", "data/fashion-mnist")
SPLIT_PREFIX = {"train": "train", "test": "t10k"}
# Caption wording varies per sample (synonyms and templates) so the text tower sees real language; the first
# synonym is the plain name a sentence uses ("a t-shirt", where the label name reads "T-shirt/top").
SYNONYMS = dict(zip(CLASSNAMES, (
    ("t-shirt", "tee", "top", "t-shirt top"), ("trouser", "pair of trousers", "pair of pants"),
    ("pullover", "sweater", "jumper"), ("dress", "gown", "frock"),
    ("coat", "jacket", "overcoat"), ("sandal", "open shoe", "summer sandal"),
    ("shirt", "button-up shirt", "blouse"), ("sneaker", "trainer", "running shoe"),
    ("bag", "handbag", "purse"), ("ankle boot", "boot", "short boot"),
), strict=True))
TEMPLATES = ("a photo of a {}.", "a grayscale photo of a {}.", "a product photo of the {}.",
             "a small picture of a {}.", "a {} on a black background.", "a low resolution photo of a {}.",
             "a centered image of a {}.", "a {}, seen from the front.", "an item of clothing: a {}.",
             "a black and white photo of the {}.")


def find_fashion_mnist(source_dir: str | Path | None = None) -> Path:
    """Folder holding the Fashion-MNIST idx .gz files (explicit, else the usual install places)."""
    candidates = [Path(source_dir)] if source_dir else [Path(d).expanduser() for d in SEARCH_DIRS]
    for d in candidates:
        if (d / "t10k-images-idx3-ubyte.gz").is_file() or (d / "t10k-images-idx3-ubyte").is_file():
            return d
    raise FileNotFoundError(f"Fashion-MNIST idx files not found in {', '.join(map(str, candidates))}; install "
                            f"Debian's {DEBIAN_PACKAGES['fashion_mnist']} or pass source_dir")


def _read_idx(path: Path) -> np.ndarray:
    """An idx array (ubyte images or labels), gzipped or plain."""
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rb") as f:
        data = f.read()
    if data[:2] != b"\0\0" or data[2] != 8:
        raise ValueError(f"{path} is not an unsigned-byte idx file")
    ndim = data[3]
    shape = tuple(int.from_bytes(data[4 + 4 * i: 8 + 4 * i], "big") for i in range(ndim))
    return np.frombuffer(data, dtype=np.uint8, offset=4 + 4 * ndim).reshape(shape)


@lru_cache(maxsize=2)
def load_fashion_mnist(split: str = "train", source_dir=None) -> tuple[np.ndarray, np.ndarray]:
    """(images uint8 (N, 28, 28), labels uint8 (N,)) of a split (read-only arrays, cached)."""
    if split not in SPLIT_PREFIX:
        raise ValueError(f"split {split!r} is not one of {tuple(SPLIT_PREFIX)}")
    d = find_fashion_mnist(source_dir)
    prefix = SPLIT_PREFIX[split]

    def pick(name):
        gz = d / f"{name}.gz"
        return gz if gz.is_file() else d / name

    images = _read_idx(pick(f"{prefix}-images-idx3-ubyte"))
    labels = _read_idx(pick(f"{prefix}-labels-idx1-ubyte"))
    if len(images) != len(labels):
        raise ValueError(f"{d}: {len(images)} images but {len(labels)} labels in split {split}")
    return images, labels


def plain_name(label: int) -> str:
    """The class's name as a caption sentence writes it ("t-shirt" for "T-shirt/top")."""
    return SYNONYMS[CLASSNAMES[label]][0]


def fashion_mnist_caption(label: int, rng: random.Random) -> str:
    """A varied caption for a Fashion-MNIST class."""
    name = rng.choice(SYNONYMS[CLASSNAMES[label]])
    return rng.choice(TEMPLATES).format(name)


def fashion_mnist_samples(split: str = "train", source_dir=None, limit: int | None = None,
                          seed: int = 0, upscale: int | None = None) -> Iterator[dict]:
    """Captioned samples of a split for write_shards (deterministic captions for a seed)."""
    images, labels = load_fashion_mnist(split, source_dir)
    n = len(images) if limit is None else min(limit, len(images))
    rng = random.Random(f"fashion-mnist-{split}-{seed}")
    for i in range(n):
        img = Image.fromarray(images[i], mode="L")
        if upscale:
            img = img.resize((upscale, upscale), Image.BICUBIC)
        yield {"image": img, "caption": fashion_mnist_caption(int(labels[i]), rng),
               "uid": f"fashion-mnist/{split}/{i}", "url": f"fashion-mnist://{split}/{i}",
               "extra": {"label": int(labels[i]), "classname": CLASSNAMES[int(labels[i])]}}


def write_fashion_mnist_shards(out_dir, split: str = "train", samples_per_shard: int = 10_000,
                               source_dir=None, limit: int | None = None, progress: bool = False,
                               upscale: int | None = None, seed: int = 0) -> dict:
    """Fashion-MNIST image-caption pairs as DataComp-layout shards (see shard_writer.write_shards)."""
    from ..shard_writer import write_shards

    images, _ = load_fashion_mnist(split, source_dir)
    total = len(images) if limit is None else min(limit, len(images))
    result = write_shards(fashion_mnist_samples(split, source_dir, limit, seed, upscale), out_dir,
                          samples_per_shard, max_side=None, progress=progress, total=total,
                          description=f"fashion-mnist {split}")
    write_dataset_record(out_dir, replace(FASHION_MNIST, split=split))   # the card names the data, not its path
    return result


def fashion_mnist_labelled(split: str = "test", source_dir=None, limit: int | None = None) -> Iterator[tuple]:
    """(PIL image, label) pairs of a split."""
    images, labels = load_fashion_mnist(split, source_dir)
    n = len(images) if limit is None else min(limit, len(images))
    for i in range(n):
        yield Image.fromarray(images[i], mode="L"), int(labels[i])


def write_fashion_mnist_eval_folder(out_dir, split: str = "test", source_dir=None, limit: int | None = None) -> Path:
    """The split as an ImageNet-val-style ImageFolder (`<root>/<NN_class>/<i>.png`) with classnames.txt."""
    from ..eval_sets import write_image_folder

    folder = write_image_folder(fashion_mnist_labelled(split, source_dir, limit), out_dir, CLASSNAMES)
    write_dataset_record(folder, replace(FASHION_MNIST, split=split))
    return folder


def write_fashion_mnist_classification_shards(out_dir, split: str = "test", samples_per_shard: int = 10_000,
                                              source_dir=None, limit: int | None = None) -> dict:
    """The split as classification shards (`<key>.jpg` + `<key>.cls`) in CLIP_benchmark's `wds/` layout, with
    classnames.txt and the zero-shot templates."""
    from ..eval_sets import write_classification_shards

    return write_classification_shards(fashion_mnist_labelled(split, source_dir, limit), out_dir, CLASSNAMES,
                                       samples_per_shard, split=split, templates=FASHION_MNIST_TEMPLATES)
