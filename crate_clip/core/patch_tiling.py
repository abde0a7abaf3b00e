"""Pixels in, pixels used: an image size the image tower's patches tile exactly, checked in one place.

A patch convolution (stride = kernel = patch) over a side that is not a multiple of the patch drops the leftover
pixel rows and columns, and every patch then sits shifted against the image it covered at another stage (issue 39:
a 28 px stage at 9 px patches). The run config (train, plan, demo), `crate-clip eval` and the export refuse such a
size with this module's sentence, which names both numbers and the nearest sizes that tile. No torch here: the
config check runs before anything heavy is imported.
"""
from __future__ import annotations

from typing import Optional

from crate_clip.core.errors import UserError


class PatchTilingError(UserError, ValueError):
    """An image size its patches (or its patch grid) do not tile; the message names both numbers and the fix."""


def tiling_sizes(image_size: int, unit: int) -> list[int]:
    """The multiples of `unit` nearest to `image_size` (below, if it holds one unit, and above)."""
    below = image_size - image_size % unit
    return [size for size in (below, below + unit) if size >= unit]


def _sizes_text(image_size: int, unit: int) -> str:
    return " or ".join(str(size) for size in tiling_sizes(image_size, unit))


def _dropped(pixels: int) -> str:
    return f"{pixels} pixel row{'s' if pixels > 1 else ''} and column{'s' if pixels > 1 else ''}"


def patch_tiling_problem(image_size: int, patch_size: Optional[int]) -> Optional[str]:
    """None when `patch_size` px patches tile `image_size` px exactly (or the patch size is unknown), else the
    sentence: 'image_size 28 is not a multiple of patch_size 9 (...); use 27 or 36'."""
    if not patch_size or image_size < patch_size or image_size % patch_size == 0:
        return None   # a size below one patch has its own error (it holds no patch at all)
    return (f"image_size {image_size} is not a multiple of patch_size {patch_size} (the patch convolution would "
            f"drop {_dropped(image_size % patch_size)}); use {_sizes_text(image_size, patch_size)}")


def grid_tiling_problem(image_size: int, grid: int) -> Optional[str]:
    """None when a `grid` x `grid` patch grid tiles `image_size` px with whole patches of one size (the grid kept,
    the kernel resized: eval's 'patch' mode), else the sentence with the nearest sizes that do."""
    if grid < 1 or (image_size >= grid and image_size % grid == 0):
        return None
    if image_size < grid:
        return (f"image_size {image_size} cannot hold the {grid}x{grid} patch grid (a patch needs at least 1 px); "
                f"use {grid} or more (a multiple of {grid})")
    patch = image_size // grid
    return (f"image_size {image_size} is not a multiple of the {grid}x{grid} patch grid ({patch} px patches would "
            f"drop {_dropped(image_size % grid)}); use {_sizes_text(image_size, grid)}")


def check_patch_tiling(where: str, image_size: int, patch_size: Optional[int]) -> None:
    """Raise PatchTilingError('<where>: image_size ... ; use ...') unless the patches tile the image."""
    problem = patch_tiling_problem(image_size, patch_size)
    if problem:
        raise PatchTilingError(f"{where}: {problem}")
