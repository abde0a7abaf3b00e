"""Small random CRATE-alpha-CLIPA models in the OFFICIAL key layout, and an independent float64 forward of
the official model written from the spec's equations (../shared/SPEC-whitebox-and-scale.md), not from our code."""
import json
import math

import torch
import torch.nn.functional as F

ETA = LAMBDA = 0.1
# image: width 32, 2 blocks, 2 heads, /8 patches at 32 px (4x4 grid); text: width = embed = 16 (the official
# forward `x @ text_projection.T` needs a square matrix), 2 blocks, 2 heads, context 8, 50-row vocabulary
SMALL = dict(d=32, depth=2, heads=2, patch=8, px=32, embed=16, tw=16, tdepth=2, theads=2, ctx=8, vocab=50)
SMALL_NAME = "test-CRATE-alpha-CLIPA-small"


def small_config() -> dict:
    """open_clip config of the small model: our CLIPA text settings at test size."""
    s = SMALL
    return {"embed_dim": s["embed"],
            "vision_cfg": {"image_size": s["px"], "timm_model_name": f"crate_alpha_clipa_w{s['d']}_d{s['depth']}_h"
                                                                      f"{s['heads']}_p{s['patch']}_{s['px']}",
                           "timm_pool": "token", "timm_proj": "linear", "timm_proj_bias": False},
            "text_cfg": {"context_length": s["ctx"], "vocab_size": s["vocab"], "width": s["tw"], "heads": s["theads"],
                         "layers": s["tdepth"], "pool_type": "last", "no_causal_mask": True, "proj_bias": False,
                         "act_kwargs": {"approximate": "tanh"}, "norm_kwargs": {"eps": 1e-6}}}


def write_small_configs(folder) -> tuple:
    """Write the small config's JSON into `folder`, and a copy naming CLIPA's BERT tokenizer; returns both names."""
    (folder / f"{SMALL_NAME}.json").write_text(json.dumps(small_config()))
    bert = small_config()
    bert["text_cfg"].update(hf_tokenizer_name="bert-base-uncased", tokenizer_kwargs={"strip_sep_token": True})
    (folder / f"{SMALL_NAME}-bert.json").write_text(json.dumps(bert))
    return SMALL_NAME, f"{SMALL_NAME}-bert"


def random_official_clipa(seed: int = 0, dtype=torch.float64, layernorm_bias: bool = True) -> dict:
    """A random state dict with the released files' keys (Q = K = V copies of U in every image block); without
    `layernorm_bias`, the layout of a file saved under torch >= 2.1, whose LayerNorms the port built bias-free."""
    s = SMALL
    g = torch.Generator().manual_seed(seed)
    r = lambda *shape, std=0.2: (torch.randn(*shape, generator=g, dtype=torch.float64) * std).to(dtype)  # noqa: E731
    d, tw = s["d"], s["tw"]
    sd = {"visual.conv1.weight": r(d, 3, s["patch"], s["patch"], std=0.1), "visual.class_embedding": r(d),
          "visual.positional_embedding": r((s["px"] // s["patch"]) ** 2 + 1, d),
          "visual.ln_post.weight": 1 + r(d), "visual.ln_post.bias": r(d), "visual.proj": r(d, s["embed"])}
    for i in range(s["depth"]):
        p = f"visual.transformer.resblocks.{i}."
        u = r(d, d, std=0.3)
        sd.update({p + "ln_1.weight": 1 + r(d), p + "ln_1.bias": r(d), p + "attn.in_proj_weight": torch.cat([u, u, u]),
                   p + "attn.out_proj.weight": r(d, d, std=0.3), p + "ln_2.weight": 1 + r(d), p + "ln_2.bias": r(d),
                   p + "mlp.c_fc": r(d, 4 * d, std=0.3), p + "mlp.c_proj": r(d, 4 * d, std=0.3)})
    sd.update({"token_embedding.weight": r(s["vocab"], tw), "positional_embedding": r(s["ctx"], tw),
               "ln_final.weight": 1 + r(tw), "ln_final.bias": r(tw), "text_projection": r(tw, s["embed"]),
               "logit_scale": torch.tensor(math.log(1 / 0.07), dtype=dtype)})
    for i in range(s["tdepth"]):
        p = f"transformer.resblocks.{i}."
        sd.update({p + "ln_1.weight": 1 + r(tw), p + "ln_1.bias": r(tw), p + "attn.in_proj_weight": r(3 * tw, tw),
                   p + "attn.in_proj_bias": r(3 * tw), p + "attn.out_proj.weight": r(tw, tw),
                   p + "attn.out_proj.bias": r(tw), p + "ln_2.weight": 1 + r(tw), p + "ln_2.bias": r(tw),
                   p + "mlp.c_fc.weight": r(4 * tw, tw), p + "mlp.c_fc.bias": r(4 * tw),
                   p + "mlp.c_proj.weight": r(tw, 4 * tw), p + "mlp.c_proj.bias": r(tw)})
    return sd if layernorm_bias else {k: v for k, v in sd.items() if not _is_layernorm_bias(k)}


def _is_layernorm_bias(key: str) -> bool:
    return key.endswith(".bias") and key.split(".")[-2] in ("ln_1", "ln_2", "ln_post", "ln_final")


def _ln(x, sd, key, eps=1e-6):
    """LayerNorm with the file's weight, and its bias when the file has one (torch's bias=False: none)."""
    mu = x.mean(-1, keepdim=True)
    var = ((x - mu) ** 2).mean(-1, keepdim=True)
    y = (x - mu) / torch.sqrt(var + eps) * sd[key + ".weight"]
    return y + sd[key + ".bias"] if key + ".bias" in sd else y


def _attention(q, k, v, heads):
    B, L, d = q.shape
    hd = d // heads
    split = lambda t: t.reshape(B, L, heads, hd).permute(0, 2, 1, 3)  # noqa: E731
    a = torch.softmax(split(q) @ split(k).transpose(-1, -2) / math.sqrt(hd), dim=-1)
    return (a @ split(v)).permute(0, 2, 1, 3).reshape(B, L, d)


def official_image_forward(sd: dict, x: torch.Tensor) -> torch.Tensor:
    """ln_post(x[:, 0]) @ proj of the official visual tower: MHA with Q = K = V = y U^T, then the ISTA step."""
    s = SMALL
    t = F.conv2d(x, sd["visual.conv1.weight"], stride=s["patch"]).flatten(2).transpose(1, 2)
    B, _, d = t.shape
    t = torch.cat([sd["visual.class_embedding"].expand(B, 1, d), t], dim=1) + sd["visual.positional_embedding"]
    for i in range(s["depth"]):
        p = f"visual.transformer.resblocks.{i}."
        y = _ln(t, sd, p + "ln_1")
        w = sd[p + "attn.in_proj_weight"]
        q, k, v = y @ w[:d].t(), y @ w[d:2 * d].t(), y @ w[2 * d:].t()
        t = t + _attention(q, k, v, s["heads"]) @ sd[p + "attn.out_proj.weight"].t()
        y = _ln(t, sd, p + "ln_2")
        D, D1 = sd[p + "mlp.c_fc"], sd[p + "mlp.c_proj"]
        z1 = torch.relu(ETA * (y @ D) - ETA * LAMBDA)
        z2 = torch.relu(z1 - ETA * ((z1 @ D.t() - y) @ D) - ETA * LAMBDA)
        t = t + z2 @ D1.t()
    return _ln(t[:, 0], sd, "visual.ln_post") @ sd["visual.proj"]


def _gelu_tanh(x):
    return 0.5 * x * (1 + torch.tanh(math.sqrt(2 / math.pi) * (x + 0.044715 * x ** 3)))


def official_text_forward(sd: dict, tokens: torch.Tensor) -> torch.Tensor:
    """The official text tower: no mask, tanh-GELU, ln_final, LAST position, then x @ text_projection.T."""
    s = SMALL
    t = sd["token_embedding.weight"][tokens] + sd["positional_embedding"]
    tw = t.shape[-1]
    for i in range(s["tdepth"]):
        p = f"transformer.resblocks.{i}."
        y = _ln(t, sd, p + "ln_1")
        w, b = sd[p + "attn.in_proj_weight"], sd[p + "attn.in_proj_bias"]
        q, k, v = (y @ w[j * tw:(j + 1) * tw].t() + b[j * tw:(j + 1) * tw] for j in range(3))
        t = t + _attention(q, k, v, s["theads"]) @ sd[p + "attn.out_proj.weight"].t() + sd[p + "attn.out_proj.bias"]
        y = _ln(t, sd, p + "ln_2")
        h = _gelu_tanh(y @ sd[p + "mlp.c_fc.weight"].t() + sd[p + "mlp.c_fc.bias"])
        t = t + h @ sd[p + "mlp.c_proj.weight"].t() + sd[p + "mlp.c_proj.bias"]
    return _ln(t, sd, "ln_final")[:, -1] @ sd["text_projection"].t()
