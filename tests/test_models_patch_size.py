"""Patch-size change between stages: the kernel resize, the position embedding, the stage change, eval and export;
sizes the patches do not tile refused (issue 39)."""
from pathlib import Path

import pytest
import torch

import crate_clip  # noqa: F401  (registers the towers and CLIP configs)
from crate_clip.models.crate_alpha import CrateAlpha, resize_patch_kernel
from crate_clip.models import create_clip
from crate_clip.models.patch_change import checkpoint_patch_size
from crate_clip.train.run.run_config import config_from_dict

TINY = "CRATE-alpha-CLIPA-tiny"


def small_tower(patch: int = 4, img: int = 16) -> CrateAlpha:
    torch.manual_seed(0)
    return CrateAlpha(img_size=img, patch_size=patch, embed_dim=32, depth=2, num_heads=2, num_classes=0,
                      patch_bias=False).eval()


def test_kernel_of_ones_2_to_4_pi_resize_keeps_tokens_bilinear_keeps_values():
    ones = torch.ones(1, 1, 2, 2)
    # PI-resize: w' = B (B^T B)^-1 w with B the 2->4 bilinear upsampling; for w = 1, B^T 1 = 4 * 1, so w' = 1/4:
    # the token of a constant image (4 pixels x 1 = 16 pixels x 1/4) is unchanged
    torch.testing.assert_close(resize_patch_kernel(ones, 4, "pi_resize"), torch.full((1, 1, 4, 4), 0.25))
    # plain bilinear (the paper's jax.image.resize) keeps the values: the constant image's token grows 4x
    torch.testing.assert_close(resize_patch_kernel(ones, 4, "bilinear"), torch.ones(1, 1, 4, 4))
    # shrinking 8 -> 2: bilinear keeps values, so tokens shrink ~16x; pi_resize keeps them (about)
    image = torch.rand(1, 1, 1, 1).expand(1, 1, 8, 8)
    kernel = torch.rand(3, 1, 8, 8) + 0.5
    token = torch.nn.functional.conv2d(image, kernel, stride=8)
    small_image = image[..., :2, :2]
    for mode, ratio in (("pi_resize", 1.0), ("bilinear", 1 / 16)):
        new = torch.nn.functional.conv2d(small_image, resize_patch_kernel(kernel, 2, mode), stride=2)
        assert (new / token).mean().item() == pytest.approx(ratio, rel=0.2 if mode == "bilinear" else 0.1)  # PI: least squares when shrinking
    with pytest.raises(ValueError, match="patch resize mode"):
        resize_patch_kernel(ones, 4, "nearest")


def test_same_patch_keeps_the_function_and_a_change_follows_the_grid():
    tower = small_tower()
    x = torch.randn(2, 3, 16, 16)
    before = tower(x)
    tower.set_patch_size(4)
    torch.testing.assert_close(tower(x), before, rtol=0, atol=0)
    tower.set_input_size(patch_size=4)                        # timm's spelling, same no-op
    torch.testing.assert_close(tower(x), before, rtol=0, atol=0)
    kernel, pos = tower.patch_embed.proj.weight.detach().clone(), tower.pos_embed.detach().clone()
    tower.set_patch_size(8, "bilinear")
    assert tower.grid_size == (2, 2) and tower.pos_embed.shape == (1, 5, 32) and tower(x).shape == (2, 32)
    torch.testing.assert_close(tower.patch_embed.proj.weight, resize_patch_kernel(kernel, 8, "bilinear"))
    torch.testing.assert_close(tower.pos_embed[:, 0], pos[:, 0])   # the class slot is kept apart
    with pytest.raises(ValueError, match="larger than the image"):
        tower.set_patch_size(32)


def _two_stage_config(patch0, patch1, resize="pi_resize"):
    stage = dict(image_size=28, context_length=8, samples=512, global_batch=256, lr=1e-3)
    return config_from_dict({"model": {"name": TINY}, "data": {"sources": ["x"]},
                             "stages": [dict(stage, name="coarse", patch_size=patch0),
                                        dict(stage, name="fine", patch_size=patch1, patch_resize=resize)]},
                            check_paths=False)


@pytest.mark.parametrize("resize", ["pi_resize", "bilinear"])
def test_stage_change_resizes_the_kernel_and_eval_export_know_the_patch(resize, tmp_path):
    from crate_clip.export.writer import export_open_clip, load_export
    from crate_clip.train.stage_setup.stage_model import resolve_stage

    cfg = _two_stage_config(7, 4, resize)
    coarse = resolve_stage(cfg, 0).build_model().eval()
    assert coarse.visual.trunk.patch_size == 7 and coarse.visual.trunk.pos_embed.shape[1] == 17
    weights = {k: v.clone() for k, v in coarse.state_dict().items()}
    assert checkpoint_patch_size(weights) == 7 and cfg.patch_size_at(0) == 7 and cfg.patch_size_at(1) == 4
    fine = resolve_stage(cfg, 1).build_model(weights)
    kernel = fine.state_dict()["visual.trunk.patch_embed.proj.weight"]
    torch.testing.assert_close(kernel, resize_patch_kernel(weights["visual.trunk.patch_embed.proj.weight"], 4, resize))
    assert fine.visual.trunk.pos_embed.shape[1] == 50
    # evaluation rebuilds a checkpoint at its own patch size: the same function as the trained model
    images, text = torch.randn(2, 3, 28, 28), torch.randint(1, 100, (2, 8))
    rebuilt = create_clip(TINY, pretrained=weights, image_size=28, context_length=8).eval()
    with torch.no_grad():
        torch.testing.assert_close(rebuilt(images, text)[0], coarse(images, text)[0])
    # the export at patch 7 loads in open_clip at patch 7 with exactly these weights
    export_open_clip(weights, TINY, tmp_path / "export", image_size=28, context_length=8, patch_size=7)
    loaded, _, _ = load_export(tmp_path / "export")
    assert loaded.visual.trunk.patch_size == 7
    got = loaded.state_dict()
    assert set(got) == set(weights) and all(torch.equal(got[k].reshape(-1), weights[k].float().reshape(-1)) for k in got)


def test_eval_of_an_exports_weights_file_rebuilds_at_its_patch_image_size_and_context(tmp_path, capsys):
    """`crate-clip eval --model CONFIG --pretrained export/open_clip_model.safetensors` of a patch-7, 21 px,
    16-token export: the model is the export's (rebuilt as saved), and a note names the local-dir: form."""
    from crate_clip.export.writer import WEIGHTS_FILE, export_open_clip, load_export
    from crate_clip.eval.model_loading import load_eval_model

    torch.manual_seed(0)
    weights = create_clip(TINY, patch_size=7, image_size=21, context_length=16).state_dict()
    export_open_clip(weights, TINY, tmp_path / "export", image_size=21, context_length=16)
    model, _, tokenizer, _ = load_eval_model(TINY, pretrained=str(tmp_path / "export" / WEIGHTS_FILE))
    assert model.visual.trunk.patch_size == 7 and model.visual.image_size == (21, 21) and model.context_length == 16
    assert f"--model local-dir:{tmp_path / 'export'}" in capsys.readouterr().err
    exported, _, exported_tokenizer = load_export(tmp_path / "export")
    images, texts = torch.randn(2, 3, 21, 21), ["a shirt", "a sneaker"]
    assert torch.equal(tokenizer(texts), exported_tokenizer(texts))
    with torch.no_grad():
        assert torch.equal(model.encode_image(images), exported.encode_image(images))


def test_patch_size_keys_are_checked():
    from crate_clip.train.run.run_config import ConfigError
    with pytest.raises(ConfigError, match=r"stages.1.patch_resize: 'nearest'"):
        _two_stage_config(7, 4, "nearest")
    with pytest.raises(ConfigError, match=r"stages.0.patch_size: 64"):
        _two_stage_config(64, 4)


def test_tower_names_carry_patch_and_size_and_resolve_without_registration():
    """`crate_alpha_clipa.w.._d.._h.._p<patch>_<px>` builds that tower through timm's own name parsing (the tag
    goes to one registered architecture); registered variants keep their names where they fit; the underscore
    form is registered on request; names that are no tower are refused naming the form."""
    import timm
    from timm.models import is_model

    from crate_clip.models.clip_tower_names import FORM, parse_clip_tower_name, tower_name_at
    from crate_clip.models.patch_change import register_tower_of

    for patch, px in ((1, 3), (7, 21), (32, 96)):
        tower = timm.create_model(f"crate_alpha_clipa.w16_d1_h2_p{patch}_{px}")
        assert (tower.patch_size, tower.img_size, tower.embed_dim, len(tower.blocks)) == (patch, (px, px), 16, 1)
        assert tower.patch_embed.proj.bias is None and tower.num_classes == 0   # a CLIP tower
    assert tower_name_at("crate_alpha_clipa_large_patch14_224", 14, 224) == "crate_alpha_clipa_large_patch14_224"
    assert tower_name_at("crate_alpha_clipa_large_patch14_224", 14, 84) == "crate_alpha_clipa.w1024_d24_h16_p14_84"
    assert tower_name_at("crate_alpha_clipa.w128_d4_h4_p4_28", 7, 21) == "crate_alpha_clipa.w128_d4_h4_p7_21"
    with pytest.raises(ValueError, match="only CRATE-alpha CLIP towers"):
        tower_name_at("crate_alpha_tiny_patch16_224", 8, 224)   # a classifier (conv bias, head): no CLIP name
    with pytest.raises(ValueError, match="multiple of heads"):
        timm.create_model("crate_alpha_clipa.w10_d1_h3_p4_16")
    with pytest.raises(ValueError, match=FORM.replace(".", r"\.")):
        parse_clip_tower_name("crate_alpha_clipa.w16_p4")
    legacy = "crate_alpha_clipa_w16_d1_h2_p5_20"
    assert parse_clip_tower_name(legacy) == parse_clip_tower_name("crate_alpha_clipa.w16_d1_h2_p5_20")
    assert not is_model(legacy)
    register_tower_of({"vision_cfg": {"timm_model_name": legacy}})
    assert timm.create_model(legacy).patch_size == 5


def test_a_shipped_configs_patch_is_read_from_its_json_as_open_clip_reads_it():
    """The run config's checks read a shipped config's patch from its JSON (no open_clip import in the launching
    process): the same patch as from the config open_clip registered and the tower name timm builds, for every
    JSON; another name is asked from open_clip."""
    from crate_clip.models.clip_tower_names import tower_arch
    from crate_clip.models.model_config_files import MODEL_CONFIG_DIR, parametric_patch
    from crate_clip.models.model_patch_size import image_patch_size
    from crate_clip.models.open_clip_configs import registered_patch_size

    names = sorted(p.stem for p in MODEL_CONFIG_DIR.glob("*.json"))
    assert len(names) >= 15
    for name in names:
        assert image_patch_size(name) == registered_patch_size(name) is not None, name
    assert [parametric_patch(t) for t in ("crate_alpha_clipa.w16_d1_h2_p5_20", "crate_alpha_clipa_w16_d1_h2_p5_20",
                                          "crate_alpha_clipa_large_patch14_224", "crate_alpha_clipa.w16_p4")] \
        == [5, 5, None, None]
    assert tower_arch("crate_alpha_clipa_large_patch14_224")["patch_size"] == 14
    assert image_patch_size("ViT-B-32") == 32 and image_patch_size("no-such-model") is None


UNTILED = ("stages.1: image_size 28 is not a multiple of patch_size 9 (the patch convolution would drop 1 pixel row "
           "and column); use 27 or 36")


@pytest.mark.parametrize("command", [["train", "--validate"], ["plan", "--gpus", "1", "--gpu", "h100"]])
def test_train_and_plan_refuse_a_stage_its_patches_do_not_tile_in_one_line(command, capsys):
    """Issue 39: the demo's fine-tune at 28 px / patch 9 (its last pixel row and column never reached a patch)."""
    from crate_clip.cli import main

    config = str(Path(__file__).resolve().parents[1] / "configs" / "demo" / "fashion_mnist.yaml")
    args = [command[0], *(["--config", config] if command[0] == "train" else [config]), *command[1:]]
    assert main(args + ["--set", "stages.1.image_size=28"]) == 2
    err = capsys.readouterr().err
    assert err.splitlines()[1:] == ["  " + UNTILED] and "Traceback" not in err


def test_an_export_at_a_size_its_patches_do_not_tile_is_refused_before_anything_is_written(tmp_path):
    from crate_clip.core.patch_tiling import PatchTilingError
    from crate_clip.export.writer import export_open_clip

    weights = create_clip(TINY, patch_size=9, image_size=27, context_length=16).state_dict()
    with pytest.raises(PatchTilingError) as exc:
        export_open_clip(weights, TINY, tmp_path / "export", image_size=28, context_length=16)
    assert str(exc.value) == f"export of {TINY}: {UNTILED.split(': ', 1)[1]}"
    assert not any(tmp_path.iterdir())
