"""timm loads an export's image tower the ways timm users load a local file (docs/export.md, "The image tower in
timm"), with the export's own preprocessing; the demo's export is checked against the demo's own evaluation in
test_train_demo.py. Here: the seeded tiny CRATE-alpha CLIP's export, and what is refused."""
import json
import shutil

import pytest
import timm
import torch
from timm.data import resolve_data_config

import crate_clip  # noqa: F401  (registers the CRATE towers with timm)
from crate_clip.core.image_normalization import IMAGENET_MEAN, IMAGENET_STD, OPENAI_MEAN, OPENAI_STD
from crate_clip.models.export_timm_cfg import ExportPreprocessError
from eval_fixtures import shared_crate_tiny, write_tiny_export


def test_an_exports_tower_loads_in_timm_with_its_preprocessing_and_what_is_refused(tmp_path):
    export = write_tiny_export(tmp_path / "export")
    name = json.loads((export / "open_clip_config.json").read_text())["model_cfg"]["vision_cfg"]["timm_model_name"]
    weights = export / "open_clip_model.safetensors"
    x = torch.randn(2, 3, 28, 28)
    with torch.no_grad():
        expected = shared_crate_tiny().visual.trunk(x)
    own = {"input_size": (3, 28, 28), "interpolation": "bicubic", "mean": OPENAI_MEAN, "std": OPENAI_STD,
           "crop_pct": 1.0, "crop_mode": "center"}   # the export's preprocess_cfg (the tiny config's: OpenAI's)
    overlay = dict(file=str(weights))
    for kwargs in (dict(pretrained=True, pretrained_cfg_overlay=overlay),
                   dict(checkpoint_path=str(weights), pretrained_cfg_overlay=overlay)):
        tower = timm.create_model(name, **kwargs).eval()
        assert resolve_data_config({}, model=tower) == own, kwargs
        with torch.no_grad():
            torch.testing.assert_close(tower(x), expected)

    # the weights without their folder: loaded, with the CLIP tower's defaults (ImageNet's, no crop)
    alone = shutil.copy(weights, tmp_path / "weights.safetensors")
    tower = timm.create_model(name, pretrained=True, pretrained_cfg_overlay=dict(file=str(alone))).eval()
    assert resolve_data_config({}, model=tower) == {**own, "mean": IMAGENET_MEAN, "std": IMAGENET_STD}
    with torch.no_grad():
        torch.testing.assert_close(tower(x), expected)

    with pytest.raises(ValueError, match="no released weights; name a file: pretrained_cfg_overlay=dict"):
        timm.create_model(name, pretrained=True)
    config = json.loads((export / "open_clip_config.json").read_text())
    config["preprocess_cfg"]["resize_mode"] = "longest"   # open_clip pads; timm has no such resize
    (export / "open_clip_config.json").write_text(json.dumps(config))
    with pytest.raises(ExportPreprocessError, match=r"open_clip_config.json: preprocess_cfg.resize_mode 'longest'"):
        timm.create_model(name, pretrained=True, pretrained_cfg_overlay=overlay)
    config["preprocess_cfg"].update(resize_mode="shortest", std=[0.2, float("nan"), 0.2])
    (export / "open_clip_config.json").write_text(json.dumps(config))
    with pytest.raises(ExportPreprocessError, match=r"preprocess_cfg.std is \[0.2, nan, 0.2\], not one or three"):
        timm.create_model(name, checkpoint_path=str(weights), pretrained_cfg_overlay=overlay)
