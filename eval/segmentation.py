"""Zero-shot segmentation of images with a CLIP image tower: MaskCut on one block's patch features, masks
back at the image's own size, COCO RLE records, overlays; and the class-agnostic evaluation against COCO-style
ground truth (pycocotools: mask AP50, and the mean over ground-truth objects of the best IoU of any mask).
"""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch
from PIL import Image

from crate_clip.core.image_normalization import OPENAI_MEAN, OPENAI_STD
from crate_clip.eval.maskcut import DEFAULT_MASKS, DEFAULT_TAU, maskcut
from crate_clip.eval.whitebox_maps import block_maps, display_scale

MASK_COLOURS = np.array([(230, 25, 75), (60, 180, 75), (0, 130, 200), (245, 130, 48), (145, 30, 180)], np.uint8)


def tower_input_size(clip) -> int:
    """The square input size the image tower was built for."""
    size = getattr(getattr(getattr(clip, "module", clip), "visual", None), "image_size", 224)
    return int(size[0] if isinstance(size, (tuple, list)) else size)


def to_tensor(images: list[Image.Image], clip, size: int | None = None) -> torch.Tensor:
    """Images squashed to the tower's square input and normalised with its mean/std: (B, 3, S, S)."""
    visual = getattr(getattr(clip, "module", clip), "visual", None)
    cfg = getattr(visual, "preprocess_cfg", None) or {}
    mean = torch.tensor(cfg.get("mean", OPENAI_MEAN)).view(3, 1, 1)
    std = torch.tensor(cfg.get("std", OPENAI_STD)).view(3, 1, 1)
    size = size or tower_input_size(clip)
    arrays = [np.asarray(im.convert("RGB").resize((size, size), Image.BICUBIC), np.float32) / 255.0 for im in images]
    return (torch.from_numpy(np.stack(arrays)).permute(0, 3, 1, 2) - mean) / std


def segment_batch(clip, images: list[Image.Image], *, layer: int = -1, facet: str = "projection",
                  tau: float = DEFAULT_TAU, n_masks: int = DEFAULT_MASKS) -> list[list[np.ndarray]]:
    """MaskCut masks per image, boolean at the image's own size (patch-level masks, nearest-upsampled)."""
    maps = block_maps(clip, to_tensor(images, clip), layer)
    feats = maps.patch_features(facet).cpu().numpy()
    out = []
    for image, f in zip(images, feats):
        masks = maskcut(f, maps.grid, tau=tau, n_masks=n_masks)
        out.append([np.asarray(Image.fromarray(m.astype(np.uint8) * 255).resize(image.size, Image.NEAREST)) > 127
                    for m in masks])
    return out


def mask_records(masks: list[np.ndarray]) -> list[dict]:
    """COCO RLE results of one image's masks (category 1; score by MaskCut round: 1, 1/2, 1/3)."""
    from pycocotools import mask as mask_utils

    records = []
    for i, m in enumerate(masks):
        rle = mask_utils.encode(np.asfortranarray(m.astype(np.uint8)))
        records.append({"segmentation": {"size": [int(s) for s in rle["size"]], "counts": rle["counts"].decode("ascii")},
                        "area": int(m.sum()), "bbox": [float(v) for v in mask_utils.toBbox(rle)],
                        "score": 1.0 / (i + 1), "category_id": 1})
    return records


def overlay_masks(image: Image.Image, masks: list[np.ndarray], alpha: float = 0.5) -> Image.Image:
    """The image (up-scaled when small) with each mask tinted in its own colour."""
    rgb = np.asarray(image.convert("RGB"), np.float32)
    for i, m in enumerate(masks):
        rgb[m] = (1 - alpha) * rgb[m] + alpha * MASK_COLOURS[i % len(MASK_COLOURS)]
    out = Image.fromarray(rgb.round().astype(np.uint8))
    s = display_scale(out.size)
    return out.resize((out.width * s, out.height * s), Image.NEAREST)


def write_results(results: list[dict], out_dir: Path) -> Path:
    """segments.json: [{image, height, width, masks: [COCO RLE records]}]."""
    path = Path(out_dir) / "segments.json"
    path.write_text(json.dumps(results, indent=1))
    return path


# ---------------------------------------------------------------- evaluation
def coco_evaluate(gt_images: list[dict], predictions: list[list[dict]]) -> dict:
    """Class-agnostic mask AP50 / AP (pycocotools) and mean best IoU per ground-truth object.

    `gt_images`: [{height, width, objects: [{segmentation (RLE), area, bbox}]}]; `predictions`: per image, the
    records of `mask_records`.
    """
    from pycocotools import mask as mask_utils
    from pycocotools.coco import COCO
    from pycocotools.cocoeval import COCOeval

    images, annotations, detections, best = [], [], [], []
    for image_id, (gt, preds) in enumerate(zip(gt_images, predictions), start=1):
        images.append({"id": image_id, "height": gt["height"], "width": gt["width"]})
        for obj in gt["objects"]:
            annotations.append({"id": len(annotations) + 1, "image_id": image_id, "category_id": 1, "iscrowd": 0,
                                "segmentation": obj["segmentation"], "area": obj["area"], "bbox": obj["bbox"]})
        detections += [{**p, "image_id": image_id} for p in preds]
        gts = [o["segmentation"] for o in gt["objects"]]
        dts = [p["segmentation"] for p in preds]
        if gts:
            ious = mask_utils.iou(dts, gts, [0] * len(gts)) if dts else np.zeros((0, len(gts)))
            best += list(np.max(ious, axis=0)) if len(dts) else [0.0] * len(gts)
    coco = COCO()
    coco.dataset = {"images": images, "annotations": annotations, "categories": [{"id": 1, "name": "object"}]}
    coco.createIndex()
    if not detections:
        return {"ap50": 0.0, "ap": 0.0, "mean_best_iou": float(np.mean(best)) if best else 0.0,
                "images": len(images), "objects": len(annotations), "masks": 0}
    result = coco.loadRes(detections)
    ev = COCOeval(coco, result, iouType="segm")
    ev.params.maxDets = [1, 10, 100]
    ev.evaluate()
    ev.accumulate()
    ev.summarize()
    return {"ap50": float(ev.stats[1]), "ap": float(ev.stats[0]), "mean_best_iou": float(np.mean(best)),
            "images": len(images), "objects": len(annotations), "masks": len(detections)}
