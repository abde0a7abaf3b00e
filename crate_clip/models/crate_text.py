"""CRATE-alpha text tower: the image tower's white-box blocks (MSSA + overcomplete ISTA) over word tokens.

token embedding + learned position embedding -> CRATE-alpha blocks (causal MSSA as in CLIP, or bidirectional as
in CLIPA) -> final LayerNorm -> pooling ('argmax' = CLIP's end-of-text token, 'last' = CLIPA's last position,
'first', 'eos') -> projection to the joint space. The attribute names are open_clip's TextTransformer's
(token_embedding, positional_embedding, transformer.resblocks, ln_final, text_projection), so open_clip's
`lock_text_tower`, its text position-embedding resize and state-dict conventions apply unchanged.
docs/text_tower.md states the sources of each choice.
"""
from dataclasses import dataclass, fields
from typing import Dict, List, Optional, Union

import torch
from open_clip.transformer import lock_text_tower, text_global_pool
from timm.models._features import feature_take_indices
from torch import nn
from torch.utils.checkpoint import checkpoint

from crate_clip.models.crate_alpha import CrateBlock, blocks_with_extras
from crate_clip.models.open_clip_text_tower import TextTowerKind, register_text_tower

TOWER_NAME = "crate_alpha"
POOL_TYPES = ("argmax", "last", "first", "eos")


@dataclass(frozen=True)
class CrateTextCfg:
    """A CRATE-alpha text tower's `text_cfg` (open_clip JSON); defaults follow open_clip's CLIPTextCfg where the
    key is shared (causal, argmax pooling) and the CRATE-alpha image tower for the block (C = 4, eta = lambda = 0.1)."""
    tower: str = TOWER_NAME
    context_length: int = 77
    vocab_size: int = 49408
    width: int = 512
    heads: int = 8
    layers: int = 12
    no_causal_mask: bool = False
    pool_type: str = "argmax"
    eos_id: int = 2
    proj_type: str = "linear"
    proj_bias: bool = False
    output_tokens: bool = False
    norm_eps: float = 1e-6
    overcomplete_ratio: int = 4
    decoupled_dictionary: bool = True
    ista_residual: bool = True
    eta: float = 0.1
    lambd: float = 0.1
    attn_impl: str = "sdpa"
    # read by open_clip's get_tokenizer, not by the tower
    hf_tokenizer_name: Optional[str] = None
    tokenizer_mode: Optional[str] = None
    tokenizer_kwargs: Optional[dict] = None

    @classmethod
    def from_dict(cls, cfg: Dict) -> "CrateTextCfg":
        """Validate a text_cfg dict; an unknown key or value is a ValueError that names it."""
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(cfg) - known)
        if unknown:
            raise ValueError(f"text_cfg of a {TOWER_NAME} text tower: unknown keys {unknown} "
                             f"(known: {sorted(known)})")
        out = cls(**cfg)
        if out.tower != TOWER_NAME:
            raise ValueError(f"text_cfg.tower must be {TOWER_NAME!r}, got {out.tower!r}")
        if out.pool_type not in POOL_TYPES:
            raise ValueError(f"text_cfg.pool_type must be one of {POOL_TYPES}, got {out.pool_type!r}")
        if out.proj_type not in ("linear", "none"):
            raise ValueError(f"text_cfg.proj_type must be 'linear' or 'none', got {out.proj_type!r}")
        return out


class CrateBlockStack(nn.Module):
    """The text tower's blocks under open_clip's name (`transformer.resblocks`), with gradient checkpointing."""

    def __init__(self, width: int, layers: int, heads: int, causal: bool, **block_kwargs):
        super().__init__()
        self.width, self.layers = width, layers
        self.grad_checkpointing = False
        self.resblocks = nn.ModuleList([CrateBlock(width, heads, causal=causal, **block_kwargs)
                                        for _ in range(layers)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """(B, L, d) -> (B, L, d) through every block."""
        for blk in self.resblocks:
            x = checkpoint(blk, x, use_reentrant=False) if self.checkpointing_active() else blk(x)
        return x

    def checkpointing_active(self) -> bool:
        """True while gradient checkpointing is on and autograd records."""
        return self.grad_checkpointing and torch.is_grad_enabled()


class CrateAlphaText(nn.Module):
    """CRATE-alpha text tower with open_clip's TextTransformer interface: (B, L) token ids -> (B, output_dim)."""

    def __init__(self, context_length: int = 77, vocab_size: int = 49408, width: int = 512, heads: int = 8,
                 layers: int = 12, output_dim: Optional[int] = 512, causal: bool = True, pool_type: str = "argmax",
                 eos_id: int = 2, proj_bias: bool = False, output_tokens: bool = False, norm_eps: float = 1e-6,
                 overcomplete_ratio: int = 4, decoupled_dictionary: bool = True, ista_residual: bool = True,
                 eta: float = 0.1, lambd: float = 0.1, attn_impl: str = "sdpa"):
        super().__init__()
        self.num_pos = self.context_length = context_length
        self.vocab_size, self.width, self.heads, self.output_dim = vocab_size, width, heads, output_dim
        self.causal, self.pool_type, self.eos_id, self.output_tokens = causal, pool_type, eos_id, output_tokens
        self.token_embedding = nn.Embedding(vocab_size, width)
        self.positional_embedding = nn.Parameter(torch.empty(context_length, width))
        self.transformer = CrateBlockStack(
            width, layers, heads, causal, overcomplete_ratio=overcomplete_ratio, decoupled=decoupled_dictionary,
            residual=ista_residual, eta=eta, lambd=lambd, norm_eps=norm_eps, attn_impl=attn_impl)
        self.ln_final = nn.LayerNorm(width, eps=norm_eps)
        if not output_dim:
            self.text_projection = None
        elif proj_bias:
            self.text_projection = nn.Linear(width, output_dim)
        else:
            self.text_projection = nn.Parameter(torch.empty(width, output_dim))  # used as x @ P, as open_clip
        self.init_parameters()

    @classmethod
    def from_cfg(cls, embed_dim: int, cfg: Union[CrateTextCfg, Dict]) -> "CrateAlphaText":
        """Build from a text_cfg (dict or CrateTextCfg) projecting to `embed_dim`."""
        c = cfg if isinstance(cfg, CrateTextCfg) else CrateTextCfg.from_dict(cfg)
        return cls(context_length=c.context_length, vocab_size=c.vocab_size, width=c.width, heads=c.heads,
                   layers=c.layers, output_dim=embed_dim if c.proj_type == "linear" else None,
                   causal=not c.no_causal_mask, pool_type=c.pool_type, eos_id=c.eos_id, proj_bias=c.proj_bias,
                   output_tokens=c.output_tokens, norm_eps=c.norm_eps, overcomplete_ratio=c.overcomplete_ratio,
                   decoupled_dictionary=c.decoupled_dictionary, ista_residual=c.ista_residual, eta=c.eta,
                   lambd=c.lambd, attn_impl=c.attn_impl)

    def init_parameters(self) -> None:
        """Embeddings and projection as CLIPA's text tower (token 0.02, position 0.01, projection width^-0.5);
        the blocks as the CRATE-alpha image tower (U, W_out normal 0.02; D, D1 uniform sqrt(6/d))."""
        nn.init.normal_(self.token_embedding.weight, std=0.02)
        nn.init.normal_(self.positional_embedding, std=0.01)
        for blk in self.transformer.resblocks:
            blk.init_weights()
        proj = self.text_projection
        if isinstance(proj, nn.Linear):
            nn.init.normal_(proj.weight, std=self.width ** -0.5)
            nn.init.zeros_(proj.bias)
        elif proj is not None:
            nn.init.normal_(proj, std=self.width ** -0.5)

    # ----- open_clip's text-tower interface -----
    @torch.jit.ignore
    def set_grad_checkpointing(self, enable: bool = True) -> None:
        """Recompute each block in the backward pass instead of storing its activations."""
        self.transformer.grad_checkpointing = enable

    def lock(self, unlocked_layers: int = 0, freeze_layer_norm: bool = True) -> None:
        """Freeze the tower except its last `unlocked_layers` groups (open_clip's grouping: embeddings, each block,
        the last block with ln_final, the projection)."""
        if not freeze_layer_norm:
            raise ValueError("unfreezing LayerNorm alone is not supported (open_clip's text lock treats it as weights)")
        lock_text_tower(self, unlocked_layers)

    @torch.jit.ignore
    def no_weight_decay(self) -> set:
        """Not decayed, as the image tower's policy: embeddings, the dictionaries D and D1, and 1-D parameters."""
        names = {"positional_embedding", "token_embedding.weight"}
        names.update(n for n, p in self.named_parameters() if n.endswith(("ista.D", "ista.D1")) or p.ndim <= 1)
        return names

    # ----- forward -----
    def _embed(self, text: torch.Tensor) -> torch.Tensor:
        L = text.shape[1]
        if L > self.num_pos:
            raise ValueError(f"{L} text tokens but the tower's context_length is {self.num_pos}: tokenize with "
                             f"context_length={self.num_pos} or build the model with force_context_length={L}")
        return self.token_embedding(text) + self.positional_embedding[:L]

    def _pool_and_project(self, x: torch.Tensor, text: torch.Tensor) -> torch.Tensor:
        pooled = text_global_pool(x, text, self.pool_type, eos_token_id=self.eos_id)
        if isinstance(self.text_projection, nn.Linear):
            return self.text_projection(pooled)
        return pooled if self.text_projection is None else pooled @ self.text_projection

    def forward(self, text: torch.Tensor):
        """(B, L) token ids -> (B, output_dim) features; with `output_tokens` also the (B, L, width) tokens."""
        x = self.ln_final(self.transformer(self._embed(text)))
        pooled = self._pool_and_project(x, text)
        return (pooled, x) if self.output_tokens else pooled

    def forward_intermediates(
            self,
            text: torch.Tensor,
            indices: Optional[Union[int, List[int]]] = None,
            stop_early: bool = False,
            normalize_intermediates: bool = False,
            intermediates_only: bool = False,
            output_fmt: str = "NLC",
            output_extra_tokens: bool = False,
            return_attn: bool = False,
            return_sparse_codes: bool = False,
            return_projections: bool = False,
    ) -> Dict[str, Union[torch.Tensor, List[torch.Tensor]]]:
        """open_clip's text intermediates ('text_intermediates', 'text_features') plus, when asked, per taken block
        'text_attn' ((B, h, L, L)), 'text_sparse_codes' (ISTA codes, (B, L, C*d)) and 'text_projections'
        (the MSSA subspace projections U_k^T LN(Z) of the block's input, (B, h, L, hd))."""
        if output_fmt != "NLC":
            raise ValueError(f"text output_fmt must be 'NLC', got {output_fmt!r}")
        blocks = self.transformer.resblocks
        take_indices, max_index = feature_take_indices(len(blocks), indices)
        x = self._embed(text)
        x, taken = blocks_with_extras(blocks[:max_index + 1] if stop_early else blocks, x, take_indices, return_attn,
                                      return_projections, self.transformer.checkpointing_active())
        out = {"text_intermediates": [self.ln_final(y) if normalize_intermediates else y for y, _, _, _ in taken]}
        for key, asked, position in (("text_attn", return_attn, 1), ("text_sparse_codes", return_sparse_codes, 2),
                                     ("text_projections", return_projections, 3)):
            if asked:
                out[key] = [record[position] for record in taken]
        if not intermediates_only:
            out["text_features"] = self._pool_and_project(self.ln_final(x), text)
        return out

    def prune_intermediate_layers(self, indices: Union[int, List[int]] = 1, prune_norm: bool = False,
                                  prune_head: bool = True) -> List[int]:
        """Drop the blocks after the last index taken (open_clip convention); returns the taken indices."""
        take_indices, max_index = feature_take_indices(len(self.transformer.resblocks), indices)
        self.transformer.resblocks = self.transformer.resblocks[:max_index + 1]
        if prune_norm:
            self.ln_final = nn.Identity()
        if prune_head:
            self.text_projection = None
        return take_indices


def text_tower_param_count(embed_dim: int, cfg: Dict) -> int:
    """Parameters of a CRATE-alpha text tower config (with projection), counted on the meta device."""
    with torch.device("meta"):
        tower = CrateAlphaText.from_cfg(embed_dim, cfg)
    return sum(p.numel() for p in tower.parameters())


# the text_cfg `"tower": "crate_alpha"` builds this tower (open_clip_text_tower.py's registry)
register_text_tower(TextTowerKind(
    name=TOWER_NAME, label="CRATE-alpha", module_class=CrateAlphaText, state_key_suffix=".ista.D",
    build=CrateAlphaText.from_cfg, checkpoint_hint="the export or a checkpoint of a *-crate-text run",
    model_hint="the checkpoint's *-crate-text model.name", check_cfg=CrateTextCfg.from_dict))
