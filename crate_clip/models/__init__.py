"""CRATE / CRATE-alpha image towers (registered with timm on import), the CRATE-alpha text tower (built by open_clip
from a text_cfg with "tower": "crate_alpha") and CRATE-alpha CLIP configs (open_clip)."""
from crate_clip.models.crate_alpha import VARIANTS, CrateAlpha, checkpoint_filter_fn, official_to_timm
from crate_clip.models.crate_text import CrateAlphaText, CrateTextCfg, text_tower_param_count
from crate_clip.models.open_clip_text_tower import install_text_tower_builder
from crate_clip.models.clip_tower_names import clip_tower_name, register_clip_tower
from crate_clip.models.open_clip_configs import preprocess_cfg_for, register_open_clip_configs
from crate_clip.models.checkpoint_errors import CheckpointMismatchError
from crate_clip.models.clip_tokenizers import (TokenizerUnavailableError, bert_text_cfg, bert_tokenizer,
                                               clip_tokenizer, tokenizer_record)
from crate_clip.models.clip_factory import (create_clip, image_tower_param_count, load_clip_weights, read_state_dict,
                                            resize_clip_state_dict, set_image_token_mask)
from crate_clip.models.clipa_import import load_official_clipa, load_text_tower, text_tower_keys
from crate_clip.models.official_clipa import is_official_clipa_layout, official_clipa_to_open_clip
from crate_clip.models.pos_embed import POS_EMBED_RESIZE_MODES, resize_image_pos_embed, resize_text_pos_embed

install_text_tower_builder()
CLIP_MODEL_NAMES = register_open_clip_configs()

__all__ = ["CrateAlpha", "VARIANTS", "CrateAlphaText", "CrateTextCfg", "text_tower_param_count",
           "install_text_tower_builder", "checkpoint_filter_fn", "official_to_timm", "clip_tower_name",
           "register_clip_tower",
           "register_open_clip_configs", "preprocess_cfg_for", "CheckpointMismatchError", "TokenizerUnavailableError",
           "bert_text_cfg", "bert_tokenizer", "clip_tokenizer", "tokenizer_record", "create_clip",
           "image_tower_param_count", "load_clip_weights", "read_state_dict", "resize_clip_state_dict",
           "set_image_token_mask", "load_official_clipa", "load_text_tower", "text_tower_keys",
           "is_official_clipa_layout", "official_clipa_to_open_clip", "POS_EMBED_RESIZE_MODES",
           "resize_image_pos_embed", "resize_text_pos_embed", "CLIP_MODEL_NAMES"]
