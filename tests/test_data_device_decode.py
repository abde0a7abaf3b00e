"""decode: device: the loader ships JPEG bytes + crop boxes, the trainer's device decodes them (here: CPU).

Same seed -> the same crop boxes and token rows as the CPU path; pixels within the JPEG-decoder tolerance;
images the device cannot decode (PNG, CMYK JPEG) decoded by the worker and counted; exact resume."""
import io
import random

import numpy as np
import pytest
import torch
from PIL import Image

from crate_clip.core.image_normalization import OPENAI_MEAN, OPENAI_STD
from crate_clip.data.device_decode import DEVICE_FAILED, FALLBACK, SUBSTITUTED, DeviceJpegBatch, ShippedImage
from crate_clip.data.train_stream import StreamConfig, build_train_stream

from data_fixtures import write_tar

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")
MEAN, STD = OPENAI_MEAN, OPENAI_STD
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
    from crate_clip.data.sources.fashion_mnist import load_fashion_mnist

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


def _sample_index(tokens):
    """Which 'picture number i' each token row is."""
    from crate_clip.data.text_reduction import TextReducer

    reducer = TextReducer(16, "truncate")
    rows = {tuple(reducer(f"picture number {i}").tolist()): i for i in range(48)}
    return [rows[tuple(r)] for r in tokens.tolist()]


def test_device_decode_gives_the_cpu_crops(shards):
    """Tolerance: on the CPU both paths decode with libjpeg-turbo (identical pixels) and resample with PIL's
    bicubic weights, PIL in 22-bit fixed point, the device in float32: at most 1 level of 255 apart. Against
    the default CPU path (reduced_decode: large crops decoded at a JPEG DCT scale of 1/2..1/8) the crops
    are the same but the low-pass differs: a few levels on average."""
    cpu_full = _batches(_stream(shards, "cpu", reduced_decode=False), 5)
    cpu_reduced = _batches(_stream(shards, "cpu"), 5)
    dev_stream = _stream(shards, "device", reduced_decode=False)
    dev = _batches(dev_stream, 5)
    full, reduced, seen = [], [], []
    for (fi, ft), (ri, rt), (di, dt) in zip(cpu_full, cpu_reduced, dev):
        assert torch.equal(ft, dt) and torch.equal(rt, dt)  # same samples, order and text-mask draws
        full.append((_levels(fi) - _levels(di)).abs())
        reduced.append((_levels(ri) - _levels(di)).abs())
        seen += _sample_index(dt)
    full, reduced = torch.cat(full), torch.cat(reduced)
    assert full.max() <= 1.0 + 1e-3 and full.mean() < 0.05, (full.max(), full.mean())
    assert reduced.mean() < 3.0, reduced.mean()
    # the PNG and the CMYK JPEG of each shard were decoded by the worker, counted
    fallbacks = sum(1 for i in seen if i % 16 in (0, 1))
    assert fallbacks > 0 and dev_stream.decode_counts() == {FALLBACK: fallbacks, DEVICE_FAILED: 0, SUBSTITUTED: 0}


def test_device_decode_resumes_exactly(shards):
    first = _stream(shards, "device")
    a = _batches(first, 3)
    second = _stream(shards, "device")
    second.load_state_dict(_batches_state(shards))
    (images, tokens), = _batches(second, 1)
    assert torch.equal(tokens, a[2][1]) and torch.equal(images, a[2][0])


def _batches_state(shards):
    """The state of a device-decode stream after two batches."""
    stream = _stream(shards, "device")
    _batches(stream, 2)
    return stream.state_dict()


def test_undecodable_bytes_fall_back_then_are_replaced(shards):
    from crate_clip.data.device_decode import ShippedImage
    from collections import Counter

    good = _encoded(Image.new("RGB", (50, 40), (10, 200, 30)), "JPEG", quality=95)
    items = [ShippedImage((0, 0, 50, 40), jpeg=good), ShippedImage((0, 0, 50, 40), jpeg=b"not a jpeg at all")]
    batch = DeviceJpegBatch.collate(items, 16, MEAN, STD, reduced_decode=True)
    counts = Counter()
    tokens = torch.tensor([[1, 2], [3, 4]])
    images, new_tokens = batch.to_images("cpu", tokens, counts)
    assert counts == {DEVICE_FAILED: 1, SUBSTITUTED: 1}
    assert torch.equal(images[1], images[0]) and new_tokens.tolist() == [[1, 2], [1, 2]]
    green = _levels(images)[0].mean((1, 2))
    assert abs(green[1] - 200) < 3 and abs(green[0] - 10) < 3


def test_stage_key_decode_reaches_the_stream(shards):
    from crate_clip.train.stage_setup.engine import DistInfo
    from crate_clip.train.run.run_config import ConfigError, config_from_dict
    from crate_clip.train.loop.stage_loop import default_stream_factory
    from crate_clip.train.stage_setup.stage_model import resolve_stage

    raw = {"data": {"sources": [str(shards)], "num_workers": 0, "shuffle_buffer": 8},
           "model": {"name": "CRATE-alpha-CLIPA-tiny"},
           "stages": [{"name": "s", "image_size": 32, "context_length": 16, "samples": 8, "global_batch": 8,
                       "decode": "gpu"}]}
    with pytest.raises(ConfigError, match=r"stages\.0\.decode"):
        config_from_dict(raw)
    raw["stages"][0]["decode"] = "device"
    cfg = config_from_dict(raw)
    stream = default_stream_factory(cfg, resolve_stage(cfg, 0), DistInfo(0, 1, 0, "cpu"))
    (images, tokens), = _batches(stream, 1)
    assert images.shape == (8, 3, 32, 32) and images.dtype == torch.float32 and tokens.shape == (8, 16)
    assert set(stream.decode_counts()) == {FALLBACK, DEVICE_FAILED, SUBSTITUTED}


def test_slices_of_several_streams_decode_as_one_batch(shards):
    """4 canonical streams in one process: their slices are joined into one device batch; the same batch as
    the 2 ranks of a 2-process job decode separately (per-image decode and resampling: bit-exact)."""
    joined = _batches(_stream(shards, "device", canonical_streams=4), 2)
    cfg = StreamConfig(sources=[str(shards)], shuffle_buffer=8, num_workers=0, mean=MEAN, std=STD,
                       crop_scale=(0.1, 1.0), canonical_streams=4)
    ranks = [_batches(build_train_stream(cfg, image_size=SIZE, context_length=16, text_mask="truncate", batch_size=4,
                                         rank=r, world_size=2, decode="device"), 2) for r in range(2)]
    for step, (images, tokens) in enumerate(joined):
        assert torch.equal(images, torch.cat([ranks[0][step][0], ranks[1][step][0]]))
        assert torch.equal(tokens, torch.cat([ranks[0][step][1], ranks[1][step][1]]))


def test_an_image_too_large_for_the_device_is_decoded_by_the_worker_or_skipped():
    """The device decodes at full size, so the worker holds a JPEG to data.max_image_bytes as the CPU path does:
    above it, the worker decodes the crop (a large JPEG at a reduced DCT scale), counted as a fallback; too large
    even so, the CPU path's decompression-bomb skip."""
    from collections import Counter

    from crate_clip.data.device_decode import ship_sample
    from crate_clip.data.image_decode import BadImage

    data = _encoded(Image.new("RGB", (800, 600), (10, 200, 30)), "JPEG", quality=90)
    full, counts = 800 * 600 * 3, Counter()

    def ship(max_bytes, reduced=True):
        return ship_sample(data, 32, random.Random(0), (1.0, 1.0), (1.0, 1.0), 10 ** 8, reduced, counts,
                           max_bytes=max_bytes)

    at_cap = ship(full)
    assert at_cap.jpeg == data and at_cap.nbytes == full and not counts
    above = ship(full - 1)
    assert above.jpeg is None and above.pixels.shape == (32, 32, 3) and counts == {FALLBACK: 1}
    with pytest.raises(BadImage) as refused:
        ship(full - 1, reduced=False)
    assert refused.value.reason == "decompression_bomb"


def test_a_batch_of_large_images_is_decoded_in_groups_within_the_byte_budget(monkeypatch):
    """One batched device decode holds at most DEVICE_DECODE_BYTES of full-size images (one larger image alone);
    decoded in groups, a batch has the pixels of one call."""
    from collections import Counter

    from crate_clip.data import device_decode
    from crate_clip.data.device_decode import decode_groups, ship_sample

    assert decode_groups([0, 1, 2, 3], [60, 60, 30, 10], 100) == [[0], [1, 2, 3]]
    assert decode_groups([0, 2, 3], [250, 0, 40, 70], 100) == [[0], [2], [3]]
    assert decode_groups([], [], 100) == []
    rng = np.random.default_rng(1)
    shipped = [ship_sample(_encoded(Image.fromarray(rng.integers(0, 255, (90 + 10 * i, 120, 3), np.uint8)), "JPEG"),
                           16, random.Random(i), (0.3, 1.0), (0.75, 1.33), 10 ** 8, True, Counter())
               for i in range(4)]
    assert all(s.jpeg is not None for s in shipped)
    tokens = torch.arange(8).view(4, 2)

    def images():
        return DeviceJpegBatch.collate(shipped, 16, MEAN, STD, reduced_decode=True).to_images("cpu", tokens, Counter())[0]

    one_call = images()
    monkeypatch.setattr(device_decode, "DEVICE_DECODE_BYTES", shipped[0].nbytes)   # one image a call
    assert torch.equal(images(), one_call)
