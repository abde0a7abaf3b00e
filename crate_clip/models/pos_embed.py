"""Position-embedding resizing, in one place: the image tower's (two modes) and the text tower's.

Image (`(1, 1 + gh*gw, d)`, class slot first):
  - 'grid_2d': the patch grid resampled in 2-D (timm's bicubic, antialiased), class slot kept apart;
    what `CrateAlpha.set_input_size` and timm/open_clip do for ViTs.
  - 'official_1d': the whole flattened sequence, class slot included, resampled as a 1-D signal by
    linear interpolation with half-pixel centres, as the official CRATE-alpha CLIPA code does at its
    84 -> 224 px stage change (`jax.image.resize(pos, new_shape, 'bilinear')`, 37 -> 257 rows). When
    shrinking, jax antialiases (triangle filter widened by the scale); the same filter is used here.
  The 1-D rule is the paper's for growing a grid; shrinking one with it mixes rows of different image rows
  (a 4x4 model at 3x3 scored 16.1% on Fashion-MNIST where grid_2d gave 48.0%), so a shrink switches to
  grid_2d with a warning.
Text (`(ctx, d)`): linear interpolation along the positions, open_clip's own rule.

Nothing here runs implicitly: the tower's `set_input_size` and the loaders in clip_factory call it.
"""
import math
import warnings
from typing import Sequence, Tuple

import torch
import torch.nn.functional as F

POS_EMBED_RESIZE_MODES = ("grid_2d", "official_1d")


def check_resize_mode(mode: str) -> str:
    """Validate a position-embedding resize mode name."""
    if mode not in POS_EMBED_RESIZE_MODES:
        raise ValueError(f"position-embedding resize mode must be one of {POS_EMBED_RESIZE_MODES}, got {mode!r}")
    return mode


def square_grid(num_tokens: int, key: str = "pos_embed") -> Tuple[int, int]:
    """The square patch grid of a position embedding with `num_tokens` rows (class slot included)."""
    side = math.isqrt(max(num_tokens - 1, 0))
    if side < 1 or side * side != num_tokens - 1:
        raise ValueError(f"{key}: {num_tokens} rows are not a square patch grid plus a class slot")
    return side, side


def resize_image_pos_embed(pos: torch.Tensor, new_grid: Sequence[int], old_grid: Sequence[int] = None,
                           mode: str = "grid_2d") -> torch.Tensor:
    """(1, 1 + old_gh*old_gw, d) -> (1, 1 + new_gh*new_gw, d) by `mode` ('grid_2d' or 'official_1d')."""
    check_resize_mode(mode)
    old_grid = tuple(old_grid) if old_grid is not None else square_grid(pos.shape[1])
    new_grid = tuple(new_grid)
    if new_grid == old_grid:
        return pos
    mode = mode_for_grids(mode, old_grid, new_grid)
    dtype = pos.dtype
    x = pos.float() if dtype in (torch.float16, torch.bfloat16) else pos
    if mode == "grid_2d":
        from timm.layers import resample_abs_pos_embed   # importing timm registers the towers: not for the constants

        out = resample_abs_pos_embed(x, new_size=list(new_grid), old_size=list(old_grid), num_prefix_tokens=1)
    else:
        out = _resize_sequence(x, 1 + new_grid[0] * new_grid[1])
    return out.to(dtype)


def mode_for_grids(mode: str, old_grid: Sequence[int], new_grid: Sequence[int]) -> str:
    """The mode a resize from `old_grid` to `new_grid` uses: `mode`, except official_1d on a shrinking grid,
    which switches to grid_2d and says so (a UserWarning)."""
    if mode == "official_1d" and new_grid[0] * new_grid[1] < old_grid[0] * old_grid[1]:
        warnings.warn(f"position embedding {old_grid[0]}x{old_grid[1]} -> {new_grid[0]}x{new_grid[1]}: official_1d "
                      "is the paper's rule for growing a grid; shrinking uses grid_2d", UserWarning, stacklevel=3)
        return "grid_2d"
    return mode


def _resize_sequence(pos: torch.Tensor, length: int) -> torch.Tensor:
    # (1, L, d) as a one-row image (1, d, 1, L): 'bilinear' with a size-1 height is linear along L;
    # antialias only acts when shrinking, where it is jax's widened triangle filter
    x = pos.permute(0, 2, 1).unsqueeze(2)
    shrink = length < pos.shape[1]
    x = F.interpolate(x, size=(1, length), mode="bilinear", align_corners=False, antialias=shrink)
    return x.squeeze(2).permute(0, 2, 1)


def resize_text_pos_embed(pos: torch.Tensor, length: int) -> torch.Tensor:
    """(ctx, d) -> (length, d) by linear interpolation along the positions (open_clip's rule)."""
    if pos.shape[0] == length:
        return pos
    x = pos.float() if pos.dtype in (torch.float16, torch.bfloat16) else pos
    x = F.interpolate(x.t().unsqueeze(0), size=length, mode="linear", align_corners=False)  # (1, width, ctx)
    return x.squeeze(0).t().to(pos.dtype)
