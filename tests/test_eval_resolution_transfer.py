"""Resolution transfer without fine-tuning: `--resize patch` keeps the patch grid and PI-resizes the kernel
(FlexiViT), beside grid growth (`--resize grid`); official_1d never shrinks a grid; the stage evaluations' points."""
import json
import warnings

import pytest
import torch
import torch.nn.functional as F
from timm.layers import resample_patch_embed

from crate_clip.cli import main as crate_clip_main
from crate_clip.models.patch_change import (create_clip_at_patch, patch_for_image_size, patch_input_size,
                                           set_resolution_by_patch)
from crate_clip.models.pi_resize import pi_resize_kernel, resize_image_patches
from crate_clip.models.pos_embed import resize_image_pos_embed
from eval_fixtures import CRATE_TINY


@pytest.mark.parametrize("old,new", [(7, 9), (4, 7), (7, 14)])
def test_a_pi_resized_kernel_gives_each_resized_patch_its_original_token(old, new):
    """<resize(x), w'> = <x, w> patch by patch when growing (the pseudo-inverse property), and the kernel is the
    one timm's independent resample_patch_embed computes."""
    torch.manual_seed(0)
    w = torch.randn(16, 3, old, old, dtype=torch.float64)
    x = torch.randn(2, 3, 3 * old, 3 * old, dtype=torch.float64)
    w2 = pi_resize_kernel(w, new)
    assert w2.shape == (16, 3, new, new)
    tokens = F.conv2d(x, w, stride=old)
    resized = F.conv2d(resize_image_patches(x, old, new), w2, stride=new)
    torch.testing.assert_close(resized, tokens, rtol=0, atol=1e-9)
    torch.testing.assert_close(w2.float(), resample_patch_embed(w.float(), [new, new]), rtol=1e-4, atol=1e-5)
    # a plain bilinear kernel resize does not keep the tokens
    bilinear = F.interpolate(w, size=(new, new), mode="bilinear", align_corners=False)
    assert not torch.allclose(F.conv2d(resize_image_patches(x, old, new), bilinear, stride=new), tokens, atol=1e-2)


def test_a_clip_moved_to_a_larger_image_by_patch_embeds_the_resized_image_as_the_original():
    """The whole tiny CRATE-alpha CLIP at 21 px / patch 7, then at 28 px by --resize patch (patch 9, 3x3 grid kept,
    the 28th pixel row and column dropped by the VALID conv): the same image embedding for the patch-wise resized
    image, whatever the dropped pixels hold."""
    torch.manual_seed(0)
    model = create_clip_at_patch(CRATE_TINY, None, patch_size=7, image_size=21).eval()
    x = torch.randn(2, 3, 21, 21)
    with torch.no_grad():
        before = model.encode_image(x)
        assert set_resolution_by_patch(model, 28) == 9
        big = torch.full((2, 3, 28, 28), 5.0)
        big[..., :27, :27] = resize_image_patches(x, 7, 9)
        after = model.encode_image(big)
    assert model.visual.trunk.grid_size == (3, 3) and model.visual.trunk.pos_embed.shape[1] == 10
    assert patch_input_size(model) == 27   # the images are resized to whole patches
    torch.testing.assert_close(after, before, rtol=1e-4, atol=1e-4)


def test_a_size_the_grid_cannot_fill_with_whole_patches_is_refused():
    assert patch_for_image_size(3, 28) == 9 and patch_for_image_size(4, 21) == 5
    with pytest.raises(ValueError, match=r"--resize patch: 8 px cannot hold the model's 3x3 patch grid"):
        patch_for_image_size(3, 8)
    with pytest.raises(ValueError, match="cannot hold"):
        patch_for_image_size(4, 3)


def test_official_1d_never_shrinks_a_grid_it_switches_to_grid_2d_and_says_so():
    pos = torch.randn(1, 17, 8)
    with pytest.warns(UserWarning, match=r"4x4 -> 3x3: official_1d .* shrinking uses grid_2d"):
        shrunk = resize_image_pos_embed(pos, (3, 3), (4, 4), mode="official_1d")
    assert torch.equal(shrunk, resize_image_pos_embed(pos, (3, 3), (4, 4), mode="grid_2d"))
    with warnings.catch_warnings():
        warnings.simplefilter("error")   # growing: the paper's rule, no warning
        grown = resize_image_pos_embed(pos[:, :10], (4, 4), (3, 3), mode="official_1d")
    assert not torch.allclose(grown, resize_image_pos_embed(pos[:, :10], (4, 4), (3, 3), mode="grid_2d"))


def test_cli_resize_patch_evaluates_a_21px_model_at_28px_with_its_grid(sets, tmp_path, capsys):
    from safetensors.torch import save_file

    torch.manual_seed(0)
    model = create_clip_at_patch(CRATE_TINY, None, patch_size=7, image_size=21)
    weights = tmp_path / "m21.safetensors"
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, weights)
    base = ["eval", "zeroshot", "--model", CRATE_TINY, "--pretrained", str(weights), "--data", str(sets["folder"]),
            "--dataset", "fashion_mnist", "--workers", "0", "--no-progress", "--cache-dir", "", "--image-size", "28"]
    out = {}
    for mode in ("grid", "patch"):
        assert crate_clip_main(base + ["--resize", mode, "--output", str(tmp_path / f"{mode}.json")]) == 0
        out[mode] = json.loads((tmp_path / f"{mode}.json").read_text())
    assert "kernel 7 -> 9 px (PI-resize), patch grid kept, 28 px requested: images resized to 27 px" in \
        capsys.readouterr().err
    assert out["grid"]["n_images"] == out["patch"]["n_images"] > 0
    assert out["grid"]["top1"] != out["patch"]["top1"] or out["grid"]["per_class"] != out["patch"]["per_class"]
    assert crate_clip_main(base[:-1] + ["8", "--resize", "patch"]) == 2
    assert "8 px cannot hold the model's 3x3 patch grid" in capsys.readouterr().err


def test_stage_evaluations_take_the_full_size_both_ways_after_a_low_resolution_stage(tmp_path):
    from crate_clip.train.run_config import config_from_dict
    from crate_clip.train.stage_evals import eval_points

    cfg = config_from_dict({"run": {"output_dir": str(tmp_path)}, "model": {"name": CRATE_TINY},
                            "data": {"sources": ["/data/{00000000..00000009}.tar"]},
                            "stages": [{"name": "low", "image_size": 21, "patch_size": 7, "samples": 8,
                                        "global_batch": 8},
                                       {"name": "full", "image_size": 28, "samples": 8, "global_batch": 8}],
                            "eval": {"evals": [{"name": "fm", "dataset": "fashion_mnist", "data": "/data/x"}]}},
                           check_paths=False)
    assert eval_points(cfg, 0) == [(21, "grid"), (28, "grid"), (28, "patch")]
    assert eval_points(cfg, 1) == [(28, "grid")]


def test_a_stage_moving_21px_p7_weights_to_28px_p9_keeps_the_grid_exactly():
    """A later stage at 28 px / patch 9 built from 21 px / patch 7 weights: the 3x3 grid is kept (no 3 -> 4 -> 3
    position-embedding round trip), the same model as --resize patch gives."""
    torch.manual_seed(0)
    low = create_clip_at_patch(CRATE_TINY, None, patch_size=7, image_size=21).eval()
    staged = create_clip_at_patch(CRATE_TINY, low.state_dict(), patch_size=9, image_size=28).eval()
    set_resolution_by_patch(low, 28)
    assert staged.visual.trunk.grid_size == (3, 3) and staged.visual.trunk.img_size == (28, 28)
    for key, value in low.state_dict().items():
        torch.testing.assert_close(staged.state_dict()[key], value, rtol=0, atol=0, msg=key)
