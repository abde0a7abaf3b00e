"""CRATE / CRATE-alpha image towers (registered with timm on import) and CRATE-alpha CLIP configs (open_clip)."""
from crate_clip.models.crate_alpha import VARIANTS, CrateAlpha, checkpoint_filter_fn, official_to_timm
from crate_clip.models.open_clip_configs import register_clip_tower, register_open_clip_configs
from crate_clip.models.clip_factory import (CheckpointMismatchError, bert_text_cfg, bert_tokenizer, create_clip,
                                            image_tower_param_count, load_clip_weights, read_state_dict,
                                            resize_clip_state_dict, set_image_token_mask)

CLIP_MODEL_NAMES = register_open_clip_configs()

__all__ = ["CrateAlpha", "VARIANTS", "checkpoint_filter_fn", "official_to_timm", "register_clip_tower",
           "register_open_clip_configs", "CheckpointMismatchError", "bert_text_cfg", "bert_tokenizer", "create_clip",
           "image_tower_param_count", "load_clip_weights", "read_state_dict", "resize_clip_state_dict",
           "set_image_token_mask", "CLIP_MODEL_NAMES"]
