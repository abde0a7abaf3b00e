"""The released CRATE-alpha-CLIPA checkpoints (UCSC-VLAA/CRATE-alpha `torch_inference`) in open_clip's layout.

The official module is OpenAI-CLIP-shaped. Image side -> our timm tower inside open_clip's TimmModel:
  visual.conv1.weight -> visual.trunk.patch_embed.proj.weight (no bias)
  visual.class_embedding (d) -> visual.trunk.cls_token (1, 1, d)
  visual.positional_embedding (L, d) -> visual.trunk.pos_embed (1, L, d)
  visual.transformer.resblocks.{i}.ln_1 / ln_2 -> visual.trunk.blocks.{i}.norm1 / norm2
  ...attn.in_proj_weight (3d, d): U three times (Q = K = V) -> rows [0:d] as blocks.{i}.attn.qkv.weight
  ...attn.out_proj.weight -> blocks.{i}.attn.proj.weight
  ...mlp.c_fc = D, mlp.c_proj = D1 (both (d, 4d)) -> blocks.{i}.ista.D / ista.D1 (same orientation)
  visual.ln_post -> visual.trunk.norm;  visual.proj (d, E), used as x @ proj -> visual.head.proj.weight = proj.T
Text side: open_clip's CLIP text keys are the same names; only `text_projection` differs: the official
forward is `x @ text_projection.T`, open_clip's `x @ text_projection`, so it is transposed here (the matrix
is square in the released models, so forgetting it would fail silently).

LayerNorm biases: the port subclasses nn.LayerNorm and calls `super().__init__(shape, eps, elementwise_affine,
device, dtype)` positionally. Under torch 2.0 (the port's pin) that is what it says; from torch 2.1 on the
fourth parameter is `bias`, which receives `device=None`: every LayerNorm is built without a bias, and a file
saved there has no `*ln_*.bias` keys (L/14: 394 keys instead of 492). Both layouts are read: a file without
any LayerNorm bias gets zeros, which is exactly what a bias-free LayerNorm computes; a file missing only some
of them is reported as missing keys.
"""
import logging
import re
from typing import Dict, List, Optional

import torch

from crate_clip.models.checkpoint_errors import CheckpointMismatchError, key_list

_logger = logging.getLogger(__name__)
_BLOCK = re.compile(r"^visual\.transformer\.resblocks\.(\d+)\.(.+)$")
_LAYERNORM_WEIGHT = re.compile(r"(^|\.)ln_(1|2|post|final)\.weight$")
_ISTA_KEY = re.compile(r"^visual\.transformer\.resblocks\.\d+\.mlp\.c_(fc|proj)$")
_BLOCK_KEYS = {"ln_1.weight": "norm1.weight", "ln_1.bias": "norm1.bias", "ln_2.weight": "norm2.weight",
               "ln_2.bias": "norm2.bias", "attn.in_proj_weight": "attn.qkv.weight",
               "attn.out_proj.weight": "attn.proj.weight", "mlp.c_fc": "ista.D", "mlp.c_proj": "ista.D1"}
_TOP_KEYS = {"visual.conv1.weight": "visual.trunk.patch_embed.proj.weight",
             "visual.class_embedding": "visual.trunk.cls_token",
             "visual.positional_embedding": "visual.trunk.pos_embed",
             "visual.ln_post.weight": "visual.trunk.norm.weight", "visual.ln_post.bias": "visual.trunk.norm.bias",
             "visual.proj": "visual.head.proj.weight"}
_REVERSE_BLOCK = {v: k for k, v in _BLOCK_KEYS.items()}
_REVERSE_TOP = {v: k for k, v in _TOP_KEYS.items()}


def is_official_clipa_layout(state_dict: Dict[str, torch.Tensor]) -> bool:
    """True for a state dict in the official CRATE-alpha-CLIPA layout.

    OpenAI-CLIP-style visual keys alone do not tell: open_clip's own ViT towers (e.g. ViT-H-14-CLIPA) have
    them too. The CRATE port's ISTA dictionaries are raw Parameters, `...resblocks.{i}.mlp.c_fc` without
    `.weight`, which no Linear-based ViT has.
    """
    return any(_ISTA_KEY.match(k) for k in state_dict)


def official_key(open_clip_key: str) -> str:
    """The official checkpoint's name for one of our open_clip keys (the key itself when shared)."""
    if open_clip_key in _REVERSE_TOP:
        return _REVERSE_TOP[open_clip_key]
    m = re.match(r"^visual\.trunk\.blocks\.(\d+)\.(.+)$", open_clip_key)
    if m and m.group(2) in _REVERSE_BLOCK:
        return f"visual.transformer.resblocks.{m.group(1)}.{_REVERSE_BLOCK[m.group(2)]}"
    return open_clip_key


def _rename(key: str) -> Optional[str]:
    if key in _TOP_KEYS:
        return _TOP_KEYS[key]
    m = _BLOCK.match(key)
    if m:
        rest = _BLOCK_KEYS.get(m.group(2))
        return f"visual.trunk.blocks.{m.group(1)}.{rest}" if rest else None
    return None if key.startswith("visual.") else key   # text keys are shared


def _convert_value(key: str, value: torch.Tensor, untied: List[str]) -> torch.Tensor:
    if key == "visual.class_embedding":
        return value.reshape(1, 1, -1)
    if key == "visual.positional_embedding":
        return value.unsqueeze(0)
    if key in ("visual.proj", "text_projection"):
        return value.t().contiguous()
    if key.endswith("attn.in_proj_weight") and key.startswith("visual."):
        d = value.shape[1]
        if value.shape[0] != 3 * d:
            return value  # reported as a shape mismatch
        q, k, v = value[:d], value[d:2 * d], value[2 * d:]
        if not (torch.equal(q, k) and torch.equal(q, v)):
            untied.append(key)
        return q.contiguous()
    return value


def with_layernorm_biases(state_dict: Dict[str, torch.Tensor]) -> Dict[str, torch.Tensor]:
    """The official state dict with zero LayerNorm biases added when it has none at all (a file saved under
    torch >= 2.1, see the module doc), said in one logged line; otherwise unchanged."""
    weights = [k for k in state_dict if _LAYERNORM_WEIGHT.search(k)]
    if not weights or any(k[:-len("weight")] + "bias" in state_dict for k in weights):
        return state_dict
    _logger.warning("official CRATE-alpha-CLIPA file without LayerNorm biases (saved under torch >= 2.1, whose "
                    "LayerNorm(shape, eps, affine, device) builds them without): %d biases set to zero", len(weights))
    out = dict(state_dict)
    out.update({k[:-len("weight")] + "bias": torch.zeros_like(state_dict[k]) for k in weights})
    return out


def official_clipa_to_open_clip(state_dict: Dict[str, torch.Tensor]) -> Dict[str, torch.Tensor]:
    """Convert an official CRATE-alpha-CLIPA state dict to our open_clip layout.

    Raises CheckpointMismatchError naming the official keys it does not know and the `in_proj_weight`s
    whose Q, K and V row blocks are not identical (the tower ties them). Missing keys and shape
    mismatches are found by the loader against the model (named with `official_key`).
    """
    out, unknown, untied = {}, [], []
    for key, value in with_layernorm_biases(state_dict).items():
        new = _rename(key)
        if new is None:
            unknown.append(key)
            continue
        out[new] = _convert_value(key, value, untied)
    problems = []
    if unknown:
        problems.append(f"unexpected keys [{key_list(unknown)}]")
    if untied:
        problems.append(f"in_proj_weight whose three row blocks (Q, K, V) differ, but the CRATE tower ties "
                        f"them to one U [{key_list(untied)}]")
    if problems:
        raise CheckpointMismatchError("official CRATE-alpha-CLIPA checkpoint does not fit the model: "
                                      + "; ".join(problems))
    return out
