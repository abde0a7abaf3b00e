"""On-disk cache of zero-shot text classifiers, keyed by text-tower weights, templates and class names."""
import hashlib
import json
import os
from pathlib import Path

import torch

from eval.class_sets import template_text
from eval.distributed_batches import gather_objects
from eval.model_calls import unwrap_model

CACHE_VERSION = 1


def _tensor_bytes(t: torch.Tensor) -> bytes:
    return t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def text_weights_digest(model: torch.nn.Module) -> str:
    """sha256 of every weight except the image tower's; ZeRO-3 partitions are hashed per rank and combined."""
    digest = hashlib.sha256()
    for name, tensor in list(unwrap_model(model).named_parameters()) + list(unwrap_model(model).named_buffers()):
        if name.startswith("visual."):
            continue   # the text classifier does not depend on the image tower
        local = getattr(tensor, "ds_tensor", None)   # ZeRO-3: this rank's partition only
        digest.update(f"{name}:{tuple(getattr(tensor, 'ds_shape', tensor.shape))}:{tensor.dtype};".encode())
        digest.update(_tensor_bytes(local if local is not None else tensor))
    return hashlib.sha256("".join(gather_objects(digest.hexdigest())).encode()).hexdigest()


def classifier_key(model, tokenizer, classnames, templates, precision: str) -> str:
    """Cache key: text weights + the exact prompts (templates applied to the first class) + names + settings."""
    prompts = [template_text(t, "{}") for t in templates]   # callables and strings both rendered
    context = getattr(tokenizer, "context_length", None)
    meta = json.dumps({"v": CACHE_VERSION, "prompts": prompts, "classnames": list(classnames),
                       "precision": precision, "context_length": context,
                       "tokenizer": type(tokenizer).__name__}, sort_keys=True)
    return hashlib.sha256((text_weights_digest(model) + meta).encode()).hexdigest()


def cache_path(cache_dir: str | Path, key: str) -> Path:
    """File holding the classifier for `key`."""
    return Path(cache_dir) / f"zeroshot_classifier_{key[:40]}.pt"


def load_cached(path: Path, num_classes: int) -> torch.Tensor | None:
    """The cached [embed_dim, num_classes] classifier, or None when absent or unusable."""
    if not path.is_file():
        return None
    try:
        weights = torch.load(path, map_location="cpu", weights_only=True)["weights"]
    except Exception:   # a truncated or foreign file is a cache miss, rebuilt and overwritten
        return None
    return weights if weights.ndim == 2 and weights.shape[1] == num_classes else None


def save_cached(path: Path, weights: torch.Tensor) -> None:
    """Write atomically (temp file + rename) so a concurrent reader never sees half a file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".tmp{os.getpid()}")
    torch.save({"weights": weights.detach().cpu().float()}, tmp)
    os.replace(tmp, path)
