"""Per-block attention maps and patch features of an image tower (CRATE-alpha or an open_clip ViT), their PCA,
and PNG renderings over the input image (CRATE `vis_utils/` and crate-emergence notebooks, as facts).

Feature facets: 'projection' is MSSA's U^T LN(Z) for CRATE-alpha (its Q = K = V) and the attention key
W_k LN(Z) + b_k for a ViT (the 'key' facet of DINO/CutLER); 'output' is the block's output tokens.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from PIL import Image

FACETS = ("projection", "output")


@dataclass
class BlockMaps:
    """One block's view of a batch: attention (B, h, L, L), facet features (B, L, d), grid, patch size."""
    attn: torch.Tensor
    projection: torch.Tensor
    output: torch.Tensor
    grid: tuple[int, int]
    patch_size: int

    def cls_attention(self) -> torch.Tensor:
        """Class-token attention to each patch per head, (B, h, gh, gw)."""
        B, h = self.attn.shape[:2]
        return self.attn[:, :, 0, 1:].reshape(B, h, *self.grid)

    def patch_features(self, facet: str = "projection") -> torch.Tensor:
        """Patch tokens of a facet, (B, gh*gw, d) (class token dropped)."""
        if facet not in FACETS:
            raise ValueError(f"facet must be one of {FACETS}, got {facet!r}")
        return getattr(self, facet)[:, 1:]


def _layer_index(layer: int, depth: int) -> int:
    index = layer if layer >= 0 else depth + layer
    if not 0 <= index < depth:
        raise ValueError(f"layer {layer} is out of range for a tower of {depth} blocks")
    return index


@torch.no_grad()
def block_maps(clip: torch.nn.Module, images: torch.Tensor, layer: int = -1) -> BlockMaps:
    """Attention and features of block `layer` (negative counts from the end) for (B, 3, H, W) images."""
    from crate_clip.eval.whitebox import find_crate_tower

    trunk = find_crate_tower(clip)
    if trunk is not None:
        return _crate_maps(trunk, images, _layer_index(layer, len(trunk.blocks)))
    visual = getattr(getattr(clip, "module", clip), "visual", clip)
    if hasattr(visual, "transformer") and hasattr(visual, "conv1"):
        return _vit_maps(visual, images, _layer_index(layer, len(visual.transformer.resblocks)))
    raise TypeError(f"{type(clip).__name__}: neither a CRATE-alpha tower nor an open_clip VisionTransformer")


def _crate_maps(trunk, images: torch.Tensor, index: int) -> BlockMaps:
    param = next(trunk.parameters())
    out = trunk.forward_intermediates(images.to(param.device, param.dtype), indices=[index], output_fmt="NLC",
                                      return_prefix_tokens=True, intermediates_only=True, return_attn=True,
                                      return_projections=True)
    spatial, prefix = out["intermediates"][0]
    proj = out["projections"][0]                                      # (B, h, L, hd)
    B, h, L, hd = proj.shape
    grid = (images.shape[-2] // trunk.patch_size, images.shape[-1] // trunk.patch_size)
    return BlockMaps(out["attn"][0].float(), proj.transpose(1, 2).reshape(B, L, h * hd).float(),
                     torch.cat([prefix, spatial], dim=1).float(), grid, trunk.patch_size)


def _vit_maps(visual, images: torch.Tensor, index: int) -> BlockMaps:
    block = visual.transformer.resblocks[index]
    seen = {}
    handles = [block.register_forward_pre_hook(lambda m, args: seen.__setitem__("x", args[0])),
               block.register_forward_hook(lambda m, args, out: seen.__setitem__("out", out))]
    try:
        param = next(visual.parameters())
        visual(images.to(param.device, param.dtype))
    finally:
        for handle in handles:
            handle.remove()
    x, out = seen["x"], seen["out"]
    if not getattr(visual.transformer, "batch_first", True):
        x, out = x.transpose(0, 1), out.transpose(0, 1)
    mha = block.attn
    q, k, _ = F.linear(block.ln_1(x), mha.in_proj_weight, mha.in_proj_bias).chunk(3, dim=-1)
    B, L, d = k.shape
    h = mha.num_heads
    qh, kh = (t.reshape(B, L, h, d // h).transpose(1, 2) for t in (q, k))
    attn = ((qh * (d // h) ** -0.5) @ kh.transpose(-2, -1)).softmax(dim=-1)
    patch = visual.patch_size[0] if isinstance(visual.patch_size, tuple) else visual.patch_size
    grid = (images.shape[-2] // patch, images.shape[-1] // patch)
    return BlockMaps(attn.float(), k.float(), out.float(), grid, patch)


def joint_pca(features: np.ndarray, components: int = 4) -> np.ndarray:
    """PCA of (n_images, n_patches, d) features fit jointly; returns (n_images, n_patches, components),
    each component min-max scaled to [0, 1] over all images."""
    n, p, d = features.shape
    x = features.reshape(n * p, d).astype(np.float64)
    x = x - x.mean(axis=0)
    _, _, vt = np.linalg.svd(x, full_matrices=False)
    k = min(components, vt.shape[0])
    proj = x @ vt[:k].T
    lo, hi = proj.min(axis=0), proj.max(axis=0)
    proj = (proj - lo) / np.where(hi > lo, hi - lo, 1.0)
    return proj.reshape(n, p, k)


# ---------------------------------------------------------------- rendering
def display_scale(size: tuple[int, int], target: int = 128) -> int:
    """Integer up-scaling so that small images (e.g. 28 px) are visible in a PNG."""
    return max(1, -(-target // min(size)))


def grid_to_image(values: np.ndarray, size: tuple[int, int], cmap: str | None = "inferno") -> Image.Image:
    """A (gh, gw) map (min-max scaled) or (gh, gw, 3) RGB in [0, 1], nearest-upsampled to `size` (w, h)."""
    if values.ndim == 2:
        import matplotlib

        lo, hi = float(values.min()), float(values.max())
        values = (values - lo) / (hi - lo) if hi > lo else np.zeros_like(values)
        values = matplotlib.colormaps[cmap](values)[..., :3]
    rgb = Image.fromarray((np.clip(values, 0, 1) * 255).astype(np.uint8))
    return rgb.resize(size, Image.NEAREST)


def overlay(image: Image.Image, heat: Image.Image, alpha: float = 0.6) -> Image.Image:
    """`heat` blended over `image` (both RGB, same size)."""
    return Image.blend(image.convert("RGB"), heat, alpha)


def strip(tiles: list[Image.Image], gap: int = 2) -> Image.Image:
    """Tiles side by side on white."""
    w = sum(t.width for t in tiles) + gap * (len(tiles) - 1)
    h = max(t.height for t in tiles)
    out = Image.new("RGB", (w, h), "white")
    x = 0
    for t in tiles:
        out.paste(t, (x, 0))
        x += t.width + gap
    return out


def attention_strip(image: Image.Image, cls_attn: np.ndarray, alpha: float = 0.6) -> Image.Image:
    """Input | head-average saliency | each head's class-token attention, all over the (up-scaled) image."""
    s = display_scale(image.size)
    big = image.convert("RGB").resize((image.width * s, image.height * s), Image.NEAREST)
    tiles = [big, overlay(big, grid_to_image(cls_attn.mean(axis=0), big.size), alpha)]
    tiles += [overlay(big, grid_to_image(head, big.size), alpha) for head in cls_attn]
    return strip(tiles)


def pca_strip(image: Image.Image, pca: np.ndarray, grid: tuple[int, int], alpha: float = 0.7) -> Image.Image:
    """Input | PCA components 2-4 as RGB over the image (component 1 is mostly foreground vs background)."""
    s = display_scale(image.size)
    big = image.convert("RGB").resize((image.width * s, image.height * s), Image.NEAREST)
    rgb = pca[:, 1:4].reshape(*grid, -1)
    if rgb.shape[-1] < 3:
        rgb = np.concatenate([rgb, np.zeros((*grid, 3 - rgb.shape[-1]))], axis=-1)
    return strip([big, overlay(big, grid_to_image(rgb, big.size), alpha)])
