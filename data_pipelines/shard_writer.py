"""Write image-caption samples as DataComp-layout webdataset shards (what img2dataset produces).

Layout: `{shard:08d}.tar` holding `<key>.jpg`, `<key>.txt`, `<key>.json` per sample, with 12-digit keys
`shard * 10**4 + index`, and `{shard:08d}_stats.json` beside each tar (plus `{shard:08d}.parquet` when
pyarrow is installed and asked for). Each shard is written under a temporary name and renamed, so a
killed run never leaves a half-written tar under a final name; a shard whose stats already record the
same samples (fingerprint of uids and captions) is not rewritten, so re-running is idempotent.
"""
from __future__ import annotations

import hashlib
import io
import itertools
import json
import os
import time
from pathlib import Path
from typing import Callable, Iterable, Iterator

from PIL import Image

from crate_clip.checkpoint_io.atomic_files import atomic_write, atomic_write_text
from webdataset import TarWriter

from .image_decode import to_rgb

DEFAULT_MAX_SIDE = 512  # DataComp images are resized to at most 512 px on the longer side
INDEX_DIGITS = 4


def _index_digits(samples_per_shard: int) -> int:
    """Digits of the in-shard index: 4 for DataComp's 10,000 per shard, more for bigger shards."""
    return max(INDEX_DIGITS, len(str(samples_per_shard - 1)))


def sample_key(shard: int, index: int, samples_per_shard: int = 10_000) -> str:
    """img2dataset key: shard id (8 digits) followed by the in-shard index (4 digits by default)."""
    return f"{shard:08d}{index:0{_index_digits(samples_per_shard)}d}"


def _load_image(image) -> tuple[Image.Image, bytes | None]:
    """A PIL image (and the original encoded bytes, if given) from a PIL image, bytes, path or callable."""
    if callable(image) and not isinstance(image, Image.Image):
        image = image()
    if isinstance(image, Image.Image):
        return image, None
    if isinstance(image, (str, os.PathLike)):
        data = Path(image).read_bytes()
    else:
        data = bytes(image)
    img = Image.open(io.BytesIO(data))
    img.load()
    return img, data


def encode_jpeg(img: Image.Image, max_side: int | None = DEFAULT_MAX_SIDE, min_side: int | None = None,
                quality: int = 95) -> tuple[bytes, int, int]:
    """RGB/L JPEG bytes of an image, the longer side shrunk to max_side (or grown to min_side) if needed."""
    img = img if img.mode == "L" else to_rgb(img)
    w, h = img.size
    scale = 1.0
    if max_side and max(w, h) > max_side:
        scale = max_side / max(w, h)
    elif min_side and min(w, h) < min_side:
        scale = min_side / min(w, h)
    if scale != 1.0:
        img = img.resize((max(1, round(w * scale)), max(1, round(h * scale))), Image.BICUBIC)
    buf = io.BytesIO()
    img.save(buf, format="JPEG", quality=quality)
    return buf.getvalue(), img.size[0], img.size[1]


def _fingerprint(chunk: list[dict]) -> str:
    """Hash of a shard's sample ids and captions: equal fingerprints mean the shard is already written."""
    h = hashlib.sha256()
    for s in chunk:
        h.update(str(s.get("uid", "")).encode())
        h.update(b"\0")
        h.update(str(s.get("caption", "")).encode())
        h.update(b"\1")
    return h.hexdigest()


def _shard_done(out_dir: Path, shard: int, fingerprint: str, settings: dict) -> bool:
    """Whether shard `shard` exists with the same samples and encoding settings."""
    tar, stats = out_dir / f"{shard:08d}.tar", out_dir / f"{shard:08d}_stats.json"
    if not (tar.is_file() and stats.is_file()):
        return False
    try:
        old = json.loads(stats.read_text())
    except json.JSONDecodeError:
        return False
    return old.get("fingerprint") == fingerprint and old.get("settings") == settings


def _write_one_shard(out_dir: Path, shard: int, chunk: list[dict], samples_per_shard: int, settings: dict,
                     write_parquet: bool, on_sample: Callable[[], None] | None) -> dict:
    """Encode and write one shard atomically; returns its stats."""
    start = time.time()
    tmp = out_dir / f".{shard:08d}.tar.tmp{os.getpid()}"
    try:
        rows, failed = _encode_into(tmp, shard, chunk, samples_per_shard, settings, on_sample, start)
    except BaseException:
        tmp.unlink(missing_ok=True)  # killed mid-shard: no partial file under any name
        raise
    successes = len(chunk) - failed
    stats = {"count": len(chunk), "successes": successes, "failed_to_download": 0, "failed_to_resize": failed,
             "duration": round(time.time() - start, 3), "start_time": start, "end_time": time.time(),
             "status_dict": {"success": successes, **({"failed_to_resize": failed} if failed else {})},
             "fingerprint": _fingerprint(chunk), "settings": settings}
    if write_parquet:
        _write_parquet(out_dir / f"{shard:08d}.parquet", rows)
    os.replace(tmp, out_dir / f"{shard:08d}.tar")
    atomic_write_text(out_dir / f"{shard:08d}_stats.json", json.dumps(stats, indent=1))
    return stats


def _encode_into(tmp: Path, shard: int, chunk: list[dict], samples_per_shard: int, settings: dict,
                 on_sample: Callable[[], None] | None, start: float) -> tuple[list[dict], int]:
    """Encode a shard's samples into the tar at `tmp`; returns (metadata rows, failed count)."""
    rows, failed = [], 0
    # Integer mtime: a float one makes tarfile add a PAX header to every member (slower to read).
    with open(tmp, "wb") as f, TarWriter(f, mtime=int(start)) as sink:
        for index, sample in enumerate(chunk):
            key = sample_key(shard, index, samples_per_shard)
            try:
                img, original = _load_image(sample["image"])
                ow, oh = img.size
                jpg, w, h = encode_jpeg(img, settings["max_side"], settings["min_side"], settings["quality"])
            except Exception as exn:  # an unreadable source image is a failed sample, as in img2dataset
                failed += 1
                if on_sample:
                    on_sample()
                rows.append({"key": key, "uid": sample.get("uid"), "status": "failed_to_resize",
                             "error_message": str(exn)[:200]})
                continue
            meta = {"uid": str(sample.get("uid", key)), "url": str(sample.get("url", "")), "key": key,
                    "caption": sample["caption"], "status": "success", "error_message": None,
                    "width": w, "height": h, "original_width": ow, "original_height": oh,
                    "sha256": hashlib.sha256(original if original is not None else jpg).hexdigest()}
            meta.update(sample.get("extra", {}))
            sink.write({"__key__": key, "jpg": jpg, "txt": sample["caption"], "json": meta})
            rows.append(meta)
            if on_sample:
                on_sample()
    return rows, failed


def _write_parquet(path: Path, rows: list[dict]) -> None:
    """img2dataset's per-shard metadata table (needs pyarrow)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    cols = sorted({k for r in rows for k in r})
    table = pa.table({c: [None if r.get(c) is None else str(r.get(c)) if not isinstance(r.get(c), (int, float))
                          else r.get(c) for r in rows] for c in cols})
    atomic_write(path, lambda tmp: pq.write_table(table, tmp))


def _chunks(samples: Iterable[dict], size: int) -> Iterator[list[dict]]:
    """Consecutive lists of `size` samples (the last one may be shorter)."""
    it = iter(samples)
    while chunk := list(itertools.islice(it, size)):
        yield chunk


def _default_workers() -> int:
    """Encoding processes when none is asked for: the CPUs, at most 4 (JPEG encoding is per-core work)."""
    return max(1, min(4, os.cpu_count() or 1))


def _materialised(chunk: list[dict]) -> list[dict]:
    """The chunk with lazy (callable) images loaded, so it can be pickled to an encoding process."""
    return [{**s, "image": s["image"]()} if callable(s["image"]) and not isinstance(s["image"], Image.Image) else s
            for s in chunk]


def write_shards(samples: Iterable[dict], out_dir: str | Path, samples_per_shard: int = 10_000, *,
                 max_side: int | None = DEFAULT_MAX_SIDE, min_side: int | None = None, quality: int = 95,
                 first_shard: int = 0, write_parquet: bool = False, progress: bool = True,
                 total: int | None = None, description: str = "writing shards",
                 num_workers: int | None = None) -> dict:
    """Write samples ({'image', 'caption', 'uid'?, 'url'?, 'extra'?}) as DataComp-layout shards.

    'image' is a PIL image, encoded bytes, a file path, or a callable returning one of those (loaded
    only when the shard is actually written). Shards are encoded by `num_workers` processes (default:
    up to 4). Returns {'out_dir', 'pattern', 'shards', 'samples', 'failed', 'shards_written',
    'shards_skipped'}.
    """
    from concurrent.futures import Future, ProcessPoolExecutor
    from multiprocessing import get_context

    from crate_clip.core.progress_lines import StepProgress

    if samples_per_shard < 1:
        raise ValueError(f"samples_per_shard must be >= 1, got {samples_per_shard}")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    settings = {"max_side": max_side, "min_side": min_side, "quality": quality, "samples_per_shard": samples_per_shard}
    result = {"out_dir": str(out), "shards": [], "samples": 0, "failed": 0, "shards_written": 0, "shards_skipped": 0}
    bar = StepProgress(description, total=total, unit="image", enabled=progress, leave=False)
    workers = _default_workers() if num_workers is None else max(1, num_workers)
    pool = ProcessPoolExecutor(workers, mp_context=get_context("fork")) if workers > 1 else None
    pending: list[tuple] = []  # (shard, written?, stats or Future, samples not yet shown on the bar), in order

    def collect_ready(limit: int) -> None:
        """Account for finished shards in order, waiting while more than `limit` are in flight."""
        while pending and (len(pending) > limit or not isinstance(pending[0][2], Future) or pending[0][2].done()):
            shard, written, stats, shown_later = pending.pop(0)
            stats = stats.result() if isinstance(stats, Future) else stats
            bar.update(shown_later)
            result["shards"].append(str(out / f"{shard:08d}.tar"))
            result["shards_written" if written else "shards_skipped"] += 1
            result["samples"] += stats["successes"]
            result["failed"] += stats["count"] - stats["successes"]

    written = False   # a write cut short by an error: the error is said, not an end line
    try:
        for shard, chunk in enumerate(_chunks(samples, samples_per_shard), start=first_shard):
            for s in chunk:
                if not isinstance(s.get("caption"), str):
                    raise ValueError(f"sample {s.get('uid', '?')!r} for shard {shard:08d} has no str 'caption'")
            if _shard_done(out, shard, _fingerprint(chunk), settings):
                pending.append((shard, False, json.loads((out / f"{shard:08d}_stats.json").read_text()), len(chunk)))
            elif pool is None:
                stats = _write_one_shard(out, shard, chunk, samples_per_shard, settings, write_parquet,
                                         lambda: bar.update(1))
                pending.append((shard, True, stats, 0))
            else:
                future = pool.submit(_write_one_shard, out, shard, _materialised(chunk), samples_per_shard,
                                     settings, write_parquet, None)
                pending.append((shard, True, future, len(chunk)))
            collect_ready(limit=2 * workers)  # bounded: at most ~2 shards per process held in memory
        collect_ready(limit=0)
        written = True
    finally:
        if pool is not None:
            pool.shutdown(wait=True, cancel_futures=True)
        bar.close(done=written)
    n = len(result["shards"])
    result["pattern"] = (str(out / f"{{{first_shard:08d}..{first_shard + n - 1:08d}}}.tar") if n > 1
                         else (result["shards"][0] if n else ""))
    return result
