"""MSSA: multi-head subspace self-attention, the CRATE attention block (one projection U used as Q = K = V)."""
from typing import Optional, Tuple

import torch
import torch.nn.functional as F
from torch import nn


class MSSA(nn.Module):
    """Multi-head subspace self-attention: softmax((yU)_h (yU)_h^T / sqrt(hd)) (yU)_h, heads merged, then W_out.

    `qkv.weight` stores U transposed (a Linear weight, as in the official port: w = y @ qkv.weight.T);
    `proj` is W_out. CRATE-alpha has no output bias; the original CRATE has one (`out_bias=True`).
    `causal`: token i attends to tokens 0..i only (a GPT/CLIP text tower); the image tower attends to all.
    """

    def __init__(self, dim: int, num_heads: int, out_bias: bool = False, attn_impl: str = "sdpa",
                 causal: bool = False):
        super().__init__()
        if dim % num_heads:
            raise ValueError(f"embed_dim {dim} is not divisible by num_heads {num_heads}")
        self.num_heads = num_heads
        self.head_dim = dim // num_heads
        self.scale = self.head_dim ** -0.5
        self.attn_impl = attn_impl
        self.causal = causal
        self.qkv = nn.Linear(dim, dim, bias=False)
        self.proj = nn.Linear(dim, dim, bias=out_bias)

    def project(self, y: torch.Tensor) -> torch.Tensor:
        """Per-head subspace projections U_k^T y of (B, L, d) tokens: (B, h, L, hd) (the shared Q = K = V)."""
        B, L, _ = y.shape
        return self.qkv(y).reshape(B, L, self.num_heads, self.head_dim).transpose(1, 2)

    def forward(self, y: torch.Tensor, return_attn: bool = False) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
        """Attend (B, L, d) -> (B, L, d); also the (B, h, L, L) attention map when `return_attn`."""
        B, L, d = y.shape
        w = self.project(y)  # (B, h, L, hd)
        if return_attn or self.attn_impl == "math":
            # explicit path: needed to hand the map out (SDPA never materialises it); also the bench baseline
            scores = (w * self.scale) @ w.transpose(-2, -1)
            if self.causal:   # the positions after each query get -inf, as SDPA's is_causal
                future = torch.ones(L, L, dtype=torch.bool, device=y.device).triu(1)
                scores = scores.masked_fill(future, float("-inf"))
            attn = scores.softmax(dim=-1)
            return self._merge_heads(attn @ w), (attn if return_attn else None)
        return self._merge_heads(F.scaled_dot_product_attention(w, w, w, is_causal=self.causal)), None

    def _merge_heads(self, out: torch.Tensor) -> torch.Tensor:
        """(B, h, L, hd) -> W_out applied to the (B, L, d) concatenation of the heads."""
        B, h, L, hd = out.shape
        return self.proj(out.transpose(1, 2).reshape(B, L, h * hd))
