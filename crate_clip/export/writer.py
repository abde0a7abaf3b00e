"""Export weights as an open_clip model folder: `local-dir:`, and the Hugging Face Hub layout for `hf-hub:`.

    open_clip_config.json          model_cfg (image tower named so `import crate_clip` alone resolves it, at
                                   the weights' patch size and image size), preprocess_cfg, tokenizer record
    open_clip_model.safetensors    fp32 weights (the file open_clip's hf-hub: loader looks for first)
    tokenizer.json, tokenizer_config.json   a HuggingFace tokenizer's files (CLIPA's BERT), where open_clip's
                                   `get_tokenizer('local-dir:OUT')` reads them
    README.md                      the model card (exports of a training checkpoint)

`export_checkpoint` turns any checkpoint of a run into such a folder; the trainer's final export is that
function on the last checkpoint, so `crate-clip export` of the same checkpoint writes the same bytes. The
folder is written beside its destination and swapped in whole; identical inputs give identical files (the
safetensors header and the JSON are written with sorted keys).
"""
from __future__ import annotations

import json
import os
import shutil
import sys
from copy import deepcopy
from pathlib import Path

import open_clip
import torch

from crate_clip.checkpoint_io.atomic_files import atomic_write, atomic_write_text, fsync_tree, replace_dir
from crate_clip.checkpoint_io.file_checksums import CHECKSUMS_KEY, file_checksum
from crate_clip.checkpoint_io.deepspeed_checkpoints import consolidated_state_dict
from crate_clip.checkpoint_io.ema_state import ema_weights_of_checkpoint
from crate_clip.core.patch_tiling import check_patch_tiling
from crate_clip.models import clip_tokenizer, preprocess_cfg_for, tokenizer_record
from crate_clip.models.export_files import CARD_FILE, CONFIG_FILE, LOCAL_DIR, WEIGHTS_FILE
from crate_clip.models.export_loading import create_from_export
from crate_clip.models.clip_tower_names import tower_arch, tower_name_at
from crate_clip.models.patch_change import checkpoint_patch_size
from crate_clip.export.source import export_source

# text_cfg keys that describe the tokenizer (taken from the tokenizer's own config when a run names one)
TOKENIZER_KEYS = ("hf_tokenizer_name", "tokenizer_kwargs", "tokenizer_mode")


def export_open_clip(state_dict: dict, model_name: str, out_dir: Path, *, image_size: int, context_length: int,
                     mean=None, std=None, bert_vocab: str | None = None, patch_size: int | None = None,
                     tokenizer_name: str | None = None, hub_id: str | None = None,
                     model_card: str | None = None) -> Path:
    """Write fp32 weights, config, tokenizer files and `model_card` (README.md) so that
    `open_clip.create_model_and_transforms('local-dir:OUT')` rebuilds the model after `import crate_clip`; returns OUT.

    Arguments as `export_config`'s; the patch size defaults to the weights' kernel.
    """
    config = export_config(model_name, image_size=image_size, context_length=context_length, mean=mean, std=std,
                           bert_vocab=bert_vocab, patch_size=patch_size or checkpoint_patch_size(state_dict),
                           tokenizer_name=tokenizer_name, hub_id=hub_id)
    return write_export(state_dict, config, out_dir, tokenizer_name=tokenizer_name or model_name,
                        bert_vocab=bert_vocab, model_card=model_card)


def export_checkpoint(checkpoint: str | Path, out_dir: Path, *, stage: int | None = None, state: dict | None = None,
                      bert_vocab: str | None = None, hub_id: str | None = None, repo_url: str | None = None,
                      weights: str = "live") -> Path:
    """Export a training checkpoint (a run folder, its `checkpoints/` folder following `latest`, or one
    `<tag>/` folder; `stage`: that stage's last checkpoint) as an open_clip model folder with its model card
    (linking `repo_url`); `state`: its weights when the caller has them. `weights`: 'live' (the consolidated
    trained weights) or 'ema' (with train.ema's average in their place: NoEmaError when it holds none). Returns
    OUT."""
    from crate_clip.export.model_card import model_card

    source = export_source(checkpoint, stage, bert_vocab, weights)
    if state is None:
        state = consolidated_state_dict(source.tag_dir)
        state = ema_weights_of_checkpoint(source.tag_dir, state) if weights == "ema" else state
    config = export_config(source.model_name, image_size=source.image_size, context_length=source.context_length,
                           mean=source.mean, std=source.std, bert_vocab=source.bert_vocab,
                           patch_size=checkpoint_patch_size(state), tokenizer_name=source.tokenizer_name,
                           hub_id=hub_id, interpolation=trained_interpolation(source.run_config))
    return write_export(state, config, out_dir, tokenizer_name=source.tokenizer_name, bert_vocab=source.bert_vocab,
                        model_card=model_card(source, config, hub_id, repo_url=repo_url))


def export_config(model_name: str, *, image_size: int, context_length: int, mean=None, std=None,
                  bert_vocab: str | None = None, patch_size: int | None = None, tokenizer_name: str | None = None,
                  hub_id: str | None = None, interpolation: str | None = None) -> dict:
    """The open_clip_config.json of an export: the model's config at `image_size` / `context_length`, its
    CRATE-alpha tower named for `patch_size` and the size; preprocessing with mean/std (default: the model
    config's, ImageNet's for the CLIPA models); `tokenizer_name`'s tokenizer (an open_clip name; default the
    model's) over `bert_vocab`. `hub_id` (ORG/NAME): the repository the folder will be uploaded to; a
    HuggingFace tokenizer is then read from it by `hf-hub:ORG/NAME` (open_clip reads `hf_tokenizer_name`
    there, the folder itself for `local-dir:`). `interpolation`: the resize filter (default: the model config's;
    an export of a run: the training crop's). An image size the patches do not tile is refused (PatchTilingError)."""
    tokenizer_name = tokenizer_name or model_name
    preprocess_cfg = {**preprocess_cfg_for(model_name), "size": image_size}
    if interpolation:
        preprocess_cfg["interpolation"] = interpolation
    preprocess_cfg["mean"] = [float(v) for v in (mean if mean is not None else preprocess_cfg["mean"])]
    preprocess_cfg["std"] = [float(v) for v in (std if std is not None else preprocess_cfg["std"])]
    return {"model_name": model_name,
            "model_cfg": _model_cfg(model_name, tokenizer_name, image_size, context_length, patch_size, hub_id),
            "preprocess_cfg": preprocess_cfg, "tokenizer": tokenizer_record(tokenizer_name, bert_vocab)}


def write_export(state_dict: dict, config: dict, out_dir: Path, *, tokenizer_name: str, bert_vocab: str | None = None,
                 model_card: str | None = None) -> Path:
    """Write the export folder: fp32 weights, `config`, the files of `tokenizer_name`'s tokenizer when it is a
    HuggingFace one, the model card. Written beside OUT and swapped in whole; returns OUT."""
    out_dir = Path(out_dir)
    text_cfg = config["model_cfg"]["text_cfg"]
    tokenizer = None
    if text_cfg.get("hf_tokenizer_name"):   # loaded before anything is written: a missing vocabulary stops here
        tokenizer = clip_tokenizer(tokenizer_name, text_cfg["context_length"], bert_vocab)
    staging = _staging_dir(out_dir)
    try:
        if tokenizer is not None:
            tokenizer.save_pretrained(str(staging))
        metadata = {"format": "pt", "model_name": config["model_name"]}
        atomic_write(staging / WEIGHTS_FILE, lambda tmp: write_safetensors(fp32_weights(state_dict), tmp, metadata))
        # loaders verify the weights against this record (a copy cut short or changed after writing is refused)
        config = {**config, CHECKSUMS_KEY: {WEIGHTS_FILE: file_checksum(staging / WEIGHTS_FILE)}}
        atomic_write_text(staging / CONFIG_FILE, json.dumps(config, indent=2, sort_keys=True) + "\n")
        if model_card is not None:
            atomic_write_text(staging / CARD_FILE, model_card)
        fsync_tree(staging)
        replace_dir(staging, out_dir)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return out_dir


def _model_cfg(model_name: str, tokenizer_name: str, image_size: int, context_length: int,
               patch_size: int | None, hub_id: str | None) -> dict:
    """The model's open_clip config at the exported sizes, its tower named for them, its tokenizer's keys."""
    model_cfg = deepcopy(open_clip.get_model_config(model_name))
    if model_cfg is None:
        raise ValueError(f"export: unknown open_clip model {model_name!r} (open_clip.list_models() names them)")
    vision, text = model_cfg["vision_cfg"], model_cfg["text_cfg"]
    vision["image_size"], text["context_length"] = image_size, context_length
    tower = vision.get("timm_model_name")
    arch = tower_arch(tower) if tower else None
    if arch is not None:
        patch_size = patch_size or arch["patch_size"]
        vision.update(timm_model_name=tower_name_at(tower, patch_size, image_size), patch_size=patch_size)
    # pixels in, pixels used: open_clip would build a tower whose convolution drops the leftover pixels
    check_patch_tiling(f"export of {model_name}", image_size, vision.get("patch_size"))
    if tokenizer_name != model_name:
        tokenizer_text = (open_clip.get_model_config(tokenizer_name) or {}).get("text_cfg", {})
        for key in TOKENIZER_KEYS:
            text.pop(key, None)
            if key in tokenizer_text:
                text[key] = deepcopy(tokenizer_text[key])
    if hub_id and text.get("hf_tokenizer_name"):
        text["hf_tokenizer_name"] = hub_id   # the uploaded folder holds the tokenizer files
    return model_cfg


def trained_interpolation(run_config: dict) -> str | None:
    """The resampling filter of a run's training crops (data.crop_interpolation; None: not recorded)."""
    return (run_config.get("data") or {}).get("crop_interpolation")


def fp32_weights(state_dict: dict) -> dict:
    """CPU, contiguous, floating tensors as fp32, the logit scale / bias as open_clip's scalars."""
    weights = {}
    for key, value in state_dict.items():
        value = value.detach().to("cpu")
        value = value.float() if value.is_floating_point() else value
        if key in ("logit_scale", "logit_bias"):
            value = value.reshape(())  # DeepSpeed trained it as [1]; open_clip's CLIP holds a scalar
        weights[key] = value.contiguous().clone()
    return weights


def write_safetensors(tensors: dict, path: Path, metadata: dict) -> None:
    """safetensors.torch.save_file with the JSON header's keys sorted: the library writes the metadata map
    in hash order, which differs between processes, so two saves of the same tensors differ in bytes."""
    from safetensors.torch import save_file

    save_file(tensors, str(path), metadata=metadata)
    with open(path, "r+b") as f:
        size = int.from_bytes(f.read(8), "little")
        header = json.loads(f.read(size))
        text = json.dumps(header, sort_keys=True, separators=(",", ":")).encode()
        if len(text) > size:   # cannot happen (same content, compact separators); never shift the data
            raise RuntimeError(f"{path}: sorted safetensors header longer than the written one")
        f.seek(8)
        f.write(text.ljust(size, b" "))   # the format pads its header with spaces
    os.chmod(path, 0o644)   # readable like the export's other files (the library creates it owner-only)


def check_out_dir(out_dir: Path) -> None:
    """Raise FileExistsError unless `out_dir` is new, empty or an earlier export (which an export replaces)."""
    out_dir = Path(out_dir)
    if out_dir.exists() and not (out_dir / CONFIG_FILE).is_file() and (not out_dir.is_dir() or any(out_dir.iterdir())):
        raise FileExistsError(f"{out_dir}: exists and is not an export (no {CONFIG_FILE}); choose a new folder "
                              f"(an earlier export there is replaced)")


def _staging_dir(out_dir: Path) -> Path:
    """An empty folder beside `out_dir` to write the export into."""
    check_out_dir(out_dir)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    staging = out_dir.with_name(f".{out_dir.name}.writing")
    shutil.rmtree(staging, ignore_errors=True)   # a leftover of an interrupted export
    staging.mkdir()
    return staging


def load_export(out_dir: Path, device: str = "cpu"):
    """(model, preprocess, tokenizer) of an export, through open_clip's own `local-dir:` loader: what a user of
    the export gets (verify_export compares it with the weights written), so not through create_clip."""
    folder = Path(out_dir).resolve()
    model, _, preprocess = create_from_export(folder, open_clip.create_model_and_transforms, device=device)
    return model.eval(), preprocess, open_clip.get_tokenizer(f"{LOCAL_DIR}{folder}")


def verify_export(out_dir: Path, state_dict: dict, prog: str) -> int:
    """Reload the export through open_clip and compare it with `state_dict`; prints the verdict (errors as
    `prog: error: ...`) and returns the exit code, 0 or 1."""
    reloaded, _, _ = load_export(out_dir)
    if not export_state_equal(reloaded, state_dict):
        print(f"{prog}: error: the export reloaded through open_clip differs", file=sys.stderr)
        return 1
    print("verified: open_clip reloads the export with identical weights")
    return 0


def export_state_equal(model: torch.nn.Module, state_dict: dict) -> bool:
    """True when `model` holds exactly `state_dict` (logit_scale compared by value, any shape)."""
    own = model.state_dict()
    return set(own) == set(state_dict) and all(
        torch.equal(own[k].float().reshape(-1), state_dict[k].float().reshape(-1)) for k in own)
