"""Importing released CRATE-alpha classifiers: the official PyTorch port's layout through timm."""
import pytest
import timm
import torch

import crate_clip  # noqa: F401
from crate_clip.models import checkpoint_filter_fn, official_to_timm
from models_fixtures import (TINY, crate_reference_forward, random_crate_state_dict, random_official_state_dict,
                            reference_forward)

D, DEPTH, HEADS, PATCH = TINY["embed_dim"], TINY["depth"], TINY["num_heads"], 16


def write_official(tmp_path, num_classes, grid=2, name="official.pth"):
    sd = random_official_state_dict(D, DEPTH, PATCH, grid, num_classes)
    path = tmp_path / name
    torch.save(sd, path)
    return sd, path


def load(path, name="crate_alpha_base_patch16_224", **kw):
    # as with timm's own models, the overlay states the file's class count: a head of another size than
    # pretrained_cfg['num_classes'] is dropped by timm's loader (pretrained_cfg['classifier'] names it)
    overlay = dict(file=str(path), **({"num_classes": kw["num_classes"]} if "num_classes" in kw else {}))
    return timm.create_model(name, pretrained=True, pretrained_cfg_overlay=overlay,
                             **{**TINY, "img_size": 32, **kw}).eval()


def test_official_round_trip_matches_reference_equations(tmp_path):
    sd, path = write_official(tmp_path, num_classes=7)
    model = load(path, num_classes=7)
    x = torch.randn(3, 3, 32, 32)
    torch.testing.assert_close(model(x), reference_forward(sd, x, DEPTH, HEADS, PATCH), rtol=1e-4, atol=1e-5)


def test_in21k_head_with_num_classes_given(tmp_path):
    sd, path = write_official(tmp_path, num_classes=19_167)
    x = torch.randn(2, 3, 32, 32)
    expected = reference_forward(sd, x, DEPTH, HEADS, PATCH)
    model = load(path, num_classes=19_167)
    assert model.head.weight.shape == (19_167, D)
    torch.testing.assert_close(model(x), expected, rtol=1e-4, atol=1e-5)
    tagged = load(path, name="crate_alpha_base_patch16_224.in21k")  # the tag's default head is 19,167 wide
    torch.testing.assert_close(tagged(x), expected, rtol=1e-4, atol=1e-5)


def test_other_class_count_keeps_body_and_fresh_head(tmp_path):
    sd, path = write_official(tmp_path, num_classes=19_167)
    model = load(path, num_classes=10)
    x = torch.randn(2, 3, 32, 32)
    assert model(x).shape == (2, 10)
    feats = model.forward_head(model.forward_features(x), pre_logits=True)
    torch.testing.assert_close(feats, reference_forward(sd, x, DEPTH, HEADS, PATCH, pre_logits=True),
                               rtol=1e-4, atol=1e-5)


def test_load_at_another_resolution_resamples_pos_embed(tmp_path):
    _, path = write_official(tmp_path, num_classes=7, grid=2)
    model = load(path, num_classes=7, img_size=64)
    assert model.pos_embed.shape == (1, 17, D)
    assert model(torch.randn(1, 3, 64, 64)).shape == (1, 7)


def test_clip_tower_folds_conv_bias_into_pos_embed(tmp_path):
    sd, path = write_official(tmp_path, num_classes=7)
    tower = load(path, name="crate_alpha_clipa_base_patch16_224", num_classes=0)
    assert tower.patch_embed.proj.bias is None
    x = torch.randn(2, 3, 32, 32)
    torch.testing.assert_close(tower(x), reference_forward(sd, x, DEPTH, HEADS, PATCH, pre_logits=True),
                               rtol=1e-4, atol=1e-5)


def test_unexpected_official_key_is_named(tmp_path):
    sd = random_official_state_dict(D, DEPTH, PATCH, 2, 7)
    sd["transformer.layers.0.1.fn.lambd"] = torch.zeros(1)
    torch.save(sd, tmp_path / "bad.pth")
    with pytest.raises(RuntimeError, match=r"transformer\.layers\.0\.1\.fn\.lambd"):
        load(tmp_path / "bad.pth", num_classes=7)
    del sd["transformer.layers.0.1.fn.lambd"], sd["transformer.layers.1.1.fn.D1"]
    torch.save(sd, tmp_path / "missing.pth")
    with pytest.raises(RuntimeError, match=r"blocks\.1\.ista\.D1"):
        load(tmp_path / "missing.pth", num_classes=7)


def test_official_key_mapping_and_module_prefix():
    sd = random_official_state_dict(D, 1, PATCH, 2, 7)
    mapped = official_to_timm(sd)
    assert {"patch_embed.proj.weight", "cls_token", "pos_embed", "blocks.0.attn.qkv.weight",
            "blocks.0.attn.proj.weight", "blocks.0.ista.D", "blocks.0.ista.D1", "norm.weight", "head.bias"} \
        <= set(mapped)
    model = timm.create_model("crate_alpha_base_patch16_224", img_size=32, num_classes=7, **{**TINY, "depth": 1})
    filtered = checkpoint_filter_fn({"module." + k: v for k, v in sd.items()}, model)
    model.load_state_dict(filtered)  # strict


def test_weights_only_refuses_pickled_code(tmp_path):
    sd = random_official_state_dict(D, DEPTH, PATCH, 2, 7)
    sd["extra"] = torch.nn.Linear(2, 2)  # a pickled module object: not loadable with weights_only=True
    torch.save(sd, tmp_path / "pickled.pth")
    with pytest.raises(Exception, match="(?i)weights_only|unpickl"):
        load(tmp_path / "pickled.pth", num_classes=7)


def test_original_crate_checkpoint_matches_reference(tmp_path):
    sd = random_crate_state_dict(D, DEPTH, PATCH, 2, 7)
    torch.save(sd, tmp_path / "crate.pth")
    model = load(tmp_path / "crate.pth", name="crate_base_patch16_224", num_classes=7)
    x = torch.randn(2, 3, 32, 32)
    torch.testing.assert_close(model(x), crate_reference_forward(sd, x, DEPTH, HEADS, PATCH), rtol=1e-4, atol=1e-5)
