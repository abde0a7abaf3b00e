"""One training stage resolved once from the run config and the launch, and the one builder of its model.

A stage's settings come from several places: its own keys, a patch size set by an earlier stage, the model
section (weights to start from, text lock, checkpointing, compile), the DeepSpeed section (ZeRO stage), the
data section (normalisation) and the launch (world size; the device for micro_batch: auto). resolve_stage()
decides them once, when the stage starts, into a frozen ResolvedStage. Its build_model() is the only place a
stage's model is built: for training, for the stage's evaluations, for the white-box probe's copy of the tower,
and for the planner and the throughput meter, which both read `counts`: FLOPs and tokens per sample counted on
a copy of that model, so they agree with each other and with the model that trains.
"""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass, replace
from typing import Optional

import torch
from torch import nn

from crate_clip.core.errors import ConfigError
from crate_clip.data.stream_layout import StreamSettings, stream_settings
from crate_clip.models import create_clip, preprocess_cfg_for, set_image_token_mask
from crate_clip.train.planning import planner
from crate_clip.train.planning.plan_inputs import COMPILE_WORDS
from crate_clip.train.stage_setup.engine import model_dtype, zero_stage_of
from crate_clip.train.run.run_config import ModelSection, RunConfig, StageConfig
from crate_clip.train.stage_setup.text_lock import apply_text_config
from crate_clip.core.host_ranks import ranks_on_this_host


@dataclass(frozen=True)
class ResolvedStage:
    """Everything one stage needs, decided once by resolve_stage(); build_model() builds its model."""
    index: int
    name: str
    config: StageConfig            # the stage's keys as written: schedule (lr, warm-up, decay) and crop range
    model: ModelSection            # model name, weights to start from, text lock, kernel, checkpointing, compile
    seed: int                      # run.seed: the same initial weights on every rank
    image_size: int
    patch_size: Optional[int]      # set by this or an earlier stage; None: the weights' own (fresh: the config's)
    patch_resize: str
    context_length: int
    text_mask: str
    image_mask: str
    image_mask_ratio: float
    global_batch: int
    world_size: int
    micro_batch: int               # per rank
    steps: int
    zero_stage: int
    precision: str
    mean: tuple[float, ...]        # image normalisation of the training stream
    std: tuple[float, ...]
    decode: str
    interpolation: str = "bicubic"   # the training crop's resampling filter (data.crop_interpolation)
    stream: Optional[StreamSettings] = None   # canonical streams, shuffle buffer, workers (stream_layout's one rule)
    checkpoint_blocks: Optional[int] = None   # image-tower blocks recomputed (None: model.grad_checkpointing's all/none)
    ema: bool = False              # train.ema on: rank 0 holds an fp32 average of the trained parameters

    @property
    def loader_streams(self) -> int:
        """Canonical streams one rank reads, each with its shuffle buffer."""
        return self.stream.per_rank if self.stream else 1

    @property
    def shuffle_buffer(self) -> int:
        """Raw samples held per canonical stream."""
        return self.stream.shuffle_buffer if self.stream else 0

    @property
    def image_blocks_recomputed(self) -> tuple:
        """(blocks of the image tower recomputed in the backward, its depth): what the planner's memory and time
        read; (0, depth) without checkpointing."""
        depth = self.image_depth
        if self.checkpoint_blocks is not None:
            return min(self.checkpoint_blocks, depth), depth
        return (depth if self.model.grad_checkpointing else 0), depth

    @property
    def image_depth(self) -> int:
        """Blocks of the image tower (1 where the tower is not recognised)."""
        return self._image_tower[0]

    @property
    def partial_checkpointing(self) -> bool:
        """Whether the image tower can recompute some of its blocks (checkpoint_blocks: a CRATE-alpha trunk)."""
        return self._image_tower[1]

    @functools.cached_property
    def _image_tower(self) -> tuple:
        with torch.random.fork_rng(devices=[]):
            model = self.build_model(read_files=False, device="meta", train=False)
        lists = planner.tower_blocks(model)
        trunk = getattr(getattr(model, "visual", None), "trunk", None)
        return (len(getattr(*lists[0])) if lists else 1), hasattr(trunk, "checkpoint_blocks")

    @property
    def per_rank_batch(self) -> int:
        """Samples one rank takes per optimizer step."""
        return self.global_batch // self.world_size

    @property
    def accumulation_steps(self) -> int:
        """k: micro-batches per optimizer step and rank."""
        return self.per_rank_batch // self.micro_batch

    def build_model(self, weights: Optional[dict] = None, *, read_files: bool = True, image_size: Optional[int] = None,
                    device: str = "cpu", train: bool = True) -> nn.Module:
        """The stage's model: from `weights` (position embeddings resized 2-D for the image grid, 1-D for the text;
        the patch kernel moved to this stage's patch size), or fresh (plus model.pretrained and model.text_pretrained
        when `read_files`); with the stage's token mask and text lock. `read_files=False`: shapes and initial values
        only (a resumed stage loads every weight next; the counts need no file). `image_size`: the same weights at
        another resolution (the full-size evaluation). `train`: gradient checkpointing and compile as configured.
        `device='meta'` builds shapes only."""
        torch.manual_seed(self.seed)   # identical initial weights on every rank
        start = weights if weights is not None else self.model.pretrained if read_files else None
        model = create_clip(self.model.name, image_size=image_size or self.image_size,
                            context_length=self.context_length, pretrained=start, patch_size=self.patch_size,
                            patch_resize=self.patch_resize, pos_embed_resize=self.model.pos_embed_resize, device=device)
        set_image_token_mask(model, self.image_mask, self.image_mask_ratio)
        self._set_preprocess(model)
        apply_text_config(model, text_pretrained=self.model.text_pretrained, lock_text=self.model.lock_text,
                          lock_logit_scale=self.model.lock_logit_scale, compute_dtype=model_dtype(self.precision),
                          load=weights is None and read_files)
        if train and self.checkpoint_blocks is not None:
            _checkpoint_first_blocks(model, self.checkpoint_blocks, self.model.grad_checkpointing)
        elif train and self.model.grad_checkpointing:
            model.set_grad_checkpointing(True)
        if train and self.model.compile:
            compile_towers(model)
        return model

    def _set_preprocess(self, model: nn.Module) -> None:
        """The evaluation preprocessing the model carries (eval_transform reads it): the training stream's
        normalisation and resampling filter, so the stage's evaluations see the images as training did."""
        visual = getattr(model, "visual", None)
        if visual is not None:
            visual.preprocess_cfg = {**(getattr(visual, "preprocess_cfg", None) or {}), "mean": self.mean,
                                     "std": self.std, "interpolation": self.interpolation}

    @functools.cached_property
    def counts(self) -> planner.SampleCounts:
        """FLOPs and tokens per sample of one training step of the stage's model, counted on a meta-device copy
        (no memory, no compute; deep towers on 1 and 2 of their blocks: planner.count_cut_per_sample): token
        mask, text length and text lock as configured; checkpointing's recomputation and the accumulation's
        extra forward are not model FLOPs and are not counted in `flops` (`grad_forward_flops` is what they
        repeat: the planner's time adds it)."""
        # the token mask draws from torch's global generator even on the meta device: a count must not move it
        with torch.random.fork_rng(devices=[]):
            model = self.build_model(read_files=False, device="meta", train=False)
            return planner.count_cut_per_sample(model, self.image_size, self.context_length)


def resolve_stage(cfg: RunConfig, index: int, world_size: int = 1, device: str = "cpu",
                  ranks_per_host: Optional[int] = None, stream: Optional[StreamSettings] = None) -> ResolvedStage:
    """Stage `index` of `cfg` for a job of `world_size` processes on `device` (CUDA: micro_batch auto is the
    planner's largest that fits this GPU; elsewhere the whole rank batch), `ranks_per_host` of them a host
    (default: LOCAL_WORLD_SIZE, else all); `stream`: the stream settings the launch settled
    (elastic_resume.launch_stream_settings), else those the config's data section gives (a plan without a checkpoint,
    an evaluation)."""
    s = cfg.stages[index]
    norm = {k: tuple(getattr(cfg.data, k) if k in cfg.data.model_fields_set else preprocess_cfg_for(cfg.model.name)[k])
            for k in ("mean", "std")}   # the model's own normalisation unless the run config sets data.mean/std
    stage = ResolvedStage(
        index=index, name=s.name, config=s, model=cfg.model, seed=cfg.run.seed, image_size=s.image_size,
        patch_size=cfg.patch_size_at(index), patch_resize=s.patch_resize, context_length=s.context_length,
        text_mask=s.text_mask, image_mask=s.image_mask, image_mask_ratio=s.image_mask_ratio,
        global_batch=s.global_batch, world_size=world_size,
        micro_batch=s.micro_batch if isinstance(s.micro_batch, int) else s.global_batch // world_size,
        steps=s.steps, zero_stage=zero_stage_of(cfg), precision=cfg.precision, decode=s.decode,
        interpolation=cfg.data.crop_interpolation,
        stream=stream or stream_settings(cfg.data, world_size,
                                         math.gcd(*(t.global_batch // world_size for t in cfg.stages)),
                                         None, ranks_per_host or ranks_on_this_host(world_size)),
        checkpoint_blocks=s.checkpoint_blocks, ema=cfg.train.ema.on, **norm)
    if s.micro_batch == "auto" and device.startswith("cuda"):
        memory = torch.cuda.get_device_properties(torch.device(device)).total_memory
        fitted = replace(stage, micro_batch=planner.fit_micro_batch(stage, memory))
        if "counts" in stage.__dict__:   # counted by the fit; the micro-batch does not change it (replace drops it)
            fitted.__dict__["counts"] = stage.counts
        stage = fitted
    return stage


def _checkpoint_first_blocks(model: nn.Module, blocks: int, text: bool) -> None:
    """Recompute the first `blocks` blocks of the image tower in the backward (a CRATE-alpha trunk), the text
    tower's blocks when `text` and `blocks` (0: nothing recomputed in this stage)."""
    model.set_grad_checkpointing(text and blocks > 0)
    trunk = getattr(getattr(model, "visual", None), "trunk", None)
    if not hasattr(trunk, "checkpoint_blocks"):
        raise ConfigError("stages.N.checkpoint_blocks: this model's image tower recomputes all its blocks or none; "
                          "fix: remove the key and set model.grad_checkpointing")
    trunk.grad_checkpointing, trunk.checkpoint_blocks = blocks > 0, blocks


def compile_line(stage: ResolvedStage, device: str) -> str:
    """The one console line saying whether the stage compiles its towers, and why (COMPILE_WORDS: what compiling
    was measured to give)."""
    setting = f"[compile] stage {stage.name}: " + ("both towers compiled (model.compile: true)" if stage.model.compile
                                                    else "eager (model.compile: false)")
    if device.startswith("cuda"):
        return f"{setting}; compiled against eager is not measured on a GPU yet (bench/bench_gpu.py runs both)"
    return f"{setting}; {COMPILE_WORDS}"


def compile_towers(model: nn.Module) -> None:
    """torch.compile each tower in place (nn.Module.compile keeps the state-dict keys, so checkpoints and
    exports are unchanged); the contrastive loss and DeepSpeed stay eager."""
    for tower in (getattr(model, "visual", None), getattr(model, "text", getattr(model, "transformer", None))):
        if tower is not None:
            tower.compile()
