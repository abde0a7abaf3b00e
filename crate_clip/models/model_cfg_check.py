"""An open_clip model config read from a file (an export's `open_clip_config.json`) checked before anything is built.

open_clip turns an unknown key into a TypeError deep in a dataclass constructor, and builds whatever sizes the file
says: a crafted or damaged config would allocate many GB before failing. `check_model_cfg` accepts only the keys
open_clip's CLIP / CustomTextCLIP and their tower configs take (CrateTextCfg's for a CRATE-alpha text tower), sizes
that are positive integers no larger than the largest value any registered config uses for that key, and a
parametric CRATE-alpha tower name within the registered families' bounds (clip_tower_names); `check_preprocess_cfg`
accepts only finite normalisation and a bounded size. Everything they raise is a ModelConfigError (a ValueError)
naming the file and the key.
"""
from __future__ import annotations

import dataclasses
import inspect
import math

import open_clip.factory as open_clip_factory
import open_clip.model as open_clip_model

from crate_clip.core.errors import UserError
from crate_clip.models.clip_tower_names import FAMILY, parse_clip_tower_name
from crate_clip.models.open_clip_text_tower import text_tower_kind

# sizes bounded by the registered configs (image_size may be [h, w], a ResNet tower's layers one count per stage)
SIZE_KEYS = {"vision_cfg": ("width", "layers", "heads", "image_size", "patch_size", "head_width"),
             "text_cfg": ("width", "layers", "heads", "context_length", "vocab_size")}


MAX_PREPROCESS_SIZE = 4096   # pixels a side an export's preprocessing may resize to (the run config's image bound)


class ModelConfigError(UserError, ValueError):
    """A model config read from a file that crate-clip will not build; the message names the file and the keys."""


def _init_keys(cls) -> set[str]:
    return {n for n, p in inspect.signature(cls.__init__).parameters.items()
            if n != "self" and p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL)}


# custom_text: which class open_clip builds; multimodal_cfg: CoCa's decoder
TOP_KEYS = (_init_keys(open_clip_model.CLIP) | _init_keys(open_clip_model.CustomTextCLIP)
            | {"custom_text", "multimodal_cfg"})
TOWER_KEYS = {"vision_cfg": {f.name for f in dataclasses.fields(open_clip_model.CLIPVisionCfg)},
              "text_cfg": {f.name for f in dataclasses.fields(open_clip_model.CLIPTextCfg)}}


def registered_maxima() -> dict[str, int]:
    """The largest value every registered open_clip config uses, per size key (`vision_cfg.width`, `embed_dim`)."""
    maxima: dict[str, int] = {}
    for cfg in open_clip_factory._MODEL_CONFIGS.values():
        _raise_max(maxima, "embed_dim", cfg.get("embed_dim"))
        for part, keys in SIZE_KEYS.items():
            for key in keys:
                _raise_max(maxima, f"{part}.{key}", (cfg.get(part) or {}).get(key))
    return maxima


def _raise_max(maxima: dict, key: str, value) -> None:
    values = value if isinstance(value, (list, tuple)) else [value]
    for v in values:
        if isinstance(v, int) and not isinstance(v, bool):
            maxima[key] = max(maxima.get(key, 0), v)


def check_model_cfg(model_cfg, source) -> None:
    """ValueError naming `source` and the key unless `model_cfg` is a config open_clip can build at a size no
    registered config exceeds; nothing is allocated."""
    if not isinstance(model_cfg, dict):
        raise ModelConfigError(f"{source}: model_cfg is {type(model_cfg).__name__}, not an object of open_clip settings")
    problems = [f"unknown key {k!r}" for k in sorted(set(model_cfg) - TOP_KEYS)]
    maxima = registered_maxima()
    problems += _size_problems("embed_dim", model_cfg.get("embed_dim"), maxima, required=True)
    for part in ("vision_cfg", "text_cfg"):
        tower = model_cfg.get(part)
        if not isinstance(tower, dict):
            problems.append(f"{part} is {type(tower).__name__}, not an object")
            continue
        problems += _tower_problems(part, tower, maxima)
    if problems:
        raise ModelConfigError(f"{source}: not a model config crate-clip builds: {'; '.join(problems)}; fix: use the "
                         f"open_clip_config.json the export was written with")


def _tower_problems(part: str, tower: dict, maxima: dict) -> list[str]:
    problems = []
    kind = text_tower_kind(tower) if part == "text_cfg" else None
    if kind is not None and kind.check_cfg is not None:
        try:
            kind.check_cfg(tower)   # a registered text tower kind checks its own keys and values
        except (ValueError, TypeError) as exc:
            problems.append(f"text_cfg: {exc}")
    else:
        problems += [f"unknown key {part}.{k}" for k in sorted(set(tower) - TOWER_KEYS[part])]
    for key in SIZE_KEYS[part]:
        if key in tower:
            problems += _size_problems(f"{part}.{key}", tower[key], maxima)
    name = tower.get("timm_model_name") if part == "vision_cfg" else None
    if isinstance(name, str) and name.startswith((f"{FAMILY}.", f"{FAMILY}_w")):   # parametric: sizes bounded
        try:
            parse_clip_tower_name(name)
        except ValueError as exc:
            problems.append(f"vision_cfg.timm_model_name: {exc}")
    return problems


def _size_problems(key: str, value, maxima: dict, required: bool = False) -> list[str]:
    if value is None:
        return [f"{key} missing"] if required else []
    values = value if isinstance(value, (list, tuple)) and value else [value]   # [h, w]; a ResNet's layers
    bound = maxima.get(key)
    for v in values:
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            return [f"{key} is {value!r}, not a positive integer"]
        if bound is not None and v > bound:
            return [f"{key} is {v:,}, more than the {bound:,} of the largest registered config"]
    return []


EXPORT_FIX = "use the open_clip_config.json the export was written with"


def check_preprocess_cfg(preprocess_cfg, source, name: str = "preprocess_cfg", fix: str = EXPORT_FIX) -> None:
    """ModelConfigError naming `source` and the key (`name`.mean) unless the image preprocessing a file records is
    usable: mean and std one or three finite numbers (std above 0), the size 1 to MAX_PREPROCESS_SIZE px. A NaN
    mean would turn every image into NaN, reported later as images that could not be read."""
    if preprocess_cfg is None:
        return
    if not isinstance(preprocess_cfg, dict):
        raise ModelConfigError(f"{source}: {name} is {type(preprocess_cfg).__name__}, not an object; fix: {fix}")
    problems = []
    for key, low in (("mean", -math.inf), ("std", 0.0)):
        value = preprocess_cfg.get(key)
        values = value if isinstance(value, (list, tuple)) else [value]
        if value is None:
            continue
        if len(values) not in (1, 3) or not all(_finite_above(v, low) for v in values):
            what = "finite numbers above 0" if key == "std" else "finite numbers"
            problems.append(f"{name}.{key} is {value!r}, not one or three {what}")
    size = preprocess_cfg.get("size")
    sizes = size if isinstance(size, (list, tuple)) and size else [size]
    if size is not None and not all(isinstance(v, int) and not isinstance(v, bool) and 1 <= v <= MAX_PREPROCESS_SIZE
                                    for v in sizes):
        problems.append(f"{name}.size is {size!r}, not 1 to {MAX_PREPROCESS_SIZE:,} px")
    if problems:
        raise ModelConfigError(f"{source}: its image preprocessing cannot be used: {'; '.join(problems)}; fix: {fix}")


def check_recorded_normalisation(recorded, source, fix: str) -> None:
    """check_preprocess_cfg of the normalisation (mean, std) a checkpoint's record (crate_clip.json) holds
    (CheckpointInfo.normalisation; None or {} when it records none)."""
    if isinstance(recorded, dict):
        recorded = {k: v for k, v in recorded.items() if k in ("mean", "std")}
    check_preprocess_cfg(recorded, source, "normalisation", fix)


def _finite_above(value, low: float) -> bool:
    return (isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
            and value > low)
