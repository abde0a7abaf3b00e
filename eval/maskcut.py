"""MaskCut (Wang et al. 2023, CutLER) on patch features: class-agnostic object masks from normalised cuts.

Per round: L2-normalised patch features F, affinity A = [F^T F > tau] (zeros set to eps), D = diag(A 1),
second-smallest generalised eigenvector x of (D - A) x = lambda D x, foreground = x > mean(x); flipped when
>= 3 grid corners are foreground or the seed (argmax |x|) is not; only the seed's connected component is
kept. Later rounds zero the features of earlier foregrounds. A mask whose IoU with the previous kept mask
is > 0.5, or that covers <= 1% of the grid, is dropped. No CRF (no maintained package installs here).
"""
from __future__ import annotations

import numpy as np
from scipy import linalg, ndimage

DEFAULT_TAU = 0.3      # CRATE-alpha's MaskCut setting (CutLER's DINO default is 0.15)
DEFAULT_MASKS = 3
AFFINITY_EPS = 1e-5


def _corner_foreground(mask: np.ndarray) -> int:
    return int(mask[0, 0]) + int(mask[0, -1]) + int(mask[-1, 0]) + int(mask[-1, -1])


def normalized_cut(features: np.ndarray, grid: tuple[int, int], tau: float = DEFAULT_TAU) -> np.ndarray:
    """One bipartition of (n_patches, d) features on a (gh, gw) grid: the seed's foreground component."""
    f = features / np.maximum(np.linalg.norm(features, axis=1, keepdims=True), 1e-12)
    affinity = (f @ f.T > tau).astype(np.float64)
    affinity[affinity == 0] = AFFINITY_EPS
    degree = np.diag(affinity.sum(axis=1))
    _, vectors = linalg.eigh(degree - affinity, degree, subset_by_index=[1, 1])
    x = vectors[:, 0]
    fg = x > x.mean()
    seed = int(np.argmax(np.abs(x)))
    if _corner_foreground(fg.reshape(grid)) >= 3 or not fg[seed]:
        x, fg = -x, ~fg
        seed = int(np.argmax(x))
    labels, _ = ndimage.label(fg.reshape(grid))  # 4-connectivity
    seed_label = labels.reshape(-1)[seed]
    return labels == seed_label if seed_label else np.zeros(grid, bool)


def mask_iou(a: np.ndarray, b: np.ndarray) -> float:
    """Intersection over union of two boolean masks."""
    union = np.logical_or(a, b).sum()
    return float(np.logical_and(a, b).sum() / union) if union else 0.0


def maskcut(features: np.ndarray, grid: tuple[int, int], tau: float = DEFAULT_TAU, n_masks: int = DEFAULT_MASKS,
            min_area: float = 0.01, max_iou: float = 0.5) -> list[np.ndarray]:
    """Up to `n_masks` boolean (gh, gw) object masks from (n_patches, d) patch features."""
    if features.shape[0] != grid[0] * grid[1]:
        raise ValueError(f"{features.shape[0]} patch features do not fill a {grid} grid")
    feats = np.asarray(features, dtype=np.float64).copy()
    painted = np.zeros(grid, bool)
    kept, previous = [], None
    for _ in range(n_masks):
        if painted.all():
            break
        mask = normalized_cut(feats, grid, tau) & ~painted
        painted |= mask
        feats[painted.reshape(-1)] = 0.0  # earlier foregrounds take no part in the next cut
        if mask.mean() <= min_area or (previous is not None and mask_iou(mask, previous) > max_iou):
            continue
        kept.append(mask)
        previous = mask
    return kept
