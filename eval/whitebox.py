"""White-box diagnostics of a CRATE-alpha tower: coding rate of the MSSA projections and ISTA code sparsity per layer.

Definitions (CRATE papers and Ma-Lab-Berkeley/CRATE `vis_utils/`):
  coding rate  R^c(Z) = 1/2 * sum_k logdet(I_p + p / (N eps^2) * Z_k Z_k^T), Z_k = U_k^T LN(Z) the p x N
               projection of a block's N input tokens (class token included) on head k's subspace, each token
               L2-normalised; eps^2 = 0.01 as in the official code. Lower = more compressed.
  sparsity     fraction of exact zeros of the ISTA code over tokens x code dims (CRATE-alpha: z2, before the
               decoupled dictionary D1); 'l0' = 1 - that (the normalised L0 the papers plot).
Both are computed per sample and reported as mean and std over the batch, per block: per image for the image
tower (layer_diagnostics), per caption over its own tokens for the text tower (crate_clip.eval.whitebox_text), the one
`block_diagnostics` for both.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

EPS2 = 0.01


def find_crate_tower(model: torch.nn.Module):
    """The CRATE-alpha trunk of a tower, a CLIP model or a DeepSpeed engine; None for any other tower."""
    from crate_clip.models import CrateAlpha

    model = getattr(model, "module", model)
    for candidate in (model, getattr(model, "trunk", None), getattr(getattr(model, "visual", None), "trunk", None)):
        if isinstance(candidate, CrateAlpha):
            return candidate
    return None


def coding_rate(projections: torch.Tensor, eps2: float = EPS2, mask: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Per-sample coding rate of (B, h, N, p) head projections -> (B,), computed in float64; `mask` (B, N), True
    for the tokens that count (a caption's own tokens): N is then each sample's count."""
    z = F.normalize(projections.double(), dim=-1)                 # each token on the unit sphere
    b, _, n, p = z.shape
    if mask is None:
        scale = p / (n * eps2)
    else:   # a left-out token adds a zero column: Z_k Z_k^T is that of the kept tokens alone
        z = z * mask[:, None, :, None].to(z.dtype)
        scale = (p / (mask.sum(dim=1).double() * eps2)).view(b, 1, 1, 1)
    gram = z.transpose(-2, -1) @ z                                 # (B, h, p, p) = Z_k Z_k^T
    eye = torch.eye(p, dtype=gram.dtype, device=gram.device)
    logdet = torch.linalg.slogdet(eye + scale * gram).logabsdet   # PSD + I: sign is +1
    return 0.5 * logdet.sum(dim=1)


def zero_fraction(codes: torch.Tensor, mask: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Per-sample fraction of exact zeros of (B, L, C) sparse codes -> (B,); `mask` (B, L): the tokens that count."""
    zeros = (codes == 0).float()
    if mask is None:
        return zeros.flatten(1).mean(dim=1)
    kept = mask.to(zeros.dtype)
    return (zeros * kept[..., None]).flatten(1).sum(dim=1) / (kept.sum(dim=1) * codes.shape[-1])


def _mean_std(values: torch.Tensor) -> tuple[float, float]:
    return float(values.mean()), float(values.std(unbiased=False))


def block_diagnostics(projections: list, codes: list, mask: Optional[torch.Tensor] = None,
                      eps2: float = EPS2) -> dict:
    """Per-block coding rate and sparsity from each block's head projections (B, h, N, p) and ISTA codes
    (B, N, C), over the tokens `mask` (B, N) keeps (default all): lists indexed by block of coding_rate,
    coding_rate_std, zero_fraction, zero_fraction_std, l0 (mean and std over the batch)."""
    result = {"coding_rate": [], "coding_rate_std": [], "zero_fraction": [], "zero_fraction_std": [], "l0": []}
    for proj, code in zip(projections, codes):
        rate, rate_std = _mean_std(coding_rate(proj, eps2, mask))
        zeros, zeros_std = _mean_std(zero_fraction(code, mask))
        result["coding_rate"].append(rate)
        result["coding_rate_std"].append(rate_std)
        result["zero_fraction"].append(zeros)
        result["zero_fraction_std"].append(zeros_std)
        result["l0"].append(1.0 - zeros)
    return result


@torch.no_grad()
def layer_diagnostics(tower: torch.nn.Module, images: torch.Tensor, eps2: float = EPS2) -> dict:
    """Per-block coding rate and sparsity of `images` through a CRATE-alpha image tower (no token mask, no grad):
    block_diagnostics over every token (class token included)."""
    trunk = find_crate_tower(tower)
    if trunk is None:
        raise TypeError(f"{type(tower).__name__} has no CRATE-alpha tower: white-box diagnostics need MSSA/ISTA blocks")
    param = next(trunk.parameters())
    out = trunk.forward_intermediates(images.to(param.device, param.dtype), intermediates_only=True,
                                      return_sparse_codes=True, return_projections=True)
    return block_diagnostics(out["projections"], out["sparse_codes"], eps2=eps2)
