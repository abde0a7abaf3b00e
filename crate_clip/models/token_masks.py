"""Image token reduction (CLIPA): random / grid / block masks that keep a subset of patch tokens."""
import math
from typing import Literal, Tuple, get_args

import torch

TokenMask = Literal["none", "random", "grid", "block"]
TOKEN_MASKS = get_args(TokenMask)


def check_token_mask(kind: str, drop_ratio: float) -> None:
    """Raise ValueError for an unknown mask kind or a drop ratio outside [0, 1)."""
    if kind not in TOKEN_MASKS:
        raise ValueError(f"token_mask must be one of {TOKEN_MASKS}, got {kind!r}")
    if not 0.0 <= drop_ratio < 1.0:
        raise ValueError(f"token_drop_ratio must be in [0, 1), got {drop_ratio}")


def num_kept_tokens(kind: str, grid: Tuple[int, int], drop_ratio: float) -> int:
    """How many patch tokens a mask keeps on a (rows, cols) patch grid."""
    H, W = grid
    if kind == "random":
        return max(1, round(H * W * (1.0 - drop_ratio)))
    if kind == "grid":
        return math.ceil(H / 2) * math.ceil(W / 2)
    if kind == "block":
        bh, bw = _block_shape(grid, drop_ratio)
        return bh * bw
    return H * W


def _block_shape(grid: Tuple[int, int], drop_ratio: float) -> Tuple[int, int]:
    # a rectangle of about (1 - drop_ratio) of the grid's area, same aspect ratio as the grid
    side = math.sqrt(1.0 - drop_ratio)
    return max(1, min(grid[0], round(grid[0] * side))), max(1, min(grid[1], round(grid[1] * side)))


def kept_patch_indices(kind: str, batch: int, grid: Tuple[int, int], drop_ratio: float,
                       device: torch.device) -> torch.Tensor:
    """(B, K) sorted raster indices of the patch tokens to keep, drawn independently per sample.

    random: a uniform random subset of round(N (1 - drop_ratio)) patches.
    grid:   one patch in each 2x2 window, at a random offset per sample (drop_ratio ignored, ~75% dropped).
    block:  one contiguous rectangle of about (1 - drop_ratio) of the grid, at a random place per sample.
    """
    H, W = grid
    if kind == "random":
        keep = num_kept_tokens(kind, grid, drop_ratio)
        noise = torch.rand(batch, H * W, device=device)
        return noise.argsort(dim=1)[:, :keep].sort(dim=1).values
    if kind == "grid":
        off = torch.randint(0, 2, (batch, 2, 1, 1), device=device)
        rows = (torch.arange(0, H, 2, device=device).view(1, -1, 1) + off[:, 0]).clamp(max=H - 1)
        cols = (torch.arange(0, W, 2, device=device).view(1, 1, -1) + off[:, 1]).clamp(max=W - 1)
        return (rows * W + cols).reshape(batch, -1)
    if kind == "block":
        bh, bw = _block_shape(grid, drop_ratio)
        top = torch.randint(0, H - bh + 1, (batch, 1, 1), device=device)
        left = torch.randint(0, W - bw + 1, (batch, 1, 1), device=device)
        rows = top + torch.arange(bh, device=device).view(1, -1, 1)
        cols = left + torch.arange(bw, device=device).view(1, 1, -1)
        return (rows * W + cols).reshape(batch, -1)
    raise ValueError(f"no indices for token mask {kind!r}")


def apply_token_mask(x: torch.Tensor, kind: str, grid: Tuple[int, int], drop_ratio: float,
                     num_prefix_tokens: int = 1) -> torch.Tensor:
    """Keep the prefix (class) token and the masked subset of patch tokens of x (B, prefix + N, d)."""
    if kind == "none" or (kind == "random" and drop_ratio == 0.0):
        return x
    B, _, d = x.shape
    idx = kept_patch_indices(kind, B, grid, drop_ratio, x.device)
    patches = x[:, num_prefix_tokens:].gather(1, idx.unsqueeze(-1).expand(-1, -1, d))
    return torch.cat([x[:, :num_prefix_tokens], patches], dim=1)
