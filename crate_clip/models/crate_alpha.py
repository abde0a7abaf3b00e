"""CRATE-alpha and the original CRATE as one timm-registered family of white-box vision transformers.

Order (timm's habit): patch embeddings, block, model class, init, checkpoint_filter_fn, _create, variants.
The three CRATE-alpha switches rebuild the paper's ablation ladder from CRATE:
  overcomplete_ratio (C: 1 -> 4), decoupled_dictionary (separate output dictionary D1), ista_residual.
"""
import contextlib
import logging
import math
from typing import Dict, List, Optional, Tuple, Union

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from timm.layers import DropPath, to_2tuple
from timm.models import build_model_with_cfg, generate_default_cfgs, register_model
from timm.models._features import feature_take_indices

from crate_clip.core.image_normalization import IMAGENET_MEAN, IMAGENET_STD
from crate_clip.models.ista import ISTA
from crate_clip.models.mssa import MSSA
from crate_clip.models.pi_resize import pi_resize_kernel
from crate_clip.models.pos_embed import resize_image_pos_embed, square_grid
from crate_clip.models.token_masks import apply_token_mask, check_token_mask

_logger = logging.getLogger(__name__)

__all__ = ["CrateAlpha", "checkpoint_filter_fn", "official_to_timm", "resize_patch_kernel"]

PATCH_RESIZE_MODES = ("pi_resize", "bilinear")


def resize_patch_kernel(weight: torch.Tensor, patch_size: int, mode: str = "pi_resize") -> torch.Tensor:
    """A (d, C, p, p) patch kernel resized to (d, C, patch_size, patch_size).

    'pi_resize': FlexiViT's pseudo-inverse resize (pi_resize.py; equal to timm's resample_patch_embed): a patch
    upsampled to the new size gives the same token as the original patch under the old kernel, so token
    norms are kept. 'bilinear': the kernel itself resampled (antialiased when shrinking, as
    jax.image.resize), what the CRATE-alpha paper did; values keep their scale, so a kernel shrunk from
    32 to 8 px sums 16x fewer pixels and gives about 16x smaller tokens.
    """
    if mode not in PATCH_RESIZE_MODES:
        raise ValueError(f"patch resize mode must be one of {PATCH_RESIZE_MODES}, got {mode!r}")
    if weight.shape[-2:] == (patch_size, patch_size):
        return weight
    if mode == "pi_resize":
        return pi_resize_kernel(weight.float(), patch_size).to(weight.dtype)
    return F.interpolate(weight.float(), size=(patch_size, patch_size), mode="bilinear", align_corners=False,
                         antialias=patch_size < weight.shape[-1]).to(weight.dtype)


class ConvPatchEmbed(nn.Module):
    """CRATE-alpha patch embedding: a stride-p p x p convolution (VALID: leftover pixels are dropped)."""

    def __init__(self, patch_size: int, in_chans: int, embed_dim: int, bias: bool = True):
        super().__init__()
        self.patch_size = patch_size
        self.proj = nn.Conv2d(in_chans, embed_dim, kernel_size=patch_size, stride=patch_size, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """(B, C, H, W) -> (B, floor(H/p) * floor(W/p), d), raster order over the patch grid."""
        return self.proj(x).flatten(2).transpose(1, 2)


class CratePatchEmbed(nn.Module):
    """Original CRATE patch embedding: p*p*C pixel vectors -> LayerNorm -> Linear -> LayerNorm."""

    def __init__(self, patch_size: int, in_chans: int, embed_dim: int, eps: float = 1e-5):
        super().__init__()
        self.patch_size = patch_size
        pixels = patch_size * patch_size * in_chans
        self.norm_in = nn.LayerNorm(pixels, eps=eps)
        self.proj = nn.Linear(pixels, embed_dim)
        self.norm_out = nn.LayerNorm(embed_dim, eps=eps)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """(B, C, H, W) -> (B, N, d); pixels that do not fill a whole patch are dropped (as VALID conv)."""
        B, C, H, W = x.shape
        p = self.patch_size
        gh, gw = H // p, W // p
        x = x[:, :, :gh * p, :gw * p].reshape(B, C, gh, p, gw, p)
        x = x.permute(0, 2, 4, 3, 5, 1).reshape(B, gh * gw, p * p * C)  # (p1 p2 c) order, as the original
        return self.norm_out(self.proj(self.norm_in(x)))


class CrateBlock(nn.Module):
    """Pre-norm block: t + MSSA(LN1 t), then ISTA(LN2 t) added to t (`residual`) or replacing it.

    The one block of both towers: the image tower attends over all tokens, a causal text tower
    (`causal=True`) lets each token attend to itself and the tokens before it.
    """

    def __init__(self, dim: int, num_heads: int, overcomplete_ratio: int = 4, decoupled: bool = True,
                 residual: bool = True, eta: float = 0.1, lambd: float = 0.1, attn_out_bias: bool = False,
                 norm_eps: float = 1e-6, drop_path: float = 0.0, attn_impl: str = "sdpa", causal: bool = False):
        super().__init__()
        self.norm1 = nn.LayerNorm(dim, eps=norm_eps)
        self.attn = MSSA(dim, num_heads, out_bias=attn_out_bias, attn_impl=attn_impl, causal=causal)
        self.norm2 = nn.LayerNorm(dim, eps=norm_eps)
        self.ista = ISTA(dim, overcomplete_ratio, decoupled, eta, lambd)
        self.residual = residual
        self.drop_path = DropPath(drop_path) if drop_path > 0 else nn.Identity()

    def init_weights(self) -> None:
        """JAX init of the published models: U and W_out normal(0.02), W_out's bias 0, D and D1 uniform(sqrt(6/d))."""
        nn.init.normal_(self.attn.qkv.weight, std=0.02)
        nn.init.normal_(self.attn.proj.weight, std=0.02)
        if self.attn.proj.bias is not None:
            nn.init.zeros_(self.attn.proj.bias)
        self.ista.reset_parameters()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """(B, L, d) -> (B, L, d)."""
        return self.forward_with_extras(x, False)[0]

    def forward_with_extras(self, x: torch.Tensor, return_attn: bool):
        """Block output plus the attention map (when asked) and the ISTA sparse code."""
        a, attn = self.attn(self.norm1(x), return_attn=return_attn)
        x = x + self.drop_path(a)
        if self.residual and isinstance(self.drop_path, nn.Identity):
            x, code = self.ista(self.norm2(x), residual=x)  # residual add fused into the last matmul
        else:
            out, code = self.ista(self.norm2(x))
            x = x + self.drop_path(out) if self.residual else out
        return x, attn, code


def blocks_with_extras(blocks, x: torch.Tensor, take_indices, return_attn: bool, return_projections: bool,
                       checkpointing: bool) -> Tuple[torch.Tensor, list]:
    """`x` through `blocks` (both towers' forward_intermediates); returns the last output and, per block whose index
    is in `take_indices`, (its output, attention or None, ISTA code, MSSA projections of its input or None)."""
    taken = []
    for i, blk in enumerate(blocks):
        proj = None
        if return_projections and i in take_indices:  # one extra d x d matmul: analysis only
            proj = blk.attn.project(blk.norm1(x))
        if checkpointing:
            x, attn, code = checkpoint(blk.forward_with_extras, x, return_attn, use_reentrant=False)
        else:
            x, attn, code = blk.forward_with_extras(x, return_attn)
        if i in take_indices:
            taken.append((x, attn, code, proj))
    return x, taken


# ----- an input's patch grid and its position embedding -----
# Module-level and fx-wrapped: a torch.fx trace (symbolic_trace, timm's create_feature_extractor) records each as
# one call, so their Python checks on the input's size run when the traced graph runs, not while tracing.
def patch_grid(img_size: Tuple[int, int], patch_size: int) -> Tuple[int, int]:
    """The patch grid of an (h, w) input (VALID convolution: remainders dropped); smaller than a patch: error."""
    grid = (img_size[0] // patch_size, img_size[1] // patch_size)
    if min(grid) < 1:
        raise ValueError(f"image size {(img_size[0], img_size[1])} is smaller than one {patch_size}px patch")
    return grid


def pos_embed_for_grid(pos_embed: torch.Tensor, grid: Tuple[int, int], model_grid: Tuple[int, int],
                       img_size: Tuple[int, int], dynamic_img_size: bool) -> torch.Tensor:
    """The tower's position embedding for an input's patch grid: its own, or resampled when `dynamic_img_size`."""
    if grid == model_grid:
        return pos_embed
    if not dynamic_img_size:
        raise ValueError(
            f"the input gives a {grid} patch grid but the position embedding is for {model_grid} "
            f"(img_size={img_size}): call set_input_size(new_size) or build with dynamic_img_size=True")
    return _resampled_pos_embed(pos_embed, grid, model_grid)


@torch.jit.unused
def _resampled_pos_embed(pos_embed: torch.Tensor, grid: Tuple[int, int], model_grid: Tuple[int, int]) -> torch.Tensor:
    # TorchScript: a scripted tower runs at its own grid (set_input_size before scripting); resampling per
    # forward (dynamic_img_size) stays eager, where timm's resampler and the two resize modes live
    return resize_image_pos_embed(pos_embed, grid, model_grid)


torch.fx.wrap("patch_grid")
torch.fx.wrap("pos_embed_for_grid")


class CrateAlpha(nn.Module):
    """CRATE-alpha / CRATE image tower (timm interface).

    Input sizes follow the official VALID convolution: an image side that is not a multiple of the patch
    size loses its last `side % patch_size` pixels (e.g. 84 px with /16 patches gives a 5x5 grid).
    The position embedding is built for `img_size`; other input sizes need `set_input_size` (persistent)
    or `dynamic_img_size=True` (resampled each forward).

    Token masks (`token_mask` in none/random/grid/block, `token_drop_ratio`) act after the position
    embedding, in training mode only, and always keep the class token.

    Architecture switches (defaults = CRATE-alpha): `overcomplete_ratio` C of the dictionary (1 = CRATE),
    `decoupled_dictionary` (learned output dictionary D1), `ista_residual` (residual around ISTA);
    original CRATE also sets patch_embed_type='crate', attn_out_bias=True, norm_eps=1e-5.
    CLIP towers: patch_bias=False, num_classes=0. `attn_impl='math'` is the explicit softmax baseline.
    """

    def __init__(
            self,
            img_size: Union[int, Tuple[int, int]] = 224,
            patch_size: int = 16,
            in_chans: int = 3,
            num_classes: int = 1000,
            global_pool: str = "token",
            embed_dim: int = 768,
            depth: int = 12,
            num_heads: int = 12,
            overcomplete_ratio: int = 4,
            decoupled_dictionary: bool = True,
            ista_residual: bool = True,
            eta: float = 0.1,
            lambd: float = 0.1,
            patch_embed_type: str = "conv",
            patch_bias: bool = True,
            attn_out_bias: bool = False,
            norm_eps: float = 1e-6,
            drop_rate: float = 0.0,
            drop_path_rate: float = 0.0,
            patch_drop_rate: float = 0.0,
            token_mask: str = "none",
            token_drop_ratio: float = 0.0,
            dynamic_img_size: bool = False,
            attn_impl: str = "sdpa",
            weight_init: str = "jax",
    ):
        super().__init__()
        if global_pool not in ("token", "avg", ""):
            raise ValueError(f"global_pool must be 'token', 'avg' or '', got {global_pool!r}")
        if patch_drop_rate > 0 and token_mask == "none":
            # open_clip's `patch_dropout` arrives as timm's patch_drop_rate: it is our random token mask
            token_mask, token_drop_ratio = "random", patch_drop_rate
        check_token_mask(token_mask, token_drop_ratio)
        self.num_classes = num_classes
        self.in_chans = in_chans   # timm's model attribute (input channels; default_cfg input_size[0])
        self.global_pool = global_pool
        self.num_features = self.head_hidden_size = self.embed_dim = embed_dim
        self.num_prefix_tokens = 1
        self.dynamic_img_size = dynamic_img_size
        self.grad_checkpointing = False
        self.checkpoint_blocks: Optional[int] = None   # with grad_checkpointing: the first N blocks only (None: all)
        self.token_mask, self.token_drop_ratio = token_mask, token_drop_ratio
        self.patch_size = patch_size
        self.img_size = to_2tuple(img_size)
        self.grid_size = patch_grid(self.img_size, patch_size)

        if patch_embed_type == "conv":
            self.patch_embed = ConvPatchEmbed(patch_size, in_chans, embed_dim, bias=patch_bias)
        elif patch_embed_type == "crate":
            self.patch_embed = CratePatchEmbed(patch_size, in_chans, embed_dim, eps=norm_eps)
        else:
            raise ValueError(f"patch_embed_type must be 'conv' or 'crate', got {patch_embed_type!r}")
        self.cls_token = nn.Parameter(torch.zeros(1, 1, embed_dim))
        self.pos_embed = nn.Parameter(torch.zeros(1, self.grid_size[0] * self.grid_size[1] + 1, embed_dim))
        dpr = [drop_path_rate * i / max(depth - 1, 1) for i in range(depth)]  # python floats: works on meta
        self.blocks = nn.ModuleList([
            CrateBlock(embed_dim, num_heads, overcomplete_ratio, decoupled_dictionary, ista_residual, eta, lambd,
                       attn_out_bias, norm_eps, dpr[i], attn_impl)
            for i in range(depth)])
        self.feature_info = [dict(module=f"blocks.{i}", num_chs=embed_dim, reduction=patch_size) for i in range(depth)]
        self.norm = nn.LayerNorm(embed_dim, eps=norm_eps)
        self.head_drop = nn.Dropout(drop_rate)
        self.head = nn.Linear(embed_dim, num_classes) if num_classes > 0 else nn.Identity()
        if weight_init != "skip":
            self.init_weights(weight_init)

    # ----- initialisation and policies -----
    def init_weights(self, mode: str = "jax") -> None:
        """JAX initialisation of the published CRATE-alpha models (spec table)."""
        if mode != "jax":
            raise ValueError(f"weight_init must be 'jax' or 'skip', got {mode!r}")
        pe = self.patch_embed
        if isinstance(pe, ConvPatchEmbed):
            fan_in = pe.proj.in_channels * pe.patch_size ** 2
            bound = math.sqrt(6.0 / fan_in)
            nn.init.uniform_(pe.proj.weight, -bound, bound)
        else:
            nn.init.normal_(pe.proj.weight, std=0.02)
        if pe.proj.bias is not None:
            nn.init.zeros_(pe.proj.bias)
        nn.init.normal_(self.cls_token, std=1e-6)
        nn.init.normal_(self.pos_embed, std=0.02)
        for blk in self.blocks:
            blk.init_weights()
        if isinstance(self.head, nn.Linear):
            nn.init.normal_(self.head.weight, std=0.02)
            nn.init.zeros_(self.head.bias)

    @torch.jit.ignore
    def no_weight_decay(self) -> set:
        """Parameters the published recipes do not decay: cls, pos and the dictionaries D, D1 (1-D ones too)."""
        names = {"cls_token", "pos_embed"}
        names.update(n for n, p in self.named_parameters() if n.endswith(("ista.D", "ista.D1")) or p.ndim <= 1)
        return names

    @torch.jit.ignore
    def group_matcher(self, coarse: bool = False) -> Dict:
        """Parameter groups for layer-wise LR decay / partial freezing (timm convention)."""
        return dict(stem=r"^cls_token|pos_embed|patch_embed",
                    blocks=[(r"^blocks\.(\d+)", None), (r"^norm", (99999,))])

    @torch.jit.ignore
    def load_state_dict(self, state_dict, strict: bool = True, assign: bool = False):
        """nn.Module's, also given an export's whole CLIP weights: `timm.create_model(name, checkpoint_path=...)`
        hands a file's tensors to the model unfiltered, so the tower takes its own part (checkpoint_filter_fn)."""
        if is_clip_layout(state_dict):
            state_dict = checkpoint_filter_fn(state_dict, self)
        return super().load_state_dict(state_dict, strict=strict, assign=assign)

    @torch.jit.ignore
    def set_grad_checkpointing(self, enable: bool = True) -> None:
        """Recompute each block in the backward pass instead of storing its activations."""
        self.grad_checkpointing = enable

    def set_token_mask(self, kind: str, drop_ratio: float = 0.0) -> None:
        """Choose the training-time token mask ('none', 'random', 'grid', 'block') and its drop ratio."""
        check_token_mask(kind, drop_ratio)
        self.token_mask, self.token_drop_ratio = kind, drop_ratio

    @torch.jit.ignore
    def get_classifier(self) -> nn.Module:
        """The classification head."""
        return self.head

    def reset_classifier(self, num_classes: int, global_pool: Optional[str] = None) -> None:
        """Replace the head (0 removes it) and optionally the pooling ('token', 'avg', '')."""
        if global_pool is not None:
            if global_pool not in ("token", "avg", ""):
                raise ValueError(f"global_pool must be 'token', 'avg' or '', got {global_pool!r}")
            self.global_pool = global_pool
        self.num_classes = num_classes
        # the new head matches the model: its dtype and device (a float64 or meta model keeps working) and its
        # train/eval mode, as timm's reset_classifier contract asks
        like = self.cls_token
        head = nn.Linear(self.embed_dim, num_classes, device=like.device, dtype=like.dtype) if num_classes > 0 \
            else nn.Identity()
        self.head = head.train(self.training)

    # ----- input size -----
    def set_input_size(self, img_size: Optional[Union[int, Tuple[int, int]]] = None,
                       patch_size: Optional[int] = None, pos_embed_resize: str = "grid_2d") -> None:
        """Rebuild for a new input size; the current position embedding is resampled once
        (`pos_embed_resize`: 'grid_2d' bicubic with the cls slot apart, or 'official_1d', see pos_embed.py).
        A new `patch_size` goes through `set_patch_size` (pi_resize of the kernel), as timm's ViT does."""
        if patch_size is not None:
            p = to_2tuple(patch_size)
            if p[0] != p[1]:
                raise ValueError(f"CRATE towers use square patches, got {patch_size}")
            self.set_patch_size(p[0])
        if img_size is None:
            return
        new_grid = patch_grid(to_2tuple(img_size), self.patch_size)
        if new_grid != self.grid_size:
            with torch.no_grad():
                pos = resize_image_pos_embed(self.pos_embed.detach(), new_grid, self.grid_size, pos_embed_resize)
            self.pos_embed = nn.Parameter(pos, requires_grad=self.pos_embed.requires_grad)
        self.img_size, self.grid_size = to_2tuple(img_size), new_grid

    def set_patch_size(self, patch_size: int, resize: str = "pi_resize") -> None:
        """Change the patch size in place: the conv kernel is resized (`resize`: 'pi_resize' keeps token norms,
        'bilinear' as the CRATE-alpha paper, 'reinit' draws a fresh kernel) and the position embedding is
        resampled 2-D to the new grid (cls slot apart). The same patch size is a no-op."""
        if patch_size == self.patch_size:
            return
        if not isinstance(self.patch_embed, ConvPatchEmbed):
            raise ValueError("set_patch_size: only the conv patch embedding (CRATE-alpha) can change its patch size")
        new_grid = (self.img_size[0] // patch_size, self.img_size[1] // patch_size)
        if min(new_grid) < 1:
            raise ValueError(f"patch size {patch_size} is larger than the image size {self.img_size}")
        old = self.patch_embed.proj
        conv = nn.Conv2d(old.in_channels, old.out_channels, kernel_size=patch_size, stride=patch_size,
                         bias=old.bias is not None, device=old.weight.device, dtype=old.weight.dtype)
        with torch.no_grad():
            if resize == "reinit":
                bound = math.sqrt(6.0 / (old.in_channels * patch_size ** 2))   # the jax init of init_weights
                nn.init.uniform_(conv.weight, -bound, bound)
            else:
                conv.weight.copy_(resize_patch_kernel(old.weight, patch_size, resize))
            if old.bias is not None:
                conv.bias.copy_(old.bias)
            pos = resize_image_pos_embed(self.pos_embed.detach(), new_grid, self.grid_size)
        conv.weight.requires_grad_(old.weight.requires_grad)
        self.patch_embed.proj, self.patch_embed.patch_size = conv, patch_size
        self.pos_embed = nn.Parameter(pos, requires_grad=self.pos_embed.requires_grad)
        self.patch_size, self.grid_size = patch_size, new_grid
        for info in self.feature_info:
            info["reduction"] = patch_size

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs):
        # load_state_dict never resamples (our loaders do that, on request: clip_factory.load_clip_weights,
        # checkpoint_filter_fn). A checkpoint saved at another square grid is loaded exactly as saved and
        # the tower takes its input size: open_clip's `create_model(pretrained=<84 px file>,
        # force_image_size=84)` builds the tower at 224 and loads before calling set_input_size(84), and
        # must give back the saved model bit for bit. A forward at the old size then fails, naming
        # set_input_size. Any other shape mismatch is torch's usual error.
        # (a ZeRO-3-partitioned parameter has no elements: DeepSpeed loads those itself, gathered)
        key = prefix + "pos_embed"
        pos = state_dict.get(key)
        if (isinstance(pos, torch.Tensor) and pos.ndim == 3 and self.pos_embed.numel() > 0
                and pos.shape != self.pos_embed.shape and pos.shape[-1] == self.embed_dim
                and math.isqrt(pos.shape[1] - 1) ** 2 == pos.shape[1] - 1):
            grid = square_grid(pos.shape[1], key)
            self.pos_embed = nn.Parameter(self.pos_embed.data.new_empty(pos.shape),
                                          requires_grad=self.pos_embed.requires_grad)
            self.img_size = (grid[0] * self.patch_size, grid[1] * self.patch_size)
            self.grid_size = grid
            _logger.warning("%s: the checkpoint is for a %s patch grid: the tower now takes %s px input "
                            "(call set_input_size to resample it to another size)", key, grid, self.img_size)
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)

    # ----- forward -----
    def _embed(self, x: torch.Tensor) -> Tuple[torch.Tensor, Tuple[int, int]]:
        """Patch embedding, class token and position embedding: (B, C, H, W) -> (B, 1 + N, d), grid."""
        grid = patch_grid((x.shape[-2], x.shape[-1]), self.patch_size)
        x = self.patch_embed(x)
        pos = pos_embed_for_grid(self.pos_embed, grid, self.grid_size, self.img_size, self.dynamic_img_size)
        x = torch.cat([self.cls_token.expand(x.shape[0], -1, -1).to(x.dtype), x], dim=1)
        return x + pos.to(x.dtype), grid

    def forward_features(self, x: torch.Tensor) -> torch.Tensor:
        """Tokens after the final LayerNorm: (B, 1 + N_kept, d)."""
        x, grid = self._embed(x)
        if not torch.jit.is_scripting() and self.training and self.token_mask != "none":   # training only
            x = apply_token_mask(x, self.token_mask, grid, self.token_drop_ratio)
        recomputed = len(self.blocks) if self.checkpoint_blocks is None else self.checkpoint_blocks
        for i, blk in enumerate(self.blocks):
            if not torch.jit.is_scripting() and self.grad_checkpointing and i < recomputed and torch.is_grad_enabled():
                x = checkpoint(blk, x, use_reentrant=False)
            else:
                x = blk(x)
        return self.norm(x)

    def pool(self, x: torch.Tensor) -> torch.Tensor:
        """Class token ('token'), mean of the patch tokens ('avg') or all tokens ('')."""
        if self.global_pool == "token":
            return x[:, 0]
        if self.global_pool == "avg":
            return x[:, 1:].mean(dim=1)
        return x

    def forward_head(self, x: torch.Tensor, pre_logits: bool = False) -> torch.Tensor:
        """Pool, then the classification head (skipped when `pre_logits`)."""
        x = self.head_drop(self.pool(x))
        return x if pre_logits else self.head(x)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Images (B, C, H, W) -> logits (B, num_classes), or pooled features when the head is removed."""
        return self.forward_head(self.forward_features(x))

    def forward_intermediates(
            self,
            x: torch.Tensor,
            indices: Optional[Union[int, List[int]]] = None,
            return_prefix_tokens: bool = False,
            norm: bool = False,
            stop_early: bool = False,
            output_fmt: str = "NCHW",
            intermediates_only: bool = False,
            return_attn: bool = False,
            return_sparse_codes: bool = False,
            return_projections: bool = False,
    ):
        """Per-block outputs (timm convention), optionally with per-block attention maps and ISTA codes.

        `indices`: last n blocks if int, all if None, else the listed block indices. Without extras the
        return is timm's: intermediates list (`intermediates_only`) or (final tokens, intermediates).
        With `return_attn` / `return_sparse_codes` it is a dict with keys 'intermediates', 'attn'
        ((B, h, L, L) per taken block), 'sparse_codes' ((B, L, C*d) per taken block), 'projections'
        (`return_projections`: the MSSA subspace projections U_k^T LN(Z) of the block's input, (B, h, L, hd))
        and, unless `intermediates_only`, 'final'. No token mask is applied here (white-box analysis of full images).
        """
        if output_fmt not in ("NCHW", "NLC"):
            raise ValueError(f"output_fmt must be 'NCHW' or 'NLC', got {output_fmt!r}")
        take_indices, max_index = feature_take_indices(len(self.blocks), indices)
        B = x.shape[0]
        x, (gh, gw) = self._embed(x)
        blocks = self.blocks if not stop_early else self.blocks[:max_index + 1]
        x, taken = blocks_with_extras(blocks, x, take_indices, return_attn, return_projections,
                                      self.grad_checkpointing and torch.is_grad_enabled())  # as forward_features does
        intermediates = []
        for y, _, _, _ in taken:
            y = self.norm(y) if norm else y
            prefix, spatial = y[:, :1], y[:, 1:]
            if output_fmt == "NCHW":
                spatial = spatial.reshape(B, gh, gw, -1).permute(0, 3, 1, 2).contiguous()
            intermediates.append((spatial, prefix) if return_prefix_tokens else spatial)
        final = None if intermediates_only else self.norm(x)
        if return_attn or return_sparse_codes or return_projections:
            out = {"intermediates": intermediates}
            if return_projections:
                out["projections"] = [proj for _, _, _, proj in taken]
            if return_attn:
                out["attn"] = [attn for _, attn, _, _ in taken]
            if return_sparse_codes:
                out["sparse_codes"] = [code for _, _, code, _ in taken]
            if not intermediates_only:
                out["final"] = final
            return out
        return intermediates if intermediates_only else (final, intermediates)

    def prune_intermediate_layers(self, indices: Union[int, List[int]] = 1, prune_norm: bool = False,
                                  prune_head: bool = True) -> List[int]:
        """Drop the blocks after the last index taken (timm convention); returns the taken indices."""
        take_indices, max_index = feature_take_indices(len(self.blocks), indices)
        self.blocks = self.blocks[:max_index + 1]
        if prune_norm:
            self.norm = nn.Identity()
        if prune_head:
            self.reset_classifier(0, "")
        return take_indices


# ----- official checkpoints -----
_OFFICIAL_BLOCK_KEYS = {
    "0.norm.weight": "norm1.weight", "0.norm.bias": "norm1.bias",
    "0.fn.qkv.weight": "attn.qkv.weight",
    "0.fn.to_out.0.weight": "attn.proj.weight", "0.fn.to_out.0.bias": "attn.proj.bias",
    "1.norm.weight": "norm2.weight", "1.norm.bias": "norm2.bias",
    "1.fn.D": "ista.D", "1.fn.D1": "ista.D1",
    "1.fn.weight": "ista.D",  # original CRATE (Ma-Lab-Berkeley/CRATE): the square dictionary, same orientation
}
_OFFICIAL_TOP_KEYS = {
    "conv1.weight": "patch_embed.proj.weight", "conv1.bias": "patch_embed.proj.bias",
    "cls_token": "cls_token", "pos_embedding": "pos_embed",
    "mlp_head.0.weight": "norm.weight", "mlp_head.0.bias": "norm.bias",
    "mlp_head.1.weight": "head.weight", "mlp_head.1.bias": "head.bias",
    # original CRATE's patch embedding: Rearrange, LayerNorm(3p^2), Linear, LayerNorm(d)
    **{f"to_patch_embedding.{i}.{w}": f"patch_embed.{name}.{w}"
       for i, name in ((1, "norm_in"), (2, "proj"), (3, "norm_out")) for w in ("weight", "bias")},
}


def official_to_timm(state_dict: Dict[str, torch.Tensor]) -> Dict[str, torch.Tensor]:
    """Rename the official keys to this model's: CRATE-alpha's PyTorch port and the original CRATE release.

    Keys it does not know are kept unchanged, so a strict load names them as unexpected.
    """
    out = {}
    for key, value in state_dict.items():
        new = _OFFICIAL_TOP_KEYS.get(key)
        if new is None and key.startswith("transformer.layers."):
            layer, _, rest = key[len("transformer.layers."):].partition(".")
            new = f"blocks.{layer}.{_OFFICIAL_BLOCK_KEYS[rest]}" if rest in _OFFICIAL_BLOCK_KEYS else None
        out[new or key] = value
    return out


def _is_official_layout(state_dict: Dict[str, torch.Tensor]) -> bool:
    return "conv1.weight" in state_dict or any(k.startswith("transformer.layers.") for k in state_dict)


# an open_clip CLIP's state dict (an export's weights): the tower is its TimmModel's trunk
CLIP_TOWER_PREFIX = "visual.trunk."


def is_clip_layout(state_dict: Dict[str, torch.Tensor]) -> bool:
    """Whether `state_dict` is a whole open_clip CLIP's (an export's weights) rather than a tower's."""
    return any(k.startswith(CLIP_TOWER_PREFIX) for k in state_dict)


def clip_image_tower(state_dict: Dict[str, torch.Tensor]) -> Dict[str, torch.Tensor]:
    """The image tower's entries of an open_clip CLIP's state dict, named as the tower's own (the projection,
    `visual.head`, and the text tower are the CLIP's, not the tower's)."""
    return {k[len(CLIP_TOWER_PREFIX):]: v for k, v in state_dict.items() if k.startswith(CLIP_TOWER_PREFIX)}


def checkpoint_filter_fn(state_dict: Dict[str, torch.Tensor], model: CrateAlpha) -> Dict[str, torch.Tensor]:
    """Adapt a checkpoint (official port layout, ours, or an export's whole CLIP) to `model`.

    Takes the image tower out of an open_clip CLIP's weights (an export's `visual.trunk.`), renames the official
    layout, resamples the position embedding to the model's grid, folds a patch-conv
    bias into the position embedding when the model's conv has none (exact: the bias adds to every patch
    token), drops the head when the model has none and keeps the model's own (freshly initialised) head
    when the class counts differ (e.g. a 19,167-class IN-21K checkpoint into a 1000-class model).
    """
    state_dict = {k[len("module."):] if k.startswith("module.") else k: v for k, v in state_dict.items()}
    if is_clip_layout(state_dict):
        state_dict = clip_image_tower(state_dict)
    if _is_official_layout(state_dict):
        state_dict = official_to_timm(state_dict)
    pos = state_dict.get("pos_embed")
    if pos is not None and pos.shape != model.pos_embed.shape:  # timm's pretrained loader: resizing is asked for
        state_dict["pos_embed"] = resize_image_pos_embed(pos, model.grid_size, square_grid(pos.shape[1]))
    conv_bias = state_dict.get("patch_embed.proj.bias")
    if conv_bias is not None and getattr(model.patch_embed.proj, "bias", None) is None:
        pos = state_dict["pos_embed"].clone()
        pos[:, 1:] += conv_bias
        state_dict["pos_embed"] = pos
        del state_dict["patch_embed.proj.bias"]
    _adapt_head(state_dict, model)
    return state_dict


def _adapt_head(state_dict: Dict[str, torch.Tensor], model: CrateAlpha) -> None:
    if "head.weight" not in state_dict:
        return
    if not isinstance(model.head, nn.Linear):
        state_dict.pop("head.weight"), state_dict.pop("head.bias", None)
    elif state_dict["head.weight"].shape != model.head.weight.shape:
        _logger.warning("checkpoint head %s != model head %s: keeping the model's freshly initialised head",
                        tuple(state_dict["head.weight"].shape), tuple(model.head.weight.shape))
        state_dict["head.weight"], state_dict["head.bias"] = model.head.weight, model.head.bias


# ----- build and register -----
def _create_crate_alpha(variant: str, pretrained: bool = False, device=None, dtype=None, **kwargs) -> CrateAlpha:
    # timm.create_model(name, device=..., dtype=...): parameters are created on `device` (e.g. 'meta',
    # nothing allocated) through torch's default-device context, then cast to `dtype`
    overlay = kwargs.get("pretrained_cfg_overlay") or {}
    if overlay.get("file"):   # an export's weights: its own preprocessing under the caller's keys
        from crate_clip.models.export_timm_cfg import export_preprocessing

        kwargs["pretrained_cfg_overlay"] = {**export_preprocessing(overlay["file"], kwargs.get("img_size")),
                                            **overlay}
    with torch.device(device) if device is not None else contextlib.nullcontext():
        model = build_model_with_cfg(
            CrateAlpha, variant, pretrained,
            pretrained_filter_fn=checkpoint_filter_fn,
            feature_cfg=dict(out_indices=3, feature_cls="getter"),
            **kwargs,
        )
    return model.to(dtype=dtype) if dtype is not None else model


def _cfg(input_px: int = 224, num_classes: int = 1000, **kwargs) -> Dict:
    # 'classifier' names the head (timm's convention; its loader drops a head of another class count after
    # checkpoint_filter_fn, which already keeps the model's fresh head then). Towers without a head: None.
    # mean/std: ImageNet defaults (the released models' own normalisation is not recorded in the spec).
    return {**dict(url="", num_classes=num_classes, input_size=(3, input_px, input_px), pool_size=None,
                   crop_pct=0.875, interpolation="bicubic", fixed_input_size=True,
                   mean=IMAGENET_MEAN, std=IMAGENET_STD, first_conv="patch_embed.proj",
                   classifier="head" if num_classes else None), **kwargs}


def clip_tower_cfg(input_px: int) -> Dict:
    """The pretrained cfg of a CLIP image tower (no head): CLIPA's evaluation and every export resize the shorter
    side to the input size and take the center square, timm's crop_pct 1.0. An export's file overrides the rest
    (export_timm_cfg)."""
    return _cfg(input_px, num_classes=0, crop_pct=1.0)


_SIZES = {  # name: (width, depth, heads)  (CRATE-alpha decode_variant; note S is 576 wide)
    "tiny": (192, 12, 3), "small": (576, 12, 12), "base": (768, 12, 12), "large": (1024, 24, 16),
    "huge": (1280, 32, 16),
}
_CRATE_SIZES = {"tiny": (384, 12, 6), "small": (576, 12, 12), "base": (768, 12, 12), "large": (1024, 24, 16)}
_CRATE_ARGS = dict(overcomplete_ratio=1, decoupled_dictionary=False, ista_residual=False,
                   patch_embed_type="crate", attn_out_bias=True, norm_eps=1e-5)
_CLIP_TOWER_ARGS = dict(patch_bias=False, num_classes=0)


def _variants() -> Dict[str, Dict]:
    """Every registered name -> its architecture kwargs."""
    out = {}
    for size in ("tiny", "small", "base", "large"):
        for p in (32, 16, 14, 8):
            out[f"crate_alpha_{size}_patch{p}_224"] = dict(zip(("embed_dim", "depth", "num_heads"), _SIZES[size]),
                                                          patch_size=p)
    for p in (14, 16):
        out[f"crate_alpha_huge_patch{p}_224"] = dict(zip(("embed_dim", "depth", "num_heads"), _SIZES["huge"]),
                                                    patch_size=p)
    for size, dims in _CRATE_SIZES.items():
        out[f"crate_{size}_patch16_224"] = dict(zip(("embed_dim", "depth", "num_heads"), dims), patch_size=16,
                                                **_CRATE_ARGS)
    # CLIP image towers (CRATE-alpha-CLIPA): conv without bias, no head; open_clip adds the projection.
    # open_clip's TimmModel does not pass image_size to timm, so each tower's default size is its name's.
    for size, p in (("base", 16), ("large", 14), ("huge", 14)):
        out[f"crate_alpha_clipa_{size}_patch{p}_224"] = dict(
            zip(("embed_dim", "depth", "num_heads"), _SIZES[size]), patch_size=p, **_CLIP_TOWER_ARGS)
    # small demo towers are named parametrically in their JSON (see open_clip_configs.py)
    return out


VARIANTS = _variants()


def _default_cfgs() -> Dict[str, Dict]:
    cfgs = {}
    for name, arch in VARIANTS.items():
        px = arch.get("img_size", 224)
        if name.startswith("crate_alpha_clipa_"):
            cfgs[name] = clip_tower_cfg(px)
        elif name.startswith("crate_alpha_"):
            cfgs[f"{name}.in21k_ft_in1k"] = _cfg(px, 1000)   # first tag = default
            cfgs[f"{name}.in21k"] = _cfg(px, 19167)          # IN-21K pre-training head
        else:
            cfgs[name] = _cfg(px, 1000)
    return cfgs


default_cfgs = generate_default_cfgs(_default_cfgs())


def _make_entrypoint(name: str, arch: Dict):
    def entrypoint(pretrained: bool = False, **kwargs) -> CrateAlpha:
        # registered-architecture defaults, overridable by timm.create_model(name, **overrides)
        return _create_crate_alpha(name, pretrained, **{**arch, **kwargs})
    entrypoint.__name__ = entrypoint.__qualname__ = name
    entrypoint.__module__ = __name__
    entrypoint.__doc__ = f"{name}: {arch}"
    return entrypoint


for _name, _arch in VARIANTS.items():
    globals()[_name] = register_model(_make_entrypoint(_name, _arch))
