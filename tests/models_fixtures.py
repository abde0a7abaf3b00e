"""Shared helpers for the models tests: tiny tower kwargs and an independent reference of the spec's forward."""
import torch
import torch.nn.functional as F

# tiny widths so every test runs in well under a second on 2 cores
TINY = dict(embed_dim=32, depth=2, num_heads=2)
ETA = LAMBDA = 0.1


def random_official_state_dict(d: int, depth: int, patch: int, grid: int, num_classes: int, C: int = 4,
                               seed: int = 0) -> dict:
    """A random state dict in the official PyTorch port's layout (keys of the spec's table)."""
    g = torch.Generator().manual_seed(seed)
    r = lambda *s, std=0.05: torch.randn(*s, generator=g) * std  # noqa: E731
    sd = {"conv1.weight": r(d, 3, patch, patch), "conv1.bias": r(d), "cls_token": r(1, 1, d),
          "pos_embedding": r(1, grid * grid + 1, d),
          "mlp_head.0.weight": 1 + r(d), "mlp_head.0.bias": r(d),
          "mlp_head.1.weight": r(num_classes, d), "mlp_head.1.bias": r(num_classes)}
    for i in range(depth):
        p = f"transformer.layers.{i}."
        sd.update({p + "0.norm.weight": 1 + r(d), p + "0.norm.bias": r(d), p + "0.fn.qkv.weight": r(d, d, std=0.3),
                   p + "0.fn.to_out.0.weight": r(d, d, std=0.3), p + "1.norm.weight": 1 + r(d),
                   p + "1.norm.bias": r(d), p + "1.fn.D": r(d, C * d, std=0.3), p + "1.fn.D1": r(d, C * d, std=0.3)})
    return sd


def reference_forward(sd: dict, x: torch.Tensor, depth: int, heads: int, patch: int, eps: float = 1e-6,
                      pre_logits: bool = False):
    """Logits (or the pooled normalised class token) of the spec's equations, straight from an official state dict."""
    t = F.conv2d(x, sd["conv1.weight"], sd["conv1.bias"], stride=patch).flatten(2).transpose(1, 2)
    B, _, d = t.shape
    t = torch.cat([sd["cls_token"].expand(B, -1, -1), t], dim=1) + sd["pos_embedding"]
    L, hd = t.shape[1], d // heads
    for i in range(depth):
        p = f"transformer.layers.{i}."
        y = F.layer_norm(t, (d,), sd[p + "0.norm.weight"], sd[p + "0.norm.bias"], eps)
        w = (y @ sd[p + "0.fn.qkv.weight"].t()).reshape(B, L, heads, hd).transpose(1, 2)
        a = torch.softmax(w @ w.transpose(-1, -2) / hd ** 0.5, dim=-1)
        t = t + ((a @ w).transpose(1, 2).reshape(B, L, d)) @ sd[p + "0.fn.to_out.0.weight"].t()
        y = F.layer_norm(t, (d,), sd[p + "1.norm.weight"], sd[p + "1.norm.bias"], eps)
        D, D1 = sd[p + "1.fn.D"], sd[p + "1.fn.D1"]
        z1 = F.relu(ETA * (y @ D) - ETA * LAMBDA)
        z2 = F.relu(z1 - ETA * ((z1 @ D.t() - y) @ D) - ETA * LAMBDA)
        t = t + z2 @ D1.t()
    out = F.layer_norm(t, (d,), sd["mlp_head.0.weight"], sd["mlp_head.0.bias"], eps)[:, 0]
    if pre_logits:
        return out
    return out @ sd["mlp_head.1.weight"].t() + sd["mlp_head.1.bias"]


def random_crate_state_dict(d: int, depth: int, patch: int, grid: int, num_classes: int, seed: int = 0) -> dict:
    """A random original-CRATE state dict (Ma-Lab-Berkeley/CRATE key layout)."""
    g = torch.Generator().manual_seed(seed)
    r = lambda *s, std=0.05: torch.randn(*s, generator=g) * std  # noqa: E731
    pix = 3 * patch * patch
    sd = {"to_patch_embedding.1.weight": 1 + r(pix), "to_patch_embedding.1.bias": r(pix),
          "to_patch_embedding.2.weight": r(d, pix), "to_patch_embedding.2.bias": r(d),
          "to_patch_embedding.3.weight": 1 + r(d), "to_patch_embedding.3.bias": r(d),
          "cls_token": r(1, 1, d), "pos_embedding": r(1, grid * grid + 1, d),
          "mlp_head.0.weight": 1 + r(d), "mlp_head.0.bias": r(d),
          "mlp_head.1.weight": r(num_classes, d), "mlp_head.1.bias": r(num_classes)}
    for i in range(depth):
        p = f"transformer.layers.{i}."
        sd.update({p + "0.norm.weight": 1 + r(d), p + "0.norm.bias": r(d), p + "0.fn.qkv.weight": r(d, d, std=0.3),
                   p + "0.fn.to_out.0.weight": r(d, d, std=0.3), p + "0.fn.to_out.0.bias": r(d),
                   p + "1.norm.weight": 1 + r(d), p + "1.norm.bias": r(d), p + "1.fn.weight": r(d, d, std=0.3)})
    return sd


def crate_reference_forward(sd: dict, x: torch.Tensor, depth: int, heads: int, patch: int, eps: float = 1e-5):
    """Logits of the original CRATE equations (spec), straight from its state dict."""
    B, C, H, W = x.shape
    gh, gw = H // patch, W // patch
    pix = x.reshape(B, C, gh, patch, gw, patch).permute(0, 2, 4, 3, 5, 1).reshape(B, gh * gw, -1)  # (p1 p2 c)
    ln = lambda t, k: F.layer_norm(t, t.shape[-1:], sd[k + ".weight"], sd[k + ".bias"], eps)  # noqa: E731
    t = ln(ln(pix, "to_patch_embedding.1") @ sd["to_patch_embedding.2.weight"].t() + sd["to_patch_embedding.2.bias"],
           "to_patch_embedding.3")
    d = t.shape[-1]
    t = torch.cat([sd["cls_token"].expand(B, -1, -1), t], dim=1) + sd["pos_embedding"]
    L, hd = t.shape[1], d // heads
    for i in range(depth):
        p = f"transformer.layers.{i}."
        y = ln(t, p + "0.norm")
        w = (y @ sd[p + "0.fn.qkv.weight"].t()).reshape(B, L, heads, hd).transpose(1, 2)
        a = torch.softmax(w @ w.transpose(-1, -2) / hd ** 0.5, dim=-1)
        out = (a @ w).transpose(1, 2).reshape(B, L, d)
        t = t + out @ sd[p + "0.fn.to_out.0.weight"].t() + sd[p + "0.fn.to_out.0.bias"]
        y, Dm = ln(t, p + "1.norm"), sd[p + "1.fn.weight"]
        t = F.relu(y + ETA * (y @ Dm - (y @ Dm.t()) @ Dm) - ETA * LAMBDA)
    return ln(t, "mlp_head.0")[:, 0] @ sd["mlp_head.1.weight"].t() + sd["mlp_head.1.bias"]
