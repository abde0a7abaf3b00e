"""decode: device: the loader ships JPEG bytes + crop boxes, the trainer's device decodes them (here: CPU).

Same seed -> the same crop boxes and token rows as the CPU path; pixels within the JPEG-decoder tolerance;
images the device cannot decode (PNG, CMYK JPEG) decoded by the worker and counted; exact resume."""
import io

import numpy as np
import pytest
import torch
from PIL import Image

from data_pipelines.device_decode import DEVICE_FAILED, FALLBACK, SUBSTITUTED, DeviceJpegBatch, ShippedImage
from data_pipelines.train_stream import StreamConfig, build_train_stream

from data_fixtures import write_tar

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")
MEAN, STD = (0.48145466, 0.4578275, 0.40821073), (0.26862954, 0.26130258, 0.27577711)
SIZE = 64


def _photo(images, i: int, rng) -> Image.Image:
    """A colour picture from three real Fashion-MNIST images (one per channel), DataComp-like sizes."""
    rgb = np.stack([images[(3 * i + c) % len(images)] for c in range(3)], -1)
    w, h = int(rng.integers(160, 400)), int(rng.integers(160, 400))
    return Image.fromarray(rgb, "RGB").resize((w, h), Image.BICUBIC)


def _encoded(img: Image.Image, fmt: str, **kw) -> bytes:
    buf = io.BytesIO()
    img.save(buf, format=fmt, **kw)
    return buf.getvalue()


@pytest.fixture(scope="module")
def shards(tmp_path_factory, fashion_mnist_dir):
    """3 shards x 16 samples: colour and gray JPEGs (4:2:0 and 4:4:4), one PNG and one CMYK JPEG per shard."""
    from data_pipelines.sources.fashion_mnist import load_fashion_mnist

    images, _ = load_fashion_mnist("test", fashion_mnist_dir)
    out, rng = tmp_path_factory.mktemp("device_decode"), np.random.default_rng(0)
    for s in range(3):
        members = []
        for j in range(16):
            i = 16 * s + j
            img = _photo(images, i, rng)
            if j == 0:
                name, data = "png", _encoded(img, "PNG")
            elif j == 1:
                name, data = "jpg", _encoded(img.convert("CMYK"), "JPEG", quality=90)
            elif j % 4 == 2:
                name, data = "jpg", _encoded(img.convert("L"), "JPEG", quality=90)
            else:
                name, data = "jpg", _encoded(img, "JPEG", quality=90, subsampling=2 if j % 2 else 0)
            members += [(f"{i:06d}.{name}", data), (f"{i:06d}.txt", f"picture number {i}".encode())]
        write_tar(out / f"{s:05d}.tar", members)
    return out


def _stream(src, decode, **kw):
    cfg = StreamConfig(sources=[str(src)], shuffle_buffer=8, num_workers=0, mean=MEAN, std=STD,
                       **{"crop_scale": (0.1, 1.0), **kw})
    return build_train_stream(cfg, image_size=SIZE, context_length=16, text_mask="truncate", batch_size=8,
                              decode=decode, device="cpu")


def _batches(stream, n):
    out = []
    for images, tokens in stream:
        out.append((images.clone(), tokens.clone()))
        if len(out) == n:
            return out
    return out


def _levels(images):
    """Normalised images back to 0..255 levels."""
    return images * torch.tensor(STD).view(1, 3, 1, 1) * 255 + torch.tensor(MEAN).view(1, 3, 1, 1) * 255


def test_device_decode_gives_the_cpu_crops(shards):
    cpu = _batches(_stream(shards, "cpu", reduced_decode=False), 5)
    dev_stream = _stream(shards, "device", reduced_decode=False)
    dev = _batches(dev_stream, 5)
    diffs = []
    for (ci, ct), (di, dt) in zip(cpu, dev):
        assert torch.equal(ct, dt)   # same samples, same order, same text-mask draws
        diffs.append((_levels(ci) - _levels(di)).abs())
    d = torch.cat(diffs)
    print("max", d.max().item(), "mean", d.mean().item(), "p99", d.flatten().kthvalue(int(0.99 * d.numel())).values.item())
