"""CRATE / CRATE-alpha image towers (timm), the CRATE-alpha text tower and CLIP configs (open_clip), and the CLIP
build, load and export helpers around them.

The names below load on first use (PEP 562): `from crate_clip.models import create_clip` imports
crate_clip.models.registration, which imports timm and open_clip and registers the towers and configs with them.
A light submodule imported by itself (token_masks, export_files, weights_source: what a run config's checks use)
imports neither, so the process that checks a run and launches its workers (`crate-clip train --nproc N`) does not
pay seconds of imports that only the workers use.
"""
import importlib

REGISTRATION = "crate_clip.models.registration"
# each name handed out -> the submodule that defines it
_HOMES = {
    "crate_alpha": ("CrateAlpha", "VARIANTS", "checkpoint_filter_fn", "official_to_timm"),
    "crate_text": ("CrateAlphaText", "CrateTextCfg", "text_tower_param_count"),
    "open_clip_text_tower": ("install_text_tower_builder",),
    "clip_tower_names": ("clip_tower_name", "register_clip_tower"),
    "open_clip_configs": ("register_open_clip_configs", "preprocess_cfg_for"),
    "checkpoint_errors": ("CheckpointMismatchError",),
    "clip_tokenizers": ("TokenizerUnavailableError", "bert_text_cfg", "bert_tokenizer", "clip_tokenizer",
                        "tokenizer_record"),
    "clip_factory": ("create_clip", "image_tower_param_count", "load_clip_weights", "read_state_dict",
                     "resize_clip_state_dict", "set_image_token_mask"),
    "clipa_import": ("load_official_clipa", "load_text_tower", "text_tower_keys"),
    "official_clipa": ("is_official_clipa_layout", "official_clipa_to_open_clip"),
    "pos_embed": ("POS_EMBED_RESIZE_MODES", "resize_image_pos_embed", "resize_text_pos_embed"),
    "registration": ("CLIP_MODEL_NAMES",),
}
_HOME_OF = {name: module for module, names in _HOMES.items() for name in names}
__all__ = list(_HOME_OF)


def __getattr__(name: str):
    # a submodule's name (`from crate_clip.models import crate_alpha`) is not ours: AttributeError lets the import
    # system load the submodule
    if name in _HOME_OF:
        importlib.import_module(REGISTRATION)
        return getattr(importlib.import_module(f"{__name__}.{_HOME_OF[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__():
    return sorted(set(globals()) | set(__all__))
