"""White-box reading of one caption through a CRATE-alpha text tower: which words each MSSA head attends to, which
dictionary atoms (columns of D) each token's ISTA code uses, and per-layer coding rate and sparsity.

The attention rows and the codes are the tower's own (`forward_intermediates` with `return_attn` /
`return_sparse_codes`); coding rate and code sparsity are crate_clip.eval.whitebox's definitions, restricted to each caption's
tokens (padding left out, except the pooled position when pooling reads a padding slot, as CLIPA's 'last' does):
`caption_token_mask`. `text_layer_diagnostics` gives them per block for a batch of captions (the training probe).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
from open_clip.transformer import text_global_pool

from crate_clip.eval.whitebox import EPS2, block_diagnostics

PAD_ID = 0   # open_clip's CLIP BPE and the BERT tokenizers both pad with 0
_SHORT = {"<start_of_text>": "<sot>", "<end_of_text>": "<eot>"}   # CLIP BPE's special tokens, for narrow tables


def find_crate_text_tower(model: torch.nn.Module):
    """The CRATE-alpha text tower of a CLIP model or DeepSpeed engine; None for any other text tower."""
    from crate_clip.models import CrateAlphaText

    model = getattr(model, "module", model)
    text = getattr(model, "text", model)
    return text if isinstance(text, CrateAlphaText) else None


@dataclass
class TextInspection:
    """One caption at one block: the shown tokens, attention per head over them, the top atoms per token."""
    caption: str
    tokens: list[str]                   # the caption's pieces, in order (special tokens included)
    positions: list[int]                # their positions in the tokenized sequence
    pooled: int                         # index into `tokens` of the position the tower pools
    layer: int
    depth: int
    causal: bool
    attention: list                     # [head][query][key] over `tokens`, plus a last column: mass on padding
    atoms: list                         # [token] -> [(atom index, code value)], largest first
    active_atoms: list[int]             # nonzero code entries per token
    code_dim: int
    coding_rate: list[float] = field(default_factory=list)    # per block, over the shown tokens
    zero_fraction: list[float] = field(default_factory=list)  # per block, over the shown tokens


def token_strings(tokenizer, ids: list[int]) -> list[str]:
    """Readable pieces of token ids: BERT WordPiece names, or CLIP BPE pieces without the end-of-word mark."""
    hf = getattr(tokenizer, "tokenizer", None)
    if hf is not None and hasattr(hf, "convert_ids_to_tokens"):
        return [str(t) for t in hf.convert_ids_to_tokens(ids)]
    decoder = getattr(tokenizer, "decoder", None)
    if decoder is not None:
        pieces = (decoder.get(i, str(i)).replace("</w>", "") for i in ids)
        return [_SHORT.get(p, p) for p in pieces]
    return [str(i) for i in ids]


def pooled_positions(tower, ids: torch.Tensor) -> torch.Tensor:
    """(B,) the position each caption's feature is pooled from: open_clip's text_global_pool (the tower's own
    pooling) applied to the positions."""
    positions = torch.arange(ids.shape[1], device=ids.device).expand_as(ids)
    return text_global_pool(positions, ids, tower.pool_type, eos_token_id=tower.eos_id)


def caption_token_mask(tower, ids: torch.Tensor) -> torch.Tensor:
    """(B, L) True at each caption's tokens: everything but padding, plus the pooled position (a padding slot
    under CLIPA's 'last' pooling, which the feature is read from)."""
    mask = ids != PAD_ID
    mask[torch.arange(ids.shape[0], device=ids.device), pooled_positions(tower, ids)] = True
    return mask


@torch.no_grad()
def text_layer_diagnostics(clip: torch.nn.Module, ids: torch.Tensor, eps2: float = EPS2) -> dict:
    """Per-block coding rate and sparsity of tokenized captions `ids` (B, L) through a CRATE-alpha text tower, each
    caption over its own tokens (caption_token_mask); the image tower's block_diagnostics."""
    tower = _text_tower(clip)
    ids = ids.to(tower.token_embedding.weight.device)   # a locked tower holds buffers, not parameters
    out = tower.forward_intermediates(ids, intermediates_only=True, return_sparse_codes=True, return_projections=True)
    return block_diagnostics(out["text_projections"], out["text_sparse_codes"], caption_token_mask(tower, ids), eps2)


def _text_tower(clip: torch.nn.Module):
    tower = find_crate_text_tower(clip)
    if tower is None:
        raise TypeError(f"{type(getattr(clip, 'module', clip)).__name__} has no CRATE-alpha text tower: it needs a "
                        f"model whose text_cfg has \"tower\": \"crate_alpha\"")
    return tower


@torch.no_grad()
def inspect_caption(clip: torch.nn.Module, tokenizer, caption: str, layer: int = -1,
                    top_atoms: int = 5) -> TextInspection:
    """Attention and sparse codes of `caption` at block `layer` (negative: from the end) of the text tower."""
    tower = _text_tower(clip)
    depth = len(tower.transformer.resblocks)
    index = layer if layer >= 0 else depth + layer
    if not 0 <= index < depth:
        raise ValueError(f"--layer {layer}: the text tower has {depth} blocks")
    ids = tokenizer([caption]).to(tower.token_embedding.weight.device)   # a locked tower holds buffers
    out = tower.forward_intermediates(ids, intermediates_only=True, return_attn=True, return_sparse_codes=True,
                                      return_projections=True)
    pooled = int(pooled_positions(tower, ids)[0])
    mask = caption_token_mask(tower, ids)
    idx = mask[0].nonzero().flatten()
    shown = idx.tolist()
    attn = out["text_attn"][index][0][:, idx]                     # (h, shown, L)
    shown_attn = attn[:, :, idx]                                  # (h, shown, shown)
    padding = (attn.sum(-1) - shown_attn.sum(-1)).clamp_min(0)    # mass on the positions not shown
    attention = torch.cat([shown_attn, padding.unsqueeze(-1)], dim=-1)
    per_block = block_diagnostics(out["text_projections"], out["text_sparse_codes"], mask)
    code = out["text_sparse_codes"][index][0][idx]                # (shown, C*d)
    values, atoms = code.topk(min(top_atoms, code.shape[-1]), dim=-1)
    return TextInspection(
        caption=caption, tokens=token_strings(tokenizer, ids[0, idx].tolist()), positions=shown,
        pooled=shown.index(pooled), layer=index, depth=depth, causal=tower.causal,
        attention=attention.float().cpu().tolist(),
        atoms=[[(int(a), float(v)) for a, v in zip(row_a, row_v) if v > 0] for row_a, row_v in zip(atoms, values)],
        active_atoms=(code != 0).sum(-1).tolist(), code_dim=code.shape[-1],
        coding_rate=per_block["coding_rate"], zero_fraction=per_block["zero_fraction"])


def format_inspection(ins: TextInspection) -> str:
    """The inspection as text: one attention table per head, then the top atoms per token, then per-layer numbers."""
    names = [f"{t}*" if i == ins.pooled else t for i, t in enumerate(ins.tokens)]
    width = max(7, *(len(n) for n in names)) + 1
    lines = [f"caption: {ins.caption!r}   block {ins.layer} of 0..{ins.depth - 1}, "
             f"{'causal' if ins.causal else 'bidirectional'} MSSA; * = the pooled position",
             f"tokens: {' '.join(names)}"]
    for head, rows in enumerate(ins.attention):
        lines.append(f"\nhead {head}: attention of each token (row) over the tokens (columns) and the padding")
        lines.append(" " * width + "".join(f"{n[:width - 1]:>{width}}" for n in names + ["(pad)"]))
        for name, row in zip(names, rows):
            lines.append(f"{name:<{width}}" + "".join(f"{v:>{width}.2f}" for v in row))
    lines.append(f"\nmost active dictionary atoms (ISTA code z, {ins.code_dim} atoms): atom:value")
    for name, atoms, active in zip(names, ins.atoms, ins.active_atoms):
        lines.append(f"{name:<{width}}{active:>5} active  " + "  ".join(f"#{a}:{v:.3f}" for a, v in atoms))
    lines.append("\nper block over these tokens: coding rate R^c (lower = more compressed) | zero fraction of z")
    for i, (rate, zeros) in enumerate(zip(ins.coding_rate, ins.zero_fraction)):
        lines.append(f"block {i:>2}: {rate:10.3f} | {zeros:.3f}")
    return "\n".join(lines)


def draw_attention(ins: TextInspection, path) -> None:
    """A PNG with one heatmap per head: rows are the querying tokens, columns the tokens attended to."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    heads, n = len(ins.attention), len(ins.tokens)
    fig, axes = plt.subplots(1, heads, figsize=(1.2 + 0.45 * n * heads, 0.9 + 0.45 * n), squeeze=False)
    for head, ax in enumerate(axes[0]):
        ax.imshow([row[:n] for row in ins.attention[head]], cmap="viridis", vmin=0, vmax=1)
        ax.set_title(f"block {ins.layer}, head {head}", fontsize=9)
        ax.set_xticks(range(n), ins.tokens, rotation=90, fontsize=8)
        ax.set_yticks(range(n), ins.tokens if head == 0 else [""] * n, fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
