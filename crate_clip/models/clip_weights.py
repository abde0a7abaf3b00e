"""Read, resize and load CLIP weights: the layer below the model factory (clip_factory.create_clip) and the
patch-size changes (patch_change.py), which both load through `load_clip_weights`.

open_clip's own loader resizes only its native ViT's position embedding. `load_clip_weights` resizes
`visual.trunk.pos_embed` and the text `positional_embedding` to the model when asked to
(`pos_embed_resize='grid_2d'` or `'official_1d'`, see pos_embed.py), converts the official
CRATE-alpha-CLIPA layout (official_clipa.py), and otherwise refuses a shape mismatch, naming it.
"""
import contextlib
import logging
from pathlib import Path
from typing import Dict, Optional, Union

import open_clip
import torch
from torch import nn

from crate_clip.checkpoint_io.checkpoint_choice import is_deepspeed_checkpoint
from crate_clip.checkpoint_io.deepspeed_checkpoints import consolidate_deepspeed_checkpoint, verify_recorded_file
from crate_clip.models.checkpoint_errors import CheckpointMismatchError, key_list
from crate_clip.models.crate_alpha import CrateAlpha
from crate_clip.models.official_clipa import is_official_clipa_layout, official_clipa_to_open_clip, official_key
from crate_clip.models.pos_embed import check_resize_mode, resize_image_pos_embed, resize_text_pos_embed, square_grid
from crate_clip.models.weights_files import read_weights_file, refuse_special_file

IMAGE_POS_KEY = "visual.trunk.pos_embed"
TEXT_POS_KEY = "positional_embedding"
TEXT_POS_KEYS = (TEXT_POS_KEY, "text." + TEXT_POS_KEY)  # CLIP's text tower, CustomTextCLIP's (CRATE-alpha text)


def _drop_random_init_warning(record: logging.LogRecord) -> bool:
    return "No pretrained weights loaded" not in record.getMessage()


@contextlib.contextmanager
def quiet_random_init():
    """Silence open_clip's "No pretrained weights loaded ... initialized randomly" while our code builds a
    model: our loaders load the weights themselves right after (a checkpoint, an export, carried stage
    weights), and a fresh stage-0 model is random by design, so the notice would only mislead."""
    root = logging.getLogger()
    root.addFilter(_drop_random_init_warning)
    try:
        yield
    finally:
        root.removeFilter(_drop_random_init_warning)


def _image_tower(model: nn.Module) -> Optional[CrateAlpha]:
    model = getattr(model, "module", model)  # DeepSpeed engine / DDP wrapper
    trunk = getattr(getattr(model, "visual", None), "trunk", None)
    return trunk if isinstance(trunk, CrateAlpha) else None


def resize_clip_state_dict(state_dict: Dict[str, torch.Tensor], model: nn.Module,
                           mode: str = "grid_2d") -> Dict[str, torch.Tensor]:
    """Resize the image pos-embed (`mode`: 'grid_2d' or 'official_1d') and the text pos-embed (1-D linear)
    to `model`."""
    check_resize_mode(mode)
    sd = dict(state_dict)
    target = getattr(model, "module", model).state_dict()
    pos = sd.get(IMAGE_POS_KEY)
    if pos is not None and IMAGE_POS_KEY in target and pos.shape != target[IMAGE_POS_KEY].shape:
        sd[IMAGE_POS_KEY] = _resize_image_pos(pos, target[IMAGE_POS_KEY], model, mode)
    if "visual.positional_embedding" in sd and "visual.positional_embedding" in target:
        # an open_clip ViT tower (the white-box benchmark's baseline): open_clip's own 2-D resize
        open_clip.model.resize_pos_embed(sd, getattr(model, "module", model))
    for key in TEXT_POS_KEYS:
        tpos = sd.get(key)
        # (another width cannot be resized: the loader's key and shape checks report it)
        if tpos is not None and key in target and tpos.shape[1:] == target[key].shape[1:]:
            sd[key] = resize_text_pos_embed(tpos, target[key].shape[0])
    return sd


def _resize_image_pos(pos: torch.Tensor, target: torch.Tensor, model: nn.Module, mode: str) -> torch.Tensor:
    try:
        old = square_grid(pos.shape[1], IMAGE_POS_KEY)
    except ValueError:
        old = None
    if old is None or pos.shape[-1] != target.shape[-1] or pos.ndim != 3:
        raise CheckpointMismatchError(
            f"{IMAGE_POS_KEY}: checkpoint shape {tuple(pos.shape)} cannot be resized to {tuple(target.shape)}")
    trunk = _image_tower(model)
    new = trunk.grid_size if trunk is not None else square_grid(target.shape[1], IMAGE_POS_KEY)
    return resize_image_pos_embed(pos, new, old, mode)


def read_state_dict(source: Union[str, Path]) -> Dict[str, torch.Tensor]:
    """Read a weights file (.safetensors, or torch.load weights_only=True; unwraps state_dict/module nesting) or
    a DeepSpeed checkpoint folder of any ZeRO stage (consolidated to fp32), refusing pickled code either way."""
    path = Path(source)
    refuse_special_file(path)   # before anything opens it
    if is_deepspeed_checkpoint(path):
        return consolidate_deepspeed_checkpoint(path)[0]
    if not path.is_file():
        raise FileNotFoundError(f"checkpoint file not found: {path}")
    verify_recorded_file(path)   # a file of an export or a checkpoint: against the record beside it
    sd = read_weights_file(path)   # a corrupt or truncated file: one line naming it
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


def load_clip_weights(model: nn.Module, source: Union[str, Path, Dict[str, torch.Tensor]], strict: bool = True,
                      pos_embed_resize: Optional[str] = None, origin: Union[str, Path, None] = None) -> None:
    """Load a CLIP checkpoint (file or state dict; ours or the official CRATE-alpha-CLIPA layout) into `model`.

    Position embeddings of another size are resized only when `pos_embed_resize` names a mode ('grid_2d',
    'official_1d'); otherwise, as every other mismatch, they raise CheckpointMismatchError naming the
    missing / unexpected keys (strict) or the mismatched shapes; `origin` names the file a state dict was read
    from in those errors.
    """
    sd = read_state_dict(source) if isinstance(source, (str, Path)) else strip_module_prefix(dict(source))
    target_model = getattr(model, "module", model)
    target = target_model.state_dict()
    origin = source if isinstance(source, (str, Path)) else origin
    where = f" in {origin}" if origin is not None else ""
    name = str  # how keys are named in errors: the checkpoint's own names
    if is_official_clipa_layout(sd):
        sd, name = official_clipa_to_open_clip(sd), official_key
        where = f" (official CRATE-alpha-CLIPA layout){where}"
    for key in ("logit_scale", "logit_bias"):  # DeepSpeed trains them as [1], open_clip holds scalars
        if key in sd and key in target and sd[key].shape != target[key].shape and sd[key].numel() == 1:
            sd[key] = sd[key].reshape(target[key].shape)
    if pos_embed_resize is not None:
        sd = resize_clip_state_dict(sd, target_model, pos_embed_resize)
    missing, unexpected = set(target) - set(sd), set(sd) - set(target)
    if strict and (missing or unexpected):
        raise CheckpointMismatchError(
            f"checkpoint{where} does not match the model: missing keys [{key_list(map(name, missing))}]; "
            f"unexpected keys [{key_list(map(name, unexpected))}]")
    bad = {name(k): (tuple(v.shape), tuple(target[k].shape)) for k, v in sd.items()
           if k in target and v.shape != target[k].shape}
    if bad:
        hint = (" (position embeddings of another size load with pos_embed_resize='grid_2d' or 'official_1d')"
                if {name(IMAGE_POS_KEY), *TEXT_POS_KEYS} & set(bad) else "")
        raise CheckpointMismatchError(f"checkpoint{where} has shape mismatches (checkpoint, model): {bad}{hint}")
    target_model.load_state_dict({k: v for k, v in sd.items() if k in target}, strict=strict)
