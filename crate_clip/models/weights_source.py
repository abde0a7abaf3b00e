"""What a weights-source string names: the one parser behind `create_clip(pretrained=...)` (model.pretrained,
conversion, the benchmarks), `model.text_pretrained` (text_sources.py) and eval's / inspect's --model and
--pretrained (eval/model_loading.py). It reads the string and looks at the path (what kind of file or folder it
is); it opens no file and fetches nothing. Each caller then takes the kinds it supports and refuses the others
with its own one-line message, as before:

    kind        the string                                create_clip   text_pretrained   eval
    FILE        a weights file                            yes           yes               --pretrained (1)
    CHECKPOINT  a DeepSpeed checkpoint folder (a `latest` yes           yes               --model or --pretrained
                file, or one tag folder)
    EXPORT      an export folder (open_clip_config.json)  yes           -                 - (2)
    LOCAL_DIR   local-dir:FOLDER (an export)              as the model  yes               --model
    HF_HUB      hf-hub:ORG/REPO                           -             yes               --model (open_clip's)
    OPEN_CLIP   MODEL:TAG open_clip knows a model of      -             yes               -
    NAME        anything else: an open_clip model name,   read as a     refused           --model (checked)
                or a path that is not there (or a FIFO)   path
    (1) as --model: refused, naming the fix; (2) refused, naming the fix (--model local-dir:FOLDER)

The order decides a string two kinds could read: local-dir: and hf-hub: first (a prefix), then an existing path
(a checkpoint before an export: a folder with DeepSpeed's files is read as one), then open_clip's MODEL:TAG.

Where the three parsers this replaces disagreed, and what is chosen here:
  - `~` was expanded by text_pretrained and by eval's model-name check, not by create_clip or eval's checkpoint
    test: every path here is expanded (a run config's paths are made absolute before, run_config.py).
  - text_pretrained read `MODEL:TAG` before looking at the disk, the others looked only at the disk: an existing
    path wins here (a file the user has is what is meant); the prefixes were read first by all three.
  - kept apart: create_clip's pretrained (model.pretrained) reads no hub or open_clip tag and no local-dir: (the
    run config checks it as a path), text_pretrained no bare export folder; each still refuses what it refused,
    in its own words: taking more there would be a new feature, not one reading.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from crate_clip.checkpoint_io.checkpoint_choice import is_deepspeed_checkpoint
from crate_clip.models.export_files import CONFIG_FILE, LOCAL_DIR

HF_HUB = "hf-hub:"
FILE, CHECKPOINT, EXPORT, LOCAL_DIR_KIND, HF_HUB_KIND, OPEN_CLIP, NAME = (
    "file", "checkpoint folder", "export folder", "local-dir", "hf-hub", "open_clip name:tag", "name")


@dataclass(frozen=True)
class WeightsSource:
    """One weights-source string, read."""
    spec: str                     # as given
    kind: str                     # FILE, CHECKPOINT, EXPORT, LOCAL_DIR_KIND, HF_HUB_KIND, OPEN_CLIP, NAME
    path: Optional[Path] = None   # FILE, CHECKPOINT, EXPORT, LOCAL_DIR_KIND (its folder), NAME (the string as a path)
    name: Optional[str] = None    # HF_HUB_KIND: ORG/REPO; OPEN_CLIP: the model (tag: `tag`); NAME: the string
    tag: Optional[str] = None     # OPEN_CLIP: the pretrained tag

    @property
    def after_prefix(self) -> str:
        """What follows `local-dir:` / `hf-hub:` ('' when nothing does)."""
        return self.spec.split(":", 1)[1] if self.kind in (LOCAL_DIR_KIND, HF_HUB_KIND) else self.spec


def parse_weights_source(spec: str | Path) -> WeightsSource:
    """The kind of weights `spec` names (the table above)."""
    spec = str(spec)
    if spec.startswith(LOCAL_DIR):
        return WeightsSource(spec, LOCAL_DIR_KIND, path=Path(spec[len(LOCAL_DIR):]).expanduser())
    if spec.startswith(HF_HUB):
        return WeightsSource(spec, HF_HUB_KIND, name=spec[len(HF_HUB):])
    path = Path(spec).expanduser()
    if is_deepspeed_checkpoint(path):
        return WeightsSource(spec, CHECKPOINT, path=path)
    if path.is_dir() and (path / CONFIG_FILE).is_file():
        return WeightsSource(spec, EXPORT, path=path)
    if path.is_file():
        return WeightsSource(spec, FILE, path=path)
    tag = open_clip_tag(spec)
    if tag is not None:
        return WeightsSource(spec, OPEN_CLIP, name=tag[0], tag=tag[1])
    return WeightsSource(spec, NAME, path=path, name=spec)


def open_clip_tag(spec: str) -> Optional[tuple[str, str]]:
    """(model, tag) when `spec` is one of open_clip's `MODEL:TAG` names (a model open_clip has a config or
    pretrained tags for), else None."""
    if ":" not in spec or spec.startswith((LOCAL_DIR, HF_HUB)):
        return None
    model, tag = spec.split(":", 1)
    import open_clip   # here, not at the top: a run config's checks parse sources without importing the model stack

    known = model in open_clip.list_models() or bool(open_clip.list_pretrained_tags_by_model(model))
    return (model, tag) if known else None
