"""Build CRATE-alpha CLIP models at a stage's image size / context length, and load weights of any size.

open_clip alone cannot load a checkpoint whose timm-tower position embedding has another size (it only
resizes its native ViT's): `load_clip_weights` resizes `visual.trunk.pos_embed` (2-D, cls apart) and the
text `positional_embedding` (1-D) to the model before a strict load.
"""
import json
import logging
import math
from copy import deepcopy
from pathlib import Path
from typing import Dict, Optional, Union

import open_clip
import torch
import torch.nn.functional as F
from timm.layers import resample_abs_pos_embed
from torch import nn

from crate_clip.models.crate_alpha import CrateAlpha

IMAGE_POS_KEY = "visual.trunk.pos_embed"
TEXT_POS_KEY = "positional_embedding"


class CheckpointMismatchError(RuntimeError):
    """A checkpoint whose keys or shapes do not match the model; the message names them."""


def create_clip(model_name: str, image_size: Optional[int] = None, context_length: Optional[int] = None,
                pretrained: Union[str, Path, Dict, None] = None, device: Union[str, torch.device] = "cpu", precision: str = "fp32",
                text_cfg: Optional[Dict] = None, **open_clip_kwargs) -> nn.Module:
    """Build an open_clip CLIP at `image_size` / `context_length`; `pretrained` (a file or a state dict)
    of any size is loaded.

    `text_cfg` entries override the config's text tower (e.g. from `bert_text_cfg`). Unknown model names
    raise open_clip's usual error.
    """
    if text_cfg:
        merged = deepcopy(_model_cfg(model_name)["text_cfg"])
        merged.update(text_cfg)
        open_clip_kwargs["text_cfg"] = merged
        if context_length is not None:
            merged["context_length"] = context_length
    root = logging.getLogger()
    if pretrained is not None:  # we load the weights below: open_clip's "initialized randomly" would mislead
        root.addFilter(_drop_random_init_warning)
    try:
        model = open_clip.create_model(
            model_name, pretrained=None, precision=precision, device=device,
            force_image_size=image_size, force_context_length=context_length, **open_clip_kwargs)
    finally:
        root.removeFilter(_drop_random_init_warning)
    if pretrained is not None:
        load_clip_weights(model, pretrained, strict=True)
    return model


def _drop_random_init_warning(record: logging.LogRecord) -> bool:
    return "No pretrained weights loaded" not in record.getMessage()


def _model_cfg(model_name: str) -> Dict:
    cfg = open_clip.get_model_config(model_name)
    if cfg is None:
        raise RuntimeError(f"Model config for {model_name} not found (open_clip.list_models() names the known ones)")
    return cfg


def _image_tower(model: nn.Module) -> Optional[CrateAlpha]:
    model = getattr(model, "module", model)  # DeepSpeed engine / DDP wrapper
    trunk = getattr(getattr(model, "visual", None), "trunk", None)
    return trunk if isinstance(trunk, CrateAlpha) else None


def resize_clip_state_dict(state_dict: Dict[str, torch.Tensor], model: nn.Module) -> Dict[str, torch.Tensor]:
    """Resize image pos-embed (2-D bicubic, cls kept apart), text pos-embed (1-D linear) and logit_scale to `model`."""
    sd = dict(state_dict)
    target = getattr(model, "module", model).state_dict()
    pos = sd.get(IMAGE_POS_KEY)
    if pos is not None and IMAGE_POS_KEY in target and pos.shape != target[IMAGE_POS_KEY].shape:
        sd[IMAGE_POS_KEY] = _resize_image_pos(pos, target[IMAGE_POS_KEY], model)
    if "visual.positional_embedding" in sd:  # an open_clip ViT tower (the white-box benchmark's baseline)
        open_clip.model.resize_pos_embed(sd, getattr(model, "module", model))
    tpos = sd.get(TEXT_POS_KEY)
    if tpos is not None and TEXT_POS_KEY in target and tpos.shape != target[TEXT_POS_KEY].shape:
        sd[TEXT_POS_KEY] = _resize_text_pos(tpos, target[TEXT_POS_KEY].shape[0])
    for key in ("logit_scale", "logit_bias"):
        if key in sd and key in target and sd[key].shape != target[key].shape:
            sd[key] = sd[key].reshape(target[key].shape)
    return sd


def _resize_image_pos(pos: torch.Tensor, target: torch.Tensor, model: nn.Module) -> torch.Tensor:
    old = math.isqrt(pos.shape[1] - 1)
    if old * old != pos.shape[1] - 1 or pos.shape[-1] != target.shape[-1]:
        raise CheckpointMismatchError(
            f"{IMAGE_POS_KEY}: checkpoint shape {tuple(pos.shape)} cannot be resized to {tuple(target.shape)}")
    trunk = _image_tower(model)
    new = trunk.grid_size if trunk is not None else (math.isqrt(target.shape[1] - 1),) * 2
    return resample_abs_pos_embed(pos.float(), new_size=list(new), old_size=[old, old],
                                  num_prefix_tokens=1).to(pos.dtype)


def _resize_text_pos(pos: torch.Tensor, length: int) -> torch.Tensor:
    # same rule as open_clip's own resize_text_pos_embed: linear interpolation along the positions
    x = pos.float().t().unsqueeze(0)  # (1, width, ctx)
    x = F.interpolate(x, size=length, mode="linear", align_corners=False)
    return x.squeeze(0).t().to(pos.dtype)


def read_state_dict(source: Union[str, Path]) -> Dict[str, torch.Tensor]:
    """Read a weights file (.safetensors, or torch.load weights_only=True); unwraps state_dict/module nesting."""
    path = Path(source)
    if not path.is_file():
        raise FileNotFoundError(f"checkpoint file not found: {path}")
    if path.suffix == ".safetensors":
        from safetensors.torch import load_file
        sd = load_file(str(path), device="cpu")
    else:
        try:
            sd = torch.load(path, map_location="cpu", weights_only=True)
        except Exception as e:  # pickle with code, corrupt zip, ...: say which file
            raise CheckpointMismatchError(f"cannot load {path} with torch.load(weights_only=True): {e}") from e
    for key in ("state_dict", "module"):  # open_clip's trainer / DeepSpeed's mp_rank_00_model_states.pt
        if isinstance(sd, dict) and isinstance(sd.get(key), dict):
            sd = sd[key]
            break
    if not isinstance(sd, dict) or not sd:
        raise CheckpointMismatchError(f"{path} holds no state dict (got {type(sd).__name__})")
    return strip_module_prefix(sd)


def strip_module_prefix(sd: Dict[str, torch.Tensor]) -> Dict[str, torch.Tensor]:
    """Drop the 'module.' prefix DDP / DeepSpeed put on every key."""
    if all(k.startswith("module.") for k in sd):
        return {k[len("module."):]: v for k, v in sd.items()}
    return sd


def _names(keys) -> str:
    keys = sorted(keys)
    more = f" ... and {len(keys) - 20} more" if len(keys) > 20 else ""
    return ", ".join(keys[:20]) + more


def load_clip_weights(model: nn.Module, source: Union[str, Path, Dict[str, torch.Tensor]], strict: bool = True) -> None:
    """Load a CLIP checkpoint (file or state dict) into `model`, resizing position embeddings first.

    Raises CheckpointMismatchError naming the missing / unexpected keys (strict) or mismatched shapes.
    """
    sd = read_state_dict(source) if isinstance(source, (str, Path)) else strip_module_prefix(dict(source))
    target_model = getattr(model, "module", model)
    sd = resize_clip_state_dict(sd, target_model)
    target = target_model.state_dict()
    missing, unexpected = set(target) - set(sd), set(sd) - set(target)
    where = f" in {source}" if isinstance(source, (str, Path)) else ""
    if strict and (missing or unexpected):
        raise CheckpointMismatchError(
            f"checkpoint{where} does not match the model: missing keys [{_names(missing)}]; "
            f"unexpected keys [{_names(unexpected)}]")
    bad = {k: (tuple(v.shape), tuple(target[k].shape)) for k, v in sd.items()
           if k in target and v.shape != target[k].shape}
    if bad:
        raise CheckpointMismatchError(f"checkpoint{where} has shape mismatches (checkpoint, model): {bad}")
    target_model.load_state_dict({k: v for k, v in sd.items() if k in target}, strict=strict)


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


def bert_text_cfg(vocab_dir: Union[str, Path]) -> Dict:
    """text_cfg overrides for a BERT-style WordPiece tokenizer from a local vocabulary (CLIPA's text setup).

    `vocab_dir` holds `vocab.txt` (one token a line); a `tokenizer_config.json` naming BertTokenizer
    (lower-cased) is written beside it when absent, so transformers loads it offline. The text tower then
    has the vocabulary's size, no causal mask and pools at the last position.
    """
    vocab_dir = Path(vocab_dir)
    vocab = vocab_dir / "vocab.txt"
    if not vocab.is_file():
        raise FileNotFoundError(f"BERT vocabulary not found: {vocab}")
    cfg_path = vocab_dir / "tokenizer_config.json"
    if not cfg_path.exists():
        cfg_path.write_text(json.dumps({"tokenizer_class": "BertTokenizer", "do_lower_case": True,
                                        "model_max_length": 512}))
    vocab_size = sum(1 for line in vocab.read_text(encoding="utf-8").splitlines() if line)
    return {"hf_tokenizer_name": str(vocab_dir), "vocab_size": vocab_size, "no_causal_mask": True,
            "pool_type": "last"}


def bert_tokenizer(vocab_dir: Union[str, Path], context_length: int = 32):
    """open_clip HFTokenizer over a local BERT vocabulary (see `bert_text_cfg`); lower-cases, pads to length."""
    return open_clip.tokenizer.HFTokenizer(bert_text_cfg(vocab_dir)["hf_tokenizer_name"], context_length=context_length)
