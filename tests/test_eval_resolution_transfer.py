"""Resolution transfer without fine-tuning: `--resize patch` keeps the patch grid and PI-resizes the kernel
(FlexiViT), beside grid growth (`--resize grid`); official_1d never shrinks a grid; the stage evaluations' points."""
import json
import warnings

import pytest
import torch
import torch.nn.functional as F
from timm.layers import resample_patch_embed

from crate_clip.cli import main as crate_clip_main
from crate_clip.core.patch_tiling import PatchTilingError
from crate_clip.models import create_clip
from crate_clip.models.patch_change import patch_for_image_size, patch_input_size, set_resolution_by_patch
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
    """The whole tiny CRATE-alpha CLIP at 21 px / patch 7, then at 27 px by --resize patch (patch 9, 3x3 grid kept):
    the same image embedding for the patch-wise resized image; 28 px, which 9 px patches do not tile, is refused."""
    torch.manual_seed(0)
    model = create_clip(CRATE_TINY, patch_size=7, image_size=21).eval()
    x = torch.randn(2, 3, 21, 21)
    with pytest.raises(PatchTilingError, match=r"image_size 28 is not a multiple of the 3x3 patch grid"):
        set_resolution_by_patch(model, 28)
    with torch.no_grad():
        before = model.encode_image(x)
        assert set_resolution_by_patch(model, 27) == 9
        after = model.encode_image(resize_image_patches(x, 7, 9))
    assert model.visual.trunk.grid_size == (3, 3) and model.visual.trunk.pos_embed.shape[1] == 10
    assert patch_input_size(model) == 27
    torch.testing.assert_close(after, before, rtol=1e-4, atol=1e-4)


def test_a_size_the_grid_does_not_tile_is_refused_naming_the_sizes_that_do():
    assert patch_for_image_size(3, 27) == 9 and patch_for_image_size(4, 20) == 5
    with pytest.raises(PatchTilingError) as exc:
        patch_for_image_size(3, 28)
    assert str(exc.value) == ("--resize patch: image_size 28 is not a multiple of the 3x3 patch grid (9 px patches "
                              "would drop 1 pixel row and column); use 27 or 30, or --resize grid")
    with pytest.raises(ValueError, match=r"image_size 3 cannot hold the 4x4 patch grid"):
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


def test_cli_resize_patch_evaluates_a_21px_model_at_27px_with_its_grid(sets, tmp_path, capsys):
    from safetensors.torch import save_file

    torch.manual_seed(0)
    model = create_clip(CRATE_TINY, patch_size=7, image_size=21)
    weights = tmp_path / "m21.safetensors"
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, weights)
    base = ["eval", "zeroshot", "--model", CRATE_TINY, "--pretrained", str(weights), "--data", str(sets["folder"]),
            "--dataset", "fashion_mnist", "--num-workers", "0", "--no-progress", "--cache-dir", "", "--image-size"]
    out = {}
    for mode, size in (("grid", "28"), ("patch", "27")):   # the sizes each way tiles: 4x4 of 7 px, 3x3 of 9 px
        assert crate_clip_main(base + [size, "--resize", mode, "--output", str(tmp_path / f"{mode}.json")]) == 0
        out[mode] = json.loads((tmp_path / f"{mode}.json").read_text())
    assert "kernel 7 -> 9 px (PI-resize), patch grid kept, images at 27 px" in capsys.readouterr().err
    assert out["grid"]["n_images"] == out["patch"]["n_images"] > 0
    assert out["grid"]["top1"] != out["patch"]["top1"] or out["grid"]["per_class"] != out["patch"]["per_class"]
    # pixels in, pixels used: a size either way would not tile is refused in one line, exit 2
    assert crate_clip_main(base + ["28", "--resize", "patch"]) == 2
    assert ("image_size 28 is not a multiple of the 3x3 patch grid (9 px patches would drop 1 pixel row and "
            "column); use 27 or 30") in capsys.readouterr().err
    assert crate_clip_main(base + ["30", "--resize", "grid"]) == 2
    err = capsys.readouterr().err
    assert err.strip() == ("crate-clip eval: --image-size: image_size 30 is not a multiple of patch_size 7 (the patch "
                           "convolution would drop 2 pixel rows and columns); use 28 or 35")


def _two_stages(tmp_path, full: dict, eval_section: dict | None = None):
    from crate_clip.train.run.run_config import config_from_dict

    return config_from_dict({"run": {"output_dir": str(tmp_path)}, "model": {"name": CRATE_TINY},
                             "data": {"sources": ["/data/{00000000..00000009}.tar"]},
                             "stages": [{"name": "low", "image_size": 21, "patch_size": 7, "samples": 8,
                                         "global_batch": 8}, {"name": "full", "samples": 8, "global_batch": 8, **full}],
                             "eval": {"evals": [{"name": "fm", "dataset": "fashion_mnist", "data": "/data/x"}],
                                      **(eval_section or {})}},
                            check_paths=False)


def test_stage_evaluations_take_the_full_size_each_way_whose_patches_tile_it(tmp_path):
    """After a 21 px / patch 7 stage: at 28 px only by grid growth (4x4 of 7 px; a 3x3 grid would need 9.33 px
    patches), at 27 px only by patch resize (3x3 of 9 px; 27 is no multiple of 7): the fine-tune's input each time."""
    from crate_clip.train.loop.stage_evals import eval_points

    grown = _two_stages(tmp_path, {"image_size": 28})
    assert eval_points(grown, 0) == [(21, "grid"), (28, "grid")] and eval_points(grown, 1) == [(28, "grid")]
    kept = _two_stages(tmp_path, {"image_size": 27, "patch_size": 9})
    assert eval_points(kept, 0) == [(21, "grid"), (27, "patch")] and eval_points(kept, 1) == [(27, "grid")]
    both = _two_stages(tmp_path, {"image_size": 42})   # 6x6 of 7 px, or 3x3 of 14 px
    assert eval_points(both, 0) == [(21, "grid"), (42, "grid"), (42, "patch")]


def test_a_stage_or_full_size_its_patches_do_not_tile_is_refused_when_the_config_is_read(tmp_path):
    """Issue 39: the 28 px / patch 9 fine-tune dropped the last pixel row and column; the config check names the
    stage, both numbers and the nearest sizes that tile, one line each."""
    from crate_clip.core.errors import ConfigError

    with pytest.raises(ConfigError) as exc:
        _two_stages(tmp_path, {"image_size": 28, "patch_size": 9}, {"full_image_size": 27})
    assert str(exc.value).splitlines()[1:] == [
        "  stages.1: image_size 28 is not a multiple of patch_size 9 (the patch convolution would drop 1 pixel row "
        "and column); use 27 or 36"]
    with pytest.raises(ConfigError) as exc:   # neither 7 px patches nor a 3x3 grid tile 32 px
        _two_stages(tmp_path, {"image_size": 32, "patch_size": 8})
    assert str(exc.value).splitlines()[1:] == [
        "  eval.full_image_size: 32 is a multiple neither of stages.0's patch_size 7 (resize grid) nor of its 3x3 "
        "patch grid (resize patch), so its full-size evaluation would drop pixels; use 30 or 33"]


def test_a_stage_moving_21px_p7_weights_to_27px_p9_keeps_the_grid_exactly():
    """A later stage at 27 px / patch 9 built from 21 px / patch 7 weights: the 3x3 grid is kept (no 3 -> 4 -> 3
    position-embedding round trip), the same model as --resize patch gives (the stage-0 eval at the same input)."""
    torch.manual_seed(0)
    low = create_clip(CRATE_TINY, patch_size=7, image_size=21).eval()
    staged = create_clip(CRATE_TINY, pretrained=low.state_dict(), patch_size=9, image_size=27).eval()
    set_resolution_by_patch(low, 27)
    assert staged.visual.trunk.grid_size == (3, 3) and staged.visual.trunk.img_size == (27, 27)
    for key, value in low.state_dict().items():
        torch.testing.assert_close(staged.state_dict()[key], value, rtol=0, atol=0, msg=key)
