"""An independent float64 forward of the CRATE-alpha text tower, written from its equations (docs/text_tower.md,
../shared/SPEC-crate-alpha.md), not from our code; and random weights for it under the tower's state-dict keys.

    t   = E[tokens] + P[:L]
    per block:  y = LN1(t);  w = y U  (U stored as the Linear weight qkv.weight = U^T)
                head k: a_k[i, j] = softmax_j(w_k[i] . w_k[j] / sqrt(hd)) over j <= i (causal) or all j
                t = t + concat_k(sum_j a_k[i, j] w_k[j]) W_out     (W_out stored as proj.weight = W_out^T)
                y = LN2(t);  z1 = relu(eta y D - eta lambda);  z2 = relu(z1 - eta (z1 D^T - y) D - eta lambda)
                t = t + z2 D1^T
    x   = LN_final(t);  pooled = x[b, argmax(tokens_b)] ('argmax') or x[b, L - 1] ('last');  out = pooled P_text
"""
import math

import torch

ETA = LAMBDA = 0.1
EPS = 1e-6
TEXT = dict(width=16, heads=2, layers=2, ctx=8, vocab=40, embed=12, C=4)


def random_text_weights(seed: int = 0, prefix: str = "text.", dtype=torch.float64) -> dict:
    """Random weights of a TEXT-sized tower under its state-dict keys (scaled so that softmax and ReLU are active)."""
    s, g = TEXT, torch.Generator().manual_seed(seed)
    r = lambda *shape, std=0.3: (torch.randn(*shape, generator=g, dtype=torch.float64) * std).to(dtype)  # noqa: E731
    w = s["width"]
    sd = {"token_embedding.weight": r(s["vocab"], w, std=1.0), "positional_embedding": r(s["ctx"], w),
          "ln_final.weight": 1 + r(w), "ln_final.bias": r(w), "text_projection": r(w, s["embed"])}
    for i in range(s["layers"]):
        p = f"transformer.resblocks.{i}."
        sd.update({p + "norm1.weight": 1 + r(w), p + "norm1.bias": r(w), p + "attn.qkv.weight": r(w, w, std=0.5),
                   p + "attn.proj.weight": r(w, w), p + "norm2.weight": 1 + r(w), p + "norm2.bias": r(w),
                   p + "ista.D": r(w, s["C"] * w), p + "ista.D1": r(w, s["C"] * w)})
    return {prefix + k: v for k, v in sd.items()}


def _layer_norm(x, weight, bias):
    mu = x.mean(-1, keepdim=True)
    var = ((x - mu) ** 2).mean(-1, keepdim=True)
    return (x - mu) / torch.sqrt(var + EPS) * weight + bias


def _subspace_attention(w: torch.Tensor, heads: int, causal: bool) -> torch.Tensor:
    """sum_j a_k[i, j] w_k[j] for every token i and head k, one query at a time (keys j <= i when causal)."""
    B, L, d = w.shape
    hd = d // heads
    out = torch.zeros_like(w)
    for k in range(heads):
        wk = w[:, :, k * hd:(k + 1) * hd]
        for i in range(L):
            keys = wk[:, :i + 1] if causal else wk
            logits = torch.einsum("bd,bjd->bj", wk[:, i], keys) / math.sqrt(hd)
            out[:, i, k * hd:(k + 1) * hd] = torch.einsum("bj,bjd->bd", torch.softmax(logits, dim=-1), keys)
    return out


def reference_text_tokens(sd: dict, tokens: torch.Tensor, causal: bool, prefix: str = "text.") -> torch.Tensor:
    """(B, L, width) token features after LN_final."""
    s = TEXT
    g = lambda key: sd[prefix + key]  # noqa: E731
    t = g("token_embedding.weight")[tokens] + g("positional_embedding")[:tokens.shape[1]]
    for i in range(s["layers"]):
        p = f"transformer.resblocks.{i}."
        y = _layer_norm(t, g(p + "norm1.weight"), g(p + "norm1.bias"))
        w = y @ g(p + "attn.qkv.weight").t()
        t = t + _subspace_attention(w, s["heads"], causal) @ g(p + "attn.proj.weight").t()
        y = _layer_norm(t, g(p + "norm2.weight"), g(p + "norm2.bias"))
        D, D1 = g(p + "ista.D"), g(p + "ista.D1")
        z1 = torch.relu(ETA * (y @ D) - ETA * LAMBDA)
        z2 = torch.relu(z1 - ETA * ((z1 @ D.t() - y) @ D) - ETA * LAMBDA)
        t = t + z2 @ D1.t()
    return _layer_norm(t, g("ln_final.weight"), g("ln_final.bias"))


def reference_text_forward(sd: dict, tokens: torch.Tensor, causal: bool, pool: str, prefix: str = "text."):
    """(B, embed) text features of the equations above."""
    x = reference_text_tokens(sd, tokens, causal, prefix)
    rows = tokens.argmax(dim=-1) if pool == "argmax" else torch.full((tokens.shape[0],), tokens.shape[1] - 1)
    return x[torch.arange(tokens.shape[0]), rows] @ sd[prefix + "text_projection"]


def text_cfg(causal: bool, pool: str) -> dict:
    """The TEXT-sized tower's open_clip text_cfg."""
    s = TEXT
    return {"tower": "crate_alpha", "context_length": s["ctx"], "vocab_size": s["vocab"], "width": s["width"],
            "heads": s["heads"], "layers": s["layers"], "no_causal_mask": not causal, "pool_type": pool}
