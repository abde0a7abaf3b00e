"""ISTA sparse-coding block of CRATE / CRATE-alpha, with the three CRATE-alpha switches."""
import math
from typing import Optional, Tuple

import torch
import torch.nn.functional as F
from torch import nn


class ISTA(nn.Module):
    """Sparse coding of y = LN(t) against dictionary D (d x C*d); returns (block output, sparse code).

    Two forms, chosen by the switches:
    - original CRATE (`overcomplete_ratio == 1` and not `decoupled`): one ISTA step started at A0 = y,
      the code is the output: relu(y + eta (y D - (y D^T) D) - eta lambda).
    - CRATE-alpha form (otherwise): two ISTA steps started at A0 = 0 in C*d dimensions, the code z2 is
      decoded back to d by D1^T (`decoupled`, a separate learned dictionary) or by D^T (tied).
    Whether the result is added to the residual stream (`residual`) is decided by the caller's block.
    """

    def __init__(self, dim: int, overcomplete_ratio: int = 4, decoupled: bool = True,
                 eta: float = 0.1, lambd: float = 0.1):
        super().__init__()
        self.eta, self.lambd = eta, lambd
        self.crate_form = overcomplete_ratio == 1 and not decoupled
        code_dim = overcomplete_ratio * dim
        self.D = nn.Parameter(torch.empty(dim, code_dim))
        self.D1 = nn.Parameter(torch.empty(dim, code_dim)) if decoupled else None
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """JAX init of the published models: uniform with bound sqrt(6 / d) for D and D1."""
        bound = math.sqrt(6.0 / self.D.shape[0])
        nn.init.uniform_(self.D, -bound, bound)
        if self.D1 is not None:
            nn.init.uniform_(self.D1, -bound, bound)

    def forward(self, y: torch.Tensor, residual: Optional[torch.Tensor] = None) -> Tuple[torch.Tensor, torch.Tensor]:
        """(B, L, d) -> (output (B, L, d), sparse code (B, L, C*d)); `residual` is added to the output if given."""
        eta, shrink = self.eta, self.eta * self.lambd
        D = self.D
        if self.crate_form:
            code = F.relu(y + eta * (y @ D - (y @ D.t()) @ D) - shrink)
            return (code if residual is None else residual + code), code
        # the same two ISTA steps as relu(eta y D - eta lambda), relu(z1 - eta (z1 D^T - y) D - eta lambda), with
        # subtractions and the residual add folded into addmm (~10% faster fwd+bwd on CPU); eta scales the
        # (tokens x d) activations, not the matmul (an addmm alpha costs a pass over the d x Cd gradient of D)
        shape = y.shape
        y2 = y.reshape(-1, shape[-1])
        z1 = torch.addmm(y2.new_full((1,), -shrink), y2 * eta, D).relu_()
        r = z1 @ D.t() - y2
        z2 = torch.addmm(z1 - shrink, r * -eta, D).relu_()
        # the code first: the block's output is then the last node of a torch.fx trace of the block (what
        # timm's fx feature extraction returns for "blocks.i"); no *-unpacking of a shape, which fx cannot trace
        code = z2.unflatten(0, shape[:-1])
        decoder = (self.D1 if self.D1 is not None else D).t()
        if residual is None:
            out = z2 @ decoder
        else:
            out = torch.addmm(residual.reshape(-1, shape[-1]), z2, decoder)
        return out.reshape(shape), code
