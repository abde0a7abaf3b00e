"""Evaluation data: ImageNet-val ImageFolder, flat folder + label file, and webdataset shards.

Every source yields samples `(image tensor or None, target, index, name)`: target is a class index
(classification) or a caption (retrieval); None marks an unreadable image, which is counted and
reported rather than fatal. `make_loader` splits the samples across ranks and workers.
"""
import csv
import io
import tarfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import numpy as np
import torch
from PIL import Image
from timm.data import ImageNetInfo
from torch.utils.data import DataLoader, Dataset, IterableDataset, Subset, get_worker_info
from torchvision.datasets.folder import IMG_EXTENSIONS, find_classes, make_dataset

from crate_clip.checkpoint_io.bounded_reads import read_small_bytes
from crate_clip.core.file_kinds import special_file
from crate_clip.core.shard_sources import ShardListError, check_shard_count, expand_source
from crate_clip.core.tar_members import TruncatedTarError
from crate_clip.core.tar_samples import SampleCaps, TarSamples
from crate_clip.eval.class_folders import map_class_folders
from crate_clip.eval.distributed_batches import rank_slice

IMAGENET_NUM_CLASSES = 1000
SHARD_IMAGE_KEYS = ("jpg", "jpeg", "png", "webp")
NSHARDS_FILE = "nshards.txt"   # CLIP_benchmark wds/ data sets: the shard count of a split folder
# What PIL raises on a corrupt, truncated or oversized file: such images are counted, not fatal.
DECODE_ERRORS = (OSError, ValueError, SyntaxError, Image.DecompressionBombError)


def imagenet_wnids() -> list[str]:
    """The 1,000 ImageNet-1K WordNet ids in sorted order (= class index order), from timm's table."""
    return list(ImageNetInfo().label_names())


def decode_image(source, transform: Callable):
    """Open a path or bytes as RGB and transform it; None when the file cannot be decoded."""
    try:
        with Image.open(io.BytesIO(source) if isinstance(source, bytes) else source) as img:
            img.load()
            return transform(img.convert("RGB"))
    except DECODE_ERRORS:
        return None


class ClassificationFolder(Dataset):
    """Map-style set of (path, label) pairs decoded on access."""

    def __init__(self, samples: list[tuple[str, int]], transform: Callable, num_classes: int, root: Path):
        self.samples, self.transform, self.num_classes, self.root = samples, transform, num_classes, root

    def __len__(self):
        return len(self.samples)

    def __getitem__(self, index):
        path, label = self.samples[index]
        return decode_image(path, self.transform), label, index, str(Path(path).relative_to(self.root))


def image_folder(root: str | Path, transform: Callable, *, num_classes: int, imagenet: bool = False,
                 classnames: list[str] | None = None, dataset: str = "custom") -> ClassificationFolder:
    """ImageNet-val layout `<root>/<class dir>/<image>`; with `classnames` each folder is matched to its class
    by name or index (crate_clip.eval.class_folders), else (and for ImageNet's WordNet ids) class index = sorted order."""
    root = Path(root)
    if not root.is_dir():
        raise FileNotFoundError(f"evaluation data folder {root} does not exist")
    classes = sorted(p.name for p in root.iterdir() if p.is_dir())
    if imagenet:
        _check_imagenet_classes(root, classes)
    elif len(classes) != num_classes:
        if len(classes) == IMAGENET_NUM_CLASSES and set(classes) <= set(imagenet_wnids()):
            raise ValueError(f"{root} holds the 1,000 ImageNet-1K WordNet-id class folders but dataset {dataset!r} "
                             f"has {num_classes} class names; fix: --dataset imagenet1k (or leave it out)")
        raise ValueError(f"{root}: found {len(classes)} class folders but {num_classes} class names of dataset "
                         f"{dataset!r}; they must agree (one folder per class)")
    if classnames is not None and not imagenet:
        class_to_idx = map_class_folders(root, classes, list(classnames))
    else:
        _, class_to_idx = find_classes(str(root))
    samples = make_dataset(str(root), class_to_idx, extensions=IMG_EXTENSIONS, allow_empty=True)
    if not samples:
        raise ValueError(f"{root}: no image files ({', '.join(IMG_EXTENSIONS)}) in its {len(classes)} class folders")
    return ClassificationFolder(samples, transform, num_classes, root)


def _check_imagenet_classes(root: Path, classes: list[str]) -> None:
    images_at_top = sum(1 for p in root.iterdir() if p.suffix.lower() in IMG_EXTENSIONS)
    hint = (f" It holds {images_at_top} images directly: for the flat val layout pass a ground-truth label "
            f"file (--labels).") if images_at_top else ""
    if len(classes) != IMAGENET_NUM_CLASSES:
        shown = ", ".join(classes[:5]) + (", ..." if len(classes) > 5 else "")
        raise ValueError(f"{root}: imagenet1k needs the 1,000 WordNet-id class folders of the ImageNet val layout "
                         f"(n01440764/ ... n15075141/), found {len(classes)} class folders"
                         f"{' (' + shown + ')' if classes else ''}.{hint}")
    unknown = sorted(set(classes) - set(imagenet_wnids()))
    if unknown:
        raise ValueError(f"{root}: {len(unknown)} class folders are not ImageNet-1K WordNet ids, e.g. {unknown[:5]}")


def flat_folder(root: str | Path, labels_file: str | Path, transform: Callable, *, num_classes: int,
                label_names: list[str] | None = None) -> ClassificationFolder:
    """Flat layout `<root>/<image>` with a ground-truth file (see `read_label_file` for its formats)."""
    root = Path(root)
    files = sorted(p for p in root.iterdir() if p.is_file() and p.suffix.lower() in IMG_EXTENSIONS)
    if not files:
        raise ValueError(f"{root}: no image files for the flat layout")
    labels = read_label_file(labels_file, [p.name for p in files], num_classes, label_names)
    return ClassificationFolder([(str(p), labels[p.name]) for p in files], transform, num_classes, root)


def read_label_file(path: str | Path, file_names: list[str], num_classes: int,
                    label_names: list[str] | None = None) -> dict[str, int]:
    """Labels per file name from `name label` lines, Kaggle's LOC_val_solution.csv, or one label per line.

    A label is a 0-based class index (sorted-WordNet-id order for ImageNet) or a name from `label_names`
    (WordNet ids for ImageNet). One-label-per-line files follow the sorted file-name order.
    """
    path = Path(path)
    rows = _label_rows(path)
    index_of = {name: i for i, name in enumerate(label_names or [])}
    if all(len(r) == 1 for r in rows):
        if len(rows) != len(file_names):
            raise ValueError(f"{path}: {len(rows)} labels for {len(file_names)} images (one label per line "
                             f"must match the sorted image files one to one)")
        rows = [(name, r[0]) for name, r in zip(file_names, rows)]
    by_stem, known = {Path(n).stem: n for n in file_names}, set(file_names)
    labels = {}
    for line_no, (name, raw) in enumerate(rows, 1):
        file_name = name if name in known else by_stem.get(Path(name).stem)
        if file_name is not None:
            labels[file_name] = _parse_label(raw, index_of, num_classes, f"{path}:{line_no}")
    missing = [n for n in file_names if n not in labels]
    if missing:
        raise ValueError(f"{path}: no label for {len(missing)} of {len(file_names)} images, e.g. {missing[:3]}")
    return labels


def _label_rows(path: Path) -> list[tuple[str, ...]]:
    text = read_small_bytes(path).decode("utf-8")   # within 64 MiB: ImageNet's LOC_val_solution.csv is 2.6 MB
    if text.startswith("ImageId,PredictionString"):   # Kaggle ImageNet localisation solution file
        return [(r["ImageId"], r["PredictionString"].split()[0]) for r in csv.DictReader(io.StringIO(text))]
    return [tuple(line.replace(",", " ").split()) for line in text.splitlines() if line.strip()]


def _parse_label(raw: str, index_of: dict[str, int], num_classes: int, where: str) -> int:
    if raw in index_of:
        return index_of[raw]
    if not raw.lstrip("-").isdigit():
        raise ValueError(f"{where}: label {raw!r} is neither a class index nor a known class name")
    label = int(raw)
    if not 0 <= label < num_classes:
        raise ValueError(f"{where}: label {label} outside 0..{num_classes - 1} for {num_classes} class names "
                         f"(indices are 0-based; the ImageNet devkit's 1-based ILSVRC2012 ids need converting)")
    return label


def wds_split_pattern(data: str | Path) -> str | None:
    """The shards of a CLIP_benchmark `wds/` data set (`<root>/<split>/{0..n-1}.tar`, n in nshards.txt) as a brace
    pattern, for its split folder or its root (split 'test', CLIP_benchmark's default, or the only one); else None."""
    path = Path(str(data))
    if not path.is_dir():
        return None
    if not (path / NSHARDS_FILE).is_file():
        splits = sorted(p for p in path.iterdir() if (p / NSHARDS_FILE).is_file())
        if not splits:
            return None
        if len(splits) > 1 and not (path / "test" / NSHARDS_FILE).is_file():
            raise ValueError(f"{path}: a wds/ data set with the splits {[p.name for p in splits]}; pass one of "
                             f"their folders as the data")
        path = path / "test" if len(splits) > 1 else splits[0]
    count = _shard_count(path / NSHARDS_FILE)
    return str(path / f"{{0..{count - 1}}}.tar")


NSHARDS_BYTES = 64   # nshards.txt holds one number (a 20-digit count is already past any bound)


def _shard_count(nshards: Path) -> int:
    """The number in nshards.txt, read as a bounded regular file (a FIFO, a sparse file of gigabytes, a link to
    /dev/zero are one line) and held to MAX_SOURCE_SHARDS before any shard name is made from it."""
    text = read_small_bytes(nshards, NSHARDS_BYTES).decode("ascii", "replace").strip()
    if not (text.isascii() and text.isdigit()) or int(text) < 1:
        raise ValueError(f"{nshards}: {text[:40]!r} is not a number of shards")
    return check_shard_count(int(text), str(nshards))


def shard_urls(data: str | Path) -> list[str]:
    """Shard paths of a local source (folder of .tar files, brace pattern, glob, one .tar, or a CLIP_benchmark
    wds/ data set), all present."""
    data = wds_split_pattern(data) or data
    try:
        urls = expand_source(str(data))
    except ShardListError as err:
        raise FileNotFoundError(f"{data}: no .tar shards ({err})") from None
    missing = [u for u in urls if not Path(u).is_file()]
    if missing:
        raise FileNotFoundError(f"shard files not found: {missing[:3]}{' ...' if len(missing) > 3 else ''}")
    return urls


def is_shard_source(data: str | Path) -> bool:
    """True for a .tar file, a brace pattern, a folder holding .tar shards, or a CLIP_benchmark wds/ data set."""
    path = Path(str(data))
    return (str(data).endswith(".tar") or "{" in str(data) or (path.is_dir() and any(path.glob("*.tar")))
            or wds_split_pattern(data) is not None)


SHARD_INDEX_BITS = 32   # sample index = shard number << 32 | position in the shard (whole-shard reading)


def tar_samples(url: str, caps: SampleCaps = SampleCaps()):
    """Samples of one tar, read by the training stream's bounded reader (crate_clip.core.tar_samples: members and
    samples above their caps passed over unread, a compressed tar refused before anything is decompressed); a
    skipped sample is one {'__unreadable_tar__': reason} entry with its key, a corrupt, truncated or compressed tar
    ends with one naming why."""
    kind = special_file(url, name_link=False)
    if kind:   # a FIFO would block the open for ever, a device read without end
        yield {"__url__": url, "__unreadable_tar__": f"unreadable tar ({kind}, not a regular file)"}
        return
    try:
        stream = open(url, "rb", buffering=1 << 20)
    except OSError as exn:
        yield {"__url__": url, "__unreadable_tar__": f"unreadable tar ({type(exn).__name__}: {exn.strerror})"}
        return
    with stream:
        samples = TarSamples(stream, caps, url)
        try:
            yield from map(_named_skip, samples)
        except TruncatedTarError:
            pending = samples.pending   # the sample the tar broke off in, kept when its image and target are whole
            if pending and any(k in pending for k in SHARD_IMAGE_KEYS) and ("cls" in pending or "txt" in pending):
                yield _named_skip(samples.finish_pending())
            yield {"__url__": url, "__unreadable_tar__": "truncated tar: it ends without the end-of-archive marker "
                                                         "(samples after the cut are lost)"}
        except (tarfile.ReadError, OSError) as exn:   # CompressedTarError is a ReadError
            yield {"__url__": url, "__unreadable_tar__": f"unreadable tar ({type(exn).__name__}: {exn})"}


def _named_skip(sample: dict) -> dict:
    """A sample the reader skipped as an unreadable entry naming why (its members above the bounds, or its key
    repeated); any other as it is."""
    if "__skip__" in sample:
        sample["__unreadable_tar__"] = (f"sample skipped ({sample.pop('__skip__')}: above the reader's bounds or a "
                                        "repeated key, docs/safety.md)")
    return sample


@dataclass
class ShardSamples(IterableDataset):
    """Samples of webdataset shards: `.jpg` + `.cls` (classification) or `.jpg` + `.txt` (retrieval)."""
    urls: list[str]
    transform: Callable
    target: str = "cls"                  # 'cls' -> class index, 'txt' -> caption
    num_classes: int | None = None
    rank: int = 0
    world: int = 1
    limit: int | None = None             # first `limit` samples of the shard list (max_images)

    def __iter__(self):
        info = get_worker_info()
        workers, worker = (info.num_workers, info.id) if info else (1, 0)
        stride, offset = self.world * workers, self.rank * workers + worker
        if self.limit is None and len(self.urls) >= stride:
            # Enough shards: every (rank, worker) reads whole shards of its own instead of every tar in full.
            # Indices (shard, position) sort in the order of the single-reader path below.
            for shard in range(offset, len(self.urls), stride):
                for local, sample in enumerate(tar_samples(self.urls[shard])):
                    yield self._decode(shard << SHARD_INDEX_BITS | local, sample)
            return
        # Sample-level interleave over (rank, worker): balanced even when shards < ranks x workers.
        index = 0
        for url in self.urls:
            for sample in tar_samples(url):
                if self.limit is not None and index >= self.limit:
                    return
                if index % stride == offset:
                    yield self._decode(index, sample)
                index += 1

    def _decode(self, index: int, sample: dict):
        if "__unreadable_tar__" in sample:   # counted and named like an unreadable image
            where = f"{sample['__url__']}:{sample['__key__']}" if "__key__" in sample else sample["__url__"]
            return None, None, index, f"{where}: {sample['__unreadable_tar__']}"
        name = f"{sample.get('__url__', '?')}:{sample['__key__']}"
        if self.target not in sample:
            raise ValueError(f"shard sample {name} has no .{self.target} member")
        raw = sample[self.target].decode("utf-8").strip()
        target = _parse_label(raw, {}, self.num_classes, name) if self.target == "cls" else raw
        image_key = next((k for k in SHARD_IMAGE_KEYS if k in sample), None)
        image = decode_image(sample[image_key], self.transform) if image_key else None
        return image, target, index, name


@dataclass
class ImageBatch:
    """One collated batch: decodable images with their targets and sample indices; unreadable names."""
    images: torch.Tensor | None
    targets: torch.Tensor | list[str]
    indices: torch.Tensor
    unreadable: list[str] = field(default_factory=list)


def collate_samples(items: list[tuple]) -> ImageBatch:
    """Stack the readable samples of a batch and list the unreadable ones by name."""
    good = [it for it in items if it[0] is not None]
    targets = [it[1] for it in good]
    return ImageBatch(
        images=torch.stack([it[0] for it in good]) if good else None,
        targets=torch.tensor(targets, dtype=torch.int64) if targets and isinstance(targets[0], int) else targets,
        indices=torch.tensor([it[2] for it in good], dtype=torch.int64),
        unreadable=[it[3] for it in items if it[0] is None],
    )


def subset_indices(n: int, max_images: int | None) -> np.ndarray:
    """All n indices, or `max_images` of them spread evenly (class-sorted folders keep every class)."""
    if max_images is None or max_images >= n:
        return np.arange(n)
    return np.unique(np.linspace(0, n - 1, max_images).round().astype(np.int64))


class IndexedPairs(Dataset):
    """Any map-style data set of (image tensor, label) pairs (e.g. torchvision's ImageFolder) as eval samples."""

    def __init__(self, dataset):
        self.dataset = dataset

    def __len__(self):
        return len(self.dataset)

    def __getitem__(self, index):
        image, label = self.dataset[index][:2]
        return image, int(label), index, str(index)


def make_loader(dataset, *, batch_size: int, num_workers: int = 0, rank: int = 0, world: int = 1,
                max_images: int | None = None) -> DataLoader:
    """A DataLoader over this rank's share of a ClassificationFolder or ShardSamples."""
    if isinstance(dataset, ShardSamples):
        shard_set = ShardSamples(**{**dataset.__dict__, "rank": rank, "world": world, "limit": max_images})
        return DataLoader(shard_set, batch_size=batch_size, num_workers=num_workers, collate_fn=collate_samples)
    if not isinstance(dataset, ClassificationFolder):
        dataset = IndexedPairs(dataset)
    chosen = subset_indices(len(dataset), max_images)
    mine = [int(chosen[i]) for i in rank_slice(len(chosen), rank, world)]
    return DataLoader(Subset(dataset, mine), batch_size=batch_size, num_workers=num_workers,
                      collate_fn=collate_samples, shuffle=False)


def loader_length(dataset, max_images: int | None, world: int, batch_size: int) -> int | None:
    """Number of batches on rank 0 (for the progress display), None for shards and other data sets of unknown
    length."""
    if isinstance(dataset, ShardSamples) or not hasattr(dataset, "__len__"):
        return None
    n = len(subset_indices(len(dataset), max_images))
    return -(-len(range(0, n, world)) // batch_size)


def classification_dataset(data: str | Path, transform: Callable, *, dataset: str, num_classes: int,
                           labels_file: str | Path | None = None, classnames: list[str] | None = None):
    """The classification source at `data`: shards with .cls, a flat folder + labels, or an ImageFolder (whose
    folders are matched to `classnames` by name or index when given)."""
    imagenet = dataset == "imagenet1k"
    if imagenet and num_classes != IMAGENET_NUM_CLASSES:
        raise ValueError(f"imagenet1k needs 1000 class names, got {num_classes}")
    if is_shard_source(data):
        return ShardSamples(shard_urls(data), transform, "cls", num_classes)
    if labels_file:
        names = imagenet_wnids() if imagenet else None
        return flat_folder(data, labels_file, transform, num_classes=num_classes, label_names=names)
    return image_folder(data, transform, num_classes=num_classes, imagenet=imagenet, classnames=classnames,
                        dataset=dataset)
