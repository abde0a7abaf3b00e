"""Text tower kinds are a registry (crate_clip/models/open_clip_text_tower.py), like timm's for the image towers: a
kind registered by its own module is built by open_clip from a text_cfg naming it, recognised in a model and in a
state dict, and named in the kind-mismatch fix; nothing else changes for a new kind."""
import copy

import open_clip
import pytest
import torch

import crate_clip  # noqa: F401  (registers the configs and the text-tower builder)
from crate_clip.models.crate_text import CrateAlphaText
from crate_clip.models.open_clip_text_tower import (OPEN_CLIP_TEXT, TEXT_TOWERS, TextTowerKind, check_text_tower_config,
                                                    kind_of_model, kind_of_state, register_text_tower)
from crate_clip.models.text_sources import TextTowerError, load_pretrained_text_tower

TINY_TEXT = "CRATE-alpha-CLIPA-tiny-crate-text"


class WideText(CrateAlphaText):
    """A third kind for the test: a CRATE-alpha text tower under another name and state-dict marker."""

    @classmethod
    def build(cls, embed_dim, text_cfg):
        tower = cls.from_cfg(embed_dim, {**text_cfg, "tower": "crate_alpha"})
        tower.register_buffer("wide_marker", torch.ones(1))
        return tower


WIDE = TextTowerKind(name="wide_test", label="wide-test", module_class=WideText, state_key_suffix=".wide_marker",
                     build=WideText.build, checkpoint_hint="a wide-test checkpoint", model_hint="a wide-test model")


@pytest.fixture
def wide_kind(monkeypatch):
    """WIDE registered for one test (and first, so a model holding a WideText is of its kind)."""
    monkeypatch.setattr("crate_clip.models.open_clip_text_tower.TEXT_TOWERS", {})
    import crate_clip.models.open_clip_text_tower as registry
    register_text_tower(WIDE)
    registry.TEXT_TOWERS.update({k: v for k, v in TEXT_TOWERS.items() if k != WIDE.name})
    return registry


def _wide_cfg() -> dict:
    cfg = copy.deepcopy(open_clip.get_model_config(TINY_TEXT))
    cfg["text_cfg"]["tower"] = WIDE.name
    return cfg


def test_crate_alpha_is_a_registered_kind_and_open_clips_own_is_the_default():
    assert TEXT_TOWERS["crate_alpha"].module_class is CrateAlphaText
    model = open_clip.create_model(TINY_TEXT)
    assert kind_of_model(model) is TEXT_TOWERS["crate_alpha"]
    assert kind_of_state(model.state_dict()) is TEXT_TOWERS["crate_alpha"]
    assert kind_of_state({"visual.blocks.0.ista.D": 0, "text.token_embedding.weight": 0}) is OPEN_CLIP_TEXT


def test_a_new_kind_is_built_by_open_clip_and_recognised(wide_kind):
    torch.manual_seed(0)
    model = open_clip.model.CustomTextCLIP(**{k: v for k, v in _wide_cfg().items() if k != "custom_text"})
    assert type(model.text) is WideText
    assert kind_of_model(model) is WIDE and kind_of_state(model.state_dict()) is WIDE
    with pytest.raises(ValueError, match="text_cfg.tower is 'wide_test'.*custom_text"):
        check_text_tower_config({k: v for k, v in _wide_cfg().items() if k != "custom_text"}, "wide.json")


def test_a_kind_mismatch_names_both_kinds_and_the_fix(wide_kind):
    torch.manual_seed(0)
    wide = open_clip.model.CustomTextCLIP(**{k: v for k, v in _wide_cfg().items() if k != "custom_text"})
    crate = open_clip.create_model(TINY_TEXT)
    source = {k: v for k, v in crate.state_dict().items() if k.startswith("text.")}
    with pytest.raises(TextTowerError, match="a wide-test text tower and the checkpoint a CRATE-alpha one: give a "
                                             "wide-test checkpoint, or the checkpoint's"):
        load_pretrained_text_tower(wide, {**source, "text.extra": torch.zeros(1)})


def test_a_kind_is_registered_once():
    with pytest.raises(ValueError, match="registered already"):
        register_text_tower(TextTowerKind(**{**TEXT_TOWERS["crate_alpha"].__dict__, "label": "other"}))
