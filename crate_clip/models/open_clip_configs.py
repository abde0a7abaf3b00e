"""Registers the CRATE-alpha CLIP model configs (model_configs/*.json) with open_clip, and their preprocessing.

A JSON may name its image tower parametrically, `crate_alpha_clipa_w{width}_d{depth}_h{heads}_p{patch}_{px}`
(e.g. the demo's `crate_alpha_clipa_w128_d4_h4_p4_28`): such towers are registered with timm here, so a
config's tower can be retuned by editing its JSON alone (open_clip passes no tower kwargs to timm).

open_clip takes a built-in config's preprocessing only from a pretrained tag, so `preprocess_cfg_for`
holds it for our names (create_clip sets it on the model; exports write it): the CLIPA models use
ImageNet's mean/std in training and evaluation, and the official evaluation's Resize(224) (shorter
side; torchvision's default bilinear) + CenterCrop(224). Others keep open_clip's (OpenAI, bicubic).
"""
import json
import re
from pathlib import Path
from typing import Dict, List

import open_clip
from timm.models import is_model, register_model

from crate_clip.models import crate_alpha
from crate_clip.models.open_clip_text_tower import check_text_tower_config
from crate_clip.models.image_normalization import IMAGENET_MEAN, IMAGENET_STD, OPENAI_MEAN, OPENAI_STD

MODEL_CONFIG_DIR = Path(__file__).resolve().parent / "model_configs"
DEFAULT_PREPROCESS = {"mode": "RGB", "mean": OPENAI_MEAN, "std": OPENAI_STD,
                      "interpolation": "bicubic", "resize_mode": "shortest", "fill_color": 0}
# the official CRATE-alpha-CLIPA protocol (torch_inference/eval_in1k.py; main_clip.py normalises the same way)
CLIPA_PREPROCESS = {**DEFAULT_PREPROCESS, "mean": IMAGENET_MEAN, "std": IMAGENET_STD, "interpolation": "bilinear"}
PREPROCESS_CFGS = {name + suffix: CLIPA_PREPROCESS for suffix in ("", "-crate-text") for name in
                   ("CRATE-alpha-CLIPA-B-16", "CRATE-alpha-CLIPA-L-14", "CRATE-alpha-CLIPA-H-14")}
_PARAMETRIC = re.compile(r"^crate_alpha_clipa_w(\d+)_d(\d+)_h(\d+)_p(\d+)_(\d+)$")


def parse_clip_tower_name(name: str) -> Dict:
    """Architecture kwargs of a parametric CLIP tower name; ValueError when the name is not parametric."""
    m = _PARAMETRIC.match(name)
    if not m:
        raise ValueError(f"{name!r} is not of the form crate_alpha_clipa_w<width>_d<depth>_h<heads>_p<patch>_<px>")
    width, depth, heads, patch, px = map(int, m.groups())
    return dict(embed_dim=width, depth=depth, num_heads=heads, patch_size=patch, img_size=px,
                **crate_alpha._CLIP_TOWER_ARGS)


def register_clip_tower(name: str) -> None:
    """Register a parametric CLIP tower name with timm (no-op when already registered)."""
    if is_model(name):
        return
    arch = parse_clip_tower_name(name)
    crate_alpha.default_cfgs.update(
        crate_alpha.generate_default_cfgs({name: crate_alpha._cfg(arch["img_size"], num_classes=0)}))
    entry = crate_alpha._make_entrypoint(name, arch)
    setattr(crate_alpha, name, register_model(entry))


def register_open_clip_configs(config_dir: Path = MODEL_CONFIG_DIR) -> List[str]:
    """Register every JSON in `config_dir` with open_clip (and its parametric tower with timm); returns names."""
    names = []
    for path in sorted(Path(config_dir).glob("*.json")):
        cfg = json.loads(path.read_text())
        check_text_tower_config(cfg, str(path))
        tower = cfg.get("vision_cfg", {}).get("timm_model_name", "")
        if _PARAMETRIC.match(tower):
            register_clip_tower(tower)
        names.append(path.stem)
    open_clip.add_model_config(config_dir)
    return names


def image_patch_size(model_name: str) -> int | None:
    """The image tower's patch size in pixels from the open_clip config (no model is built); None when
    the config does not say or the name is not a registered config."""
    config = open_clip.get_model_config(model_name) or {}
    patch = config.get("vision_cfg", {}).get("patch_size")
    if patch is None and _PARAMETRIC.match(config.get("vision_cfg", {}).get("timm_model_name", "")):
        patch = parse_clip_tower_name(config["vision_cfg"]["timm_model_name"])["patch_size"]
    return int(patch) if patch else None


def preprocess_cfg_for(model_name: str) -> Dict:
    """Image preprocessing of a config (mean, std, interpolation, resize mode), without the size."""
    return dict(PREPROCESS_CFGS.get(model_name, DEFAULT_PREPROCESS))
