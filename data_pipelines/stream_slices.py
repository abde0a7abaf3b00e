"""Worker side of the training stream: the samples of canonical streams, decoded and cut into slices.

A canonical stream reads its shard groups (shard_plan.ShardPlan) one after the other: the shards of a
group are interleaved at random, passed through a shuffle buffer drained at the end of the group (bounded in samples
and in bytes: `bounded_shuffle`), and
every random choice for a sample (crop, text mask) is seeded by (seed, stream, epoch, group, index in
group), so a stream's position is (group, offset) and nothing about it depends on which process reads
it. A resume fast-forwards within one group: the skipped samples are read, not decoded.
"""
from __future__ import annotations

import random
from collections import Counter
from dataclasses import dataclass
from typing import Iterator, Optional

import numpy as np
import torch
from torch.utils.data import IterableDataset, get_worker_info

from crate_clip.core.errors import OneLineDataError

from crate_clip.core.read_bounds import MAX_SHUFFLE_BUFFER_BYTES
from crate_clip.core.tar_samples import SampleCaps, held_bytes

from .device_decode import DeviceJpegBatch, ship_sample
from .image_decode import DEFAULT_MAX_IMAGE_BYTES, BadImage, decode_train, normalize_batch
from .remote_retry import RESUME_LATEST, RetryPolicy
from .shard_plan import ShardPlan, interleave
from .shard_reader import iter_shard_samples, sample_caption, sample_image_bytes
from .stream_layout import StreamLayout
from .text_reduction import TextReducer

# A stream that reads this many groups in a row without one usable sample stops with an error
# (every shard unreadable) instead of spinning forever.
MAX_EMPTY_GROUPS = 50


class NoUsableSamples(OneLineDataError):
    """A stream found no usable sample in MAX_EMPTY_GROUPS shard groups in a row (every shard unreadable, empty or
    bad): exit code 2 after the trainer saved the last completed step."""


@dataclass
class SliceSpec:
    """What a worker needs to turn raw samples into slices (the slice size comes from the StreamLayout)."""

    image_size: int
    crop_scale: tuple
    crop_ratio: tuple
    mean: tuple
    std: tuple
    max_image_pixels: int
    reduced_decode: bool
    shuffle_buffer: int
    drop_last: bool
    decode: str = "cpu"    # "device": ship JPEG bytes + crop boxes, decoded on the trainer's device
    crop_interpolation: str = "bicubic"   # the crop's resampling filter (image_decode.CROP_FILTERS)
    retry: RetryPolicy = RetryPolicy()    # how remote shards ride out outages (data.remote_* keys)
    caps: SampleCaps = SampleCaps()       # members / samples above these are skipped unread (data.max_*_bytes)
    max_image_bytes: int = DEFAULT_MAX_IMAGE_BYTES   # decoded size above which an image is not decoded
    shuffle_buffer_bytes: int = MAX_SHUFFLE_BUFFER_BYTES   # member bytes a shuffle buffer holds at most


def fresh_position(skips: Optional[dict] = None) -> dict:
    """A stream at the start of its epoch (skip counts carry over)."""
    return {"group": 0, "offset": 0, "skips": dict(skips or {}), "read": {}, "usable": {}}


def _group_raw(plan: ShardPlan, spec: SliceSpec, stream: int, group: int, shards: list[str],
               skips) -> Iterator[dict]:
    """Raw samples of one group: its shards interleaved at random, then shuffled; bad data counted."""
    tag = f"{plan.rng_seed}-{stream}-{plan.epoch}-{group}"
    iters = [iter_shard_samples(url, skips, spec.caps, retry=spec.retry) for url in shards]
    # seeded by the position: a resume replays the same order from the raw samples alone
    yield from bounded_shuffle(interleave(iters, random.Random(f"mix-{tag}")), spec.shuffle_buffer,
                               spec.shuffle_buffer_bytes, random.Random(f"shuffle-{tag}"))


def bounded_shuffle(samples: Iterator[dict], size: int, max_bytes: int, rng: random.Random,
                    initial: int = 100) -> Iterator[dict]:
    """webdataset's buffer shuffle (`wds.shuffle`: the same draws, so the same order while under the byte bound),
    holding at most `size` samples and `max_bytes` of their members (tar_samples.held_bytes) besides the one being
    added: at the byte bound it yields before it reads on. The bound is on bytes held, so a buffer of
    shuffle_buffer samples near data.max_sample_bytes each is max_bytes, not their product."""
    buf: list[dict] = []
    held = 0

    def pick() -> dict:   # webdataset's pick: a random item out, the last one in its place
        nonlocal held
        k = rng.randint(0, len(buf) - 1)
        sample = buf[k]
        buf[k] = buf[-1]
        buf.pop()
        held -= held_bytes(sample)
        return sample

    initial = min(initial, size)
    for sample in samples:
        buf.append(sample)
        held += held_bytes(sample)
        if len(buf) < size and held <= max_bytes:
            extra = next(samples, None)
            if extra is not None:
                buf.append(extra)
                held += held_bytes(extra)
        if len(buf) >= initial:
            yield pick()
        while buf and held > max_bytes:
            yield pick()
    while buf:
        yield pick()


class _GatedCounter:
    """A view of a Counter that ignores increments while `active` is False."""

    def __init__(self, target: Counter, active: bool = True):
        self.target, self.active = target, active

    def __getitem__(self, key):
        return self.target[key]

    def __setitem__(self, key, value):
        if self.active:
            self.target[key] = value


def decode_sample(raw: dict, spec: SliceSpec, reducer: TextReducer, rng: random.Random, skips: Counter):
    """(image uint8 HWC, tokens) of a raw sample, or None after counting why it was skipped."""
    caption, reason = sample_caption(raw)
    if reason:
        skips[reason] += 1
        return None
    data = sample_image_bytes(raw)
    if data is None:
        skips["missing_image"] += 1
        return None
    try:
        if spec.decode == "device":  # same draws, same order: only the pixels are left to the device
            image = ship_sample(data, spec.image_size, rng, spec.crop_scale, spec.crop_ratio,
                                spec.max_image_pixels, spec.reduced_decode, skips, spec.crop_interpolation,
                                spec.max_image_bytes)
        else:
            image = decode_train(data, spec.image_size, rng, spec.crop_scale, spec.crop_ratio,
                                 spec.max_image_pixels, spec.reduced_decode, spec.crop_interpolation, spec.max_image_bytes)
    except BadImage as exn:
        skips[exn.reason] += 1
        return None
    return image, reducer(caption, rng)


def collate(images: list, tokens: list, spec: SliceSpec):
    """Stack samples into normalised float images (n,3,S,S) (decode: device: a DeviceJpegBatch) and int64
    tokens (n,L)."""
    if spec.decode == "device":
        return (DeviceJpegBatch.collate(images, spec.image_size, spec.mean, spec.std, spec.reduced_decode,
                                        spec.crop_interpolation),
                torch.from_numpy(np.stack(tokens)))
    return normalize_batch(np.stack(images), spec.mean, spec.std), torch.from_numpy(np.stack(tokens))


def stream_slices(plan: ShardPlan, spec: SliceSpec, reducer: TextReducer, stream: int, position: dict,
                  step: int, end_step: Optional[int], slice_size: int) -> Iterator[tuple]:
    """(images, tokens, meta) slices of `slice_size` samples of canonical stream `stream` from `position`,
    numbered from `step`, up to `end_step` (None: until its data ends), then one end report (None, None, meta);
    images and tokens are lists of decoded samples, collated by the caller with the other streams' slices of
    the step.

    meta: stream, the samples' __key__s and the position after the slice. In epoch mode the position
    also holds the usable samples of every shard read in full ("read", the real size the next epoch is
    dealt with) and of the current group so far ("usable", so a resumed stream measures it exactly)."""
    group, offset = position["group"], position["offset"]
    skips, read, usable = Counter(position["skips"]), dict(position["read"]), Counter(position["usable"])
    measure = plan.mode == "epoch"
    images, tokens, keys = [], [], []
    empty_groups = 0

    def meta(**extra) -> dict:
        return {"stream": stream, "position": {"group": group, "offset": offset, "skips": dict(skips),
                                                              "read": dict(read), "usable": dict(usable)}, **extra}

    while end_step is None or step < end_step:
        shards = plan.group_shards(stream, group)
        if shards is None:
            break
        produced, finished = False, True
        # While fast-forwarding, reading-time events (duplicate keys, broken tars) were already counted
        # in the saved skips: the gate opens as the last already-consumed sample comes out.
        gate = _GatedCounter(skips, active=offset == 0)
        for idx, raw in enumerate(_group_raw(plan, spec, stream, group, shards, gate)):
            if idx < offset:
                gate.active = idx == offset - 1
                continue  # fast-forward after a resume: read, do not decode
            offset = idx + 1
            rng = random.Random(f"sample-{plan.rng_seed}-{stream}-{plan.epoch}-{group}-{idx}")
            item = decode_sample(raw, spec, reducer, rng, skips)
            if item is None:
                continue
            produced = True
            if measure:
                usable[raw["__url__"]] += 1
            images.append(item[0])
            tokens.append(item[1])
            keys.append(raw["__key__"])
            if len(images) == slice_size:
                yield images, tokens, meta(keys=keys)
                images, tokens, keys = [], [], []
                step += 1
                if end_step is not None and step >= end_step:
                    finished = False  # decode nothing the trainer will not get
                    break
        if not finished:
            break
        if measure:
            read.update({url: usable[url] for url in shards})
            usable = Counter()
        empty_groups = 0 if produced else empty_groups + 1
        if empty_groups >= MAX_EMPTY_GROUPS:
            raise NoUsableSamples(f"data.sources: canonical stream {stream} read {MAX_EMPTY_GROUPS} shard groups in a "
                                  f"row without one usable sample (last shards: {', '.join(shards)}; skipped so far: "
                                  f"{dict(skips)}); fix: check the sources with `crate-clip shards inspect`, then "
                                  f"{RESUME_LATEST}")
        group, offset = group + 1, 0
    if images and not spec.drop_last:
        yield images, tokens, meta(keys=keys)
        step += 1
    # The final skip counts and shard sizes, also when a partial slice is dropped.
    yield None, None, meta(end=True)


class StreamsDataset(IterableDataset):
    """A rank's canonical streams, each DataLoader worker reading its block of them: per step one item,
    (images, tokens, info), holding the slices of all its streams in stream order, collated once."""

    def __init__(self, plan: ShardPlan, spec: SliceSpec, reducer: TextReducer, layout: StreamLayout,
                 positions: dict[int, dict], step: int, end_step: Optional[int]):
        super().__init__()
        self.plan, self.spec, self.reducer, self.layout = plan, spec, reducer, layout
        self.positions, self.step, self.end_step = positions, step, end_step

    def __iter__(self):
        info = get_worker_info()
        worker = info.id if info is not None else 0
        active = [stream_slices(self.plan, self.spec, self.reducer, c, self.positions[c], self.step, self.end_step,
                                self.layout.slice_size) for c in self.layout.worker_streams(worker)]
        step = self.step
        # info: this worker's slice metas of the step (stream order) and the end reports of streams that
        # ended at it; images None once every stream has ended (the worker's last item).
        while active:
            images, tokens, slices, ended = [], [], [], []
            for it in list(active):
                got_images, got_tokens, meta = next(it)
                if meta.get("end"):
                    ended.append(meta)
                    active.remove(it)
                    continue
                images += got_images
                tokens += got_tokens
                slices.append(meta)
            chunk = collate(images, tokens, self.spec) if images else (None, None)
            yield (*chunk, {"worker": worker, "step": step, "slices": slices, "ended": ended})
            step += 1
