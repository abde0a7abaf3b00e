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
from crate_clip.models.clip_factory import (TEXT_POS_KEY, create_clip, read_state_dict,
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
    try:   # at the config's size the position embeddings must fit as they are
        model = create_clip(model_name, image_size=image_size, pretrained=sd, device="cpu", precision="fp32",
                            pos_embed_resize=pos_embed_resize if image_size else None)
    except CheckpointMismatchError as err:
        raise CheckpointMismatchError(f"{checkpoint_path} into {model_name}: {err}") from None
    return _to(model, device, precision)


def _to(model: nn.Module, device, precision: str) -> nn.Module:
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[precision]
    return model.to(device=device, dtype=dtype)


TEXT_SUBMODULE = "text."  # open_clip's CustomTextCLIP keeps its text tower under `text`


def is_text_key(name: str) -> bool:
    """True for a CLIP / CustomTextCLIP state-dict key of the text tower (not visual.*, not the logit scale)."""
    return not name.startswith("visual.") and name not in LOGIT_KEYS


def text_tower_keys(model: nn.Module, include_logit_scale: bool = True) -> List[str]:
    """State-dict keys of the text tower (everything outside `visual.`), plus the logit scale/bias if asked."""
    keys = [k for k in getattr(model, "module", model).state_dict() if not k.startswith("visual.")]
    return [k for k in keys if include_logit_scale or is_text_key(k)]


def _source_key(key: str, source: Dict[str, torch.Tensor]) -> Optional[str]:
    """The checkpoint's name for our key: the same, or moved in/out of CustomTextCLIP's `text.` submodule."""
    if key in source:
        return key
    other = key[len(TEXT_SUBMODULE):] if key.startswith(TEXT_SUBMODULE) else TEXT_SUBMODULE + key
    return other if other in source else None


def load_text_tower(model: nn.Module, source: Union[str, Path, Dict[str, torch.Tensor]],
                    include_logit_scale: bool = True, resize_positions: bool = False,
                    where: Optional[str] = None) -> List[str]:
    """Copy the text tower (and the logit scale, where the checkpoint has one) of a CLIP checkpoint into
    `model`; returns the keys loaded.

    The checkpoint's image tower is ignored; CLIP's flat text keys and CustomTextCLIP's `text.*` ones map
    onto each other. A missing text key or a shape mismatch raises CheckpointMismatchError naming them; the
    text position embedding of another length is resized (1-D linear) only with `resize_positions`.
    """
    where = where or (str(source) if isinstance(source, (str, Path)) else "the text-tower checkpoint")
    sd = read_state_dict(source) if isinstance(source, (str, Path)) else strip_module_prefix(dict(source))
    if is_official_clipa_layout(sd):  # a released crate_alpha_CLIPA_*.pth: its text_projection is transposed
        sd = official_clipa_to_open_clip({k: v for k, v in sd.items() if not k.startswith("visual.")})
    inner = getattr(model, "module", model)
    target = inner.state_dict()
    found = {k: _source_key(k, sd) for k in text_tower_keys(inner, include_logit_scale=False)}
    missing = [k for k, s in found.items() if s is None]
    if missing:
        raise CheckpointMismatchError(f"{where} lacks the text-tower keys [{key_list(missing, 12)}] of the model")
    picked = {k: sd[s] for k, s in found.items()}
    if include_logit_scale:
        picked.update({k: sd[k].reshape(target[k].shape) for k in LOGIT_KEYS
                       if k in sd and k in target and sd[k].numel() == target[k].numel()})
    if resize_positions and picked[TEXT_POS_KEY].shape[0] != target[TEXT_POS_KEY].shape[0]:
        picked[TEXT_POS_KEY] = resize_text_pos_embed(picked[TEXT_POS_KEY], target[TEXT_POS_KEY].shape[0])
    bad = sorted(f"{k} {tuple(v.shape)} vs {tuple(target[k].shape)}" for k, v in picked.items()
                 if v.shape != target[k].shape)
    if bad:
        raise CheckpointMismatchError(f"{where} has another text-tower shape (checkpoint vs model): "
                                      f"{', '.join(bad[:12])}")
    inner.load_state_dict(picked, strict=False)  # strict=False: the image tower keeps its weights
    return [k for k in target if k in picked]
