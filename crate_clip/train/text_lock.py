"""A pretrained, frozen text tower (and logit scale) for training: where its weights come from, and the lock.

The paper's CRATE-alpha-CLIPA trains only the image tower: the text tower and the temperature are copied
from a CLIPA checkpoint and stay fixed. Locking here turns the text tower's parameters (and the logit
scale's) into persistent fp32 *buffers* of the same names, because of what DeepSpeed 0.19.8 does with a
`requires_grad=False` parameter (runtime/zero/parameter_offload.py `_convert_to_zero_parameters`, engine.py
`_cast_module_mixed_precision`): under ZeRO-3 it partitions every module parameter, trainable or not, and
all-gathers the frozen tower at every forward; under bf16/fp16 it casts every parameter, so the exported
text weights would come back rounded. Buffers are never partitioned, keep their dtype, are saved in the
model-states file of every checkpoint and come back from zero_to_fp32 under their names: the frozen
tower is replicated, exact, and travels into checkpoints, the next stage and the open_clip export.

Sources (`model.text_pretrained`): a weights file (open_clip / DeepSpeed-consolidated state dict, plain or
under `state_dict`, .pt/.pth/.bin/.safetensors, or a released crate_alpha_CLIPA_*.pth in the official layout), a DeepSpeed
checkpoint folder (any ZeRO stage, consolidated), `local-dir:DIR` (an open_clip export, e.g. ours),
`hf-hub:ORG/REPO` or `MODEL:TAG` as open_clip.list_pretrained(as_str=True) names it (e.g.
`ViT-H-14-CLIPA:datacomp1b`), both resolved by open_clip's own pretrained machinery (a download when a hub
is reachable, else its cache).
"""
from __future__ import annotations

import contextlib
import types
from pathlib import Path
from typing import Optional

import torch
from torch import nn

from crate_clip.checkpoint_io.deepspeed_checkpoints import is_deepspeed_checkpoint
from crate_clip.models.checkpoint_errors import CheckpointMismatchError
from crate_clip.models.clip_factory import read_state_dict
from crate_clip.models.clipa_import import LOGIT_KEYS as SCALE_KEYS
from crate_clip.models.clipa_import import is_text_key  # noqa: F401  (re-exported: the lock's notion of "text")
from crate_clip.models.clipa_import import load_text_tower as _load_text_tower
from crate_clip.models.clipa_import import text_tower_keys as _text_tower_keys
from crate_clip.train.run_config import ConfigError

KEY = "model.text_pretrained"
LOCAL_DIR = "local-dir:"
HF_HUB = "hf-hub:"
EXPORT_WEIGHTS = ("open_clip_model.safetensors", "open_clip_pytorch_model.bin")


class TextTowerError(ConfigError):
    """A text checkpoint that cannot be used; the message names the config key, the file and the fix."""


# ---------------------------------------------------------------- which keys are the text tower
def text_tower_keys(model: nn.Module) -> list[str]:
    """The model's state-dict keys that form its text tower (CLIP: token_embedding, positional_embedding,
    transformer.*, ln_final, text_projection; CustomTextCLIP: text.*)."""
    return _text_tower_keys(model, include_logit_scale=False)


# ---------------------------------------------------------------- where the weights come from
def _pretrained_tag(spec: str) -> Optional[tuple[str, str]]:
    """(model, tag) when `spec` is one of open_clip's `MODEL:TAG` names, else None."""
    import open_clip

    if ":" not in spec or spec.startswith((LOCAL_DIR, HF_HUB)):
        return None
    model, tag = spec.split(":", 1)
    known = model in open_clip.list_models() or bool(open_clip.list_pretrained_tags_by_model(model))
    return (model, tag) if known else None


def check_text_source(spec: str, key: str = KEY) -> Optional[str]:
    """Error text for a source that is malformed or unknown (no file is opened, nothing is fetched)."""
    import open_clip

    if spec.startswith(LOCAL_DIR) or spec.startswith(HF_HUB):
        return None if spec.split(":", 1)[1] else f"{key}: {spec!r} names nothing after the prefix"
    tag = _pretrained_tag(spec)
    if tag is not None:
        model, name = tag
        if not open_clip.is_pretrained_cfg(model, name):
            known = open_clip.list_pretrained_tags_by_model(model)
            return (f"{key}: {spec!r}: open_clip has no pretrained tag {name!r} for {model!r}; fix: one of "
                    f"{[f'{model}:{t}' for t in known]}, a weights file, local-dir:DIR or hf-hub:ORG/REPO")
    return None


def resolve_text_source(spec: str, key: str = KEY, cache_dir: Optional[str] = None) -> Path:
    """The local weights file `spec` names (a hub tag is fetched by open_clip, or found in its cache)."""
    import open_clip

    error = check_text_source(spec, key)
    if error:
        raise TextTowerError(error)
    if spec.startswith(LOCAL_DIR):
        folder = Path(spec[len(LOCAL_DIR):]).expanduser()
        for name in EXPORT_WEIGHTS:
            if (folder / name).is_file():
                return folder / name
        raise TextTowerError(f"{key}: {spec!r}: no {' or '.join(EXPORT_WEIGHTS)} in {folder}; fix: point it at an "
                             "open_clip export folder (crate-clip's run_dir/export, or open_clip's save format)")
    tag = _pretrained_tag(spec)
    if tag is not None or spec.startswith(HF_HUB):
        cfg = (open_clip.get_pretrained_cfg(*tag) if tag is not None
               else {"hf_hub": spec[len(HF_HUB):].rstrip("/") + "/"})
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
    path = Path(spec).expanduser()
    if not (path.is_file() or is_deepspeed_checkpoint(path)):
        raise TextTowerError(f"{key}: {spec!r} is not a file, local-dir:DIR, hf-hub:ORG/REPO, an open_clip "
                             "MODEL:TAG (open_clip.list_pretrained(as_str=True)) or a DeepSpeed checkpoint folder; "
                             "fix: correct the path")
    return path


def read_text_source(spec: str, key: str = KEY) -> tuple[dict, str]:
    """(state dict, where it came from) for a `model.text_pretrained` value."""
    path = resolve_text_source(spec, key)
    try:
        return read_state_dict(path), str(path)
    except Exception as exc:
        raise TextTowerError(f"{key}: cannot read {path}: {exc}") from exc


# ---------------------------------------------------------------- loading
def load_text_tower(model: nn.Module, source: dict, *, where: str = "the text checkpoint", key: str = KEY,
                    logit_scale: bool = True) -> list[str]:
    """Copy the text tower (and, when `logit_scale` and present, the logit scale) of the state dict `source`
    into `model`, exactly (no resize; crate_clip.models.load_text_tower does it); returns the keys copied.
    Missing keys or other shapes raise TextTowerError naming them, the config key and the fix."""
    try:
        return _load_text_tower(model, source, include_logit_scale=logit_scale, where=where)
    except CheckpointMismatchError as exc:
        fix = ("make model.name's text_cfg (width, layers, heads, vocab_size, context_length, embed_dim) and every "
               "stage's context_length match the checkpoint" if "shape" in str(exc) else
               "give a CLIP checkpoint whose text tower matches model.name's text_cfg")
        raise TextTowerError(f"{key}: {exc}; fix: {fix}") from None


def text_context_length(source: dict) -> Optional[int]:
    """Positions of the text tower in a state dict (its positional_embedding rows)."""
    for k in ("positional_embedding", "text.positional_embedding"):
        if k in source:
            return int(source[k].shape[0])
    return None


# ---------------------------------------------------------------- the lock
def _to_buffer(model: nn.Module, name: str) -> None:
    """Re-register parameter `name` as a persistent buffer of the same name, dtype and value."""
    owner_name, _, attr = name.rpartition(".")
    owner = model.get_submodule(owner_name) if owner_name else model
    param = owner._parameters.pop(attr)
    value = param.detach()
    if name in SCALE_KEYS and value.ndim == 0:
        value = value.reshape(1)  # as prepare_model_for_deepspeed stores the trainable one
    owner.register_buffer(attr, value.clone(), persistent=True)


def _frozen_encode_text(self, text, normalize: bool = False):
    """encode_text of a locked tower: no autograd graph; matmuls in the training dtype (weights stay fp32)."""
    dtype = getattr(self, "frozen_text_compute_dtype", None)
    cast = (torch.autocast(text.device.type, dtype=dtype) if dtype is not None and dtype != torch.float32
            else contextlib.nullcontext())
    with torch.no_grad(), cast:
        return type(self).encode_text(self, text, normalize=normalize)


def lock_text_tower(model: nn.Module, *, lock_text: bool = True, lock_logit_scale: bool = False,
                    compute_dtype: Optional[torch.dtype] = None) -> list[str]:
    """Freeze the text tower and/or the logit scale: their parameters become persistent buffers (no
    gradient, no optimizer state, not ZeRO-partitioned, not cast by DeepSpeed, still saved) and the text
    forward runs under torch.no_grad (autocast to `compute_dtype`). Returns the names frozen."""
    names = []
    for name, _ in list(model.named_parameters()):
        if (lock_text and is_text_key(name)) or (lock_logit_scale and name in SCALE_KEYS):
            names.append(name)
    for name in names:
        _to_buffer(model, name)
    if lock_text:
        visual = {id(m) for m in getattr(model, "visual", nn.Identity()).modules()}
        for module in model.modules():  # a no-grad forward has nothing to recompute
            if id(module) not in visual and hasattr(module, "grad_checkpointing"):
                module.grad_checkpointing = False
        model.frozen_text_compute_dtype = compute_dtype
        model.encode_text = types.MethodType(_frozen_encode_text, model)
    return names


def frozen_names(model: nn.Module) -> list[str]:
    """Buffers that a lock made out of parameters (text tower / logit scale), by state-dict name."""
    locked = getattr(model, "encode_text", None)
    text = isinstance(locked, types.MethodType) and locked.__func__ is _frozen_encode_text
    params = {k for k, _ in model.named_parameters()}
    return [k for k in model.state_dict() if k not in params and ((text and is_text_key(k)) or k in SCALE_KEYS)]


def apply_text_config(model: nn.Module, *, text_pretrained: Optional[str], lock_text: bool, lock_logit_scale: bool,
                      compute_dtype: Optional[torch.dtype], load: bool = True) -> list[str]:
    """The run config's text-tower settings on a fresh stage model: copy the pretrained text tower and logit
    scale (when `load`; a resumed or carried-over model already holds them), then lock; returns the frozen names."""
    if load and text_pretrained:
        source, path = read_text_source(text_pretrained)
        load_text_tower(model, source, where=path)
    if not (lock_text or lock_logit_scale):
        return []
    return lock_text_tower(model, lock_text=lock_text, lock_logit_scale=lock_logit_scale, compute_dtype=compute_dtype)
