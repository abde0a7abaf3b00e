"""Patch-size changes of a CRATE-alpha CLIP between training stages (CRATE-alpha's large-patch pre-training).

The image tower's patch size lives in its weights (the kernel is p x p), so loading adopts the checkpoint's
patch size first; a stage that sets another one then resizes the kernel (`CrateAlpha.set_patch_size`) and
the position embedding follows on its grid. An export at a patch size other than its config's names its
tower parametrically (`crate_alpha_clipa_w.._d.._h.._p<patch>_<px>`), registered with timm by `register_tower_of`.
"""
from pathlib import Path
from typing import Dict, Optional, Union

import open_clip
import torch
from torch import nn

from crate_clip.models.clip_factory import (_image_tower, create_clip, load_clip_weights,
                                            read_state_dict, strip_module_prefix)
from crate_clip.models.crate_alpha import VARIANTS
from crate_clip.models.open_clip_configs import parse_clip_tower_name, register_clip_tower

KERNEL_KEY = "visual.trunk.patch_embed.proj.weight"


def checkpoint_patch_size(state_dict: Dict[str, torch.Tensor]) -> Optional[int]:
    """The image tower's patch size in a CLIP state dict (its conv kernel side), None without one."""
    kernel = state_dict.get(KERNEL_KEY)
    return None if kernel is None or kernel.ndim != 4 else int(kernel.shape[-1])


def tower_patch_size(model: nn.Module) -> Optional[int]:
    """The current patch size of a CLIP's CRATE-alpha image tower (None for other towers)."""
    trunk = _image_tower(model)
    return None if trunk is None else trunk.patch_size


def load_clip_weights_at_patch(model: nn.Module, source: Union[str, Path, Dict[str, torch.Tensor]],
                               patch_size: Optional[int] = None, resize: str = "pi_resize",
                               pos_embed_resize: Optional[str] = "grid_2d") -> None:
    """Load a CLIP checkpoint of any patch size into `model`, then move the tower to `patch_size` (if given).

    The tower first takes the checkpoint's patch size (the kernel is then loaded as it is), so without
    `patch_size` the model computes exactly what was saved.
    """
    sd = read_state_dict(source) if isinstance(source, (str, Path)) else strip_module_prefix(dict(source))
    trunk = _image_tower(model)
    saved = checkpoint_patch_size(sd)
    if trunk is not None and saved is not None:
        trunk.set_patch_size(saved)   # shapes only: the load below replaces the values
    load_clip_weights(model, sd, pos_embed_resize=pos_embed_resize)
    if patch_size is not None:
        if trunk is None:
            raise ValueError(f"patch_size {patch_size}: only a CRATE-alpha image tower can change its patch size")
        trunk.set_patch_size(patch_size, resize)


def config_patch_size(model_name: str) -> Optional[int]:
    """The patch size of a CLIP config's CRATE-alpha tower (None for other towers)."""
    tower = (open_clip.get_model_config(model_name) or {}).get("vision_cfg", {}).get("timm_model_name") or ""
    try:
        return parse_clip_tower_name(tower)["patch_size"]
    except ValueError:
        return VARIANTS.get(tower, {}).get("patch_size")


def create_clip_at_patch(model_name: str, source=None, patch_size: Optional[int] = None,
                         resize: str = "pi_resize", **create_kwargs) -> nn.Module:
    """create_clip(model_name, pretrained=source, ...) for a checkpoint of any patch size, the tower then
    moved to `patch_size` if given (a fresh kernel of that size when there is no checkpoint)."""
    sd = None if source is None else (read_state_dict(source) if isinstance(source, (str, Path))
                                      else strip_module_prefix(dict(source)))
    native = config_patch_size(model_name)
    if (patch_size in (None, native)) and (sd is None or checkpoint_patch_size(sd) in (None, native)):
        return create_clip(model_name, pretrained=sd, **create_kwargs)   # no patch-size change anywhere
    model = create_clip(model_name, **create_kwargs)   # the weights are loaded below
    if sd is None:
        set_fresh_patch_size(model, patch_size)
    else:
        load_clip_weights_at_patch(model, sd, patch_size, resize, create_kwargs.get("pos_embed_resize", "grid_2d"))
    return model


def set_fresh_patch_size(model: nn.Module, patch_size: int) -> None:
    """A randomly initialised CLIP at another patch size: a fresh kernel of that size (jax init)."""
    trunk = _image_tower(model)
    if trunk is None:
        raise ValueError(f"patch_size {patch_size}: only a CRATE-alpha image tower can change its patch size")
    trunk.set_patch_size(patch_size, "reinit")


def tower_name_at_patch(tower_name: str, patch_size: int, image_size: int) -> str:
    """The parametric timm name of `tower_name`'s architecture at another patch size (registered with timm)."""
    try:
        arch = parse_clip_tower_name(tower_name)
    except ValueError:
        if tower_name not in VARIANTS:
            raise ValueError(f"{tower_name!r} is not a CRATE-alpha CLIP tower: no patch-size variant") from None
        arch = VARIANTS[tower_name]
    if arch.get("overcomplete_ratio", 4) != 4 or arch.get("patch_embed_type", "conv") != "conv":
        raise ValueError(f"{tower_name!r}: only CRATE-alpha CLIP towers have parametric names")
    name = f"crate_alpha_clipa_w{arch['embed_dim']}_d{arch['depth']}_h{arch['num_heads']}_p{patch_size}_{image_size}"
    register_clip_tower(name)
    return name


def register_tower_of(model_cfg: dict) -> None:
    """Register a config's parametric image tower with timm (an export at a changed patch size names one)."""
    name = (model_cfg or {}).get("vision_cfg", {}).get("timm_model_name", "")
    try:
        parse_clip_tower_name(name)
    except ValueError:
        return
    register_clip_tower(name)
