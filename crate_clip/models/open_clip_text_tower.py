"""Lets open_clip build a CRATE-alpha text tower from a model config (installed by `import crate_clip`).

open_clip 3.x has no registry for text towers: `CustomTextCLIP.__init__` calls `open_clip.model._build_text_tower`,
which knows its TextTransformer and HuggingFace encoders only. `install_text_tower_builder` wraps that function once:
a `text_cfg` with `"tower": "crate_alpha"` builds `CrateAlphaText`, every other text_cfg goes to open_clip's own
builder unchanged. Such a config must also set `"custom_text": true` (open_clip's CLIP class would unpack its text
tower's parts into itself and run its own text forward); `check_text_tower_config` says so when it is missing.
Without `import crate_clip`, open_clip rejects the config (`CLIPTextCfg` has no `tower` key) instead of silently
building another tower.
"""
from typing import Dict

import open_clip.model as open_clip_model

from crate_clip.models.crate_text import TOWER_NAME, CrateAlphaText

_MARK = "_crate_clip_text_towers"


def is_crate_text_cfg(text_cfg) -> bool:
    """True for a text_cfg dict naming the CRATE-alpha text tower."""
    return isinstance(text_cfg, dict) and text_cfg.get("tower") == TOWER_NAME


def _wrap(open_clip_builder):
    def build_text_tower(embed_dim, text_cfg, quick_gelu=False, cast_dtype=None):
        if is_crate_text_cfg(text_cfg):
            return CrateAlphaText.from_cfg(embed_dim, text_cfg)
        return open_clip_builder(embed_dim, text_cfg, quick_gelu, cast_dtype)

    setattr(build_text_tower, _MARK, open_clip_builder)
    build_text_tower.__doc__ = "open_clip's text-tower builder, extended by crate_clip with the CRATE-alpha tower."
    return build_text_tower


def install_text_tower_builder() -> None:
    """Route open_clip's text-tower builder through ours (idempotent)."""
    current = getattr(open_clip_model, "_build_text_tower", None)
    if current is None:
        raise RuntimeError("open_clip.model._build_text_tower not found: this open_clip version builds text towers "
                           "another way; the CRATE-alpha text tower needs open_clip 3.x")
    if not hasattr(current, _MARK):
        open_clip_model._build_text_tower = _wrap(current)


def check_text_tower_config(model_cfg: Dict, source: str) -> None:
    """A config with a CRATE-alpha text tower must use open_clip's CustomTextCLIP: ValueError naming `source`."""
    if is_crate_text_cfg(model_cfg.get("text_cfg")) and not model_cfg.get("custom_text"):
        raise ValueError(f"{source}: text_cfg.tower is {TOWER_NAME!r}, which open_clip builds only as a "
                         f"CustomTextCLIP: add \"custom_text\": true to the config")
