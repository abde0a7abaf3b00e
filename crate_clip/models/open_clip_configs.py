"""Registers the CRATE-alpha CLIP model configs (model_configs/*.json) with open_clip, and their preprocessing.

A JSON may name its image tower by its parameters, `crate_alpha_clipa.w{width}_d{depth}_h{heads}_p{patch}_{px}`
(e.g. the demo's `crate_alpha_clipa.w128_d4_h4_p4_28`, see clip_tower_names.py), so a config's tower can be
retuned by editing its JSON alone (open_clip passes no tower kwargs to timm); the underscore form
`crate_alpha_clipa_w.._p{patch}_{px}` is registered with timm here.

open_clip takes a built-in config's preprocessing only from a pretrained tag, so `preprocess_cfg_for`
holds it for our names (create_clip sets it on the model; exports write it): the CLIPA models use
ImageNet's mean/std in training and evaluation, and the official evaluation's Resize(224) (shorter
side; torchvision's default bilinear) + CenterCrop(224). Others keep open_clip's (OpenAI, bicubic).
"""
import json
from pathlib import Path
from typing import Dict, List

import open_clip

from crate_clip.models.clip_tower_names import register_clip_tower, tower_arch
from crate_clip.core.image_normalization import IMAGENET_MEAN, IMAGENET_STD, OPENAI_MEAN, OPENAI_STD
from crate_clip.models.model_config_files import MODEL_CONFIG_DIR
from crate_clip.models.open_clip_text_tower import check_text_tower_config

DEFAULT_PREPROCESS = {"mode": "RGB", "mean": OPENAI_MEAN, "std": OPENAI_STD,
                      "interpolation": "bicubic", "resize_mode": "shortest", "fill_color": 0}
# the official CRATE-alpha-CLIPA protocol (torch_inference/eval_in1k.py; main_clip.py normalises the same way)
CLIPA_PREPROCESS = {**DEFAULT_PREPROCESS, "mean": IMAGENET_MEAN, "std": IMAGENET_STD, "interpolation": "bilinear"}
PREPROCESS_CFGS = {name + suffix: CLIPA_PREPROCESS for suffix in ("", "-crate-text") for name in
                   ("CRATE-alpha-CLIPA-B-16", "CRATE-alpha-CLIPA-L-14", "CRATE-alpha-CLIPA-H-14")}


def register_open_clip_configs(config_dir: Path = MODEL_CONFIG_DIR) -> List[str]:
    """Register every JSON in `config_dir` with open_clip (and its parametric tower with timm); returns names."""
    names = []
    for path in sorted(Path(config_dir).glob("*.json")):
        cfg = json.loads(path.read_text())
        check_text_tower_config(cfg, str(path))
        tower = cfg.get("vision_cfg", {}).get("timm_model_name") or ""
        if tower.startswith("crate_alpha_clipa_w"):
            register_clip_tower(tower)
        names.append(path.stem)
    open_clip.add_model_config(config_dir)
    return names


def registered_patch_size(model_name: str) -> int | None:
    """The image tower's patch size in pixels from the config open_clip has registered (no model is built): a CRATE
    tower's name's, else vision_cfg.patch_size; None when the config does not say or the name is not registered.
    model_patch_size.image_patch_size answers for the shipped configs without importing open_clip."""
    vision = (open_clip.get_model_config(model_name) or {}).get("vision_cfg", {})
    patch = (tower_arch(vision.get("timm_model_name") or "") or {}).get("patch_size") or vision.get("patch_size")
    return int(patch) if patch else None


def preprocess_cfg_for(model_name: str) -> Dict:
    """Image preprocessing of a config (mean, std, interpolation, resize mode), without the size."""
    return dict(PREPROCESS_CFGS.get(model_name, DEFAULT_PREPROCESS))
