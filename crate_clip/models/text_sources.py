"""Where a pretrained text tower (`model.text_pretrained`) comes from, and copying it into a model.

Sources: a weights file (open_clip / DeepSpeed-consolidated state dict, plain or under `state_dict`,
.pt/.pth/.bin/.safetensors, or a released crate_alpha_CLIPA_*.pth in the official layout), a DeepSpeed checkpoint
folder (any ZeRO stage, consolidated), `local-dir:DIR` (an open_clip export, e.g. ours), `hf-hub:ORG/REPO` or `MODEL:TAG` as open_clip.list_pretrained(as_str=True) names it
(e.g. `ViT-H-14-CLIPA:datacomp1b`), both resolved by open_clip's own pretrained machinery (a download when a hub
is reachable, else its cache). The string is read by weights_source.parse_weights_source, as every weights source
is. Every error names the config key, the source and the fix.
"""
from __future__ import annotations

from pathlib import Path
from typing import Optional

import open_clip
from torch import nn

from crate_clip.core.errors import ConfigError
from crate_clip.models.checkpoint_errors import CheckpointMismatchError
from crate_clip.models.clip_factory import read_state_dict
from crate_clip.models.clipa_import import load_text_tower
from crate_clip.models.open_clip_text_tower import kind_of_model, kind_of_state
from crate_clip.models.export_files import WEIGHTS_FILES as EXPORT_WEIGHTS
from crate_clip.models.weights_source import (CHECKPOINT, FILE, HF_HUB_KIND, LOCAL_DIR_KIND, OPEN_CLIP,
                                              WeightsSource, parse_weights_source)

KEY = "model.text_pretrained"


class TextTowerError(ConfigError):
    """A text checkpoint that cannot be used; the message names the config key, the file and the fix."""


def check_text_source(spec: str, key: str = KEY) -> Optional[str]:
    """Error text for a source that is malformed or unknown (no file is opened, nothing is fetched)."""
    return _source_problem(parse_weights_source(spec), key)


def _source_problem(source: WeightsSource, key: str) -> Optional[str]:
    if source.kind in (LOCAL_DIR_KIND, HF_HUB_KIND):
        return None if source.after_prefix else f"{key}: {source.spec!r} names nothing after the prefix"
    if source.kind == OPEN_CLIP and not open_clip.is_pretrained_cfg(source.name, source.tag):
        model, name = source.name, source.tag
        known = open_clip.list_pretrained_tags_by_model(model)
        return (f"{key}: {source.spec!r}: open_clip has no pretrained tag {name!r} for {model!r}; fix: one of "
                f"{[f'{model}:{t}' for t in known]}, a weights file, local-dir:DIR or hf-hub:ORG/REPO")
    return None


def resolve_text_source(spec: str, key: str = KEY, cache_dir: Optional[str] = None) -> Path:
    """The local weights file `spec` names (a hub tag is fetched by open_clip, or found in its cache)."""
    source = parse_weights_source(spec)
    error = _source_problem(source, key)
    if error:
        raise TextTowerError(error)
    if source.kind == LOCAL_DIR_KIND:
        folder = source.path
        for name in EXPORT_WEIGHTS:
            if (folder / name).is_file():
                return folder / name
        raise TextTowerError(f"{key}: {spec!r}: no {' or '.join(EXPORT_WEIGHTS)} in {folder}; fix: point it at an "
                             "open_clip export folder (crate-clip's run_dir/export, or open_clip's save format)")
    if source.kind in (OPEN_CLIP, HF_HUB_KIND):
        cfg = (open_clip.get_pretrained_cfg(source.name, source.tag) if source.kind == OPEN_CLIP
               else {"hf_hub": source.name.rstrip("/") + "/"})
        try:
            path = open_clip.download_pretrained(cfg, cache_dir=cache_dir)
        except Exception as exc:  # offline without a cached copy, unknown repo, no huggingface_hub, ...
            raise TextTowerError(
                f"{key}: {spec!r} could not be fetched through open_clip ({type(exc).__name__}: {exc}); fix: "
                "run where the hub is reachable once (the file is cached), or download the checkpoint and "
                "give its path") from exc
        if not path:
            raise TextTowerError(f"{key}: {spec!r}: open_clip knows no file for it; fix: give a weights file")
        return Path(path)
    if source.kind not in (FILE, CHECKPOINT):
        raise TextTowerError(f"{key}: {spec!r} is not a file, local-dir:DIR, hf-hub:ORG/REPO, an open_clip "
                             "MODEL:TAG (open_clip.list_pretrained(as_str=True)) or a DeepSpeed checkpoint folder; "
                             "fix: correct the path")
    return source.path


def read_text_source(spec: str, key: str = KEY) -> tuple[dict, str]:
    """(state dict, where it came from) for a `model.text_pretrained` value."""
    path = resolve_text_source(spec, key)
    try:
        return read_state_dict(path), str(path)
    except Exception as exc:
        raise TextTowerError(f"{key}: cannot read {path}: {exc}") from exc


def load_pretrained_text_tower(model: nn.Module, source: dict, *, where: str = "the text checkpoint", key: str = KEY,
                               logit_scale: bool = True) -> list[str]:
    """Copy the text tower (and, when `logit_scale` and present, the logit scale) of the state dict `source`
    into `model`, exactly (no resize; load_text_tower does it); returns the keys copied. Missing keys or other
    shapes raise TextTowerError naming them, the config key and the fix."""
    try:
        return load_text_tower(model, source, include_logit_scale=logit_scale, where=where)
    except CheckpointMismatchError as exc:
        fix = ("make model.name's text_cfg (width, layers, heads, vocab_size, context_length, embed_dim) and every "
               "stage's context_length match the checkpoint" if "shape" in str(exc) else
               _tower_kind_fix(model, source) or "give a CLIP checkpoint whose text tower matches model.name's text_cfg")
        raise TextTowerError(f"{key}: {exc}; fix: {fix}") from None


def _tower_kind_fix(model: nn.Module, source: dict) -> Optional[str]:
    """The fix when the model's text tower and the checkpoint's are of different kinds (open_clip_text_tower.py's
    registry: CRATE-alpha, open_clip's transformer, ...), None when they are of the same kind."""
    ours, theirs = kind_of_model(model), kind_of_state(source)
    if ours == theirs:
        return None
    return (f"model.name has a {ours.label} text tower and the checkpoint a {theirs.label} one{theirs.note}: give "
            f"{ours.checkpoint_hint}, or {theirs.model_hint}")
