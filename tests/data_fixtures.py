"""Shard fixtures for the data tests: small real-image shard sets and hand-made corrupt tars."""
from __future__ import annotations

import io
import tarfile
from pathlib import Path

from PIL import Image

from crate_clip.data.shard_writer import encode_jpeg, write_shards
from crate_clip.data.sources.fashion_mnist import load_fashion_mnist


def numbered_samples(n: int, source_dir, upscale: int | None = None):
    """n Fashion-MNIST test images with unique captions 'photo number <i> of a <class>'."""
    from crate_clip.data.sources.fashion_mnist import CLASSNAMES

    images, labels = load_fashion_mnist("test", source_dir)
    for i in range(n):
        img = Image.fromarray(images[i], mode="L")
        if upscale:
            img = img.resize((upscale, upscale), Image.BICUBIC)
        yield {"image": img, "caption": f"photo number {i} of a {CLASSNAMES[int(labels[i])]}", "uid": f"t/{i}"}


def write_numbered_shards(out_dir: Path, n: int, per_shard: int, source_dir, upscale=None) -> dict:
    """Shards of numbered samples (captions identify samples)."""
    return write_shards(numbered_samples(n, source_dir, upscale), out_dir, per_shard, max_side=None, progress=False)


def jpeg_bytes(size=(40, 30), mode="RGB", color=(200, 30, 30)) -> bytes:
    """A small real JPEG."""
    img = Image.new(mode, size, color if mode == "RGB" else 128)
    return encode_jpeg(img, max_side=None)[0]


def add_member(tar: tarfile.TarFile, name: str, data: bytes) -> None:
    """Append one member to an open tar."""
    info = tarfile.TarInfo(name)
    info.size = len(data)
    tar.addfile(info, io.BytesIO(data))


def write_tar(path: Path, members: list[tuple[str, bytes]]) -> Path:
    """A tar with the given (name, bytes) members in order."""
    with tarfile.open(path, "w", format=tarfile.USTAR_FORMAT) as tar:
        for name, data in members:
            add_member(tar, name, data)
    return path
