"""The one front door for models: `create_clip` builds every CRATE-alpha CLIP of the project (training stages,
exports, evaluation, conversion, the white-box maps, the benchmarks), as open_clip's create_model does for its own.

It builds an open_clip config at a stage's image size / context length, or an export (`local-dir:FOLDER`), moves
the image tower to another patch size (patch_change.py), and loads weights of any size into it: a weights file,
a state dict, a DeepSpeed checkpoint folder or an export folder (a string read by weights_source.py's parser, as
every weights source is). Reading, resizing and loading weights is clip_weights.py's (re-exported here, where
callers found it before).
"""
import contextlib
from copy import deepcopy
from pathlib import Path
from typing import Dict, Optional, Union

import open_clip
import torch
from open_clip.model import set_model_preprocess_cfg
from torch import nn

from crate_clip.models.checkpoint_errors import CheckpointMismatchError  # noqa: F401  (re-exported)
from crate_clip.models.clip_tokenizers import bert_text_cfg, bert_tokenizer  # noqa: F401  (re-exported)
from crate_clip.models.clip_weights import (IMAGE_POS_KEY, TEXT_POS_KEY, TEXT_POS_KEYS,  # noqa: F401  (re-exported)
                                            _image_tower, load_clip_weights, quiet_random_init, read_state_dict,
                                            resize_clip_state_dict, strip_module_prefix)
from crate_clip.models.export_files import LOCAL_DIR
from crate_clip.models.weights_source import CHECKPOINT, EXPORT, FILE, NAME, parse_weights_source
from crate_clip.models.export_folder_check import export_weights_file
from crate_clip.models.export_loading import create_from_export
from crate_clip.models.model_patch_size import image_patch_size
from crate_clip.models.open_clip_configs import preprocess_cfg_for
from crate_clip.models.patch_change import checkpoint_patch_size, load_clip_weights_at_patch, set_fresh_patch_size

Weights = Union[str, Path, Dict[str, torch.Tensor]]


def create_clip(model_name: str, image_size: Optional[int] = None, context_length: Optional[int] = None,
                pretrained: Optional[Weights] = None, device: Union[str, torch.device] = "cpu",
                precision: str = "fp32", text_cfg: Optional[Dict] = None, pos_embed_resize: Optional[str] = "grid_2d",
                *, patch_size: Optional[int] = None, patch_resize: str = "pi_resize", **open_clip_kwargs) -> nn.Module:
    """A CLIP of config `model_name` at `image_size` / `context_length` with the config's preprocessing, or the
    export `local-dir:FOLDER` (its own config, preprocessing and weights, checked by create_from_export).

    `pretrained`: a weights file (ours or the official CRATE-alpha-CLIPA layout), a state dict, a DeepSpeed
    checkpoint folder (consolidated to fp32) or an export folder (its weights file), of any size: its position
    embeddings are resized by `pos_embed_resize`, and the image tower first takes the weights' patch size.
    `patch_size`: the tower then moves to it (its kernel resized by `patch_resize`, patch_change.py; a fresh kernel
    of that size without weights). `text_cfg` entries override the config's text tower (e.g. `bert_text_cfg`).
    Unknown model names raise open_clip's usual error.
    """
    if str(model_name).startswith(LOCAL_DIR):
        return _create_from_export(parse_weights_source(model_name).path, image_size, context_length, pretrained,
                                   device, precision, pos_embed_resize, patch_size, patch_resize, **open_clip_kwargs)
    weights, origin = pretrained_state(pretrained)
    model = _build(model_name, image_size, context_length, device, precision, text_cfg, **open_clip_kwargs)
    native = image_patch_size(model_name) if (patch_size is not None or weights is not None) else None
    if patch_size in (None, native) and (weights is None or checkpoint_patch_size(weights) in (None, native)):
        if weights is not None:   # no patch-size change anywhere
            load_clip_weights(model, weights, strict=True, pos_embed_resize=pos_embed_resize, origin=origin)
    elif weights is None:
        set_fresh_patch_size(model, patch_size)
    else:
        load_clip_weights_at_patch(model, weights, patch_size, patch_resize, pos_embed_resize, origin)
    return model


def pretrained_state(pretrained: Optional[Weights]):
    """(state dict, the path it was read from) of a `pretrained` value: a state dict as it is (without DDP's
    'module.' prefix), an export folder's weights file, else a weights file or a DeepSpeed checkpoint folder."""
    if pretrained is None:
        return None, None
    if not isinstance(pretrained, (str, Path)):
        return strip_module_prefix(dict(pretrained)), None
    source = parse_weights_source(pretrained)
    if source.kind == EXPORT:
        path = export_weights_file(source.path)   # the file open_clip would load: a regular file
    else:   # a weights file or a checkpoint folder; anything else is refused by the read, naming it
        path = source.path if source.kind in (FILE, CHECKPOINT, NAME) else Path(pretrained)
    return read_state_dict(path), path


def _build(model_name: str, image_size, context_length, device, precision, text_cfg, **open_clip_kwargs) -> nn.Module:
    """The config at the sizes asked for, random weights, the config's preprocessing."""
    if text_cfg:
        merged = deepcopy(_model_cfg(model_name)["text_cfg"])
        merged.update(text_cfg)
        open_clip_kwargs["text_cfg"] = merged
        if context_length is not None:
            merged["context_length"] = context_length
    # on the meta device, build there from the start (open_clip builds on CPU, then moves): no init compute
    on_meta = torch.device(device).type == "meta"
    with quiet_random_init(), (torch.device("meta") if on_meta else contextlib.nullcontext()):
        model = open_clip.create_model(
            model_name, pretrained=None, precision=precision, device=device,
            force_image_size=image_size, force_context_length=context_length, **open_clip_kwargs)
    set_model_preprocess_cfg(model, {**preprocess_cfg_for(model_name), "size": model.visual.image_size})
    return model


def _create_from_export(folder: Path, image_size, context_length, pretrained, device, precision, pos_embed_resize,
                        patch_size, patch_resize, **open_clip_kwargs) -> nn.Module:
    """An export built at the size asked for, then its weights (or `pretrained`) loaded with the position
    embeddings resized (open_clip alone cannot resize a timm tower)."""
    weights = export_weights_file(folder)   # open_clip's choice, a regular file (not a FIFO, not /dev/zero)
    if context_length is not None:
        open_clip_kwargs["force_context_length"] = context_length
    model = create_from_export(folder, open_clip.create_model, load_weights=False, force_image_size=image_size,
                               device=device, precision=precision, **open_clip_kwargs)
    state, origin = pretrained_state(weights if pretrained is None else pretrained)
    if patch_size is None:
        load_clip_weights(model, state, pos_embed_resize=pos_embed_resize, origin=origin)
    else:
        load_clip_weights_at_patch(model, state, patch_size, patch_resize, pos_embed_resize, origin)
    return model


def _model_cfg(model_name: str) -> Dict:
    cfg = open_clip.get_model_config(model_name)
    if cfg is None:
        raise RuntimeError(f"Model config for {model_name} not found (open_clip.list_models() names the known ones)")
    return cfg


def set_image_token_mask(clip_model: nn.Module, kind: str, drop_ratio: float = 0.0) -> None:
    """Set the training-time image token mask of a CRATE-alpha CLIP ('none', 'random', 'grid', 'block')."""
    trunk = _image_tower(clip_model)
    if trunk is None and kind == "none":
        return  # another tower (e.g. a ViT baseline trained by the same trainer): nothing to switch off
    if trunk is None:
        raise TypeError(f"{type(clip_model).__name__} has no CRATE-alpha image tower at .visual.trunk")
    trunk.set_token_mask(kind, drop_ratio)


def image_tower_param_count(model_name: str, image_size: Optional[int] = None) -> int:
    """Parameters of a config's image tower (with projection), counted on the meta device (no weights made)."""
    cfg = deepcopy(_model_cfg(model_name))
    with torch.device("meta"):
        visual = open_clip.model._build_vision_tower(cfg["embed_dim"], cfg["vision_cfg"])
        if image_size is not None:
            visual.set_input_size(image_size)
    return sum(p.numel() for p in visual.parameters())
