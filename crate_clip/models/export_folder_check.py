"""An export folder (open_clip's `local-dir:` layout) checked before anything is built from it: its files regular
files (a FIFO blocks its reader, weights linked to /dev/zero read zeros without end), links that leave the folder
named, the image preprocessing it records finite, and an image tower named by another registered timm architecture
no larger than its weights (parameters counted on PyTorch's meta device: no memory, no initialisation).

model_cfg_check bounds every size a config spells out and the CRATE-alpha tower names; a timm tower of any other
architecture (`vit_gigantic_patch14_clip_224`) carries its sizes in its name, so its bound comes from the weights
beside it: a tower with more parameters than the weights file holds values cannot be the one they were saved from.
"""
from __future__ import annotations

import json
import math
import os
import struct
import sys
from pathlib import Path
from typing import Optional

import open_clip.factory as open_clip_factory
import timm
import torch

from crate_clip.core.file_kinds import special_file
from crate_clip.models.clip_tower_names import tower_arch
from crate_clip.models.export_files import WEIGHTS_FILES
from crate_clip.models.model_cfg_check import ModelConfigError

MAX_SAFETENSORS_HEADER = 100 << 20   # the safetensors library's own bound on the JSON header


class ExportFolderError(ModelConfigError):
    """An export folder whose files crate-clip will not read; the message names the file and what it is."""


def regular_file(path: Path, what: str) -> Path:
    """`path` itself when it is a regular file (links followed); ExportFolderError saying what it is otherwise: a
    FIFO, a device, a link to nothing."""
    kind = special_file(path)
    if kind is None and os.path.islink(path) and not os.path.exists(path):
        kind = f"a link to {os.readlink(path)}, which does not exist"
    if kind:
        raise ExportFolderError(f"{path}: {kind}, not {what}; fix: put the file itself there (or a link to it)")
    return path


def note_links_leaving(folder: Path, paths) -> None:
    """A line on stderr for each file of `folder` that is a link to a file outside it: what is loaded is then not
    what the folder holds (a HuggingFace cache's snapshot links to its blobs this way)."""
    root = os.path.realpath(folder)
    for path in paths:
        target = os.path.realpath(path)
        if os.path.islink(path) and os.path.commonpath([root, target]) != root:
            print(f"note: {path} is a link to {target}, outside the export folder {folder}", file=sys.stderr)


def export_weights_file(folder: Path) -> Path:
    """The weights file open_clip loads from export `folder` (its own choice among the files there), checked to be
    a regular file; FileNotFoundError naming the folder when there is none."""
    found = open_clip_factory._find_checkpoint_in_dir(folder)   # a glob: it takes FIFOs and dangling links too
    if found is None:
        raise FileNotFoundError(f"{folder}: no {' / '.join(WEIGHTS_FILES)} weights")
    return regular_file(Path(found), "a weights file")


def stored_values(weights: Path) -> int:
    """How many values weights file `weights` holds at most: a safetensors file's from its header (the sizes of
    its tensors, nothing else read), another file's from its size (every value takes at least one byte)."""
    size = weights.stat().st_size
    if weights.suffix != ".safetensors":
        return size
    with open(weights, "rb") as f:
        head = f.read(8)
        length = struct.unpack("<Q", head)[0] if len(head) == 8 else -1
        if not 0 < length <= min(MAX_SAFETENSORS_HEADER, size - 8):
            raise ExportFolderError(f"{weights}: not a safetensors file (its header length is {length:,})")
        try:
            header = json.loads(f.read(length))
            return sum(math.prod(entry["shape"]) for name, entry in header.items() if name != "__metadata__")
        except (ValueError, TypeError, KeyError, AttributeError) as exc:
            raise ExportFolderError(f"{weights}: not a safetensors file ({type(exc).__name__} in its "
                                    "header)") from None


def timm_tower_parameters(model_cfg: dict) -> Optional[tuple[str, int]]:
    """(name, parameters) of the image tower when the config names a timm architecture other than CRATE /
    CRATE-alpha (whose sizes model_cfg_check bounds); counted on the meta device. None for other towers."""
    name = ((model_cfg or {}).get("vision_cfg") or {}).get("timm_model_name")
    if not isinstance(name, str) or tower_arch(name) is not None:
        return None
    if not timm.is_model(name):
        raise ModelConfigError(f"vision_cfg.timm_model_name {name!r} is no registered timm architecture")
    try:
        with torch.device("meta"):   # shapes only: a 1.8-billion-parameter tower in a fraction of a second
            tower = timm.create_model(name, pretrained=False, num_classes=0)
    except Exception as exc:   # noqa: BLE001 - whatever timm raises, the config cannot be built
        raise ModelConfigError(f"vision_cfg.timm_model_name {name!r}: timm cannot build it "
                               f"({type(exc).__name__}: {' '.join(str(exc).split())[:160]})") from None
    return name, sum(p.numel() for p in tower.parameters())


def check_tower_fits_weights(model_cfg: dict, weights: Path, config_path: Path) -> None:
    """ExportFolderError when the config's timm image tower has more parameters than `weights` holds values."""
    try:
        counted = timm_tower_parameters(model_cfg)
    except ModelConfigError as exc:
        raise ExportFolderError(f"{config_path}: not a model config crate-clip builds: {exc}") from None
    if counted is None:
        return
    name, parameters = counted
    values = stored_values(weights)
    if parameters > values:
        raise ExportFolderError(f"{config_path}: its image tower {name} has {parameters:,} parameters, more than "
                                f"the {values:,} values of {weights.name}: not the config of these weights; fix: "
                                "the export's own config")
