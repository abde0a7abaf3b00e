"""The text tower kinds open_clip builds from a model config, in a registry like timm's for the image towers
(installed by `import crate_clip`).

open_clip 3.x has no registry for text towers: `CustomTextCLIP.__init__` calls `open_clip.model._build_text_tower`,
which knows its TextTransformer and HuggingFace encoders only. `install_text_tower_builder` wraps that function once:
a `text_cfg` whose `"tower"` names a registered kind (`register_text_tower`, called by the module that defines the
tower, e.g. crate_text.py for `"crate_alpha"`) builds that kind, every other text_cfg goes to open_clip's own builder
unchanged (OPEN_CLIP_TEXT). Such a config must also set `"custom_text": true` (open_clip's CLIP class would unpack
its text tower's parts into itself and run its own text forward); `check_text_tower_config` says so when it is
missing. Without `import crate_clip`, open_clip rejects the config (`CLIPTextCfg` has no `tower` key) instead of
silently building another tower. A new kind is one module that registers itself (imported by
models/registration.py) and its model configs.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Dict, Optional

import open_clip.model as open_clip_model
from torch import nn

_MARK = "_crate_clip_text_towers"


@dataclass(frozen=True)
class TextTowerKind:
    """One kind of text tower: how a config names it, builds it, and how a model or a state dict shows it."""

    name: str                                  # text_cfg["tower"]
    label: str                                 # how messages call it ("CRATE-alpha")
    module_class: Optional[type]               # what a model holds (None: open_clip's own transformer)
    state_key_suffix: Optional[str]            # a text-tower state-dict key only this kind has
    build: Optional[Callable[[int, dict], nn.Module]]   # (embed_dim, text_cfg) -> the tower
    checkpoint_hint: str                       # where to get a checkpoint with such a text tower
    model_hint: str                            # the model.name to use for a checkpoint with such a text tower
    note: str = ""                             # said of a checkpoint with this kind
    check_cfg: Optional[Callable[[dict], object]] = None   # raises ValueError/TypeError for a text_cfg it can't take


# open_clip's own text transformer: every text_cfg that names no registered tower
OPEN_CLIP_TEXT = TextTowerKind(
    name="transformer", label="transformer", module_class=None, state_key_suffix=None, build=None,
    checkpoint_hint="a checkpoint with a transformer text tower (e.g. ViT-H-14-CLIPA:datacomp1b)",
    model_hint="a model.name with a transformer text tower", note=" (as every released CLIPA checkpoint)")
TEXT_TOWERS: Dict[str, TextTowerKind] = {}


def register_text_tower(kind: TextTowerKind) -> TextTowerKind:
    """Make `kind` buildable from a text_cfg with `"tower": kind.name` (idempotent for the same kind)."""
    if TEXT_TOWERS.get(kind.name, kind) != kind or kind.name == OPEN_CLIP_TEXT.name:
        raise ValueError(f"text tower kind {kind.name!r} is registered already")
    TEXT_TOWERS[kind.name] = kind
    return kind


def text_tower_kind(text_cfg) -> Optional[TextTowerKind]:
    """The registered kind a text_cfg dict names, None for open_clip's own towers."""
    return TEXT_TOWERS.get(text_cfg.get("tower")) if isinstance(text_cfg, dict) else None


def kind_of_model(model: nn.Module) -> TextTowerKind:
    """The kind of text tower `model` (a CLIP, or an engine holding one as .module) holds."""
    modules = list(getattr(model, "module", model).modules())
    return next((k for k in TEXT_TOWERS.values() if any(isinstance(m, k.module_class) for m in modules)),
                OPEN_CLIP_TEXT)


def kind_of_state(state_dict: dict) -> TextTowerKind:
    """The kind of text tower a CLIP state dict holds (its text keys, not the image tower's)."""
    text_keys = [k for k in state_dict if not k.startswith("visual.")]
    return next((k for k in TEXT_TOWERS.values() if any(key.endswith(k.state_key_suffix) for key in text_keys)),
                OPEN_CLIP_TEXT)


def _wrap(open_clip_builder):
    def build_text_tower(embed_dim, text_cfg, quick_gelu=False, cast_dtype=None):
        kind = text_tower_kind(text_cfg)
        if kind is not None:
            return kind.build(embed_dim, text_cfg)
        return open_clip_builder(embed_dim, text_cfg, quick_gelu, cast_dtype)

    setattr(build_text_tower, _MARK, open_clip_builder)
    build_text_tower.__doc__ = "open_clip's text-tower builder, extended by crate_clip with its registered towers."
    return build_text_tower


def install_text_tower_builder() -> None:
    """Route open_clip's text-tower builder through ours (idempotent)."""
    current = getattr(open_clip_model, "_build_text_tower", None)
    if current is None:
        raise RuntimeError("open_clip.model._build_text_tower not found: this open_clip version builds text towers "
                           "another way; the CRATE-alpha text tower needs open_clip 3.x")
    if not hasattr(current, _MARK):
        open_clip_model._build_text_tower = _wrap(current)


def check_text_tower_config(model_cfg: Dict, source: str) -> None:
    """A config with a registered text tower must use open_clip's CustomTextCLIP: ValueError naming `source`."""
    kind = text_tower_kind(model_cfg.get("text_cfg"))
    if kind is not None and not model_cfg.get("custom_text"):
        raise ValueError(f"{source}: text_cfg.tower is {kind.name!r}, which open_clip builds only as a "
                         f"CustomTextCLIP: add \"custom_text\": true to the config")
