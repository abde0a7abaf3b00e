"""Patch-size changes of a CRATE-alpha CLIP between training stages (CRATE-alpha's large-patch pre-training).

The image tower's patch size lives in its weights (the kernel is p x p), so loading adopts the checkpoint's
patch size first; a stage that sets another one then resizes the kernel (`CrateAlpha.set_patch_size`) and
the position embedding follows on its grid. An export at a patch or image size other than its config's names
its tower by its parameters (`crate_alpha_clipa.w.._d.._h.._p<patch>_<px>`, clip_tower_names.py), which timm
resolves after `import crate_clip`.
"""
from pathlib import Path
from typing import Dict, Optional, Tuple, Union

import torch
from torch import nn

from crate_clip.core.patch_tiling import PatchTilingError, grid_tiling_problem, patch_tiling_problem
from crate_clip.models.clip_weights import (IMAGE_POS_KEY, TEXT_POS_KEY, _image_tower, load_clip_weights,
                                            read_state_dict, strip_module_prefix)
from crate_clip.models.clip_tower_names import parse_clip_tower_name, register_clip_tower
from crate_clip.models.pos_embed import square_grid

KERNEL_KEY = "visual.trunk.patch_embed.proj.weight"


def checkpoint_patch_size(state_dict: Dict[str, torch.Tensor]) -> Optional[int]:
    """The image tower's patch size in a CLIP state dict (its conv kernel side), None without one."""
    kernel = state_dict.get(KERNEL_KEY)
    return None if kernel is None or kernel.ndim != 4 else int(kernel.shape[-1])


def checkpoint_input_sizes(state_dict: Dict[str, torch.Tensor]) -> Tuple[Optional[int], Optional[int]]:
    """(image size, context length) a CLIP state dict of ours was saved at: its patch grid x patch size and its
    text position embedding's length; None where it does not say (another layout, a non-square grid)."""
    patch, pos = checkpoint_patch_size(state_dict), state_dict.get(IMAGE_POS_KEY)
    image_size = None
    if patch is not None and pos is not None and pos.ndim == 3:
        try:
            image_size = square_grid(pos.shape[1])[0] * patch
        except ValueError:
            pass
    text = state_dict.get(TEXT_POS_KEY)
    return image_size, (int(text.shape[0]) if text is not None and text.ndim == 2 else None)


def tower_patch_size(model: nn.Module) -> Optional[int]:
    """The current patch size of a CLIP's CRATE-alpha image tower (None for other towers)."""
    trunk = _image_tower(model)
    return None if trunk is None else trunk.patch_size


def load_clip_weights_at_patch(model: nn.Module, source: Union[str, Path, Dict[str, torch.Tensor]],
                               patch_size: Optional[int] = None, resize: str = "pi_resize",
                               pos_embed_resize: Optional[str] = "grid_2d", origin: Optional[Path] = None) -> None:
    """Load a CLIP checkpoint of any patch size into `model`, then move the tower to `patch_size` (if given).

    The tower first takes the checkpoint's patch size (the kernel is then loaded as it is), so without
    `patch_size` the model computes exactly what was saved. `origin`: the file a state dict was read from, for errors.
    """
    sd = read_state_dict(source) if isinstance(source, (str, Path)) else strip_module_prefix(dict(source))
    trunk = _image_tower(model)
    saved = checkpoint_patch_size(sd)
    if trunk is not None and saved is not None:
        target = trunk.img_size
        trunk.set_patch_size(saved)   # shapes only: the load below replaces the values
        grid = _saved_grid(sd)
        if patch_size is not None and grid is not None and target[0] == target[1] and target[0] // patch_size == grid:
            # the new patch size keeps the saved grid (e.g. 21 px / p7 -> 28 px / p9): load at the saved size,
            # then only the kernel changes (PI-resize), the position embedding is kept exactly
            trunk.set_input_size(grid * saved)
            load_clip_weights(model, sd, pos_embed_resize=pos_embed_resize, origin=origin)
            trunk.img_size = target
            trunk.set_patch_size(patch_size, resize)
            return
    load_clip_weights(model, sd, pos_embed_resize=pos_embed_resize, origin=origin)
    if patch_size is not None:
        if trunk is None:
            raise ValueError(f"patch_size {patch_size}: only a CRATE-alpha image tower can change its patch size")
        trunk.set_patch_size(patch_size, resize)


def _saved_grid(state_dict: Dict[str, torch.Tensor]) -> Optional[int]:
    pos = state_dict.get(IMAGE_POS_KEY)
    try:
        return square_grid(pos.shape[1])[0] if pos is not None and pos.ndim == 3 else None
    except ValueError:
        return None


def set_fresh_patch_size(model: nn.Module, patch_size: int) -> None:
    """A randomly initialised CLIP at another patch size: a fresh kernel of that size (jax init)."""
    trunk = _image_tower(model)
    if trunk is None:
        raise ValueError(f"patch_size {patch_size}: only a CRATE-alpha image tower can change its patch size")
    trunk.set_patch_size(patch_size, "reinit")


def register_tower_of(model_cfg: dict) -> None:
    """Register a config's underscore-form parametric image tower with timm (`crate_alpha_clipa_w.._p7_28`;
    the `crate_alpha_clipa.w.._p7_28` form and the registered variants need nothing)."""
    name = (model_cfg or {}).get("vision_cfg", {}).get("timm_model_name") or ""
    try:
        parse_clip_tower_name(name)
    except ValueError:
        return
    register_clip_tower(name)


def patch_for_image_size(grid: int, image_size: int) -> int:
    """The patch size that lays `grid` whole patches across `image_size` px exactly; PatchTilingError when `grid`
    does not divide it (the leftover pixels would be dropped: crate_clip.core.patch_tiling)."""
    problem = grid_tiling_problem(image_size, grid)
    if problem:
        raise PatchTilingError(f"--resize patch: {problem}, or --resize grid")
    return image_size // grid


def model_tiling_problem(model: nn.Module) -> Optional[str]:
    """None when the image tower's patches tile its input size, else the sentence naming both numbers and the
    nearest sizes that tile (CRATE-alpha towers and open_clip's ViT; other towers are not checked)."""
    trunk = _image_tower(model)
    if trunk is not None:
        return patch_tiling_problem(trunk.img_size[0], trunk.patch_size)
    visual = getattr(model, "visual", None)
    size, patch = getattr(visual, "image_size", None), getattr(visual, "patch_size", None)
    if isinstance(size, (tuple, list)) and isinstance(patch, (tuple, list)):
        return patch_tiling_problem(int(size[0]), int(patch[0]))
    return None


def set_resolution_by_patch(model: nn.Module, image_size: int) -> int:
    """Run a CRATE-alpha CLIP at `image_size` with its patch grid and position embedding kept: the kernel is
    PI-resized to image_size // grid px (27 px on a 3x3 grid: patch 9). `image_size` must be a multiple of the
    grid (PatchTilingError otherwise): the patches then tile the images as they tiled the training images.
    Returns the new patch size; the input size is `patch_input_size(model)` (= image_size)."""
    trunk = _image_tower(model)
    if trunk is None:
        raise ValueError("--resize patch: only a CRATE-alpha image tower can change its patch size; use --resize grid")
    gh, gw = trunk.grid_size
    if gh != gw:
        raise ValueError(f"--resize patch: the tower's patch grid {gh}x{gw} is not square")
    patch = patch_for_image_size(gh, image_size)
    trunk.img_size = (gh * patch, gh * patch)   # the grid at the new patch size is the old one: pos-embed kept
    trunk.set_patch_size(patch, "pi_resize")
    return patch


def patch_input_size(model: nn.Module) -> int:
    """The image side a CRATE-alpha tower takes (its img_size; grid x patch after set_resolution_by_patch)."""
    return _image_tower(model).img_size[0]
