"""Exact parameter counts of every registered tower and CLIP image tower (counted on the meta device)."""
import pytest
import timm
import torch

import crate_clip  # noqa: F401  (registers the models)
from crate_clip.models import CrateAlpha, image_tower_param_count

SPEC_COUNTS = {  # SPEC-crate-alpha.md, 224 px, 1000 classes
    "crate_alpha_tiny_patch32_224": 5_226_088, "crate_alpha_tiny_patch16_224": 4_811_944,
    "crate_alpha_tiny_patch14_224": 4_788_904, "crate_alpha_tiny_patch8_224": 4_814_248,
    "crate_alpha_small_patch32_224": 42_218_344, "crate_alpha_small_patch16_224": 40_975_912,
    "crate_alpha_small_patch14_224": 40_906_792, "crate_alpha_small_patch8_224": 40_982_824,
    "crate_alpha_base_patch32_224": 73_985_512, "crate_alpha_base_patch16_224": 72_328_936,
    "crate_alpha_base_patch14_224": 72_236_776, "crate_alpha_base_patch8_224": 72_338_152,
    "crate_alpha_large_patch32_224": 255_982_568, "crate_alpha_large_patch16_224": 253_773_800,
    "crate_alpha_large_patch14_224": 253_650_920, "crate_alpha_large_patch8_224": 253_786_088,
    "crate_alpha_huge_patch14_224": 526_819_560, "crate_alpha_huge_patch16_224": 526_973_160,
    "crate_tiny_patch16_224": 6_090_856, "crate_small_patch16_224": 13_116_328,
    "crate_base_patch16_224": 22_796_008, "crate_large_patch16_224": 77_641_192,
}


def meta_count(name: str, **kwargs) -> int:
    with torch.device("meta"):
        model = timm.create_model(name, **kwargs)
    return sum(p.numel() for p in model.parameters())


@pytest.mark.parametrize("name", sorted(SPEC_COUNTS))
def test_spec_parameter_count(name):
    assert meta_count(name) == SPEC_COUNTS[name]


def test_every_family_name_is_registered():
    registered = set(timm.list_models("crate_*"))
    assert set(SPEC_COUNTS) <= registered
    assert {"crate_alpha_clipa_base_patch16_224", "crate_alpha_clipa_large_patch14_224",
            "crate_alpha_clipa_huge_patch14_224"} <= registered


def test_closed_form_matches_for_alpha_family():
    d, depth, p, K = 768, 12, 16, 1000
    n = (224 // p) ** 2
    closed = depth * (10 * d * d + 4 * d) + 3 * p * p * d + d + d + (n + 1) * d + 2 * d + d * K + K
    assert meta_count("crate_alpha_base_patch16_224") == closed


def test_in21k_head_count():
    # the released IN-21K checkpoints carry a 19,167-class head
    assert meta_count("crate_alpha_base_patch16_224.in21k") == 72_328_936 + 768 * (19_167 - 1000) + 19_167 - 1000


@pytest.mark.parametrize("name,size,expected", [
    ("CRATE-alpha-CLIPA-B-16", None, 72_345_600),
    ("CRATE-alpha-CLIPA-L-14", None, 253_673_472),
    ("CRATE-alpha-CLIPA-H-14", None, 526_848_000),
    ("CRATE-alpha-CLIPA-L-14", 84, 253_448_192),   # 6x6 + 1 = 37 tokens
    ("CRATE-alpha-CLIPA-B-16", 84, 72_345_600 - (197 - 26) * 768),  # 84 // 16 = 5: VALID conv drops 4 px
])
def test_clip_image_tower_count(name, size, expected):
    assert image_tower_param_count(name, size) == expected


def test_ablation_ladder_counts():
    # CRATE -> +overcomplete (C=4, tied D) -> +decoupled (D1) -> +residual (no new parameters): per-layer matrices
    d, depth = 64, 2
    common = dict(img_size=32, patch_size=16, embed_dim=d, depth=depth, num_heads=2, num_classes=0)

    def count(**switches):
        with torch.device("meta"):
            m = CrateAlpha(**common, **switches)
        return sum(p.numel() for p in m.parameters())

    base = count(overcomplete_ratio=1, decoupled_dictionary=False, ista_residual=False)
    over = count(overcomplete_ratio=4, decoupled_dictionary=False, ista_residual=False)
    dec = count(overcomplete_ratio=4, decoupled_dictionary=True, ista_residual=False)
    res = count(overcomplete_ratio=4, decoupled_dictionary=True, ista_residual=True)
    assert over - base == depth * 3 * d * d
    assert dec - over == depth * 4 * d * d
    assert res == dec


CRATE_TEXT_COUNTS = {  # docs/text_tower.md: (text tower with projection, whole CLIP incl. logit_scale)
    "CRATE-alpha-CLIPA-tiny-crate-text": (3_254_912, 3_941_633),
    "CRATE-alpha-CLIPA-tiny-crate-text-w52": (2_632_136, 3_318_857),
    "CRATE-alpha-CLIPA-B-16-crate-text": (285_607_936, 357_953_537),
    "CRATE-alpha-CLIPA-L-14-crate-text": (285_607_936, 539_281_409),
    "CRATE-alpha-CLIPA-H-14-crate-text": (285_607_936, 812_455_937),
}


@pytest.mark.parametrize("name", sorted(CRATE_TEXT_COUNTS))
def test_crate_text_clip_counts(name):
    import open_clip
    from crate_clip.models import create_clip, text_tower_param_count

    cfg = open_clip.get_model_config(name)
    model = create_clip(name, device="meta")
    text, total = CRATE_TEXT_COUNTS[name]
    assert sum(p.numel() for p in model.text.parameters()) == text_tower_param_count(cfg["embed_dim"], cfg["text_cfg"])
    assert (sum(p.numel() for p in model.text.parameters()), sum(p.numel() for p in model.parameters())) == (text, total)
    assert total == text + image_tower_param_count(name) + 1   # + logit_scale
    t, w = cfg["text_cfg"], cfg["text_cfg"]["width"]   # closed form: embeddings, blocks, final LN, projection
    assert text == (t["vocab_size"] + t["context_length"]) * w + t["layers"] * (10 * w * w + 4 * w) + 2 * w \
        + w * cfg["embed_dim"]
