"""JPEG decoding on the training device (stage key `decode: device`), with the CPU path's crops.

Worker side (`ship_sample`): the header is read, and the crop box drawn with the sample's own generator by
the very function and call order of the CPU path (image_decode.random_resized_crop_box, before the text
mask), so a seed gives the same boxes and the same token rows on both paths, and a resume is as exact.
The worker then ships the JPEG bytes and the box instead of pixels. What the device decoder cannot take
(not a JPEG, a JPEG mode other than RGB / grayscale such as CMYK, no end-of-image marker) the worker
decodes as the CPU path does, counted as `decode_cpu_fallback`.

Main-process side (`DeviceJpegBatch.join`, `.to_images`): the workers' parts of one step joined, then one
batched `torchvision.io.decode_jpeg` on the device (nvjpeg on CUDA; libjpeg-turbo on CPU), then per image
PIL's own box resampling as two small matmuls (the weights of PIL's Resample.c for the crop's filter,
data.crop_interpolation: bicubic with a = -0.5 or bilinear, support widened by the downscale factor, read
beyond the box up to the image edge, each pass rounded to uint8), then normalise. An image the device decoder rejects is decoded with PIL in the main process
(`decode_device_failed`); one that PIL cannot decode either is replaced, image and caption, by another
sample of the batch (`decode_substituted`), since a rank's batch size is fixed by then.

Known pixel differences to the CPU path (the geometry is identical): the CPU path decodes large crops at
a reduced JPEG DCT scale (data.reduced_decode), the device always at full size (so `decode: device`
matches the CPU path with `reduced_decode: false`); PIL's fixed-point (22-bit) weights vs float32 here move
a pixel by one level now and then; nvjpeg's IDCT and chroma upsampling differ from libjpeg-turbo.
"""
from __future__ import annotations

import warnings
from collections import Counter
from dataclasses import dataclass, field
from typing import Literal, Optional

import numpy as np
import torch

from .image_decode import (DEFAULT_MAX_IMAGE_BYTES, BadImage, decode_crop, decoded_bytes, open_image,
                           random_resized_crop_box)

Decode = Literal["cpu", "device"]
FALLBACK = "decode_cpu_fallback"        # worker: decoded on the CPU path (not device-decodable, or too large there)
DEVICE_FAILED = "decode_device_failed"  # main process: the device decoder failed, PIL decoded it
SUBSTITUTED = "decode_substituted"      # main process: undecodable; another sample of the batch doubled
DECODE_COUNTERS = (FALLBACK, DEVICE_FAILED, SUBSTITUTED)
# The most decoded bytes one batched device decode holds at once (full-size images wait there for their crops): a
# rank's batch of DataComp images (at most 512 px a side: 0.75 MiB each) is one call; a batch of large images is
# split, so it never holds batch x max_image_bytes
DEVICE_DECODE_BYTES = 4 * DEFAULT_MAX_IMAGE_BYTES


@dataclass
class ShippedImage:
    """One sample's image as a worker ships it: JPEG bytes + crop box, or pixels it decoded itself."""
    box: tuple
    jpeg: Optional[bytes] = None
    pixels: Optional[np.ndarray] = None   # (S, S, 3) uint8
    nbytes: int = 0                       # what the JPEG decodes to at full size (from its header)


def device_decodable(img, data: bytes) -> bool:
    """A JPEG that torchvision's decoders take on every device: RGB or gray, ending with its EOI marker
    (a truncated file would fail the whole batched decode on the device)."""
    return img.format == "JPEG" and img.mode in ("RGB", "L") and data.rstrip(b"\x00")[-2:] == b"\xff\xd9"


def ship_sample(data: bytes, size: int, rng, scale, ratio, max_pixels: int, reduced_decode: bool,
                counts, interpolation: str = "bicubic", max_bytes: int = DEFAULT_MAX_IMAGE_BYTES) -> ShippedImage:
    """Draw the crop box as decode_train does; ship the bytes, or decode here when the device cannot."""
    img = open_image(data, max_pixels)   # raises BadImage, counted by the caller as on the CPU path
    box = random_resized_crop_box(*img.size, rng, scale, ratio)
    # the device decodes at full size: an image above max_bytes there is decoded here instead, where a large JPEG
    # decodes at a reduced DCT scale, and is skipped as a decompression bomb only if it is still too large
    nbytes = decoded_bytes(img)
    if device_decodable(img, data) and nbytes <= max_bytes:
        return ShippedImage(box, jpeg=data, nbytes=nbytes)
    pixels = decode_crop(data, size, lambda w, h: box, max_pixels, reduced_decode, interpolation, max_bytes)
    counts[FALLBACK] += 1
    return ShippedImage(box, pixels=pixels)


@dataclass
class DeviceJpegBatch:
    """A worker's batch before decoding: all JPEG files in one uint8 buffer (one shared-memory block through
    the DataLoader queue, not one per image), their crop boxes, and the pixels of worker-decoded samples."""
    size: int
    mean: tuple
    std: tuple
    reduced_decode: bool
    buffer: torch.Tensor                       # concatenated JPEG files
    spans: list                                # per sample: (start, end) in buffer, or None
    boxes: list
    pixels: dict = field(default_factory=dict)  # sample index -> (S, S, 3) uint8
    interpolation: str = "bicubic"              # data.crop_interpolation
    nbytes: list = field(default_factory=list)  # per sample: its JPEG's full-size decoded bytes (0: pixels)

    @classmethod
    def collate(cls, items: list, size: int, mean, std, reduced_decode: bool,
                interpolation: str = "bicubic") -> "DeviceJpegBatch":
        """Pack a worker's ShippedImages."""
        spans, chunks, pixels, at = [], [], {}, 0
        for i, item in enumerate(items):
            if item.jpeg is None:
                spans.append(None)
                pixels[i] = item.pixels
                continue
            spans.append((at, at + len(item.jpeg)))
            chunks.append(item.jpeg)
            at += len(item.jpeg)
        buffer = torch.frombuffer(bytearray(b"".join(chunks)), dtype=torch.uint8) if at else \
            torch.empty(0, dtype=torch.uint8)
        return cls(size, tuple(mean), tuple(std), reduced_decode, buffer, spans, [it.box for it in items], pixels,
                   interpolation, [it.nbytes for it in items])

    @classmethod
    def join(cls, parts: list["DeviceJpegBatch"]) -> "DeviceJpegBatch":
        """One batch of several workers' parts, in order (one device decode for all of them)."""
        if len(parts) == 1:
            return parts[0]
        spans, boxes, nbytes, pixels, at, base = [], [], [], {}, 0, 0
        for part in parts:
            spans += [None if s is None else (s[0] + at, s[1] + at) for s in part.spans]
            boxes += part.boxes
            nbytes += part.nbytes
            pixels.update({base + i: px for i, px in part.pixels.items()})
            at += part.buffer.numel()
            base += len(part)
        first = parts[0]
        return cls(first.size, first.mean, first.std, first.reduced_decode, torch.cat([p.buffer for p in parts]),
                   spans, boxes, pixels, first.interpolation, nbytes)

    def __len__(self) -> int:
        return len(self.spans)

    def to_images(self, device, tokens: torch.Tensor, counts: Counter) -> tuple[torch.Tensor, torch.Tensor]:
        """Decode, crop, resize and normalise on `device`: (images float32 (B,3,S,S), tokens)."""
        dev = torch.device(device)
        out = torch.empty(len(self), 3, self.size, self.size, dtype=torch.float32, device=dev)
        jpeg_idx = [i for i, s in enumerate(self.spans) if s is not None]
        bad = []
        for group in decode_groups(jpeg_idx, self.nbytes, DEVICE_DECODE_BYTES):
            decoded = _decode_jpegs([self.buffer[slice(*self.spans[i])] for i in group], dev)
            for i, img in zip(group, decoded):
                if img is None:
                    counts[DEVICE_FAILED] += 1
                    if not self._pil_fallback(i, out):
                        bad.append(i)
                    continue
                out[i] = crop_resize(img, self.boxes[i], self.size, self.interpolation)
            del decoded, img   # freed before the next group is decoded, not after
        for i, px in self.pixels.items():
            out[i] = torch.from_numpy(np.ascontiguousarray(px)).to(dev).permute(2, 0, 1).float()
        if bad:
            tokens = _substitute(out, tokens, bad, counts)
        return normalise_(out, self.mean, self.std), tokens

    def _pil_fallback(self, i: int, out: torch.Tensor) -> bool:
        """Decode sample i with PIL as the CPU path does; False when PIL cannot either."""
        data = self.buffer[slice(*self.spans[i])].numpy().tobytes()
        box = self.boxes[i]
        try:
            px = decode_crop(data, self.size, lambda w, h: box, reduced_decode=self.reduced_decode,
                             interpolation=self.interpolation)
        except BadImage:
            return False
        out[i] = torch.from_numpy(px).to(out.device).permute(2, 0, 1).float()
        return True


def decode_groups(indices: list, nbytes: list, budget: int) -> list:
    """`indices` in order, in runs whose decoded bytes add up to at most `budget` (an image above it alone)."""
    groups, total = [], budget + 1
    for i in indices:
        size = nbytes[i] if i < len(nbytes) else 0
        if total + size > budget:
            groups.append([])
            total = 0
        groups[-1].append(i)
        total += size
    return groups


def _decode_jpegs(tensors: list, device: torch.device) -> list:
    """Batched decode_jpeg (RGB); on an error, image by image, None for those that fail."""
    from torchvision.io import ImageReadMode, decode_jpeg

    if not tensors:
        return []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torchvision 0.29 flags its image codecs as deprecated (-> TorchCodec)
        try:
            return decode_jpeg(tensors, mode=ImageReadMode.RGB, device=device)
        except RuntimeError:
            pass
        decoded = []
        for t in tensors:
            try:
                decoded.append(decode_jpeg(t, mode=ImageReadMode.RGB, device=device))
            except RuntimeError:
                decoded.append(None)
        return decoded


def _bicubic(x: np.ndarray) -> np.ndarray:
    """PIL's bicubic kernel (a = -0.5)."""
    a, x = -0.5, np.abs(x)
    return np.where(x < 1, ((a + 2) * x - (a + 3)) * x * x + 1,
                    np.where(x < 2, (((x - 5) * x + 8) * x - 4) * a, 0.0))


def _bilinear(x: np.ndarray) -> np.ndarray:
    """PIL's bilinear (triangle) kernel."""
    return np.maximum(1.0 - np.abs(x), 0.0)


# filter and its support in input pixels at scale 1, as PIL's Resample.c defines them
FILTERS = {"bicubic": (_bicubic, 2.0), "bilinear": (_bilinear, 1.0)}


def resample_weights(in0: float, in1: float, in_size: int, out_size: int,
                     interpolation: str = "bicubic") -> tuple[int, np.ndarray]:
    """PIL's resampling matrix for the span [in0, in1) of an axis of in_size pixels -> out_size pixels
    (Resample.c precompute_coeffs: support widened by the downscale factor, clipped to the image, not
    to the box; rows normalised): (first input pixel used, (out_size, n) float64)."""
    kernel, base_support = FILTERS[interpolation]
    scale = (in1 - in0) / out_size
    filterscale = max(scale, 1.0)
    support = base_support * filterscale
    centers = in0 + (np.arange(out_size) + 0.5) * scale
    lo = np.clip(np.trunc(centers - support + 0.5), 0, in_size).astype(int)
    hi = np.clip(np.trunc(centers + support + 0.5), 0, in_size).astype(int)
    first, last = int(lo.min()), int(hi.max())
    x = np.arange(first, last)[None, :]
    w = kernel((x - centers[:, None] + 0.5) / filterscale) * ((x >= lo[:, None]) & (x < hi[:, None]))
    total = w.sum(1, keepdims=True)
    return first, w / np.where(total == 0, 1.0, total)


def crop_resize(img: torch.Tensor, box: tuple, size: int, interpolation: str = "bicubic") -> torch.Tensor:
    """(3, H, W) uint8 -> the box resized to (3, size, size) float 0..255, as PIL's uint8 resize (bicubic or
    bilinear) with a box computes it: a horizontal pass rounded to uint8, then a vertical pass rounded to uint8."""
    _, height, width = img.shape
    x0, wx = resample_weights(box[0], box[2], width, size, interpolation)
    y0, wy = resample_weights(box[1], box[3], height, size, interpolation)
    region = img[:, y0:y0 + wy.shape[1], x0:x0 + wx.shape[1]].to(torch.float32)
    wx_t = torch.from_numpy(wx.T.astype(np.float32)).to(img.device)
    wy_t = torch.from_numpy(wy.astype(np.float32)).to(img.device)
    with _full_fp32_matmul():
        rows = torch.floor(region @ wx_t + 0.5).clamp_(0, 255)
        return torch.floor(wy_t @ rows + 0.5).clamp_(0, 255)


class _full_fp32_matmul:
    """TF32 off for the resampling matmuls (its 10-bit mantissa would move pixels by a level)."""

    def __enter__(self):
        self.saved = torch.backends.cuda.matmul.allow_tf32
        torch.backends.cuda.matmul.allow_tf32 = False

    def __exit__(self, *exc):
        torch.backends.cuda.matmul.allow_tf32 = self.saved
        return False


def normalise_(x: torch.Tensor, mean, std) -> torch.Tensor:
    """In place: 0..255 -> (x / 255 - mean) / std, as image_decode.normalize_batch computes it."""
    std_t = torch.tensor(std, dtype=torch.float32)
    scale = (1.0 / (255.0 * std_t)).view(1, 3, 1, 1).to(x.device)
    shift = (-torch.tensor(mean, dtype=torch.float32) / std_t).view(1, 3, 1, 1).to(x.device)
    return x.mul_(scale).add_(shift)


def _substitute(out: torch.Tensor, tokens: torch.Tensor, bad: list, counts: Counter) -> torch.Tensor:
    """Replace undecodable samples by the first good one (image and caption), counted."""
    good = next((i for i in range(len(out)) if i not in set(bad)), None)
    if good is None:
        raise BadImage("undecodable_image", f"no image of a {len(out)}-sample batch could be decoded")
    tokens = tokens.clone()
    for i in bad:
        out[i], tokens[i] = out[good], tokens[good]
        counts[SUBSTITUTED] += 1
    return tokens
