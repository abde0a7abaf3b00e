"""Released CRATE-alpha-CLIPA weights into open_clip models: the whole model, or only the text tower.

`load_official_clipa(path, 'CRATE-alpha-CLIPA-L-14')` gives an open_clip model equal to the official
PyTorch port's (see official_clipa.py for the key map). `load_text_tower` fills just the text tower and
logit scale of a model from any CLIP checkpoint with the same text tower (official layout, ours, or an
open_clip one such as ViT-H-14-CLIPA's): the paper trains its image tower against CLIPA's frozen text.
"""
from pathlib import Path
from typing import Dict, List, Optional, Union

import torch
from torch import nn

from crate_clip.models.checkpoint_errors import CheckpointMismatchError, key_list
from crate_clip.models.clip_factory import (TEXT_POS_KEY, create_clip, load_clip_weights, read_state_dict,
                                            strip_module_prefix)
from crate_clip.models.official_clipa import is_official_clipa_layout, official_clipa_to_open_clip
from crate_clip.models.pos_embed import resize_text_pos_embed

LOGIT_KEYS = ("logit_scale", "logit_bias")


def load_official_clipa(checkpoint_path: Union[str, Path], model_name: str = "CRATE-alpha-CLIPA-L-14", *,
                        image_size: Optional[int] = None, device: Union[str, torch.device] = "cpu",
                        precision: str = "fp32", pos_embed_resize: str = "grid_2d") -> nn.Module:
    """An open_clip model of config `model_name` (any registered name) holding a released
    `crate_alpha_CLIPA_*.pth`; at another `image_size` its position embedding is resized by `pos_embed_resize`.

    Raises CheckpointMismatchError naming unknown or missing keys, untied Q/K/V blocks and shape mismatches.
    """
    sd = read_state_dict(checkpoint_path)
    if not is_official_clipa_layout(sd):
        raise CheckpointMismatchError(
            f"{checkpoint_path}: not the official CRATE-alpha-CLIPA layout (no visual.class_embedding or "
            f"visual.transformer.resblocks.* keys); load our own checkpoints with create_clip(name, pretrained=...)")
    model = create_clip(model_name, image_size=image_size, device="cpu", precision="fp32")
    try:
        load_clip_weights(model, sd, pos_embed_resize=pos_embed_resize if image_size else None)
    except CheckpointMismatchError as err:
        raise CheckpointMismatchError(f"{checkpoint_path} into {model_name}: {err}") from None
    return _to(model, device, precision)


def _to(model: nn.Module, device, precision: str) -> nn.Module:
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[precision]
    return model.to(device=device, dtype=dtype)


def text_tower_keys(model: nn.Module, include_logit_scale: bool = True) -> List[str]:
    """State-dict keys of the text tower (everything outside `visual.`), plus the logit scale/bias if asked."""
    keys = [k for k in getattr(model, "module", model).state_dict() if not k.startswith("visual.")]
    return [k for k in keys if include_logit_scale or k not in LOGIT_KEYS]


def load_text_tower(model: nn.Module, source: Union[str, Path, Dict[str, torch.Tensor]],
                    include_logit_scale: bool = True, resize_positions: bool = False) -> List[str]:
    """Copy the text tower (and logit scale) of a CLIP checkpoint into `model`; returns the keys loaded.

    The checkpoint's image tower is ignored. A missing text key or a shape mismatch raises
    CheckpointMismatchError naming them; the text position embedding of another length is resized
    (1-D linear) only with `resize_positions`.
    """
    sd = read_state_dict(source) if isinstance(source, (str, Path)) else strip_module_prefix(dict(source))
    if is_official_clipa_layout(sd):
        sd = official_clipa_to_open_clip({k: v for k, v in sd.items() if not k.startswith("visual.")})
    inner = getattr(model, "module", model)
    target = inner.state_dict()
    keys = text_tower_keys(inner, include_logit_scale)
    where = f" {source}" if isinstance(source, (str, Path)) else ""
    missing = [k for k in keys if k not in sd]
    if missing:
        raise CheckpointMismatchError(f"text-tower checkpoint{where} lacks [{key_list(missing)}]")
    picked = {k: sd[k].reshape(target[k].shape) if k in LOGIT_KEYS and sd[k].numel() == 1 else sd[k] for k in keys}
    if resize_positions and picked[TEXT_POS_KEY].shape[0] != target[TEXT_POS_KEY].shape[0]:
        picked[TEXT_POS_KEY] = resize_text_pos_embed(picked[TEXT_POS_KEY], target[TEXT_POS_KEY].shape[0])
    bad = {k: (tuple(v.shape), tuple(target[k].shape)) for k, v in picked.items() if v.shape != target[k].shape}
    if bad:
        raise CheckpointMismatchError(f"text-tower checkpoint{where} has shape mismatches (checkpoint, model): {bad}")
    inner.load_state_dict(picked, strict=False)  # strict=False: the image tower keeps its weights
    return keys
