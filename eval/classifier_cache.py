"""On-disk cache of zero-shot text classifiers, keyed by what the classifier is computed from and nothing else."""
import contextlib
import hashlib
import json
from pathlib import Path

import torch

from crate_clip.checkpoint_io.atomic_files import atomic_torch_save
from crate_clip.eval.class_sets import template_text
from crate_clip.eval.model_calls import unwrap_model

CACHE_VERSION = 2   # 2: key independent of the ZeRO-3 world size and logit_scale; tokenizer by identity


def _tensor_bytes(t: torch.Tensor) -> bytes:
    return t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


# Parameters outside the image tower that do not shape the text classifier (they only scale logits).
NOT_IN_CLASSIFIER = ("logit_scale", "logit_bias")


def text_weights_digest(model: torch.nn.Module) -> str:
    """sha256 of the text-side weights (names, shapes, dtypes, values), the same on any number of ranks.

    ZeRO-3 keeps 1/world of every parameter per rank: each one is gathered whole (collectively, one at
    a time) so that a checkpoint evaluated on 8 ranks, on 1, or as a plain model has one key."""
    digest = hashlib.sha256()
    inner = unwrap_model(model)
    for name, tensor in list(inner.named_parameters()) + list(inner.named_buffers()):
        if name.startswith("visual.") or name in NOT_IN_CLASSIFIER:
            continue   # the text classifier depends on neither
        with _gathered(tensor):
            shape = tuple(tensor.shape)
            digest.update(f"{name}:{shape}:{tensor.dtype};".encode())
            digest.update(_tensor_bytes(tensor))
    return digest.hexdigest()


def _gathered(tensor: torch.Tensor):
    """Context in which a ZeRO-3 partitioned parameter holds its full value (a no-op for other tensors)."""
    if not hasattr(tensor, "ds_id"):
        return contextlib.nullcontext()
    import deepspeed
    return deepspeed.zero.GatheredParameters([tensor], modifier_rank=None)


def tokenizer_identity(tokenizer, classnames, templates) -> dict:
    """What makes a tokenizer's output: its class, vocabulary source, settings, and its tokens for these prompts.

    The tokens of every template (first class) and every class name (first template) catch any vocabulary,
    cleaning, case or truncation difference between two tokenizers of the same class."""
    kind = type(tokenizer)
    settings = {k: (v if isinstance(v, (int, float, str, bool, type(None))) else _callable_name(v))
                for k, v in sorted(vars(tokenizer).items()) if not k.startswith("_") and _is_setting(v)}
    inner = getattr(tokenizer, "tokenizer", None)
    source = getattr(inner, "name_or_path", None) or getattr(tokenizer, "vocab_path", None)
    probe = [template_text(t, classnames[0]) for t in templates] + [template_text(templates[0], c) for c in classnames]
    tokens = tokenizer(probe)
    tokens = tokens if isinstance(tokens, torch.Tensor) else torch.as_tensor(tokens)
    return {"class": f"{kind.__module__}.{kind.__qualname__}", "source": source, "settings": settings,
            "tokens": hashlib.sha256(_tensor_bytes(tokens.to(torch.int64))).hexdigest()}


def _is_setting(value) -> bool:
    # plain values and functions (clean_fn, reduction_fn); large tables (vocab dicts, caches) are covered by tokens
    return isinstance(value, (int, float, str, bool, type(None))) or callable(value)


def _callable_name(fn) -> str:
    target = getattr(fn, "func", fn)   # functools.partial
    name = f"{getattr(target, '__module__', '')}.{getattr(target, '__qualname__', type(target).__name__)}"
    return name + (repr(getattr(fn, "keywords", "")) if hasattr(fn, "func") else "")


def classifier_key(model, tokenizer, classnames, templates, precision: str) -> str:
    """Cache key: text weights, prompts, class names, tokenizer identity and settings, precision, context length."""
    classnames = list(classnames)
    prompts = [template_text(t, "{}") for t in templates]   # callables and strings both rendered
    context = getattr(tokenizer, "context_length", None)
    meta = json.dumps({"v": CACHE_VERSION, "prompts": prompts, "classnames": classnames,
                       "precision": precision, "context_length": context,
                       "tokenizer": tokenizer_identity(tokenizer, classnames, templates)}, sort_keys=True)
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
    atomic_torch_save({"weights": weights.detach().cpu().float()}, path)
