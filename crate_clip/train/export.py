"""Export trained weights as an open_clip `local-dir:` model (safetensors + open_clip_config.json)."""
from __future__ import annotations

import json
from copy import deepcopy
from pathlib import Path

import open_clip
import torch

from crate_clip.checkpoint_io.atomic_files import atomic_write, atomic_write_text
from crate_clip.models import clip_tokenizer, preprocess_cfg_for, tokenizer_record
from crate_clip.models.clip_factory import quiet_random_init
from crate_clip.models.patch_change import config_patch_size, register_tower_of, tower_name_at_patch

WEIGHTS_FILE = "open_clip_model.safetensors"
CONFIG_FILE = "open_clip_config.json"


def export_open_clip(state_dict: dict, model_name: str, out_dir: Path, *, image_size: int, context_length: int,
                     mean=None, std=None, bert_vocab: str | None = None, patch_size: int | None = None) -> Path:
    """Write fp32 weights and the config so `open_clip.create_model_and_transforms('local-dir:OUT')` rebuilds
    the model (after `import crate_clip`, which registers the CRATE-alpha tower); returns OUT.

    Preprocessing is the model config's (ImageNet mean/std for the CLIPA models) unless mean/std are given.
    A model with a HuggingFace tokenizer (CLIPA's BERT) gets its tokenizer files in OUT, where open_clip's
    `get_tokenizer('local-dir:OUT')` reads them, so the export evaluates offline with its own vocabulary.
    A tower trained at another `patch_size` than its config's is named parametrically at that patch size
    (register it before a plain open_clip load: `crate_clip.models.patch_change.register_tower_of(cfg)`;
    `load_export` and `crate-clip eval` do).
    """
    from safetensors.torch import save_file

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    model_cfg = deepcopy(open_clip.get_model_config(model_name))
    if model_cfg is None:
        raise ValueError(f"export: unknown open_clip model {model_name!r}")
    model_cfg["vision_cfg"]["image_size"] = image_size
    model_cfg["text_cfg"]["context_length"] = context_length
    if patch_size is not None and patch_size != config_patch_size(model_name):
        tower = tower_name_at_patch(model_cfg["vision_cfg"]["timm_model_name"], patch_size, image_size)
        model_cfg["vision_cfg"].update(timm_model_name=tower, patch_size=patch_size)
    weights = {}
    for key, value in state_dict.items():
        value = value.detach().to("cpu")
        value = value.float() if value.is_floating_point() else value
        if key in ("logit_scale", "logit_bias"):
            value = value.reshape(())  # DeepSpeed trained it as [1]; open_clip's CLIP holds a scalar
        weights[key] = value.contiguous().clone()
    preprocess_cfg = {**preprocess_cfg_for(model_name), "size": image_size}
    preprocess_cfg["mean"] = list(mean if mean is not None else preprocess_cfg["mean"])
    preprocess_cfg["std"] = list(std if std is not None else preprocess_cfg["std"])
    if model_cfg["text_cfg"].get("hf_tokenizer_name"):
        clip_tokenizer(model_name, context_length, bert_vocab).save_pretrained(str(out_dir))
    # each file is written under a temporary name, fsynced, then renamed: a reader never sees half a file
    atomic_write(out_dir / WEIGHTS_FILE,
                 lambda tmp: save_file(weights, str(tmp), metadata={"model_name": model_name, "format": "pt"}))
    atomic_write_text(out_dir / CONFIG_FILE, json.dumps({
        "model_name": model_name, "model_cfg": model_cfg, "preprocess_cfg": preprocess_cfg,
        "tokenizer": tokenizer_record(model_name, bert_vocab)}, indent=2))
    return out_dir


def load_export(out_dir: Path, device: str = "cpu"):
    """(model, preprocess, tokenizer) of an export, through open_clip's own `local-dir:` loader."""
    import crate_clip  # noqa: F401  (registers the CRATE-alpha tower with timm)

    register_tower_of(json.loads((Path(out_dir) / CONFIG_FILE).read_text()).get("model_cfg"))
    spec = f"local-dir:{Path(out_dir).resolve()}"
    with quiet_random_init():   # open_clip logs it for local-dir: models although it loads their weights
        model, _, preprocess = open_clip.create_model_and_transforms(spec, device=device)
    return model.eval(), preprocess, open_clip.get_tokenizer(spec)


def export_state_equal(model: torch.nn.Module, state_dict: dict) -> bool:
    """True when `model` holds exactly `state_dict` (logit_scale compared by value, any shape)."""
    own = model.state_dict()
    return set(own) == set(state_dict) and all(
        torch.equal(own[k].float().reshape(-1), state_dict[k].float().reshape(-1)) for k in own)
