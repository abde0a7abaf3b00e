"""An export folder (open_clip's `local-dir:` layout) checked before anything is built from it: its files regular
files (a FIFO blocks its reader, weights linked to /dev/zero read zeros without end), links that leave the folder
named, the image preprocessing it records finite, its weights file's header held to the file's size, and the model
it names no larger than its weights (parameters counted on PyTorch's meta device: no memory, no initialisation).

model_cfg_check bounds every size a config spells out and the CRATE-alpha tower names; a timm tower of any other
architecture (`vit_gigantic_patch14_clip_224`) carries its sizes in its name, so its bound comes from the weights
beside it: a tower with more parameters than the weights file holds values cannot be the one they were saved from.
The same holds for the whole model within those bounds (a 303M-parameter CRATE-alpha tower beside a 1 MB file), and
the values a file holds are its header's claims checked against its size (crate_clip.checkpoint_io.weights_headers:
a header claiming 2e9 values in a small file is refused before anything is built).
"""
from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Optional

import open_clip
import open_clip.factory as open_clip_factory
import timm
import torch

from crate_clip.checkpoint_io.weights_headers import stored_values
from crate_clip.core.file_kinds import special_file
from crate_clip.models.clip_tower_names import tower_arch
from crate_clip.models.clip_weights import quiet_random_init
from crate_clip.models.export_files import WEIGHTS_FILES
from crate_clip.models.model_cfg_check import ModelConfigError


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


def check_model_fits_weights(folder: Path, weights: Path, config_path: Path) -> None:
    """ExportFolderError when the model export `folder` names has more parameters than `weights` holds values:
    counted on the meta device (no memory; 0.4 s for a 2.5-billion-parameter CLIP), the header checked first."""
    values = stored_values(weights)   # WeightsHeaderError: a header claiming more than the file holds
    with quiet_random_init(), torch.device("meta"):   # built there from the start: open_clip's device= moves after
        model = open_clip.create_model(f"local-dir:{folder}", load_weights=False, device="meta")
    parameters = sum(p.numel() for p in model.parameters())
    if parameters > values:
        raise ExportFolderError(f"{config_path}: its model has {parameters:,} parameters, more than the {values:,} "
                                f"values of {weights.name}: not the config of these weights; fix: the export's own "
                                "config")
