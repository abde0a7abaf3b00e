"""The run configuration: typed sections loaded from one YAML file, `--set` overrides, validation.

Every error names the offending key (dotted path, e.g. `stages.1.lr`) and says how to fix it, and all
errors of a file are reported at once, before any process group, model or data stream exists.
"""
from __future__ import annotations

import copy
import dataclasses
import difflib
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

import yaml

from crate_clip.models.pos_embed import POS_EMBED_RESIZE_MODES

TEXT_MASKS = ("truncate", "random", "block", "syntax")
IMAGE_MASKS = ("none", "random", "grid", "block")
PRECISIONS = ("bf16", "fp16", "fp32")
DATA_MODES = ("resampled", "epoch")
EVAL_TYPES = ("zeroshot", "retrieval")
ATTENTION_KERNELS = ("auto", "math", "flash", "efficient", "default")


class ConfigError(ValueError):
    """A run config that cannot be used; the message lists every bad key with its fix."""


@dataclass
class RunSection:
    """Where the run writes, its seed, and when it gives up on non-finite losses."""
    name: str = "run"
    output_dir: str = "runs/run"
    seed: int = 0
    max_nonfinite_in_a_row: int = 5


@dataclass
class ModelSection:
    """Which open_clip model config to build (any registered name, e.g. CRATE-alpha-CLIPA-L-14)."""
    name: str = "CRATE-alpha-CLIPA-tiny"
    pretrained: Optional[str] = None       # weights file for the first stage (resized to its shapes)
    tokenizer: Optional[str] = None        # open_clip tokenizer / model name; default: model.name
    grad_checkpointing: bool = False
    # scaled_dot_product_attention kernel: 'auto' = the math kernel on CPU (its backward is several times
    # faster than the CPU flash kernel's for short sequences), torch's choice on GPU
    attention: str = "auto"
    # how carried weights' image position embeddings are resized at a stage change (and for the
    # full-size eval of a low-res stage): 'official_1d' (the CRATE-alpha CLIPA code) or 'grid_2d'
    pos_embed_resize: str = "grid_2d"
    bert_vocab: Optional[str] = None       # folder with vocab.txt: BERT tokenizer without the HuggingFace hub


@dataclass
class DataSection:
    """The training shards and how the stream reads them (see data_pipelines.train_stream.StreamConfig)."""
    sources: list[str] = field(default_factory=list)
    weights: Optional[list[float]] = None
    mode: str = "resampled"
    shuffle_buffer: int = 1000
    num_workers: int = 2
    num_samples: Optional[int] = None
    crop_scale: list[float] = field(default_factory=lambda: [0.4, 1.0])


@dataclass
class StageConfig:
    """One training stage: token budget (image size, text length, masks), batch, samples and LR schedule."""
    name: str = "stage"
    image_size: int = 224
    context_length: int = 32
    samples: int = 0
    global_batch: int = 256
    lr: float = 1e-3
    warmup_steps: int = 0
    weight_decay: float = 0.2
    min_lr: float = 0.0
    text_mask: str = "truncate"
    image_mask: str = "none"
    image_mask_ratio: float = 0.0
    crop_scale: Optional[list[float]] = None  # random-resized-crop area range; default: data.crop_scale

    @property
    def steps(self) -> int:
        """Optimizer steps in this stage (samples rounded down to whole global batches)."""
        return self.samples // self.global_batch


@dataclass
class OptimizerSection:
    """AdamW with decoupled weight decay (per-stage decay and LR live in the stages)."""
    betas: list[float] = field(default_factory=lambda: [0.9, 0.95])
    eps: float = 1e-6
    grad_clip: float = 1.0


@dataclass
class DeepSpeedSection:
    """ZeRO stage and settings: a JSON/YAML file from configs/deepspeed/ plus inline overrides."""
    zero_stage: Optional[int] = None       # default: the file's zero_optimization.stage, else 1
    config: Optional[str] = None           # e.g. configs/deepspeed/zero2.json (relative: to the run config)
    overrides: dict = field(default_factory=dict)


@dataclass
class CheckpointSection:
    """Checkpoint cadence (every N steps, plus every stage end) and how many to keep."""
    every_steps: int = 0
    keep_last: int = 3


@dataclass
class EvalEntry:
    """One evaluation after each stage (the dict eval.stage_hook.evaluate_stage takes)."""
    name: str = "zeroshot"
    type: str = "zeroshot"
    dataset: str = "imagenet1k"
    data: str = ""
    templates: str = "openai"
    batch_size: int = 256
    max_images: Optional[int] = None


@dataclass
class EvalSection:
    """Evaluations run on all ranks after every stage; low-res stages are also evaluated at full size."""
    after_each_stage: bool = True
    full_image_size: Optional[int] = None  # default: the last stage's image size
    evals: list[EvalEntry] = field(default_factory=list)


@dataclass
class LoggingSection:
    """Console progress bar, TensorBoard, metrics.jsonl cadence and the final PNG plot."""
    every_steps: int = 10
    progress: bool = True
    tensorboard: bool = True
    plot: bool = True
    diagnostics_every: int = 0     # white-box coding rate / sparsity per layer every N steps (0 = off)
    diagnostics_images: int = 64   # probe batch: this many images of the first eval set


@dataclass
class RunConfig:
    """A whole run: model, data, stages, optimizer, precision, DeepSpeed, checkpoints, eval, logging."""
    run: RunSection = field(default_factory=RunSection)
    model: ModelSection = field(default_factory=ModelSection)
    data: DataSection = field(default_factory=DataSection)
    stages: list[StageConfig] = field(default_factory=list)
    optimizer: OptimizerSection = field(default_factory=OptimizerSection)
    precision: str = "bf16"
    deepspeed: DeepSpeedSection = field(default_factory=DeepSpeedSection)
    checkpoint: CheckpointSection = field(default_factory=CheckpointSection)
    eval: EvalSection = field(default_factory=EvalSection)
    logging: LoggingSection = field(default_factory=LoggingSection)
    source_path: Optional[str] = None      # the YAML file it came from (set by the loader, not the user)

    @property
    def run_dir(self) -> Path:
        """The run's output folder."""
        return Path(self.run.output_dir)

    @property
    def full_image_size(self) -> int:
        """The resolution a low-res stage is additionally evaluated at."""
        return self.eval.full_image_size or self.stages[-1].image_size

    def to_dict(self) -> dict:
        """Plain-dict form (for the copy saved in the run folder and in checkpoints)."""
        return dataclasses.asdict(self)


# ---------------------------------------------------------------- dict -> dataclass with key-named errors
def _type_name(tp) -> str:
    return getattr(tp, "__name__", str(tp)).replace("typing.", "")


def _coerce(value: Any, tp, key: str, errors: list[str]):
    """Convert a YAML value to the annotated type, appending a key-named error on failure."""
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if value is None:
            return None
        return _coerce(value, args[0], key, errors)
    if dataclasses.is_dataclass(tp):
        if not isinstance(value, dict):
            errors.append(f"{key}: expected a mapping of {_field_list(tp)}, got {value!r}")
            return tp()
        return _build(tp, value, key, errors)
    if origin is list:
        (item_tp,) = typing.get_args(tp)
        if not isinstance(value, (list, tuple)):
            errors.append(f"{key}: expected a list, got {value!r}; fix: write it as [a, b, ...]")
            return []
        return [_coerce(v, item_tp, f"{key}.{i}", errors) for i, v in enumerate(value)]
    if tp is dict or origin is dict:
        if not isinstance(value, dict):
            errors.append(f"{key}: expected a mapping, got {value!r}")
            return {}
        return value
    if tp is bool:
        if isinstance(value, bool):
            return value
        errors.append(f"{key}: expected true or false, got {value!r}")
        return False
    if tp in (int, float):
        # YAML 1.1 reads `1e-3` (no dot) as a string: accept numeric strings for numeric keys.
        try:
            if isinstance(value, bool):
                raise ValueError
            number = float(value) if isinstance(value, str) else value
            if tp is int:
                if float(number) != int(number):
                    raise ValueError
                return int(number)
            return float(number)
        except (TypeError, ValueError):
            errors.append(f"{key}: expected {'an integer' if tp is int else 'a number'}, got {value!r}")
            return tp()
    if tp is str:
        if isinstance(value, (str, int, float)) and not isinstance(value, bool):
            return str(value)
        errors.append(f"{key}: expected a string, got {value!r}")
        return ""
    return value


def _field_list(cls) -> str:
    return ", ".join(f.name for f in dataclasses.fields(cls) if f.name != "source_path")


def _build(cls, raw: dict, prefix: str, errors: list[str]):
    """Build dataclass `cls` from `raw`, reporting unknown keys with the closest valid name."""
    hints = typing.get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls) if f.name != "source_path"]
    kwargs = {}
    for key, value in raw.items():
        dotted = f"{prefix}.{key}" if prefix else str(key)
        if key not in names:
            close = difflib.get_close_matches(str(key), names, n=1)
            hint = f"did you mean '{close[0]}'?" if close else f"valid keys here: {', '.join(names)}"
            errors.append(f"{dotted}: unknown key; fix: remove it or rename it ({hint})")
            continue
        kwargs[key] = _coerce(value, hints[key], dotted, errors)
    return cls(**kwargs)


# ---------------------------------------------------------------- overrides
def apply_override(raw: dict, assignment: str) -> None:
    """Apply one `a.b.0.c=value` override (value parsed as YAML) to the raw config dict in place."""
    if "=" not in assignment:
        raise ConfigError(f"--set {assignment!r}: expected KEY=VALUE, e.g. --set stages.0.lr=1e-3")
    path, text = assignment.split("=", 1)
    parts = [p for p in path.strip().split(".") if p]
    if not parts:
        raise ConfigError(f"--set {assignment!r}: empty key")
    value = yaml.safe_load(text) if text.strip() else None
    node: Any = raw
    for depth, part in enumerate(parts):
        last = depth == len(parts) - 1
        where = ".".join(parts[: depth + 1])
        if isinstance(node, list):
            if not part.isdigit() or int(part) >= len(node):
                raise ConfigError(f"--set {path}: '{where}' is not an index of a list of {len(node)} "
                                  f"(valid: 0..{len(node) - 1})")
            if last:
                node[int(part)] = value
            else:
                node = node[int(part)]
        elif isinstance(node, dict):
            if last:
                node[part] = value
            else:
                node = node.setdefault(part, {})
        else:
            raise ConfigError(f"--set {path}: '{'.'.join(parts[:depth])}' is a value, not a section")


# ---------------------------------------------------------------- semantic checks
def _check(cfg: RunConfig, errors: list[str], base_dir: Path, check_paths: bool) -> None:
    """Value checks that need more than a type: ranges, enumerations, paths, stage consistency."""
    def need(ok: bool, msg: str):
        if not ok:
            errors.append(msg)

    need(cfg.model.attention in ATTENTION_KERNELS,
         f"model.attention: {cfg.model.attention!r} is not one of {ATTENTION_KERNELS}")
    need(cfg.model.pos_embed_resize in POS_EMBED_RESIZE_MODES,
         f"model.pos_embed_resize: {cfg.model.pos_embed_resize!r} is not one of {POS_EMBED_RESIZE_MODES}")
    need(cfg.precision in PRECISIONS, f"precision: {cfg.precision!r} is not one of {PRECISIONS}")
    zs = cfg.deepspeed.zero_stage
    need(zs is None or zs in (0, 1, 2, 3), f"deepspeed.zero_stage: {zs!r}; fix: use 0, 1, 2 or 3")
    need(cfg.run.max_nonfinite_in_a_row >= 1, "run.max_nonfinite_in_a_row: must be >= 1")
    need(cfg.checkpoint.keep_last >= 1, "checkpoint.keep_last: must be >= 1 (the newest checkpoint is "
                                        "needed to resume and to export)")
    need(cfg.checkpoint.every_steps >= 0, "checkpoint.every_steps: must be >= 0 (0 = only at stage ends)")
    need(cfg.logging.every_steps >= 1, "logging.every_steps: must be >= 1")
    need(cfg.logging.diagnostics_every >= 0, "logging.diagnostics_every: must be >= 0 (0 = off)")
    need(cfg.logging.diagnostics_images >= 1, "logging.diagnostics_images: must be >= 1")
    need(not cfg.logging.diagnostics_every or bool(cfg.eval.evals),
         "logging.diagnostics_every: the probe batch comes from eval.evals[0]: declare an eval set or set it to 0")
    need(len(cfg.optimizer.betas) == 2 and all(0 <= b < 1 for b in cfg.optimizer.betas),
         f"optimizer.betas: {cfg.optimizer.betas}; fix: two numbers in [0, 1), e.g. [0.9, 0.95]")
    need(cfg.optimizer.eps > 0, "optimizer.eps: must be > 0")
    need(cfg.optimizer.grad_clip >= 0, "optimizer.grad_clip: must be >= 0 (0 = no clipping)")
    # data
    need(bool(cfg.data.sources), "data.sources: empty; fix: list shard folders, brace patterns "
                                 "(/data/{00000000..00000099}.tar), globs, URLs or 'pipe:' commands")
    need(cfg.data.mode in DATA_MODES, f"data.mode: {cfg.data.mode!r} is not one of {DATA_MODES}")
    if cfg.data.weights is not None:
        need(len(cfg.data.weights) == len(cfg.data.sources),
             f"data.weights: {len(cfg.data.weights)} weights for {len(cfg.data.sources)} sources; "
             "fix: one weight per source, or remove data.weights")
    need(cfg.data.num_workers >= 0, "data.num_workers: must be >= 0")
    need(len(cfg.data.crop_scale) == 2 and 0 < cfg.data.crop_scale[0] <= cfg.data.crop_scale[1] <= 1,
         f"data.crop_scale: {cfg.data.crop_scale}; fix: [min, max] with 0 < min <= max <= 1")
    if check_paths:
        for i, src in enumerate(cfg.data.sources):
            if _is_local(src) and not _local_exists(resolve_path(src, base_dir)):
                errors.append(f"data.sources.{i}: {src!r} does not exist; fix: write the shards first "
                              "(crate-clip shards ...) or correct the path")
        if cfg.model.bert_vocab and not (resolve_path(cfg.model.bert_vocab, base_dir) / "vocab.txt").is_file():
            errors.append(f"model.bert_vocab: {cfg.model.bert_vocab!r} holds no vocab.txt; fix: the folder of a "
                          "BERT vocabulary (one token a line), or remove the key to use the HuggingFace hub")
        if cfg.model.pretrained and not resolve_path(cfg.model.pretrained, base_dir).exists():
            errors.append(f"model.pretrained: file {cfg.model.pretrained!r} does not exist")
        if cfg.deepspeed.config and not resolve_path(cfg.deepspeed.config, base_dir).exists():
            errors.append(f"deepspeed.config: file {cfg.deepspeed.config!r} does not exist; fix: use one of "
                          "configs/deepspeed/zero{1,2,3}.json")
    # stages
    need(bool(cfg.stages), "stages: empty; fix: give at least one stage (image_size, context_length, "
                           "samples, global_batch, lr)")
    names = [s.name for s in cfg.stages]
    need(len(set(names)) == len(names), f"stages: duplicate stage names {names}; fix: give each a unique name")
    for i, s in enumerate(cfg.stages):
        k = f"stages.{i}"
        need(s.image_size >= 8, f"{k}.image_size: {s.image_size}; fix: a positive size in pixels (e.g. 84)")
        need(s.context_length >= 2, f"{k}.context_length: {s.context_length}; fix: >= 2 (e.g. 32)")
        need(s.global_batch >= 2, f"{k}.global_batch: {s.global_batch}; fix: >= 2 (a contrastive batch)")
        need(s.samples >= s.global_batch, f"{k}.samples: {s.samples} is less than one global batch "
                                          f"({s.global_batch}); fix: raise samples or lower global_batch")
        need(s.lr > 0, f"{k}.lr: {s.lr}; fix: a positive peak learning rate, e.g. 1e-3")
        need(0 <= s.min_lr <= s.lr, f"{k}.min_lr: {s.min_lr}; fix: between 0 and lr ({s.lr})")
        need(s.weight_decay >= 0, f"{k}.weight_decay: must be >= 0")
        need(0 <= s.warmup_steps < max(s.steps, 1),
             f"{k}.warmup_steps: {s.warmup_steps} but the stage has {s.steps} steps "
             f"(samples / global_batch); fix: fewer warm-up steps or more samples")
        need(s.text_mask in TEXT_MASKS, f"{k}.text_mask: {s.text_mask!r} is not one of {TEXT_MASKS}")
        need(s.image_mask in IMAGE_MASKS, f"{k}.image_mask: {s.image_mask!r} is not one of {IMAGE_MASKS}")
        need(0 <= s.image_mask_ratio < 1, f"{k}.image_mask_ratio: {s.image_mask_ratio}; fix: in [0, 1)")
        need(s.crop_scale is None or (len(s.crop_scale) == 2 and 0 < s.crop_scale[0] <= s.crop_scale[1] <= 1),
             f"{k}.crop_scale: {s.crop_scale}; fix: [min, max] with 0 < min <= max <= 1, or remove it")
        need(s.image_mask == "none" or s.image_mask_ratio > 0 or s.image_mask in ("grid",),
             f"{k}.image_mask_ratio: 0 with image_mask {s.image_mask!r}; fix: set a ratio such as 0.3, "
             "or image_mask: none")
    # eval
    need(cfg.eval.full_image_size is None or cfg.eval.full_image_size >= 8,
         "eval.full_image_size: must be a size in pixels")
    for i, e in enumerate(cfg.eval.evals):
        k = f"eval.evals.{i}"
        need(e.type in EVAL_TYPES, f"{k}.type: {e.type!r} is not one of {EVAL_TYPES}")
        need(bool(e.data), f"{k}.data: empty; fix: the path of the evaluation set")
        need(e.batch_size >= 1, f"{k}.batch_size: must be >= 1")
        if check_paths and e.data and not resolve_path(e.data, base_dir).exists():
            errors.append(f"{k}.data: {e.data!r} does not exist; fix: build the evaluation set first "
                          "(crate-clip shards ...) or correct the path")


def _is_local(src: str) -> bool:
    return not (src.startswith("pipe:") or "://" in src)


def _local_exists(path: Path) -> bool:
    """A folder, a file, or a brace/glob pattern with at least one existing match."""
    text = str(path)
    if path.exists():
        return True
    if "{" in text:
        import braceexpand  # webdataset's dependency
        return any(Path(p).exists() for p in braceexpand.braceexpand(text))
    if any(c in text for c in "*?["):
        return any(Path(text).parent.glob(Path(text).name))
    return False


def resolve_path(path: str, base_dir: Path) -> Path:
    """Relative paths in a config resolve against the working directory, else the config's folder."""
    p = Path(path).expanduser()
    if p.is_absolute() or p.exists() or not base_dir:
        return p
    candidate = base_dir / p
    return candidate if candidate.exists() else p


def _resolve_paths(cfg: RunConfig, base_dir: Path) -> None:
    """Make relative local paths found beside the config absolute, so every rank reads the same files."""
    cfg.data.sources = [str(resolve_path(s, base_dir)) if _is_local(s) else s for s in cfg.data.sources]
    for e in cfg.eval.evals:
        e.data = str(resolve_path(e.data, base_dir)) if e.data else e.data
    if cfg.deepspeed.config:
        cfg.deepspeed.config = str(resolve_path(cfg.deepspeed.config, base_dir))
    if cfg.model.pretrained:
        cfg.model.pretrained = str(resolve_path(cfg.model.pretrained, base_dir))
    if cfg.model.bert_vocab:
        cfg.model.bert_vocab = str(resolve_path(cfg.model.bert_vocab, base_dir))


def check_runtime(cfg: RunConfig, world_size: int, device: str = "cpu") -> None:
    """Checks that need the launch (world size, device); raises ConfigError naming the key."""
    errors = []
    for i, s in enumerate(cfg.stages):
        if s.global_batch % world_size:
            errors.append(f"stages.{i}.global_batch: {s.global_batch} is not divisible by the {world_size} "
                          f"processes; fix: use a multiple of {world_size}")
    if device == "cpu" and cfg.precision == "fp16":
        errors.append("precision: fp16 is not supported by DeepSpeed on CPU; fix: use bf16 or fp32")
    if errors:
        raise ConfigError("invalid run config:\n  " + "\n  ".join(errors))


# ---------------------------------------------------------------- entry points
def config_from_dict(raw: dict, *, base_dir: Path | None = None, check_paths: bool = True,
                     source_path: str | None = None) -> RunConfig:
    """Build and validate a RunConfig from a plain dict; raises ConfigError listing every bad key."""
    if not isinstance(raw, dict):
        raise ConfigError(f"run config{' ' + source_path if source_path else ''}: expected a mapping at the "
                          f"top level, got {type(raw).__name__}")
    errors: list[str] = []
    cfg = _build(RunConfig, raw, "", errors)
    cfg.source_path = source_path
    if not errors:
        _resolve_paths(cfg, base_dir or Path("."))
        _check(cfg, errors, base_dir or Path("."), check_paths)
    if errors:
        where = f" ({source_path})" if source_path else ""
        raise ConfigError(f"invalid run config{where}:\n  " + "\n  ".join(errors))
    return cfg


def load_run_config(path: str | Path, overrides: list[str] | tuple = (), *, check_paths: bool = True) -> RunConfig:
    """Load a YAML run config, apply `--set` overrides, validate; raises ConfigError naming the key."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"--config: file {str(path)!r} does not exist")
    try:
        raw = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as exc:
        raise ConfigError(f"{path}: not valid YAML: {exc}") from exc
    raw = copy.deepcopy(raw)
    for assignment in overrides:
        apply_override(raw, assignment)
    return config_from_dict(raw, base_dir=path.parent, check_paths=check_paths, source_path=str(path))
