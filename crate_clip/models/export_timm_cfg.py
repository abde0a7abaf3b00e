"""timm's pretrained config for an export's image tower: the export's own preprocessing, so that timm's
`resolve_data_config` and `create_transform` prepare images the way crate-clip's evaluation does.

timm keeps where a model's weights come from and how to preprocess images for them in one dict, the model's
pretrained_cfg, and a user loads a local weights file as `timm.create_model(name, pretrained=True,
pretrained_cfg_overlay=dict(file=W))`. When W lies in an export folder, the folder's open_clip_config.json says how
the tower was trained to see images (its preprocess_cfg). The tower's builder (crate_alpha._create_crate_alpha)
adds these keys under the user's own overlay keys, which win.

open_clip's evaluation transform resizes the shorter side to the image size and crops the center square
(resize_mode 'shortest'): timm's crop_pct 1.0 with crop_mode 'center'. A resize mode timm has no equivalent for is
refused rather than replaced by timm's default 0.875 crop, which scores other images.
"""
from __future__ import annotations

import math
from pathlib import Path

from crate_clip.checkpoint_io.bounded_reads import read_small_json
from crate_clip.core.errors import UserError
from crate_clip.core.image_normalization import OPENAI_MEAN, OPENAI_STD
from crate_clip.models.export_files import CONFIG_FILE

# open_clip's resize_mode -> timm's crop_mode (both at crop_pct 1.0); 'longest' pads, which timm cannot
CROP_MODES = {"shortest": "center", "squash": "squash"}
FIX = "use the open_clip_config.json the export was written with, or give pretrained_cfg_overlay the keys yourself"


class ExportPreprocessError(UserError, ValueError):
    """An export's preprocessing timm cannot take; the message names the file, the key and the fix."""


def export_config_path(weights: str | Path) -> Path | None:
    """The open_clip_config.json of the export folder holding `weights` (or of `weights` itself, a folder); None
    for a file outside an export."""
    path = Path(weights)
    config = path / CONFIG_FILE if path.is_dir() else path.parent / CONFIG_FILE
    return config if config.is_file() else None


def export_preprocessing(weights: str | Path, img_size=None) -> dict:
    """pretrained_cfg keys (input_size, mean, std, interpolation, crop_pct, crop_mode) of the export holding
    `weights`; {} for a file outside an export. `img_size`: the size the tower is built at, when not the export's."""
    config_path = export_config_path(weights)
    if config_path is None:
        return {}
    config = read_small_json(config_path)
    pre = config.get("preprocess_cfg") if isinstance(config, dict) else None
    if not isinstance(pre, dict) or not pre:
        return {}
    mode = pre.get("resize_mode", "shortest")
    if mode not in CROP_MODES:
        raise ExportPreprocessError(f"{config_path}: preprocess_cfg.resize_mode {mode!r} has no timm equivalent "
                                    f"(timm resizes as {sorted(CROP_MODES)}); fix: {FIX}")
    size = img_size or pre.get("size") or ((config.get("model_cfg") or {}).get("vision_cfg") or {}).get("image_size")
    sizes = [size, size] if isinstance(size, int) else list(size) if isinstance(size, (list, tuple)) else []
    if len(sizes) != 2 or not all(isinstance(v, int) and not isinstance(v, bool) and v >= 1 for v in sizes):
        raise ExportPreprocessError(f"{config_path}: preprocess_cfg.size is {size!r}, not a size in pixels; fix: {FIX}")
    return {"input_size": (3, *sizes), "mean": _three(pre.get("mean", OPENAI_MEAN), "mean", config_path),
            "std": _three(pre.get("std", OPENAI_STD), "std", config_path),
            "interpolation": pre.get("interpolation", "bicubic"), "crop_pct": 1.0, "crop_mode": CROP_MODES[mode]}


def _three(values, key: str, config_path: Path) -> tuple:
    """One or three finite numbers (a std above 0) as three floats; a NaN would turn every image into NaN."""
    values = list(values) if isinstance(values, (list, tuple)) else [values]
    low = 0.0 if key == "std" else -math.inf
    if len(values) not in (1, 3) or not all(isinstance(v, (int, float)) and not isinstance(v, bool)
                                            and math.isfinite(v) and v > low for v in values):
        what = "finite numbers above 0" if key == "std" else "finite numbers"
        raise ExportPreprocessError(f"{config_path}: preprocess_cfg.{key} is {values!r}, not one or three {what}; "
                                    f"fix: {FIX}")
    return tuple(float(v) for v in (values * 3 if len(values) == 1 else values))
