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
under `state_dict`, .pt/.pth/.bin/.safetensors, or a released crate_alpha_CLIPA_*.pth in the official layout), `local-dir:DIR` (an open_clip export, e.g. ours),
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

from crate_clip.models.clip_factory import read_state_dict, strip_module_prefix
from crate_clip.models.official_clipa import is_official_clipa_layout, official_clipa_to_open_clip
from crate_clip.train.run_config import ConfigError

KEY = "model.text_pretrained"
NOT_TEXT_PREFIXES = ("visual.",)
SCALE_KEYS = ("logit_scale", "logit_bias")
TEXT_SUBMODULE = "text."  # open_clip's CustomTextCLIP keeps its text tower under `text`
LOCAL_DIR = "local-dir:"
HF_HUB = "hf-hub:"
EXPORT_WEIGHTS = ("open_clip_model.safetensors", "open_clip_pytorch_model.bin")


class TextTowerError(ConfigError):
    """A text checkpoint that cannot be used; the message names the config key, the file and the fix."""


# ---------------------------------------------------------------- which keys are the text tower
def is_text_key(name: str) -> bool:
    """True for a CLIP / CustomTextCLIP state-dict key of the text tower (not visual.*, not the scale)."""
    return not name.startswith(NOT_TEXT_PREFIXES) and name not in SCALE_KEYS


def text_tower_keys(model: nn.Module) -> list[str]:
    """The model's state-dict keys that form its text tower (CLIP: token_embedding, positional_embedding,
    transformer.*, ln_final, text_projection; CustomTextCLIP: text.*)."""
    return [k for k in model.state_dict() if is_text_key(k)]


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
    if not path.is_file():
        raise TextTowerError(f"{key}: {spec!r} is not a file, local-dir:DIR, hf-hub:ORG/REPO or an open_clip "
                             "MODEL:TAG (open_clip.list_pretrained(as_str=True)); fix: correct the path")
    return path


def read_text_source(spec: str, key: str = KEY) -> tuple[dict, str]:
    """(state dict, where it came from) for a `model.text_pretrained` value."""
    path = resolve_text_source(spec, key)
    try:
        return read_state_dict(path), str(path)
    except Exception as exc:
        raise TextTowerError(f"{key}: cannot read {path}: {exc}") from exc


# ---------------------------------------------------------------- loading
def _source_key(key: str, source: dict) -> Optional[str]:
    """The source's name for our key: the same, or moved in/out of CustomTextCLIP's `text.` submodule."""
    if key in source:
        return key
    other = key[len(TEXT_SUBMODULE):] if key.startswith(TEXT_SUBMODULE) else TEXT_SUBMODULE + key
    return other if other in source else None


def load_text_tower(model: nn.Module, source: dict, *, where: str = "the text checkpoint", key: str = KEY,
                    logit_scale: bool = True) -> list[str]:
    """Copy the text tower (and, when `logit_scale` and present, the logit scale) of the state dict `source`
    into `model`, exactly (no resize); returns the keys copied. Missing keys or other shapes raise
    TextTowerError naming them."""
    source = strip_module_prefix(dict(source))
    if is_official_clipa_layout(source):  # a released crate_alpha_CLIPA_*.pth: its text_projection is transposed
        source = official_clipa_to_open_clip({k: v for k, v in source.items() if not k.startswith("visual.")})
    own = model.state_dict()
    names = text_tower_keys(model)
    found = {k: _source_key(k, source) for k in names}
    missing = sorted(k for k, s in found.items() if s is None)
    if missing:
        more = f" ... and {len(missing) - 12} more" if len(missing) > 12 else ""
        raise TextTowerError(f"{key}: {where} lacks the text-tower keys [{', '.join(missing[:12])}{more}] of "
                             f"the model; fix: give a CLIP checkpoint whose text tower matches model.name's text_cfg")
    bad = {k: (tuple(source[s].shape), tuple(own[k].shape)) for k, s in found.items()
           if tuple(source[s].shape) != tuple(own[k].shape)}
    if bad:
        listed = ", ".join(f"{k} {a} vs {b}" for k, (a, b) in sorted(bad.items())[:12])
        raise TextTowerError(f"{key}: {where} has another text-tower shape (checkpoint vs model): {listed}; fix: "
                             "make model.name's text_cfg (width, layers, heads, vocab_size, context_length, "
                             "embed_dim) and every stage's context_length match the checkpoint")
    if logit_scale:
        for name in SCALE_KEYS:
            if name in source and name in own:
                found[name] = name
    with torch.no_grad():
        params = dict(model.named_parameters())
        params.update(dict(model.named_buffers()))
        for k, s in found.items():
            params[k].copy_(source[s].reshape(params[k].shape).to(params[k].dtype))
    return list(found)


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
