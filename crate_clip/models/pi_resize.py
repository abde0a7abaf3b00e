"""The pseudo-inverse patch-kernel resize (PI-resize, FlexiViT, Beyer et al. 2023), written out.

A p x p patch x and its resize R x to q x q (R: the image resize as a (q*q, p*p) matrix) should give the same
token: <R x, w'> = <x, w> for every x, i.e. R^T w' = w. For q >= p, R has full column rank and
w' = pinv(R^T) w solves it exactly; for q < p it is the least-squares kernel. R is built by resizing the p*p
basis images with the resize the images get: bicubic with antialias (torch's antialiased kernel is PIL's
bicubic, a = -0.5, in both directions), as the evaluation preprocessing (PIL) and timm's resample_patch_embed.
"""
from functools import lru_cache

import torch
import torch.nn.functional as F


@lru_cache(maxsize=16)
def resize_matrix(old: int, new: int, mode: str = "bicubic") -> torch.Tensor:
    """(new*new, old*old) float64: column j is basis image j (old x old) resized to new x new, flattened."""
    basis = torch.eye(old * old, dtype=torch.float64).reshape(old * old, 1, old, old)
    resized = F.interpolate(basis, size=(new, new), mode=mode, align_corners=False, antialias=True)
    return resized.reshape(old * old, new * new).t().contiguous()


def resize_image_patches(x: torch.Tensor, patch: int, new_patch: int, mode: str = "bicubic") -> torch.Tensor:
    """(B, C, g*patch, g*patch) -> (B, C, g*new_patch, g*new_patch), each patch resized on its own by
    resize_matrix: the images a PI-resized kernel reproduces token for token."""
    b, c, h, w = x.shape
    gh, gw = h // patch, w // patch
    tiles = x[..., :gh * patch, :gw * patch].reshape(b, c, gh, patch, gw, patch).permute(0, 1, 2, 4, 3, 5)
    r = resize_matrix(patch, new_patch, mode).to(x.dtype)
    out = tiles.reshape(b, c, gh, gw, patch * patch) @ r.t()
    out = out.reshape(b, c, gh, gw, new_patch, new_patch).permute(0, 1, 2, 4, 3, 5)
    return out.reshape(b, c, gh * new_patch, gw * new_patch)


def pi_resize_kernel(weight: torch.Tensor, new: int, mode: str = "bicubic") -> torch.Tensor:
    """A (d, C, p, p) conv kernel -> (d, C, new, new) with <resize(x), w'> = <x, w> per patch (see above)."""
    d, c, p, q = weight.shape
    if p != q:
        raise ValueError(f"PI-resize takes square kernels, got {p}x{q}")
    if new == p:
        return weight
    r = resize_matrix(p, new, mode)                                    # (new², p²)
    flat = weight.reshape(d * c, p * p).to(torch.float64)
    resized = flat @ torch.linalg.pinv(r)                              # rows w'^T = w^T pinv(R)
    return resized.reshape(d, c, new, new).to(weight.dtype)
