"""Image decoding for the stream: reduced-size JPEG decode, RGB conversion, CLIPA crop, eval transform.

The crop box is chosen from the header size before any pixel is decoded, so the JPEG decoder can be
asked (PIL `Image.draft`) for the smallest 1/2, 1/4 or 1/8 scale that still leaves the crop at least
`size` pixels on each side. At 84 px this skips most of the IDCT work.
"""
from __future__ import annotations

import io
import math
import random
import warnings
from typing import Literal

import numpy as np
from PIL import Image, ImageMode

from crate_clip.core.read_bounds import MAX_IMAGE_BYTES as DEFAULT_MAX_IMAGE_BYTES
from crate_clip.core.read_bounds import MAX_IMAGE_PIXELS as DEFAULT_MAX_IMAGE_PIXELS

RATIO = (3 / 4, 4 / 3)


class BadImage(ValueError):
    """An image the stream skips; `reason` is the skip-count key."""

    def __init__(self, reason: str, message: str):
        super().__init__(message)
        self.reason = reason


def open_image(data: bytes, max_pixels: int = DEFAULT_MAX_IMAGE_PIXELS) -> Image.Image:
    """Open (header only) an encoded image; raises BadImage for empty, unreadable or oversized images."""
    if not data:
        raise BadImage("zero_size_image", "image member is empty")
    pil_limit = Image.MAX_IMAGE_PIXELS
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # PIL's own DecompressionBombWarning: we apply our own limit
        # PIL refuses images above 2x its own limit at open: lift it so that ours (max_pixels) decides,
        # also when a user sets it above PIL's default.
        Image.MAX_IMAGE_PIXELS = None
        try:
            img = Image.open(io.BytesIO(data))
        except Image.DecompressionBombError as exn:
            raise BadImage("decompression_bomb", f"image too large: {exn}") from None
        except Exception as exn:  # PIL raises UnidentifiedImageError, OSError, SyntaxError, ...
            raise BadImage("undecodable_image", f"cannot identify image: {exn}") from None
        finally:
            Image.MAX_IMAGE_PIXELS = pil_limit
    w, h = img.size
    if w <= 0 or h <= 0:
        raise BadImage("zero_size_image", f"image has size {w}x{h}")
    if w * h > max_pixels:
        raise BadImage("decompression_bomb", f"image has {w}x{h} = {w * h} pixels > max_image_pixels={max_pixels}")
    return img


def decoded_bytes(img: Image.Image) -> int:
    """Bytes the decoded image takes (width x height x channels x bytes per channel of its mode, at least the
    3 of the RGB it is converted to), from its header: nothing is decoded."""
    mode = ImageMode.getmode(img.mode)
    per_pixel = len(mode.bands) * np.dtype(mode.typestr).itemsize
    return img.size[0] * img.size[1] * max(per_pixel, 3)


def check_decoded_bytes(img: Image.Image, max_bytes: int) -> None:
    """Raise BadImage (decompression_bomb) when decoding `img` would take more than max_bytes."""
    need = decoded_bytes(img)
    if need > max_bytes:
        raise BadImage("decompression_bomb", f"image {img.size[0]}x{img.size[1]} ({img.mode}) decodes to {need:,} "
                                             f"bytes > max_image_bytes={max_bytes:,}")


def to_rgb(img: Image.Image) -> Image.Image:
    """Any PIL mode to RGB; transparent images (RGBA, LA, palette with transparency) go onto white."""
    if img.mode == "RGB":
        return img
    if img.mode in ("RGBA", "LA", "PA") or (img.mode == "P" and "transparency" in img.info):
        rgba = img.convert("RGBA")
        background = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
        return Image.alpha_composite(background, rgba).convert("RGB")
    if img.mode in ("I;16", "I;16B", "I;16L", "I"):
        img = img.point(lambda v: v / 256).convert("L")  # 16-bit gray: keep the high byte
    return img.convert("RGB")


# The training crop's resampling filter (data.crop_interpolation). PIL widens a filter's support by the
# downscale factor, so both are antialiased when shrinking: "bilinear" is the official CLIPA / CRATE-alpha
# pipeline's inception_crop(method="bilinear", antialias=True); "bicubic" (the default) is open_clip's.
CROP_FILTERS = {"bicubic": Image.BICUBIC, "bilinear": Image.BILINEAR}
CropInterpolation = Literal["bicubic", "bilinear"]


def random_resized_crop_box(width: int, height: int, rng: random.Random, scale=(0.4, 1.0),
                            ratio=RATIO) -> tuple[int, int, int, int]:
    """Crop box (left, top, right, bottom) with random area fraction and log-uniform aspect ratio."""
    area = width * height
    log_ratio = (math.log(ratio[0]), math.log(ratio[1]))
    for _ in range(10):
        target_area = area * rng.uniform(scale[0], scale[1])
        aspect = math.exp(rng.uniform(*log_ratio))
        w = int(round(math.sqrt(target_area * aspect)))
        h = int(round(math.sqrt(target_area / aspect)))
        if 0 < w <= width and 0 < h <= height:
            left = rng.randint(0, width - w)
            top = rng.randint(0, height - h)
            return left, top, left + w, top + h
    # Fallback (extreme aspect ratio): the largest centred crop within the ratio range.
    in_ratio = width / height
    if in_ratio < ratio[0]:
        w, h = width, int(round(width / ratio[0]))
    elif in_ratio > ratio[1]:
        w, h = int(round(height * ratio[1])), height
    else:
        w, h = width, height
    left, top = (width - w) // 2, (height - h) // 2
    return left, top, left + w, top + h


def center_crop_box(width: int, height: int) -> tuple[int, int, int, int]:
    """Largest centred square: what resize-shorter-side-then-center-crop keeps of the image."""
    side = min(width, height)
    left, top = (width - side) // 2, (height - side) // 2
    return left, top, left + side, top + side


def decode_crop(data: bytes, size: int, box_fn, max_pixels: int = DEFAULT_MAX_IMAGE_PIXELS,
                reduced_decode: bool = True, interpolation: str = "bicubic",
                max_bytes: int = DEFAULT_MAX_IMAGE_BYTES) -> np.ndarray:
    """Decode `data`, crop box_fn(width, height) and resize it to size x size RGB uint8 (H, W, 3) with the
    `interpolation` filter (CROP_FILTERS); an image that would decode to more than max_bytes is not decoded."""
    img = open_image(data, max_pixels)
    w, h = img.size
    box = box_fn(w, h)
    try:
        if reduced_decode and img.format == "JPEG":
            bw, bh = max(box[2] - box[0], 1), max(box[3] - box[1], 1)
            # Ask for a scale that keeps the crop >= size px in both directions; draft picks the
            # largest JPEG DCT scale (1/2, 1/4, 1/8) whose result is still at least this big.
            img.draft(img.mode if img.mode in ("RGB", "L") else None,
                      (math.ceil(w * size / bw), math.ceil(h * size / bh)))
            sx, sy = img.size[0] / w, img.size[1] / h
            box = (box[0] * sx, box[1] * sy, box[2] * sx, box[3] * sy)
        check_decoded_bytes(img, max_bytes)   # after draft: a big JPEG decodes at its reduced size
        img = to_rgb(img)
        out = img.resize((size, size), CROP_FILTERS[interpolation], box=box, reducing_gap=None)
        arr = np.asarray(out, dtype=np.uint8)
    except BadImage:
        raise
    except Exception as exn:  # truncated or corrupt pixel data surfaces only when decoding
        raise BadImage("undecodable_image", f"cannot decode image: {exn}") from None
    if arr.shape != (size, size, 3):
        raise BadImage("undecodable_image", f"decoded to shape {arr.shape}")
    return arr


def decode_train(data: bytes, size: int, rng: random.Random, scale=(0.4, 1.0), ratio=RATIO,
                 max_pixels: int = DEFAULT_MAX_IMAGE_PIXELS, reduced_decode: bool = True,
                 interpolation: str = "bicubic", max_bytes: int = DEFAULT_MAX_IMAGE_BYTES) -> np.ndarray:
    """CLIPA training view: random resized crop (area `scale`, no flip) at size px, uint8 (H, W, 3)."""
    return decode_crop(data, size, lambda w, h: random_resized_crop_box(w, h, rng, scale, ratio),
                       max_pixels, reduced_decode, interpolation, max_bytes)


def decode_eval(data: bytes, size: int, max_pixels: int = DEFAULT_MAX_IMAGE_PIXELS,
                reduced_decode: bool = True) -> np.ndarray:
    """Eval view: resize the shorter side to size, center crop size x size, uint8 (H, W, 3)."""
    return decode_crop(data, size, center_crop_box, max_pixels, reduced_decode)


def normalize_batch(images_uint8: np.ndarray, mean, std):
    """(B, H, W, 3) uint8 array -> (B, 3, H, W) float32 tensor normalised by mean/std (0-1 scale)."""
    import torch

    # One fused multiply-add in numpy: x/255 normalised == x * (1 / (255 std)) - mean / std.
    scale = (1.0 / (255.0 * np.asarray(std, dtype=np.float32))).astype(np.float32)
    shift = (-np.asarray(mean, dtype=np.float32) / np.asarray(std, dtype=np.float32)).astype(np.float32)
    x = images_uint8.astype(np.float32)
    x *= scale
    x += shift
    return torch.from_numpy(np.ascontiguousarray(x.transpose(0, 3, 1, 2)))


class EvalTransform:
    """PIL image or encoded bytes -> normalised float32 tensor (3, size, size): resize shorter side, center crop."""

    def __init__(self, size: int, mean, std, max_pixels: int = DEFAULT_MAX_IMAGE_PIXELS):
        self.size, self.mean, self.std, self.max_pixels = size, tuple(mean), tuple(std), max_pixels

    def __call__(self, image) -> "torch.Tensor":
        """The eval view of one image."""
        if isinstance(image, Image.Image):
            img = to_rgb(image)
            arr = np.asarray(img.resize((self.size, self.size), Image.BICUBIC, box=center_crop_box(*img.size)),
                             dtype=np.uint8)
        else:
            arr = decode_eval(bytes(image), self.size, self.max_pixels)
        return normalize_batch(arr[None], self.mean, self.std)[0]
