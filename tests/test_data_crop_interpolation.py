"""data.crop_interpolation: the training crop's resampling filter, bicubic (the default, what every run did
before the key existed) or bilinear (the official CLIPA / CRATE-alpha inception crop, antialiased), on both the
CPU path and decode: device, with the same crops and token rows."""
import io

import numpy as np
import pytest
import torch
from PIL import Image

from crate_clip.core.image_normalization import OPENAI_MEAN, OPENAI_STD
from crate_clip.data.device_decode import crop_resize
from crate_clip.data.train_stream import StreamConfig, build_train_stream

from data_fixtures import write_tar

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")
SIZE = 48


def _pictures(fashion_mnist_dir, n: int) -> list[Image.Image]:
    """Colour pictures from real Fashion-MNIST images (one per channel) at DataComp-like sizes."""
    from crate_clip.data.sources.fashion_mnist import load_fashion_mnist

    images, _ = load_fashion_mnist("test", fashion_mnist_dir)
    rng = np.random.default_rng(1)
    out = []
    for i in range(n):
        rgb = np.stack([images[3 * i + c] for c in range(3)], -1)
        out.append(Image.fromarray(rgb, "RGB").resize((int(rng.integers(150, 380)), int(rng.integers(150, 380))),
                                                     Image.BICUBIC))
    return out


@pytest.fixture(scope="module")
def shards(tmp_path_factory, fashion_mnist_dir):
    out, pictures = tmp_path_factory.mktemp("crop_interpolation"), _pictures(fashion_mnist_dir, 24)
    for s, chunk in enumerate((range(0, 12), range(12, 24))):
        members = []
        for i in chunk:
            buf = io.BytesIO()
            pictures[i].save(buf, format="JPEG", quality=92)
            members += [(f"{i:06d}.jpg", buf.getvalue()), (f"{i:06d}.txt", f"picture number {i}".encode())]
        write_tar(out / f"{s:05d}.tar", members)
    return out


def _batch(src, decode="cpu", **kw):
    cfg = StreamConfig(sources=[str(src)], shuffle_buffer=8, num_workers=0, mean=OPENAI_MEAN, std=OPENAI_STD,
                       crop_scale=(0.1, 1.0), reduced_decode=False, **kw)
    stream = build_train_stream(cfg, image_size=SIZE, context_length=16, text_mask="truncate", batch_size=8,
                                decode=decode, device="cpu")
    images, tokens = next(iter(stream))
    levels = images * torch.tensor(OPENAI_STD).view(1, 3, 1, 1) * 255 + torch.tensor(OPENAI_MEAN).view(1, 3, 1, 1) * 255
    return levels, tokens.clone()


def test_device_resampling_gives_pils_bilinear_and_bicubic(fashion_mnist_dir):
    """crop_resize's matmul weights are PIL's for either filter, when the crop shrinks (support widened:
    antialiased) and when it grows."""
    rng = np.random.default_rng(0)
    for img in _pictures(fashion_mnist_dir, 4):
        w, h = img.size
        tensor = torch.from_numpy(np.asarray(img)).permute(2, 0, 1).contiguous()
        for size in (SIZE, 400):
            x0, y0 = int(rng.integers(0, w // 3)), int(rng.integers(0, h // 3))
            box = (x0, y0, x0 + int(rng.integers(w // 3, w - x0)), y0 + int(rng.integers(h // 3, h - y0)))
            for name, pil in (("bilinear", Image.BILINEAR), ("bicubic", Image.BICUBIC)):
                ours = crop_resize(tensor, box, size, name).permute(1, 2, 0).numpy()
                theirs = np.asarray(img.resize((size, size), pil, box=box, reducing_gap=None), dtype=np.float32)
                diff = np.abs(ours - theirs)
                # a level now and then (float32 here, PIL's 22-bit fixed point; bicubic's overshoot, clamped
                # after each pass, can make it two when the crop grows)
                assert diff.max() <= (1.0 if size == SIZE else 2.0) and diff.mean() < 0.05, (name, size, box)


def test_the_key_reaches_both_decode_paths_and_bicubic_stays_the_default(shards):
    assert StreamConfig.model_fields["crop_interpolation"].default == "bicubic"
    default, default_tokens = _batch(shards)
    bicubic, _ = _batch(shards, crop_interpolation="bicubic")
    bilinear, bilinear_tokens = _batch(shards, crop_interpolation="bilinear")
    device, device_tokens = _batch(shards, "device", crop_interpolation="bilinear")
    assert torch.equal(default, bicubic)                       # runs without the key are unchanged
    assert torch.equal(default_tokens, bilinear_tokens) and torch.equal(device_tokens, bilinear_tokens)
    assert (bilinear - bicubic).abs().mean() > 0.2             # the same crops, another filter
    assert (device - bilinear).abs().max() <= 1.0 + 1e-3       # the device path resamples as the CPU path


def test_an_unknown_filter_is_a_config_error():
    with pytest.raises(ValueError, match="crop_interpolation"):
        StreamConfig(sources=["unused"], crop_interpolation="lanczos")
