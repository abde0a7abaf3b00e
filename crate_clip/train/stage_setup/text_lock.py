"""A pretrained, frozen text tower (and logit scale) for training: the lock.

The paper's CRATE-alpha-CLIPA trains only the image tower: the text tower and the temperature are copied
from a CLIPA checkpoint (crate_clip/models/text_sources.py reads it) and stay fixed. Locking here turns the
text tower's parameters (and the logit scale's) into persistent fp32 *buffers* of the same names, because of
what DeepSpeed 0.19.8 does with a `requires_grad=False` parameter (runtime/zero/parameter_offload.py
`_convert_to_zero_parameters`, engine.py `_cast_module_mixed_precision`): under ZeRO-3 it partitions every
module parameter, trainable or not, and all-gathers the frozen tower at every forward; under bf16/fp16 it
casts every parameter, so the exported text weights would come back rounded. Buffers are never partitioned,
keep their dtype, are saved in the model-states file of every checkpoint and come back from zero_to_fp32
under their names: the frozen tower is replicated, exact, and travels into checkpoints, the next stage and
the open_clip export.
"""
from __future__ import annotations

import contextlib
import types
from typing import Optional

import torch
from torch import nn

from crate_clip.models.clipa_import import LOGIT_KEYS as SCALE_KEYS
from crate_clip.models.clipa_import import is_text_key
from crate_clip.models.text_sources import load_pretrained_text_tower, read_text_source


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
    # the meta device (FLOP counting) has no autocast, and its shapes do not depend on the dtype
    cast = (torch.autocast(text.device.type, dtype=dtype) if dtype not in (None, torch.float32)
            and text.device.type != "meta" else contextlib.nullcontext())
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
        load_pretrained_text_tower(model, source, where=path)
    if not (lock_text or lock_logit_scale):
        return []
    return lock_text_tower(model, lock_text=lock_text, lock_logit_scale=lock_logit_scale, compute_dtype=compute_dtype)
