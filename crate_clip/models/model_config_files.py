"""The CRATE-alpha CLIP model configs shipped as JSON (model_configs/) and the form of the parametric tower names,
read without importing open_clip or timm (model_patch_size.py reads a shipped config's patch from here)."""
from __future__ import annotations

import json
import re
from pathlib import Path

MODEL_CONFIG_DIR = Path(__file__).resolve().parent / "model_configs"
# the parametric tower names (clip_tower_names.py): crate_alpha_clipa.w<width>_d<depth>_h<heads>_p<patch>_<px>
FAMILY = "crate_alpha_clipa"
TAG = re.compile(r"^w(\d+)_d(\d+)_h(\d+)_p(\d+)_(\d+)$")
UNDERSCORE = re.compile(rf"^{FAMILY}_(w\d+_d\d+_h\d+_p\d+_\d+)$")


def shipped_config(model_name: str) -> dict | None:
    """The JSON config shipped for `model_name`; None for a name that is not ours."""
    path = MODEL_CONFIG_DIR / f"{model_name}.json"
    shipped = path.parent == MODEL_CONFIG_DIR and path.is_file()   # a name with a '/' is no shipped config
    return json.loads(path.read_text()) if shipped else None


def parametric_tag(tower: str) -> str:
    """The `w.._d.._h.._p.._px` part of a parametric tower name, either form (the tag after `crate_alpha_clipa.`, or
    the underscore form's); '' for any other name. TAG matches it when it is well formed."""
    arch, _, tag = tower.partition(".")
    if arch == FAMILY:
        return tag
    underscore = UNDERSCORE.match(tower)
    return underscore.group(1) if underscore else ""


def parametric_patch(tower: str) -> int | None:
    """The patch size a parametric tower name carries (either form); None for any other name."""
    m = TAG.match(parametric_tag(tower))
    return int(m.group(4)) if m else None
