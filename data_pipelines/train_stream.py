"""The training stream: DataComp-layout shards -> (images, tokens) batches, resumable, bad data counted.

Each DataLoader worker reads its own sequence of *shard groups* (`shards_per_group` shards whose samples
are interleaved at random, then passed through a shuffle buffer that is drained at the end of the group):
- resampled mode: group g's shards are drawn with replacement (by source weight) from a generator seeded
  with (seed, rank, worker, epoch, g), so the stream is endless and any rank or worker always has data;
- epoch mode: the shard list shuffled by (seed, epoch) is split by rank, then by worker; one pass.
Every random choice for a sample (crop, text mask) is seeded by its position (group, index in group),
so a worker's position is two integers. The main process records the position of the last batch the
trainer consumed from each worker; resuming fast-forwards within one group without decoding anything,
and rotates the worker order so that the batch sequence continues exactly where it stopped.
"""
from __future__ import annotations

import logging
import random
from collections import Counter
from dataclasses import dataclass
from pathlib import PurePath
from typing import Iterator, Literal, Optional, get_args

import numpy as np
import torch
import webdataset as wds
from pydantic import Field, field_validator
from torch.utils.data import DataLoader, IterableDataset, get_worker_info

from crate_clip.config_schema import Bool, Float, Int, Section
from crate_clip.models.image_normalization import OPENAI_MEAN, OPENAI_STD

from .device_decode import DECODE_COUNTERS, Decode, DeviceJpegBatch, ship_sample
from .image_decode import DEFAULT_MAX_IMAGE_PIXELS, BadImage, decode_train, normalize_batch
from .epoch_sizes import adopt_real_sizes
from .pos_tagging import PosSource
from .shard_plan import ShardPlan, interleave, resolve_sizes
from .shard_reader import (SKIP_REASONS, ShardListError, check_some_shard_exists, expand_source, iter_shard_samples, sample_caption,
                           sample_image_bytes)
from .text_reduction import TEXT_MASKS, TextReducer, load_tokenizer

log = logging.getLogger(__name__)

Mode = Literal["resampled", "epoch"]
STATE_VERSION = 1
# A worker that reads this many groups in a row without one usable sample stops with an error
# (every shard unreadable) instead of spinning forever.
MAX_EMPTY_GROUPS = 50


class StreamConfig(Section):
    """Where the shards are and how they are read (everything but the stage's image size / text length);
    the run config's `data` section is this schema."""

    sources: list[str] = Field(default_factory=list, validate_default=True,
                               description="shard folders, brace patterns, globs, URLs or 'pipe:' commands")
    weights: Optional[list[Float]] = Field(None, description="one sampling weight per source; default: equal")
    mode: Mode = Field("resampled", description="resampled: shards drawn with replacement, endless; epoch: each "
                                                "shard once per epoch, split over ranks and workers")
    seed: Int = Field(0, description="the stream's seed (in a run config: set per stage from run.seed)")
    shuffle_buffer: Int = Field(1000, ge=0, description="samples held for shuffling (0 = none)")
    num_workers: Int = Field(2, ge=0, description="DataLoader worker processes per rank (0 = in the trainer)")
    num_samples: Optional[Int] = Field(None, ge=1, description="samples per epoch; default: from _stats.json")
    max_image_pixels: Int = Field(DEFAULT_MAX_IMAGE_PIXELS, ge=1, description="larger images are counted "
                                  "as decompression bombs and skipped")
    crop_scale: tuple[Float, Float] = Field((0.4, 1.0), description="random-resized-crop area range [min, max]")
    mean: tuple[Float, Float, Float] = Field(OPENAI_MEAN, description="per-channel image mean (R, G, B); a run "
                                                                      "uses the model config's unless this is set")
    std: tuple[Float, Float, Float] = Field(OPENAI_STD, description="per-channel image std; as mean")
    shards_per_group: Int = Field(2, ge=1, description="shards interleaved per worker; bounds resume "
                                  "fast-forward reading")
    drop_last: Bool = Field(True, description="epoch mode: drop each worker's final partial batch")
    pos_source: PosSource = Field("auto", description="the syntax text mask's part-of-speech source")
    reduced_decode: Bool = Field(True, description="decode a JPEG at the smallest DCT scale (1/2, 1/4, 1/8) "
                                                   "that leaves the crop at least the target size")
    prefetch_factor: Int = Field(2, ge=1, description="batches each worker prepares ahead (x batch memory)")
    crop_ratio: tuple[Float, Float] = Field((3 / 4, 4 / 3), description="random-resized-crop aspect-ratio "
                                                                        "range [min, max]")

    @field_validator("sources", mode="before")
    @classmethod
    def _as_list(cls, value):
        if isinstance(value, (str, PurePath)):
            return [str(value)]
        return [str(s) if isinstance(s, PurePath) else s for s in value] if isinstance(value, (list, tuple)) else value

    def checks(self) -> list[tuple[str, str]]:
        """Problems that involve more than one value, each with its fix."""
        problems = []
        if not self.sources:
            problems.append(("sources", "empty; fix: list shard folders, brace patterns "
                                        "(/data/{00000000..00000099}.tar), globs, URLs or 'pipe:' commands"))
        if self.weights is not None and len(self.weights) != len(self.sources):
            problems.append(("weights", f"{len(self.weights)} weights for {len(self.sources)} sources; "
                                        "fix: one weight per source, or remove the weights"))
        elif self.weights is not None and (any(w < 0 for w in self.weights) or sum(self.weights) <= 0):
            problems.append(("weights", f"{self.weights}; fix: weights >= 0 with a positive sum"))
        return problems + crop_scale_problems("crop_scale", self.crop_scale)


def crop_scale_problems(key: str, scale) -> list[tuple[str, str]]:
    """A random-resized-crop area range (min, max) as config problems under `key`: none when unset or valid."""
    if scale is None or 0 < scale[0] <= scale[1] <= 1:
        return []
    return [(key, f"{list(scale)}; fix: [min, max] with 0 < min <= max <= 1, or remove it")]


# --------------------------------------------------------------------------------------------------------
# Worker side
# --------------------------------------------------------------------------------------------------------
@dataclass
class _BatchSpec:
    """What a worker needs to turn raw samples into batches."""

    batch_size: int
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


class _StreamDataset(IterableDataset):
    """One pass of the per-worker batch streams; worker ids rotated so a resume continues the order."""

    def __init__(self, plan: ShardPlan, spec: _BatchSpec, reducer: TextReducer, positions: list[dict],
                 rotate: int):
        super().__init__()
        self.plan, self.spec, self.reducer = plan, spec, reducer
        self.positions, self.rotate = positions, rotate

    def __iter__(self):
        info = get_worker_info()
        dl_id = info.id if info is not None else 0
        worker = (dl_id + self.rotate) % self.plan.num_workers
        pos = self.positions[worker]
        yield from worker_batches(self.plan, self.spec, self.reducer, worker, pos["group"], pos["offset"],
                                  pos.get("skips", {}), pos.get("read", {}))


def _group_raw(plan: ShardPlan, spec: _BatchSpec, worker: int, group: int, shards: list[str],
               skips: Counter) -> Iterator[dict]:
    """Raw samples of one group: its shards interleaved at random, then shuffled; bad data counted."""
    tag = f"{plan.rng_seed}-{plan.rank}-{worker}-{plan.epoch}-{group}"
    iters = [iter_shard_samples(url, skips) for url in shards]
    # webdataset's buffer shuffle (starts yielding at 100 samples) with a generator seeded by the position:
    # a resume replays the same order from the raw samples alone
    shuffle = wds.shuffle(spec.shuffle_buffer, initial=100, rng=random.Random(f"shuffle-{tag}"))
    yield from shuffle(interleave(iters, random.Random(f"mix-{tag}")))


class _GatedCounter:
    """A view of a Counter that ignores increments while `active` is False."""

    def __init__(self, target: Counter, active: bool = True):
        self.target, self.active = target, active

    def __getitem__(self, key):
        return self.target[key]

    def __setitem__(self, key, value):
        if self.active:
            self.target[key] = value


def _decode_sample(raw: dict, spec: _BatchSpec, reducer: TextReducer, rng: random.Random,
                   skips: Counter):
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
                                spec.max_image_pixels, spec.reduced_decode, skips)
        else:
            image = decode_train(data, spec.image_size, rng, spec.crop_scale, spec.crop_ratio,
                                 spec.max_image_pixels, spec.reduced_decode)
    except BadImage as exn:
        skips[exn.reason] += 1
        return None
    return image, reducer(caption, rng)


def _collate(images: list, tokens: list, spec: _BatchSpec):
    """Stack a worker's samples into normalised float images (B,3,S,S) (decode: device: a DeviceJpegBatch)
    and int64 tokens (B,L)."""
    if spec.decode == "device":
        return (DeviceJpegBatch.collate(images, spec.image_size, spec.mean, spec.std, spec.reduced_decode),
                torch.from_numpy(np.stack(tokens)))
    return normalize_batch(np.stack(images), spec.mean, spec.std), torch.from_numpy(np.stack(tokens))


def worker_batches(plan: ShardPlan, spec: _BatchSpec, reducer: TextReducer, worker: int, group: int,
                   offset: int, skips: dict, read: dict | None = None) -> Iterator[tuple]:
    """(images, tokens, meta) batches of one worker from position (group, offset); meta = new position.

    meta["read"] holds the usable samples of every shard this worker has read in full (from its start),
    the real size that the next epoch's length is computed from."""
    skips, read = Counter(skips), dict(read or {})
    images, tokens = [], []
    empty_groups = 0
    while True:
        shards = plan.group_shards(worker, group)
        if shards is None:
            break
        produced = False
        # While fast-forwarding, reading-time events (duplicate keys, broken tars) were already counted
        # in the saved skips: the gate opens as the last already-consumed sample comes out.
        gate = _GatedCounter(skips, active=offset == 0)
        usable: Counter | None = Counter() if offset == 0 else None  # fast-forwarded groups are not measured
        for idx, raw in enumerate(_group_raw(plan, spec, worker, group, shards, gate)):
            if idx < offset:
                gate.active = idx == offset - 1
                continue  # fast-forward after a resume: read, do not decode
            offset = idx + 1
            rng = random.Random(f"sample-{plan.rng_seed}-{plan.rank}-{worker}-{plan.epoch}-{group}-{idx}")
            item = _decode_sample(raw, spec, reducer, rng, skips)
            if item is None:
                continue
            produced = True
            if usable is not None:
                usable[raw["__url__"]] += 1
            images.append(item[0])
            tokens.append(item[1])
            if len(images) == spec.batch_size:
                meta = {"worker": worker, "group": group, "offset": offset, "skips": dict(skips), "read": read}
                yield (*_collate(images, tokens, spec), meta)
                images, tokens = [], []
        if usable is not None:
            read = {**read, **{url: usable[url] for url in shards}}
        empty_groups = 0 if produced else empty_groups + 1
        if empty_groups >= MAX_EMPTY_GROUPS:
            raise RuntimeError(f"worker {worker} of rank {plan.rank} read {MAX_EMPTY_GROUPS} shard groups in a "
                               f"row without one usable sample (last shards: {shards}); skipped so far: "
                               f"{dict(skips)}")
        group, offset = group + 1, 0
    meta = {"worker": worker, "group": group, "offset": 0, "skips": dict(skips), "read": read}
    if images and not spec.drop_last:
        yield (*_collate(images, tokens, spec), meta)
    else:
        # Report the final skip counts and shard sizes even when the partial batch is dropped.
        yield (None, None, meta)


# --------------------------------------------------------------------------------------------------------
# Main-process side
# --------------------------------------------------------------------------------------------------------
class TrainStream:
    """Iterable of (images float32 (B,3,S,S), tokens int64 (B,L)); resumable; counts skipped samples."""

    def __init__(self, cfg: StreamConfig, plan: ShardPlan, spec: _BatchSpec, reducer: TextReducer,
                 num_samples: int, context_length: int, text_mask: str, device: str = "cpu"):
        self.cfg, self.plan, self.spec, self.reducer = cfg, plan, spec, reducer
        self.device = device  # where decode: device batches are decoded
        self._decode_main: Counter = Counter()  # device-decode fallbacks counted in this process
        self._num_samples = num_samples
        self.context_length, self.text_mask = context_length, text_mask
        self.batch_size = spec.batch_size
        self.num_workers = plan.num_workers
        self._positions = self._fresh_positions()
        self._batches = 0  # batches consumed in the current epoch (resampled: since the start)
        self._done_skips: Counter = Counter()  # skip counts of finished epochs
        self._measured: dict[str, int] = {}    # shard -> usable samples, where that differs from its stats
        self._pos_probe: str | None = None

    @property
    def num_samples(self) -> int:
        """Samples in the data set: the configured num_samples, else the shards' sizes (read on first use)."""
        if self._num_samples is None:
            self._num_samples = sum((self.plan.sizes or _data_set_sizes(self.plan.all_shards)).values())
        return self._num_samples

    @property
    def pos_source(self) -> str:
        """Active part-of-speech source of the syntax mask: 'nltk' | 'wordnet' | 'builtin' (or 'none')."""
        if self.reducer.pos_tagger is not None:
            return self.reducer.pos_source
        if self._pos_probe is None:
            self._pos_probe = _probe_pos_source(self.cfg)
        return self._pos_probe

    @property
    def epoch(self) -> int:
        """Current epoch (resampled mode: the seed component set at build time)."""
        return self.plan.epoch

    @property
    def batches_per_epoch(self) -> int | None:
        """Epoch mode: batches this rank yields per pass (all ranks equal when world_size > 1)."""
        if self.plan.mode != "epoch":
            return None
        counts = [self.plan.expected_batches(self.batch_size, self.spec.drop_last, r)
                  for r in range(self.plan.world_size)]
        return min(counts) if self.plan.world_size > 1 else counts[self.plan.rank]

    def _fresh_positions(self) -> list[dict]:
        """Every worker at the start of its stream."""
        return [{"group": 0, "offset": 0, "skips": {}} for _ in range(self.plan.num_workers)]

    def _loader(self) -> DataLoader:
        """A DataLoader over the workers' streams, starting each worker at its recorded position."""
        rotate = self._batches % self.plan.num_workers
        dataset = _StreamDataset(self.plan, self.spec, self.reducer, [dict(p) for p in self._positions], rotate)
        kwargs = {}
        if self.cfg.num_workers > 0:
            kwargs = {"prefetch_factor": self.cfg.prefetch_factor, "persistent_workers": False}
        # The stream seeds its own randomness; a private generator keeps DataLoader from drawing its base
        # seed from torch's global RNG, which would shift the trainer's (image masks) on every new iterator
        # and make a resumed run diverge from an uninterrupted one.
        generator = torch.Generator().manual_seed(self.cfg.seed)
        # pinned host batches: the trainer's non_blocking copies to the GPU then overlap with compute
        return DataLoader(dataset, batch_size=None, num_workers=self.cfg.num_workers, generator=generator,
                          pin_memory=torch.cuda.is_available(), **kwargs)

    def __iter__(self):
        """Endless batches in resampled mode; the rest of the current epoch in epoch mode."""
        cap = self.batches_per_epoch if (self.plan.mode == "epoch" and self.plan.world_size > 1) else None
        if cap is not None and self._batches >= cap:
            self._next_epoch()
            cap = self.batches_per_epoch
        for images, tokens, meta in self._loader():
            self._positions[meta["worker"]] = {k: meta[k] for k in ("group", "offset", "skips", "read")}
            if images is None:
                continue  # a worker's final skip report
            self._batches += 1
            if isinstance(images, DeviceJpegBatch):
                images, tokens = images.to_images(self.device, tokens, self._decode_main)
            yield images, tokens
            if cap is not None and self._batches >= cap:
                break  # every rank stops after the same number of batches: no rank waits on another
        if self.plan.mode == "epoch":
            self._next_epoch()

    def _next_epoch(self) -> None:
        """Move an epoch-mode stream to the start of the next epoch, whose length uses the real shard sizes."""
        self._done_skips.update(self._current_skips())
        self._measured.update(adopt_real_sizes(self.plan, [p.get("read", {}) for p in self._positions]))
        self.plan.epoch += 1
        self._positions = self._fresh_positions()
        self._batches = 0

    def _current_skips(self) -> Counter:
        """Skip counts of the current epoch, summed over workers."""
        total: Counter = Counter()
        for p in self._positions:
            total.update(p.get("skips", {}))
        return total

    def skip_counts(self) -> dict[str, int]:
        """Bad samples skipped so far, by reason (summed over DataLoader workers and finished epochs)."""
        total = self._current_skips() + self._done_skips
        return {reason: int(total.get(reason, 0)) for reason in SKIP_REASONS}

    def decode_counts(self) -> dict[str, int]:
        """decode: device: samples the CPU decoded instead (worker fallbacks, device failures) or replaced."""
        total = self._current_skips() + self._done_skips + self._decode_main
        return {key: int(total.get(key, 0)) for key in DECODE_COUNTERS}

    def state_dict(self) -> dict:
        """JSON-serialisable position of the stream (what the trainer has consumed so far)."""
        return {"version": STATE_VERSION, "mode": self.plan.mode, "seed": self.plan.seed, "epoch": self.plan.epoch,
                "rank": self.plan.rank, "world_size": self.plan.world_size, "num_workers": self.plan.num_workers,
                "batch_size": self.batch_size, "batches": self._batches, "generation": self.plan.generation,
                "samples": self._batches * self.batch_size,
                "workers": [{"group": p["group"], "offset": p["offset"], "skips": dict(p.get("skips", {})),
                             "read": dict(p.get("read", {}))} for p in self._positions],
                "done_skips": dict(self._done_skips), "measured_sizes": dict(self._measured),
                "decode_main": dict(self._decode_main)}

    def load_state_dict(self, state: dict) -> None:
        """Continue from a saved position; exact when mode, seed, world size and worker count match."""
        for key in ("mode", "seed", "rank", "world_size"):
            if key in state and state[key] != getattr(self.plan, key):
                raise ValueError(f"stream state has {key}={state[key]!r} but this stream has "
                                 f"{key}={getattr(self.plan, key)!r}; resume with the same data settings")
        self.plan.epoch = int(state.get("epoch", self.plan.epoch))
        self.plan.generation = int(state.get("generation", 0))
        self._done_skips = Counter(state.get("done_skips", {}))
        self._decode_main = Counter(state.get("decode_main", {}))
        self._measured = {k: int(v) for k, v in state.get("measured_sizes", {}).items()}
        self.plan.sizes.update(self._measured)
        workers = state.get("workers", [])
        if len(workers) != self.plan.num_workers or state.get("batch_size", self.batch_size) != self.batch_size:
            # Positions belong to other worker streams: they cannot be mapped. Keep the skip counts and
            # start this epoch's streams over (resampled: fresh draws; epoch: the epoch is repeated).
            log.warning("stream state was saved with %s workers / batch %s, now %s / %s: resume is not exact "
                        "(resampled mode restarts its draws; epoch mode restarts epoch %d)",
                        len(workers), state.get("batch_size"), self.plan.num_workers, self.batch_size,
                        self.plan.epoch)
            for w in workers:
                self._done_skips.update(w.get("skips", {}))
            self._positions = self._fresh_positions()
            self._batches = 0
            if self.plan.mode == "resampled":
                self.plan.generation += 1
            return
        self._positions = [{"group": int(w["group"]), "offset": int(w["offset"]), "skips": dict(w.get("skips", {})),
                            "read": dict(w.get("read", {}))} for w in workers]
        self._batches = int(state.get("batches", 0))


def _probe_pos_source(cfg: StreamConfig) -> str:
    """The POS source the syntax mask would use (reported even when this stage uses another mask)."""
    from .pos_tagging import select_pos_tagger

    return select_pos_tagger(cfg.pos_source).source


def build_train_stream(cfg: StreamConfig, *, image_size: int, context_length: int, text_mask: str,
                       batch_size: int, rank: int = 0, world_size: int = 1, tokenizer_name: str = "clip-bpe",
                       epoch: int = 0, bert_vocab: str | None = None, decode: Decode = "cpu",
                       device: str = "cpu") -> TrainStream:
    """The training stream of one rank for one stage (image size, text length and mask); `bert_vocab`: a
    folder with vocab.txt for a BERT-tokenized model when the HuggingFace hub is not reachable; `decode`:
    'device' decodes the JPEGs on `device` in the trainer's process (data_pipelines/device_decode.py)."""
    if decode not in get_args(Decode):   # the one list of decode paths: device_decode.Decode
        raise ValueError(f"decode={decode!r}: use one of {get_args(Decode)}")
    if text_mask not in TEXT_MASKS:
        raise ValueError(f"text_mask={text_mask!r} is not one of {TEXT_MASKS}")
    if batch_size < 1 or image_size < 1:
        raise ValueError(f"batch_size ({batch_size}) and image_size ({image_size}) must be >= 1")
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is outside world_size {world_size}")
    shards_by_source = []
    for src in cfg.sources:
        try:
            shards_by_source.append(expand_source(src))
        except ShardListError as exn:
            raise ShardListError(f"StreamConfig.sources: {exn}") from None
    all_shards = [s for shards in shards_by_source for s in shards]
    check_some_shard_exists(cfg.sources, all_shards)
    num_workers = max(1, cfg.num_workers)
    if cfg.mode == "epoch" and len(all_shards) < world_size:
        raise ValueError(f"epoch mode needs at least one shard per rank: {len(all_shards)} shards for "
                         f"world_size={world_size}; use mode='resampled' or write more, smaller shards")
    # Resampled mode draws shards without needing their sizes: the ~140k _stats.json of DataComp are read
    # only when someone asks for num_samples (shards inspect), never at a trainer's stage start.
    sizes, num_samples = {}, cfg.num_samples
    if cfg.mode == "epoch":
        sizes = _data_set_sizes(all_shards)
        num_samples = num_samples if num_samples is not None else sum(sizes.values())
    if cfg.mode == "epoch":
        per_rank = len(all_shards[rank::world_size])
        if per_rank < num_workers:
            log.info("rank %d has %d shards per epoch; %d workers would idle", rank, per_rank, num_workers - per_rank)
    tokenizer = _tokenizer(tokenizer_name, bert_vocab)
    reducer = TextReducer(context_length, text_mask, tokenizer, pos_source=cfg.pos_source)
    plan = ShardPlan(shards_by_source, list(cfg.weights or [1.0] * len(cfg.sources)), sizes, cfg.mode, cfg.seed,
                     epoch, rank, world_size, num_workers, cfg.shards_per_group,
                     overflow=cfg.mode == "epoch" and world_size > 1)
    spec = _BatchSpec(batch_size, image_size, tuple(cfg.crop_scale), tuple(cfg.crop_ratio), tuple(cfg.mean),
                      tuple(cfg.std), cfg.max_image_pixels, cfg.reduced_decode, cfg.shuffle_buffer, cfg.drop_last,
                      decode)
    return TrainStream(cfg, plan, spec, reducer, num_samples, context_length, text_mask, device)


def _data_set_sizes(shards: list[str]) -> dict[str, int]:
    """Sample count of every shard (from _stats.json / sizes.json / tar headers); logs when estimated."""
    sizes, estimated = resolve_sizes(shards)
    if estimated:
        log.warning("data set size estimated from a subset of the shards: %d samples", sum(sizes.values()))
    return sizes


def _tokenizer(name: str, bert_vocab: str | None = None):
    """CLIP BPE tokenizer, or the tokenizer of an open_clip model (after registering crate_clip's configs)."""
    if bert_vocab is not None:
        from crate_clip.models.clip_tokenizers import clip_tokenizer
        return clip_tokenizer(name, bert_vocab=bert_vocab)
    if name not in ("clip-bpe", "clip", "openai"):
        try:
            import crate_clip.models  # noqa: F401  (registers the CRATE-alpha open_clip model configs)
        except ImportError:
            pass  # a plain open_clip model name still works
    return load_tokenizer(name)
