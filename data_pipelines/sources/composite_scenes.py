"""Composite scenes for zero-shot segmentation: 1-3 Fashion-MNIST test objects pasted at random positions and
scales on textured backgrounds, with ground-truth instance masks from the object silhouettes (COCO RLE).

Each sample's JSON carries `objects`: [{label, classname, segmentation: {size: [h, w], counts}, area, bbox}]
(the visible part of each object: later objects occlude earlier ones).
"""
from __future__ import annotations

from typing import Iterator

import numpy as np
from PIL import Image
from scipy import ndimage

from .fashion_mnist import CLASSNAMES, load_fashion_mnist, plain_name

SILHOUETTE_LEVEL = 12     # of 255: Fashion-MNIST backgrounds are exact zeros, objects rarely that dark inside
MIN_VISIBLE_PIXELS = 25   # an object occluded below this is dropped from the scene


def textured_background(rng: np.random.Generator, size: int) -> np.ndarray:
    """A grey (size, size) texture in [0, 1]: a grating, smooth noise or a checkerboard, plus fine noise."""
    yy, xx = np.mgrid[0:size, 0:size].astype(np.float64)
    kind = rng.integers(3)
    if kind == 0:
        theta, period = rng.uniform(0, np.pi), rng.uniform(4, 12)
        base = 0.5 + 0.5 * np.sin(2 * np.pi * (xx * np.cos(theta) + yy * np.sin(theta)) / period)
    elif kind == 1:
        base = ndimage.gaussian_filter(rng.normal(size=(size, size)), sigma=rng.uniform(1.5, 4))
        base = (base - base.min()) / max(np.ptp(base), 1e-9)
    else:
        cell = int(rng.integers(4, 10))
        base = ((yy // cell + xx // cell) % 2).astype(np.float64)
    low, span = rng.uniform(0.05, 0.3), rng.uniform(0.15, 0.35)
    return np.clip(low + span * base + rng.normal(scale=0.03, size=(size, size)), 0, 1)


def _silhouette(obj: np.ndarray) -> np.ndarray:
    return ndimage.binary_fill_holes(obj > SILHOUETTE_LEVEL / 255.0)


def composite_scene(rng: np.random.Generator, images: np.ndarray, labels: np.ndarray, size: int = 56,
                    max_objects: int = 3, scale: tuple[int, int] = (18, 34)) -> tuple[Image.Image, list[dict]]:
    """One scene: (RGB image, [{'label', 'mask' (size, size) bool}]) of its visible objects."""
    canvas = textured_background(rng, size)
    owner = np.full((size, size), -1)
    picks = rng.integers(len(images), size=int(rng.integers(1, max_objects + 1)))
    for k, index in enumerate(picks):
        side = int(rng.integers(scale[0], min(scale[1], size) + 1))
        obj = np.asarray(Image.fromarray(images[index]).resize((side, side), Image.BICUBIC), np.float64) / 255.0
        sil = _silhouette(obj)
        y, x = (int(rng.integers(0, size - side + 1)) for _ in range(2))
        region = canvas[y:y + side, x:x + side]
        region[sil] = np.clip(obj[sil], 0, 1)
        owner[y:y + side, x:x + side][sil] = k
    objects = []
    for k, index in enumerate(picks):
        mask = owner == k
        if mask.sum() >= MIN_VISIBLE_PIXELS:
            objects.append({"label": int(labels[index]), "mask": mask})
    rgb = (np.repeat(canvas[..., None], 3, axis=2) * 255).round().astype(np.uint8)
    return Image.fromarray(rgb), objects


def encode_mask(mask: np.ndarray) -> dict:
    """COCO RLE of a boolean mask, JSON-ready (counts as str), with area and [x, y, w, h] bbox."""
    from pycocotools import mask as mask_utils

    rle = mask_utils.encode(np.asfortranarray(mask.astype(np.uint8)))
    return {"segmentation": {"size": [int(s) for s in rle["size"]], "counts": rle["counts"].decode("ascii")},
            "area": int(mask.sum()), "bbox": [float(v) for v in mask_utils.toBbox(rle)]}


def composite_scene_samples(count: int, size: int = 56, max_objects: int = 3, seed: int = 0,
                            source_dir=None) -> Iterator[dict]:
    """`count` scenes of Fashion-MNIST TEST objects as write_shards samples (deterministic for a seed)."""
    images, labels = load_fashion_mnist("test", source_dir)
    rng = np.random.default_rng(seed)
    for i in range(count):
        image, objects = composite_scene(rng, images, labels, size, max_objects)
        names = [plain_name(o["label"]) for o in objects]
        caption = "a scene with " + (", ".join(f"a {n}" for n in names) if names else "no object")
        records = [{"label": o["label"], "classname": CLASSNAMES[o["label"]], **encode_mask(o["mask"])}
                   for o in objects]
        yield {"image": image, "caption": caption, "uid": f"fmnist-scenes/{seed}/{i}",
               "url": f"fmnist-scenes://{seed}/{i}", "extra": {"objects": records}}


def write_composite_scene_shards(out_dir, count: int = 500, size: int = 56, max_objects: int = 3, seed: int = 0,
                                 samples_per_shard: int = 10_000, source_dir=None, progress: bool = False) -> dict:
    """The segmentation evaluation set as DataComp-layout shards (lossless-ish JPEG q=95 + JSON with masks)."""
    from ..shard_writer import write_shards

    if not 1 <= max_objects:
        raise ValueError(f"max_objects must be >= 1, got {max_objects}")
    return write_shards(composite_scene_samples(count, size, max_objects, seed, source_dir), out_dir,
                        samples_per_shard, max_side=None, quality=95, progress=progress, total=count,
                        description="composite scenes", num_workers=1)
