"""Calls into a CLIP model for evaluation: root forward only, precision handling, feature extraction.

The model is always called through its ROOT forward (`model(image=x)`, `model(text=t)`), never
`encode_image`/`encode_text`: under DeepSpeed ZeRO-3 open_clip's root-level parameters
(positional_embedding, text_projection, logit_scale) are gathered only by the root module's hooks.
"""
import contextlib

import torch

PRECISIONS = ("fp32", "bf16")


def unwrap_model(model: torch.nn.Module) -> torch.nn.Module:
    """The open_clip model inside a DeepSpeed engine or DDP wrapper (the model itself otherwise)."""
    return getattr(model, "module", model)


def check_precision(precision: str) -> str:
    """Validate an evaluation precision name."""
    if precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {PRECISIONS}, got {precision!r}")
    return precision


def autocast_context(precision: str, device: str | torch.device):
    """bf16 autocast for 'bf16', nothing for 'fp32'."""
    if check_precision(precision) == "bf16":
        return torch.autocast(device_type=torch.device(device).type, dtype=torch.bfloat16)
    return contextlib.nullcontext()


def _param_dtype(model: torch.nn.Module) -> torch.dtype:
    # A DeepSpeed bf16 engine holds bf16 weights; images must then be fed as bf16 too.
    for p in model.parameters():
        if p.is_floating_point():
            return p.dtype
    return torch.float32


def _features(output, index: int, key: str) -> torch.Tensor:
    return output[key] if isinstance(output, dict) else output[index]


@torch.no_grad()
def image_features(model, images: torch.Tensor, precision: str = "fp32") -> torch.Tensor:
    """L2-normalised image features (float32) from the model's root forward."""
    images = images.to(dtype=_param_dtype(model))
    with autocast_context(precision, images.device):
        out = model(image=images)
    return _features(out, 0, "image_features").float()


@torch.no_grad()
def text_features(model, tokens: torch.Tensor, precision: str = "fp32") -> torch.Tensor:
    """L2-normalised text features (float32) from the model's root forward."""
    with autocast_context(precision, tokens.device):
        out = model(text=tokens)
    return _features(out, 1, "text_features").float()


def dummy_images(model, device) -> torch.Tensor:
    """One blank image at the model's input size: the forward input of a rank whose data has run out."""
    size = getattr(unwrap_model(model).visual, "image_size", 224)
    size = tuple(size) if isinstance(size, (tuple, list)) else (size, size)
    return torch.zeros(1, 3, *size, device=device)
