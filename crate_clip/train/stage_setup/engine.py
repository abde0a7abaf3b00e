"""The one place that sets up training: process group, model, optimizer, schedule and deepspeed.initialize.

The DeepSpeed JSON is derived from the run config (a ZeRO file from configs/deepspeed/ merged with the
resolved stage's batch and micro-batch, the precision and the gradient clip). One setting can be given twice: the ZeRO stage, as
`deepspeed.zero_stage` and as the file's `zero_optimization.stage`; the run-config key wins (zero_stage_of).
"""
from __future__ import annotations

import copy
import json
import os
import socket
from dataclasses import dataclass
from datetime import timedelta

import torch

from crate_clip.core.file_kinds import read_regular_text
from crate_clip.core.safe_yaml import MAX_CONFIG_BYTES, load_yaml
from crate_clip.train.run.launcher_watch import watch_launcher
from crate_clip.train.stage_setup.deepspeed_imports import import_muon_lazily
from crate_clip.train.stage_setup.optim import build_optimizer, build_schedule
from crate_clip.train.run.run_config import RunConfig

# DeepSpeed is imported inside the functions that start it: importing it takes about a second and probes the
# accelerator, which the planner, the config check and the plot writer (importers of this module) never need.

# Sections of a DeepSpeed JSON that the run config owns; a ZeRO file may not set them.
RUN_OWNED_KEYS = ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps",
                  "gradient_clipping", "bf16", "fp16", "optimizer", "scheduler")


@dataclass
class DistInfo:
    """This process's place in the job."""
    rank: int
    world_size: int
    local_rank: int
    device: str

    @property
    def is_main(self) -> bool:
        """Rank 0 writes the shared files (latest, results, plot, export)."""
        return self.rank == 0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init_distributed(timeout_s: int = 1800) -> DistInfo:
    """Join the process group set up by deepspeed / torchrun / accelerate launch, or make a 1-process one."""
    import deepspeed   # lazy: see the top of the module
    import deepspeed.ops

    watch_launcher()   # a process whose launcher is killed stops (before anything below starts threads)
    if "RANK" not in os.environ:  # plain `crate-clip train`: a world of one
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1")
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(_free_port()))
    os.environ.setdefault("LOCAL_RANK", os.environ.get("RANK", "0"))
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cpu":
        # Otherwise DeepSpeed compiles its shared-memory collective op with g++ (about a minute per run).
        deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
        _init_on_this_restarts_keys("nccl" if device == "cuda" else "gloo", timedelta(seconds=timeout_s))
    deepspeed.init_distributed(dist_backend="nccl" if device == "cuda" else "gloo", verbose=False,
                               timeout=timedelta(seconds=timeout_s))
    local_rank = int(os.environ["LOCAL_RANK"])
    if device == "cuda":
        torch.cuda.set_device(local_rank)
        device = f"cuda:{local_rank}"
    return DistInfo(int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), local_rank, device)


def _init_on_this_restarts_keys(backend: str, timeout: timedelta) -> None:
    """The process group of a torchrun worker, on keys of its own restart: torchrun's agent keeps one store for all
    restarts (--max-restarts), and the addresses the killed workers left in it would be read by the new ones (gloo
    then fails with 'Connection refused' to a dead process). DeepSpeed adopts the group made here."""
    import torch.distributed as tdist

    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    agent_store = tdist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world_size,
                                 is_master=False, timeout=timeout)
    store = tdist.PrefixStore(f"/crate_clip/restart_{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}", agent_store)
    device = {"device_id": torch.device("cuda", int(os.environ["LOCAL_RANK"]))} if backend == "nccl" else {}
    tdist.init_process_group(backend, store=store, rank=rank, world_size=world_size, timeout=timeout, **device)


def _deep_merge(base: dict, extra: dict) -> dict:
    out = copy.deepcopy(base)
    for k, v in extra.items():
        out[k] = _deep_merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def load_zero_file(path: str | None) -> dict:
    """Read a DeepSpeed settings file (JSON or YAML) from configs/deepspeed/; {} when none is given."""
    if not path:
        return {}
    text = read_regular_text(path, MAX_CONFIG_BYTES, "deepspeed.config")   # not a FIFO, not /dev/zero
    data = json.loads(text) if str(path).endswith(".json") else load_yaml(text, f"deepspeed.config {path}")
    clash = [k for k in RUN_OWNED_KEYS if k in (data or {})]
    if clash:
        raise ValueError(f"deepspeed.config {path}: keys {clash} are set by the run config (stages.N.global_batch, "
                         "precision, optimizer.grad_clip); remove them from the DeepSpeed file")
    return data or {}


def zero_stage_of(cfg: RunConfig) -> int:
    """The ZeRO stage: deepspeed.zero_stage, else the DeepSpeed file's, else 1."""
    if cfg.deepspeed.zero_stage is not None:
        return cfg.deepspeed.zero_stage
    return int(load_zero_file(cfg.deepspeed.config).get("zero_optimization", {}).get("stage", 1))


def clips_in_train_step(cfg: RunConfig, stage) -> bool:
    """ZeRO 0 in fp32: DeepSpeed steps the torch AdamW as it is, which keeps no gradient norm and applies a NaN
    gradient (its own clipping measures the norm and drops it). There DeepSpeed does not clip: train_step measures
    the norm, clips by it and skips a non-finite step itself (train_step.step_measured)."""
    return stage.zero_stage == 0 and cfg.precision == "fp32"


def deepspeed_config(cfg: RunConfig, stage, load_universal: bool = False) -> dict:
    """The DeepSpeed JSON for one stage (a ResolvedStage), derived from the run config (`load_universal`: the
    engine will load a universal checkpoint, elastic_resume.py)."""
    ds = load_zero_file(cfg.deepspeed.config)
    ds = _deep_merge(ds, {
        "train_batch_size": stage.global_batch,
        "train_micro_batch_size_per_gpu": stage.micro_batch,
        # k > 1: train_step's feature cache makes each micro-step's gradient exact (backward without GAS scaling)
        "gradient_accumulation_steps": stage.accumulation_steps,
        "gradient_clipping": cfg.optimizer.grad_clip,
        "zero_optimization": {"stage": stage.zero_stage},
        # check_grad_overflow: a finite loss with a non-finite gradient is skipped (train_step counts it)
        "bf16": {"enabled": cfg.precision == "bf16", "check_grad_overflow": True},
        "fp16": {"enabled": cfg.precision == "fp16", "initial_scale_power": 16, "loss_scale_window": 500},
        # we pass a torch AdamW: ZeRO wraps it (a DeepSpeed-named optimizer would compile a C++ op)
        "zero_allow_untested_optimizer": True,
        "steps_per_print": 10 ** 12,
        "wall_clock_breakdown": False,
        **({"checkpoint": {"load_universal": True}} if load_universal else {}),
    })
    return _deep_merge(ds, cfg.deepspeed.overrides)


def prepare_model_for_deepspeed(model: torch.nn.Module) -> torch.nn.Module:
    """DeepSpeed (CPU) crashes on 0-dim parameters: store open_clip's logit_scale (and bias) as shape [1]."""
    for name in ("logit_scale", "logit_bias"):
        p = getattr(model, name, None)
        if isinstance(p, torch.nn.Parameter) and p.ndim == 0:
            setattr(model, name, torch.nn.Parameter(p.detach().reshape(1).clone(), requires_grad=p.requires_grad))
    return model


def build_engine(model: torch.nn.Module, cfg: RunConfig, stage, dist: DistInfo, load_universal: bool = False):
    """Wrap `model` for one stage (a ResolvedStage): AdamW groups, warm-up + cosine schedule, deepspeed.initialize
    (`load_universal`: for a checkpoint of another world size or ZeRO stage, elastic_resume.py)."""
    import deepspeed   # lazy: see the top of the module

    if dist.world_size != stage.world_size:
        raise ValueError(f"stage {stage.name} was resolved for {stage.world_size} processes, this job has "
                         f"{dist.world_size}")
    prepare_model_for_deepspeed(model)
    schedule_keys = stage.config
    optimizer = build_optimizer(model, lr=schedule_keys.lr, weight_decay=schedule_keys.weight_decay,
                                betas=cfg.optimizer.betas, eps=cfg.optimizer.eps)
    schedule = build_schedule(optimizer, total_steps=stage.steps, warmup_steps=schedule_keys.warmup_steps,
                              lr=schedule_keys.lr, min_lr=schedule_keys.min_lr)
    ds, own_clip = deepspeed_config(cfg, stage, load_universal), None
    if clips_in_train_step(cfg, stage):
        own_clip, ds["gradient_clipping"] = ds["gradient_clipping"], 0.0   # DeepSpeed's default clips at 1.0
    import_muon_lazily()   # before the engine imports it at full cost (deepspeed_imports.py)
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, lr_scheduler=schedule, config=ds)
    engine.grad_clip_in_step = own_clip   # what train_step clips to itself; None: DeepSpeed measures and clips
    return engine


def model_dtype(precision: str) -> torch.dtype:
    """The dtype DeepSpeed keeps the working copy of the model in."""
    return {"bf16": torch.bfloat16, "fp16": torch.float16}.get(precision, torch.float32)
