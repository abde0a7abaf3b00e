"""The training stream: DataComp-layout shards -> (images, tokens) batches, resumable, bad data counted.

Order is part of the data. The global batches (which samples, in which order) are a function of the seed,
the sources, the global batch G and the canonical stream count C (`data.canonical_streams`) only, not of
the number of processes W or DataLoader workers K, so a run resumed on another cluster size continues the
very sample sequence an uninterrupted run would have seen:
- C canonical streams each read their own shard groups one after the other (shard_plan.py; the samples
  of a group interleaved and shuffled, every draw seeded by the sample's position: stream_slices.py);
- global batch t = for c in 0..C-1 the next G/C usable samples of stream c (the *slice* of c at step t);
- rank r reads streams [r*C/W, (r+1)*C/W), each of its K DataLoader workers a contiguous block of them
  (stream_layout.py), yielding per step one item with its streams' slices; this process joins a step's
  items in worker order into the rank batch, so the rank batches in rank order are the global batch.
A bad sample is skipped and counted by the stream that read it: the next usable sample of the same
stream takes its place, and no other stream moves. C must divide G and be a multiple of W x K (K: the
workers used, at most C/W). Unset, C is W x K of the first launch (K lowered to the largest count that
divides the rank batch; epoch mode: C at most the shard count); it is recorded in the stream state, and
a resume whose config leaves it unset reads it back, so the order survives a resume on fewer GPUs or
workers; a resume on more needs a C set from the start.

Modes:
- resampled: group g of stream c draws its shards with replacement (by source weight), seeded by
  (seed, c, epoch, g); endless, and every stream has data whatever the shard count;
- epoch: the shards shuffled by (seed, epoch) are dealt to the streams in that order, each to the stream
  with the fewest known samples (img2dataset stats, replaced by the usable counts measured in earlier
  epochs: epoch_sizes.py). Epoch e has S = min over streams of (known samples // (G/C)) steps, the same on
  every rank. A stream gives exactly S slices: the rest of its shards waits for the next epoch's deal
  (not seen this epoch; with balanced sizes less than one shard per stream), and a stream whose shards
  hold fewer usable samples than their stats claim continues into its round-robin share of the next
  epoch's shard order (seen again next epoch). Both rules are per canonical stream, so independent of W
  and K. `drop_last: false` instead gives one exact pass (every usable sample once, the last batches
  short, ranks may end at different steps: for a single process, e.g. `shards inspect`).

State (`state_dict`): the epoch, the steps consumed in it, and per canonical stream its position
(group, offset), skip counts and measured shard sizes. A rank saves the records of its own streams;
`merge_stream_states` / `split_stream_state` (stream_layout.py) turn the states of all W ranks into the
state of any rank of W' ranks; `load_state_dict` takes either its own state or the merged table. A
resume fast-forwards each stream within one group, reading the samples already consumed without
decoding them.

Cost: every sample is read once and decoded only by the stream that yields it; reading beyond what is
yielded: at most one group of `shards_per_group` shards per stream at a resume, and one shuffle buffer
per stream at an epoch end. Per rank, C/W streams are open at once: (C/W) x shards_per_group open shards
and (C/W) x shuffle_buffer raw samples in memory (stream_layout.stream_settings: the one definition of
the count, buffer and workers, which the planner reads too).
"""
from __future__ import annotations

import logging
from collections import Counter
from pathlib import PurePath
from typing import Literal, Optional, get_args

import numpy as np
import torch
from pydantic import Field, field_validator
from torch.utils.data import DataLoader

from crate_clip.core.config_schema import Bool, Float, Int, Section
from crate_clip.core.image_normalization import OPENAI_MEAN, OPENAI_STD
from crate_clip.core.read_bounds import (MAX_CAPTION_BYTES, MAX_MEMBER_BYTES, MAX_SAMPLE_BYTES,
                                         MAX_SHUFFLE_BUFFER_BYTES)
from crate_clip.core.tar_samples import SampleCaps
from crate_clip.core.host_ranks import ranks_on_this_host

from .device_decode import DECODE_COUNTERS, Decode, DeviceJpegBatch
from .epoch_sizes import adopt_real_sizes
from .image_decode import DEFAULT_MAX_IMAGE_BYTES, DEFAULT_MAX_IMAGE_PIXELS, CropInterpolation
from .pos_tagging import PosSource
from .read_stops import LoaderStop, workers_starting
from .remote_retry import RetryPolicy
from .shard_census import ShardCensus, resolve_sizes
from .shard_plan import ShardPlan
from .shard_reader import SKIP_REASONS, ShardListError, check_some_shard_exists, expand_source
from .stream_layout import (KEY, STATE_VERSION, StreamLayout, StreamSettings, resolve_layout, stream_settings,
                            takes_rank_counters)
from .stream_slices import SliceSpec, StreamsDataset, fresh_position
from .text_reduction import TEXT_MASKS, TextReducer, load_tokenizer

log = logging.getLogger(__name__)

Mode = Literal["resampled", "epoch"]


class StreamConfig(Section):
    """Where the shards are and how they are read (everything but the stage's image size / text length);
    the run config's `data` section is this schema."""

    sources: list[str] = Field(default_factory=list, validate_default=True,
                               description="shard folders, brace patterns, globs, URLs or 'pipe:' commands")
    weights: Optional[list[Float]] = Field(None, description="one sampling weight per source; default: equal")
    mode: Mode = Field("resampled", description="resampled: shards drawn with replacement, endless; epoch: each "
                                                "shard once per epoch, dealt to the canonical streams")
    seed: Int = Field(0, description="the stream's seed (in a run config: set per stage from run.seed)")
    canonical_streams: Optional[Int] = Field(
        None, ge=1, description="sample streams every global batch is cut from (global_batch / canonical_streams "
        "samples of each): the sample order depends on it, not on the GPUs or workers. Must divide every stage's "
        "global batch and be a multiple of world size x num_workers of every launch (resume) of the run. Default: "
        "world size x num_workers of the first launch, recorded in the checkpoints (a resume on fewer GPUs or "
        "workers keeps the order; to resume on more, set it from the start)")
    shuffle_buffer: Optional[Int] = Field(
        None, ge=0, description="raw samples held for shuffling per canonical stream (0 = none). Default: "
        "host_shuffle_buffer shared by a host's streams, else 1000; settled at the first launch and recorded, so a "
        "resume on any process count keeps the sample order")
    host_shuffle_buffer: Optional[Int] = Field(
        None, ge=1, description="raw samples one host holds for shuffling, over all its ranks' canonical streams: "
        "each stream holds host_shuffle_buffer / (canonical streams per host) of the first launch (recorded as "
        "shuffle_buffer). The memory a node needs: `crate-clip plan`")
    num_workers: Int = Field(2, ge=0, le=256, description="DataLoader worker processes per rank (0 = in the "
                             "trainer; at most 256: each is a process holding its own decode buffers)")
    num_samples: Optional[Int] = Field(None, ge=1, description="samples per epoch; default: from _stats.json")
    max_image_pixels: Int = Field(DEFAULT_MAX_IMAGE_PIXELS, ge=1, description="larger images are counted "
                                  "as decompression bombs and skipped")
    max_image_bytes: Int = Field(DEFAULT_MAX_IMAGE_BYTES, ge=1, description="larger decoded images (width x height "
                                 "x channels x bytes per channel, from the header, after the JPEG reduced-size "
                                 "decode) are counted as decompression bombs and skipped, never decoded")
    max_member_bytes: Int = Field(MAX_MEMBER_BYTES, ge=1, description="a sample with a tar member larger "
                                  "than this is skipped (counted oversized_member); the member is never read")
    max_caption_bytes: Int = Field(MAX_CAPTION_BYTES, ge=1, description="a sample whose caption is larger "
                                   "than this is skipped (counted oversized_caption); the caption is never read")
    max_sample_bytes: Int = Field(MAX_SAMPLE_BYTES, ge=1, description="a sample whose members together (each with "
                                  "its 512-byte header) are larger than this is skipped (counted oversized_sample); "
                                  "the member that would pass it and the rest of the sample are never read")
    max_shuffle_buffer_bytes: Int = Field(MAX_SHUFFLE_BUFFER_BYTES, ge=1, description="member bytes one canonical "
                                          "stream's shuffle buffer holds at most (besides the sample being added); "
                                          "at the bound it yields before it reads on, whatever shuffle_buffer says")
    crop_scale: tuple[Float, Float] = Field((0.4, 1.0), description="random-resized-crop area range [min, max]")
    mean: tuple[Float, Float, Float] = Field(OPENAI_MEAN, description="per-channel image mean (R, G, B); a run "
                                                                      "uses the model config's unless this is set")
    std: tuple[Float, Float, Float] = Field(OPENAI_STD, description="per-channel image std; as mean")
    shards_per_group: Int = Field(2, ge=1, description="shards interleaved per canonical stream; bounds resume "
                                  "fast-forward reading")
    drop_last: Bool = Field(True, description="epoch mode: whole slices only (false: one exact pass, short last "
                                              "batches)")
    pos_source: PosSource = Field("auto", description="the syntax text mask's part-of-speech source")
    reduced_decode: Bool = Field(True, description="decode a JPEG at the smallest DCT scale (1/2, 1/4, 1/8) "
                                                   "that leaves the crop at least the target size")
    prefetch_factor: Int = Field(2, ge=1, description="rank batches each worker prepares ahead (x batch memory)")
    crop_ratio: tuple[Float, Float] = Field((3 / 4, 4 / 3), description="random-resized-crop aspect-ratio "
                                                                        "range [min, max]")
    crop_interpolation: CropInterpolation = Field(
        "bicubic", description="resampling filter of the training crop, antialiased when it shrinks (PIL widens "
        "the filter by the downscale factor; decode: device uses the same weights): bicubic (default, open_clip's) "
        "or bilinear (the official CLIPA / CRATE-alpha pipeline's inception crop, bilinear with antialias)")
    remote_retry_total_s: Float = Field(
        1200.0, ge=0, description="remote shards (http(s), pipe:, gs://, hf://): how long one outage is retried (a "
        "refused or reset connection, DNS error, HTTP 5xx or 429, timeout, a pipe: command's non-zero exit, a stall) "
        "before the run saves and stops with exit code 7; a broken shard is read on at the byte it broke at. Keep it "
        "below the process group's 30-minute timeout: the other ranks wait for a retrying one in the step's "
        "collectives")
    remote_stall_timeout_s: Float = Field(60.0, gt=0, description="a remote transfer that sends no byte for this "
                                          "long is broken off and retried")
    remote_backoff_base_s: Float = Field(1.0, gt=0, description="first wait between retries of a remote shard; "
                                         "doubled after each failed attempt (with jitter), up to remote_backoff_max_s")
    remote_backoff_max_s: Float = Field(60.0, gt=0, description="longest wait between retries of a remote shard")
    remote_min_bytes_per_s: Float = Field(
        1024.0, ge=0, description="a remote transfer slower than this (bytes/s, over remote_stall_timeout_s of "
        "waiting for data) counts as stalled and is retried, as one that sends nothing: a server dripping bytes "
        "would hold the run for ever. 0: no floor")

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
        if not all(s > 0 for s in self.std):   # the stream divides by it: 0 makes every pixel inf or NaN
            problems.append(("std", f"{list(self.std)}; fix: three positive values (R, G, B)"))
        if self.remote_backoff_base_s > self.remote_backoff_max_s:
            problems.append(("remote_backoff_base_s", f"{self.remote_backoff_base_s:g} is above remote_backoff_max_s "
                                                      f"({self.remote_backoff_max_s:g}); fix: base <= max"))
        return problems + crop_scale_problems("crop_scale", self.crop_scale)

    def retry_policy(self) -> RetryPolicy:
        """How the remote shards' transient failures are retried (the remote_* keys)."""
        return RetryPolicy(self.remote_retry_total_s, self.remote_stall_timeout_s, self.remote_backoff_base_s,
                           self.remote_backoff_max_s, self.remote_min_bytes_per_s)


def crop_scale_problems(key: str, scale) -> list[tuple[str, str]]:
    """A random-resized-crop area range (min, max) as config problems under `key`: none when unset or valid."""
    if scale is None or 0 < scale[0] <= scale[1] <= 1:
        return []
    return [(key, f"{list(scale)}; fix: [min, max] with 0 < min <= max <= 1, or remove it")]


class TrainStream:
    """Iterable of (images float32 (B,3,S,S), tokens int64 (B,L)), one rank's part of each global batch;
    resumable at any world size and worker count; counts skipped samples."""

    def __init__(self, cfg: StreamConfig, plan: ShardPlan, spec: SliceSpec, layout: StreamLayout,
                 reducer: TextReducer, num_samples: int, context_length: int, text_mask: str, device: str = "cpu"):
        self.cfg, self.plan, self.spec, self.layout, self.reducer = cfg, plan, spec, layout, reducer
        self.device = device  # where decode: device batches are decoded and the workers' parts joined (CUDA)
        self._decode_main: Counter = Counter()  # device-decode fallbacks counted in this process
        self._num_samples = num_samples
        self.context_length, self.text_mask = context_length, text_mask
        self.batch_size = layout.global_batch // layout.world_size
        self._positions = {c: fresh_position() for c in layout.local_streams}
        self._batches = 0  # global batches consumed in the current epoch (resampled: since the start)
        self._done_skips: Counter = Counter()  # skips carried over from a state that had no stream records
        self._measured: dict[str, int] = {}    # shard -> usable samples, where that differs from its stats
        self._keys: list[str] = []
        self._pos_probe: str | None = None
        self.census: ShardCensus | None = None   # the shards' sizes and problems, once they have been read
        self.settled_streams: int | None = None   # the count the launch settled (build_train_stream's `settings`)

    @property
    def num_samples(self) -> int:
        """Samples in the data set: the configured num_samples, else the shards' sizes (read on first use)."""
        if self._num_samples is None:
            if self.census is None and not self.plan.sizes:
                self.census = _data_set_sizes(self.plan.all_shards)
            self._num_samples = sum((self.plan.sizes or self.census.sizes).values())
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
    def num_workers(self) -> int:
        """DataLoader worker processes this rank uses (0: its streams are read in this process)."""
        return self.layout.workers

    @property
    def canonical_streams(self) -> int:
        """The canonical stream count C the sample order is defined by (recorded in the state)."""
        return self.layout.streams

    @property
    def batch_keys(self) -> list[str]:
        """The webdataset __key__ of every sample of the last batch yielded, in batch order."""
        return list(self._keys)

    @property
    def batches_per_epoch(self) -> int | None:
        """Epoch mode: global batches per pass, the same on every rank (drop_last: false: an estimate)."""
        if self.plan.mode != "epoch":
            return None
        return self.plan.steps_per_epoch(self.layout.slice_size, self.spec.drop_last)

    def _loader(self, stop: Optional[LoaderStop] = None) -> DataLoader:
        """A DataLoader over this rank's canonical streams, each starting at its recorded position; with `stop`, its
        workers handle the trainer's save signals (read_stops.py)."""
        end_step = self.batches_per_epoch if self.plan.mode == "epoch" and self.spec.drop_last else None
        positions = {c: dict(p) for c, p in self._positions.items()}
        dataset = StreamsDataset(self.plan, self.spec, self.reducer, self.layout, positions, self._batches, end_step)
        kwargs = {}
        if self.layout.workers > 0:
            # a worker's item is its share of one step: as many rank batches ahead as prefetch_factor says
            kwargs = {"prefetch_factor": self.cfg.prefetch_factor * self.layout.workers, "persistent_workers": False}
        # The stream seeds its own randomness; a private generator keeps DataLoader from drawing its base
        # seed from torch's global RNG, which would shift the trainer's (image masks) on every new iterator
        # and make a resumed run diverge from an uninterrupted one.
        generator = torch.Generator().manual_seed(self.cfg.seed)
        # pinned host memory: the copies to the GPU overlap with compute
        return DataLoader(dataset, batch_size=None, num_workers=self.layout.workers, generator=generator,
                          pin_memory=torch.cuda.is_available(), worker_init_fn=stop and stop.worker_init, **kwargs)

    def __iter__(self):
        """Endless batches in resampled mode; the rest of the current epoch in epoch mode."""
        epoch_mode = self.plan.mode == "epoch"
        if epoch_mode and self.spec.drop_last and self._batches >= self.batches_per_epoch:
            self._next_epoch()  # the state was saved after the epoch's last batch
        stop, items = LoaderStop(self.layout.workers), None
        try:
            with workers_starting():   # no save signal reaches a worker before its handler is in place
                items = iter(self._loader(stop))
            yield from self._assembled(items)
        finally:
            stop.close()   # before the workers are shut down: torch's SIGTERM then ends them, as without handlers
            del items
        if epoch_mode:
            self._next_epoch()

    def _assembled(self, items):
        """Rank batches from the workers' items: step by step, each step's items in worker order."""
        workers = range(max(1, self.layout.workers))
        pending: dict[int, dict[int, tuple]] = {}   # step -> worker -> item
        finished: set[int] = set()                  # workers whose streams have all ended
        ended: list[dict] = []                      # end reports: final skip counts and measured sizes
        step = self._batches
        for images, tokens, info in items:
            ended += info["ended"]
            if images is None:
                finished.add(info["worker"])
            else:
                pending.setdefault(info["step"], {})[info["worker"]] = (images, tokens, info)
            while pending.get(step) and all(k in pending[step] or k in finished for k in workers):
                parts = pending.pop(step)
                yield self._batch([parts[k] for k in workers if k in parts])
                step += 1
        for meta in ended:
            self._positions[meta["stream"]] = meta["position"]

    def _batch(self, parts: list[tuple]) -> tuple:
        """One step's items as the rank batch (the trainer has consumed it once it is yielded)."""
        metas = [meta for _, _, info in parts for meta in info["slices"]]
        for meta in metas:
            self._positions[meta["stream"]] = meta["position"]
        self._batches += 1
        self._keys = [key for meta in metas for key in meta["keys"]]
        images, tokens = [p[0] for p in parts], _join([p[1] for p in parts])
        if isinstance(images[0], DeviceJpegBatch):
            return DeviceJpegBatch.join(images).to_images(self.device, tokens, self._decode_main)
        return _join(images, self.device), tokens

    def _next_epoch(self) -> None:
        """Move an epoch-mode stream to the start of the next epoch, dealt and sized with the real shard sizes."""
        reads = [p["read"] for p in self._positions.values()]
        self._measured.update(adopt_real_sizes(self.plan, reads, self.layout.rank, self.layout.world_size))
        self.plan.epoch += 1
        self._positions = {c: fresh_position(p["skips"]) for c, p in self._positions.items()}
        self._batches = 0

    def _total_skips(self) -> Counter:
        """Skip counts of this rank's streams, plus those carried over from an older state."""
        total = Counter(self._done_skips)
        for p in self._positions.values():
            total.update(p["skips"])
        return total

    def skip_counts(self) -> dict[str, int]:
        """Bad samples skipped so far by this rank's streams, by reason."""
        total = self._total_skips()
        return {reason: int(total.get(reason, 0)) for reason in SKIP_REASONS}

    def decode_counts(self) -> dict[str, int]:
        """decode: device: samples the CPU decoded instead (worker fallbacks, device failures) or replaced."""
        total = self._total_skips() + self._decode_main
        return {key: int(total.get(key, 0)) for key in DECODE_COUNTERS}

    def state_dict(self) -> dict:
        """JSON-serialisable position of this rank's canonical streams (what the trainer has consumed)."""
        return {"version": STATE_VERSION, "mode": self.plan.mode, "seed": self.plan.seed,
                "generation": self.plan.generation, "epoch": self.plan.epoch, "batches": self._batches,
                "samples": self._batches * self.layout.global_batch, "canonical_streams": self.layout.streams,
                "global_batch": self.layout.global_batch, "rank": self.layout.rank,
                "world_size": self.layout.world_size, "num_workers": self.layout.workers,
                "batch_size": self.batch_size,
                "streams": {str(c): _copy_position(p) for c, p in self._positions.items()},
                "measured_sizes": dict(self._measured), "decode_main": dict(self._decode_main),
                "done_skips": dict(self._done_skips)}

    def load_state_dict(self, state: dict) -> None:
        """Continue from a saved state: this rank's own, or a table of all canonical streams
        (merge_stream_states) saved at any world size and worker count; exact in both cases."""
        for key in ("mode", "seed"):
            if key in state and state[key] != getattr(self.plan, key):
                raise ValueError(f"stream state has {key}={state[key]!r} but this stream has "
                                 f"{key}={getattr(self.plan, key)!r}; resume with the same data settings")
        if state.get("version") != STATE_VERSION:
            self._load_without_streams(state)
            return
        if state["global_batch"] != self.layout.global_batch:
            raise ValueError(f"stream state was saved with global batch {state['global_batch']}, this stream has "
                             f"{self.layout.global_batch}; resume with the global batch it was saved with")
        self._adopt_stream_count(int(state["canonical_streams"]))
        missing = [c for c in self.layout.local_streams if str(c) not in state["streams"]]
        if missing:
            raise ValueError(f"stream state lacks canonical streams {missing} of rank {self.layout.rank}; load the "
                             "table merge_stream_states(<the states of every saved rank>) instead")
        self.plan.epoch, self.plan.generation = int(state["epoch"]), int(state["generation"])
        self._measured = {k: int(v) for k, v in state.get("measured_sizes", {}).items()}
        self.plan.update_sizes(self._measured)
        self._positions = {c: _copy_position(state["streams"][str(c)]) for c in self.layout.local_streams}
        self._batches = int(state["batches"])
        own_counters = takes_rank_counters(state, self.layout.local_streams)
        self._decode_main = Counter(state.get("decode_main", {}) if own_counters else {})
        self._done_skips = Counter(state.get("done_skips", {}) if own_counters else {})

    def _adopt_stream_count(self, streams: int) -> None:
        """Read the saved canonical streams when the config leaves the count open; else they must agree."""
        if streams == self.layout.streams:
            return
        fixed = self.cfg.canonical_streams or self.settled_streams   # set, or settled by the launch: it stands
        if fixed is not None:
            raise ValueError(f"{KEY}={fixed} but the stream state was saved with "
                             f"{streams}; fix: {KEY}: {streams} (or remove the key)")
        layout = resolve_layout(streams, self.layout.global_batch, self.layout.world_size, self.layout.rank,
                                self.cfg.num_workers, " (recorded in the checkpoint)")
        _check_epoch_shards(self.plan.mode, len(self.plan.all_shards), streams)
        self.layout, self.plan.streams = layout, streams
        self._positions = {c: fresh_position() for c in self.layout.local_streams}

    def _load_without_streams(self, state: dict) -> None:
        """A state of per-worker positions (no canonical streams): its positions cannot be mapped, so keep
        its counters and start this epoch's streams over (resampled: fresh draws; epoch: epoch repeated)."""
        log.warning("stream state version %s has no canonical-stream positions: resume is not exact (resampled mode "
                    "restarts its draws; epoch mode restarts epoch %s)", state.get("version"), state.get("epoch"))
        self.plan.epoch = int(state.get("epoch", self.plan.epoch))
        self.plan.generation = int(state.get("generation", 0)) + (self.plan.mode == "resampled")
        self._measured = {k: int(v) for k, v in state.get("measured_sizes", {}).items()}
        self.plan.update_sizes(self._measured)
        self._done_skips = Counter(state.get("done_skips", {}))
        for worker in state.get("workers", []):
            self._done_skips.update(worker.get("skips", {}))
        self._decode_main = Counter(state.get("decode_main", {}))
        self._positions = {c: fresh_position() for c in self.layout.local_streams}
        self._batches = 0


def _copy_position(position: dict) -> dict:
    """A stream record with its own dicts (the trainer may keep or serialise what it gets)."""
    return {"group": int(position["group"]), "offset": int(position["offset"]),
            "skips": dict(position.get("skips", {})), "read": dict(position.get("read", {})),
            "usable": dict(position.get("usable", {}))}


def _join(parts: list[torch.Tensor], device: str = "cpu") -> torch.Tensor:
    """The workers' parts of one step as one tensor: on a CUDA device, copied there first (from pinned
    memory, without blocking) and joined there, sparing this process a host copy of the batch; else joined
    in host memory by one single-threaded copy (torch's intra-op threads would wait for busy cores)."""
    if len(parts) == 1:
        return parts[0]
    if torch.device(device).type == "cuda":
        return torch.cat([x.to(device, non_blocking=True) for x in parts])
    return torch.from_numpy(np.concatenate([x.numpy() for x in parts]))


def _check_epoch_shards(mode: str, shards: int, streams: int) -> None:
    """Epoch mode deals whole shards: every canonical stream needs one."""
    if mode == "epoch" and shards < streams:
        raise ValueError(f"epoch mode needs at least one shard per canonical stream: {shards} shards for "
                         f"{KEY}={streams}; fix: a smaller {KEY} (world size x num_workers at most {shards}), use "
                         "mode='resampled', or write more, smaller shards")


def _probe_pos_source(cfg: StreamConfig) -> str:
    """The POS source the syntax mask would use (reported even when this stage uses another mask)."""
    from .pos_tagging import select_pos_tagger

    return select_pos_tagger(cfg.pos_source).source


def build_train_stream(cfg: StreamConfig, *, image_size: int, context_length: int, text_mask: str,
                       batch_size: int, rank: int = 0, world_size: int = 1, tokenizer_name: str = "clip-bpe",
                       epoch: int = 0, bert_vocab: str | None = None, decode: Decode = "cpu",
                       device: str = "cpu", settings: StreamSettings | None = None) -> TrainStream:
    """The training stream of one rank for one stage (image size, text length and mask); `batch_size`: the
    rank's share of the global batch (global batch = batch_size x world_size); `bert_vocab`: a folder with
    vocab.txt for a BERT-tokenized model when the HuggingFace hub is not reachable; `decode`: 'device'
    decodes the JPEGs on `device` in the trainer's process (data_pipelines/device_decode.py); `settings`: the
    stream settings a training launch settled once (canonical streams, shuffle buffer), else stream_settings of
    `cfg` for this rank batch (a stream read on its own)."""
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
    epoch_mode = cfg.mode == "epoch"
    settled = settings is not None
    if not settled:
        settings = stream_settings(cfg, world_size, batch_size, len(all_shards) if epoch_mode else None,
                                   ranks_on_this_host(world_size))
    elif settings.world_size != world_size:
        raise ValueError(f"stream settings settled for world_size {settings.world_size}, this stream has {world_size}")
    streams = settings.streams
    layout = resolve_layout(streams, batch_size * world_size, world_size, rank, cfg.num_workers)
    _check_epoch_shards(cfg.mode, len(all_shards), streams)
    if layout.workers < cfg.num_workers:
        log.info("rank %d reads %d canonical streams: %d of its %d DataLoader workers are used", rank,
                 len(layout.local_streams), max(1, layout.workers), cfg.num_workers)
    # Resampled mode draws shards without needing their sizes: the ~140k _stats.json of DataComp are read
    # only when someone asks for num_samples (shards inspect), never at a trainer's stage start.
    sizes, num_samples, census = {}, cfg.num_samples, None
    if epoch_mode:
        census = _data_set_sizes(all_shards)
        sizes = dict(census.sizes)
        num_samples = num_samples if num_samples is not None else sum(sizes.values())
    tokenizer = _tokenizer(tokenizer_name, bert_vocab)
    reducer = TextReducer(context_length, text_mask, tokenizer, pos_source=cfg.pos_source)
    plan = ShardPlan(shards_by_source, list(cfg.weights or [1.0] * len(cfg.sources)), sizes, cfg.mode, cfg.seed,
                     epoch, streams, cfg.shards_per_group, overflow=epoch_mode and cfg.drop_last)
    spec = SliceSpec(image_size, tuple(cfg.crop_scale), tuple(cfg.crop_ratio), tuple(cfg.mean),
                     tuple(cfg.std), cfg.max_image_pixels, cfg.reduced_decode, settings.shuffle_buffer, cfg.drop_last,
                     decode, cfg.crop_interpolation, retry=cfg.retry_policy(),
                     caps=SampleCaps(cfg.max_member_bytes, cfg.max_caption_bytes, cfg.max_sample_bytes),
                     max_image_bytes=cfg.max_image_bytes, shuffle_buffer_bytes=cfg.max_shuffle_buffer_bytes)
    stream = TrainStream(cfg, plan, spec, layout, reducer, num_samples, context_length, text_mask, device)
    stream.census = census
    stream.settled_streams = streams if settled else None
    return stream

def _data_set_sizes(shards: list[str]) -> ShardCensus:
    """The census of every shard (sizes from _stats.json / sizes.json / tar headers); logs estimates and what is
    wrong with the shards (missing, truncated, compressed, malformed stats), one line each."""
    census = resolve_sizes(shards)
    if census.estimated:
        log.warning("data set size estimated from a subset of the shards: %d samples", sum(census.sizes.values()))
    problems = census.warning()
    if problems:
        log.warning("shard sizes %s", problems)
    return census


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
