"""The ImageNet-1K zero-shot preset for the CLIPA models follows the official torch port's eval_in1k.py."""
import open_clip
import pytest
import torch
from PIL import Image
from torchvision import transforms

import crate_clip  # noqa: F401
from crate_clip.models import create_clip, open_clip_configs, preprocess_cfg_for
from crate_clip.eval.class_sets import resolve_classnames, resolve_templates
from crate_clip.eval.model_loading import eval_transform

TINY = "CRATE-alpha-CLIPA-tiny"
# torch_inference/eval_in1k.py of UCSC-VLAA/CRATE-alpha: torchvision's Resize default is bilinear
TORCH_PORT = transforms.Compose([transforms.Resize(224), transforms.CenterCrop(size=(224, 224)), transforms.ToTensor(),
                                 transforms.Normalize(mean=[0.485, 0.456, 0.406], std=[0.229, 0.224, 0.225])])


def _images():
    g = torch.Generator().manual_seed(0)
    sizes = [(300, 200), (375, 500), (224, 224), (150, 100), (640, 480)]   # wider, taller, exact, upsampled
    return [Image.fromarray((torch.rand(h, w, 3, generator=g) * 255).byte().numpy()) for w, h in sizes]


def test_clipa_eval_transform_is_the_torch_ports(monkeypatch):
    cfg = preprocess_cfg_for("CRATE-alpha-CLIPA-L-14")
    assert (cfg["interpolation"], cfg["resize_mode"]) == ("bilinear", "shortest")
    assert tuple(cfg["mean"]) == (0.485, 0.456, 0.406) and tuple(cfg["std"]) == (0.229, 0.224, 0.225)
    # a small model given the CLIPA preprocessing (building an L/14 here would take 2.4 GB)
    monkeypatch.setitem(open_clip_configs.PREPROCESS_CFGS, TINY, cfg)
    ours = eval_transform(create_clip(TINY, image_size=224))
    for img in _images():
        assert torch.equal(ours(img), TORCH_PORT(img))   # exact: the same torchvision/PIL operations


def test_other_models_keep_open_clips_transform():
    model = create_clip(TINY, image_size=224)
    reference = open_clip.create_model_and_transforms(TINY, force_image_size=224)[2]
    for img in _images():
        assert torch.equal(eval_transform(model)(img), reference(img))
        assert not torch.equal(eval_transform(model)(img), TORCH_PORT(img))


def test_imagenet_preset_uses_openais_names_and_80_templates():
    names = resolve_classnames("imagenet1k")
    templates = resolve_templates(None, "imagenet1k")
    assert names == list(open_clip.IMAGENET_CLASSNAMES) and len(names) == 1000
    assert names[21] == "kite (bird of prey)" and names.count("missile") == 2   # OpenAI's curated list
    assert len(templates) == 80 and templates[0]("{}") == "a bad photo of a {}."


@pytest.mark.parametrize("name", ["CRATE-alpha-CLIPA-B-16", "CRATE-alpha-CLIPA-L-14", "CRATE-alpha-CLIPA-H-14"])
def test_open_clips_clipa_presets_differ(name):
    # open_clip's own ViT-*-CLIPA tags squash the image (no crop) with bilinear resizing
    tag = open_clip.get_pretrained_cfg("ViT-L-14-CLIPA", "datacomp1b")
    assert tag["resize_mode"] == "squash" and preprocess_cfg_for(name)["resize_mode"] == "shortest"
