"""The CRATE towers keep timm's model API contract (the one timm's own tests/test_models.py checks of every
registered model, written here from timm's documentation): `in_chans`, the pretrained-config fields,
`num_features` / `head_hidden_size`, forward_features / forward_head, reset_classifier keeping the model's dtype,
device and train/eval mode, the factory's num_classes / global_pool / device / dtype, and forward_intermediates.
Small models at a small input size, so the whole module runs in seconds on a CPU."""
import pytest
import timm
import torch

import crate_clip  # noqa: F401  (registers the CRATE towers with timm)

SMALL = {"img_size": 32}   # 32 px with /16 patches: a 2x2 grid, 5 tokens
NAMES = ["crate_alpha_tiny_patch16_224", "crate_tiny_patch16_224", "crate_alpha_clipa_base_patch16_224"]
CONFIG_FIELDS = ("input_size", "num_classes", "mean", "std", "interpolation", "crop_pct", "first_conv",
                 "classifier", "pool_size", "fixed_input_size")


def _create(name: str, **kwargs) -> torch.nn.Module:
    torch.manual_seed(0)
    return timm.create_model(name, pretrained=False, **{**SMALL, **kwargs}).eval()


def test_every_registered_crate_name_has_timms_config_fields_and_attributes():
    """Checked on the meta device: nothing is allocated, so every registered name (huge ones too) is covered."""
    names = timm.list_models("crate*", include_tags=True)
    assert len(names) >= 26
    for name in names:
        model = timm.create_model(name, pretrained=False, device="meta")
        cfg = model.pretrained_cfg
        assert model.default_cfg == cfg and set(CONFIG_FIELDS) <= set(cfg), name
        assert model.in_chans == cfg["input_size"][0] == 3, name
        assert model.num_classes == cfg["num_classes"] >= 0 and model.num_features > 0, name
        assert model.head_hidden_size == model.num_features, name
        keys = model.state_dict().keys()
        assert cfg["first_conv"] + ".weight" in keys, name
        assert not cfg["num_classes"] or cfg["classifier"] + ".weight" in keys, name
        assert all(p.device.type == "meta" for p in model.parameters()), name


@pytest.mark.parametrize("name", NAMES)
def test_forward_features_head_and_classifier_removal_agree(name):
    model = _create(name, num_classes=7)
    x = torch.randn(2, 3, 32, 32)
    tokens = model.forward_features(x)
    assert tokens.shape == (2, 1 + 4, model.num_features)
    pre = model.forward_head(tokens, pre_logits=True)
    assert pre.shape == (2, model.head_hidden_size) and model(x).shape == (2, 7)
    model.reset_classifier(0)
    assert model.num_classes == 0 and torch.allclose(model(x), pre)
    model.reset_classifier(0, "")   # no pooling either: the tokens
    assert model(x).shape == tokens.shape
    headless = _create(name, num_classes=0)
    assert headless(x).shape == pre.shape and _create(name, num_classes=0, global_pool="").forward(x).ndim == 3


@pytest.mark.parametrize("name", NAMES[:2])
def test_in_chans_builds_a_model_for_that_many_channels(name):
    model = _create(name, in_chans=1, num_classes=5)
    assert model.in_chans == 1 and model(torch.randn(2, 1, 32, 32)).shape == (2, 5)


@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16])
def test_reset_classifier_keeps_the_models_dtype_and_mode(dtype):
    """A float64 (or bf16) model gets a head of its own dtype: before, a float32 head failed the next forward
    with 'mat1 and mat2 must have the same dtype'."""
    model = _create(NAMES[0]).to(dtype)
    model.reset_classifier(3)
    head = model.get_classifier()
    assert head.weight.dtype == dtype and not head.training
    assert model(torch.randn(1, 3, 32, 32, dtype=dtype)).dtype == dtype
    model.train().reset_classifier(4)
    assert model.get_classifier().training


def test_reset_classifier_keeps_the_models_device():
    model = timm.create_model(NAMES[0], pretrained=False, device="meta")
    model.reset_classifier(2)
    assert model.get_classifier().weight.device.type == "meta"


def test_factory_dtype_and_unknown_arguments():
    assert next(_create(NAMES[0], dtype=torch.float64).parameters()).dtype == torch.float64
    with pytest.raises(TypeError):
        timm.create_model(NAMES[0], pretrained=False, device="meta", not_a_model_arg=1)


def test_dtype_change_after_a_forward_changes_the_output_dtype():
    model = _create(NAMES[0])
    x = torch.randn(1, 3, 32, 32)
    model(x)
    assert model.to(torch.bfloat16)(x.to(torch.bfloat16)).dtype == torch.bfloat16


def test_forward_intermediates_follow_timms_convention():
    model = _create(NAMES[0])
    x = torch.randn(2, 3, 32, 32)
    final, inter = model.forward_intermediates(x, indices=2)
    assert torch.allclose(final, model.forward_features(x), atol=1e-5)
    assert len(inter) == 2 and all(t.shape == (2, model.embed_dim, 2, 2) for t in inter)   # NCHW by default
    only = model.forward_intermediates(x, indices=[0, 3], output_fmt="NLC", intermediates_only=True)
    assert [t.shape for t in only] == [(2, 4, model.embed_dim)] * 2
    kept = model.prune_intermediate_layers(indices=[0, 3])
    assert kept == [0, 3] and len(model.blocks) == 4 and model.num_classes == 0
    pruned = model.forward_intermediates(x, indices=[0, 3], intermediates_only=True)
    assert all(torch.allclose(a, b.permute(0, 2, 1).reshape(a.shape), atol=1e-5) for a, b in zip(pruned, only))


def test_group_matcher_and_no_weight_decay_name_real_parameters():
    from timm.models._manipulate import group_parameters

    model = _create(NAMES[0])
    groups = group_parameters(model, model.group_matcher(coarse=False), reverse=True)
    assert len(set(groups.values())) > 1
    names = {n for n, _ in model.named_parameters()}
    assert set(model.no_weight_decay()) <= names
