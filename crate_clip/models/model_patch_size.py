"""The image tower's patch size of a model config, for the run config's checks (each stage's image size against the
patch).

The process that checks a run and launches its workers (`crate-clip train --nproc N`) runs these checks; for a
config shipped here it reads the JSON (model_config_files.py), so it starts the workers without the seconds of
importing open_clip and timm that only the workers use. Any other name is asked from open_clip's registry.
"""
from __future__ import annotations

from crate_clip.models.model_config_files import parametric_patch, shipped_config


def image_patch_size(model_name: str) -> int | None:
    """The image tower's patch size in pixels from the model config (no model is built): the tower name's when it
    carries one, else vision_cfg.patch_size; None when the config does not say or the name is not a registered config.
    Shipped configs are read from their JSON; other names from open_clip's registry (which imports open_clip)."""
    cfg = shipped_config(model_name)
    if cfg is None:
        from crate_clip.models.open_clip_configs import registered_patch_size   # imports open_clip

        return registered_patch_size(model_name)
    vision = cfg.get("vision_cfg", {})
    patch = parametric_patch(vision.get("timm_model_name") or "") or vision.get("patch_size")
    return int(patch) if patch else None
