"""Linear probe and few-shot evaluation (the CLIP_benchmark protocol) on cached image features.

Features: the CLIP image embedding (`features='image'`, L2-normalised as CLIP_benchmark) or the image
tower's pooled pre-projection features (`features='tower'`, also what a timm classifier gives), cached on
disk keyed by the image-tower weights, the data and the settings. Classifier: one nn.Linear trained with
AdamW (lr 0.1, batch 64, 10 epochs, cosine schedule without warm-up); its weight decay is searched on a
held-out split of the training data over logspace(-6, 2, 97) (7 coarse points, then refined around the
best), then the classifier is retrained on train+val and scored on the test split: top-1, top-5 and mean
per-class recall. Few-shot (`fewshot_k`): k training images per class drawn with each of several seeds
(the validation split is held out first and used only to choose the weight decay); mean and spread.

The task `linear_probe` (`crate-clip eval linear-probe`, `type: linear_probe`): its settings, run and summary
are here.

No torch at import: the settings serve the CLI's --help and a config's validation, so torch, numpy and the
evaluation modules built on them are imported inside the functions that run the task.
"""
from __future__ import annotations

import hashlib
import json
import math
import os
import time
from functools import cache
from pathlib import Path
from typing import TYPE_CHECKING, ClassVar, Literal, Optional

from pydantic import Field

from crate_clip.core.config_schema import Float, Int
from crate_clip.eval.class_sets import resolve_classnames
from crate_clip.eval.eval_settings import EvalSettings
from crate_clip.eval.unreadable_images import check_unreadable, data_name

if TYPE_CHECKING:
    import numpy as np
    import torch
    from torch import nn

NAME = "linear_probe"
CACHE_VERSION = 2   # 2: keyed by the class each folder of an ImageFolder split is matched to
WD_GRID_POINTS = 97                              # CLIP_benchmark's weight-decay grid: logspace(-6, 2, 97)
WD_COARSE = list(range(0, WD_GRID_POINTS, 16))   # its 7 coarse points (1e-6, ..., 1e2)
WD_FIRST_SPAN = 8                                # then +-8, +-4, +-2, +-1 grid steps around the best
TIMM_PREFIX = "timm:"   # `crate-clip eval --model timm:NAME`: a timm classifier's tower features (linear probe)


class LinearProbeSettings(EvalSettings):
    """Linear probe and few-shot evaluation (the CLIP_benchmark protocol) on cached image features.

    The keys of a `type: linear_probe` eval entry and the options of `crate-clip eval linear-probe`. The test
    split is `data`; `batch_size` is the feature-extraction batch."""

    has_details: ClassVar[bool] = False
    type: Literal["linear_probe"] = Field("linear_probe", description="the task")
    train_data: str = Field("", description="training split: ImageFolder, flat folder (with train_labels) or .cls shards")
    dataset: str = Field("custom", description="fashion_mnist / imagenet1k (built-in class lists) or any name")
    classnames: Optional[str] = Field(None, description="class-name file: the classes that folders are matched to; "
                                                        "default classnames.txt beside the data")
    train_labels: Optional[str] = Field(None, description="label file of a flat training folder")
    labels: Optional[str] = Field(None, description="label file of a flat test folder")
    features: Literal["auto", "image", "tower"] = Field("auto", description="image: CLIP image embedding; tower: "
                                                        "pooled pre-projection features (auto: image for CLIP, "
                                                        "tower for a timm:NAME classifier)")
    normalize: bool = Field(True, description="L2-normalise the features")
    max_train_images: Optional[Int] = Field(None, ge=1, description="use this many training images (spread evenly)")
    fewshot_k: Optional[Int] = Field(None, ge=1, description="k training images per class (few-shot probe)")
    fewshot_seeds: Int = Field(3, ge=1, description="few-shot draws (seeds 0..n-1): mean and spread")
    weight_decay: Optional[Float] = Field(None, ge=0, description="fixed weight decay (skips the validation search)")
    epochs: Int = Field(10, ge=1, description="probe training epochs")
    lr: Float = Field(0.1, gt=0, description="AdamW learning rate of the probe (cosine schedule, no warm-up)")
    probe_batch_size: Int = Field(64, ge=1, description="batch size of the probe's training")
    val_proportion: Float = Field(0.2, gt=0, lt=1, description="share of the training split held out to choose "
                                                                "the weight decay")
    seed: Int = Field(0, description="seed of the held-out split and of the probe's initialisation and order")

    def checks(self) -> list[tuple[str, str]]:
        """The training split is required."""
        problems = super().checks()
        if not str(self.train_data).strip():
            problems.append(("train_data", "empty; fix: the labelled training split of the linear probe"))
        return problems


Settings = LinearProbeSettings   # the task's schema, by the name every task module gives it (crate_clip.eval.registry)


@cache
def weight_decay_grid() -> np.ndarray:
    """CLIP_benchmark's weight-decay grid, np.logspace(-6, 2, 97)."""
    import numpy as np

    return np.logspace(-6, 2, num=WD_GRID_POINTS)


# ---------------------------------------------------------------- features
def is_clip(model) -> bool:
    """True for an open_clip CLIP (has an image tower `visual` and a text side)."""
    from crate_clip.eval.model_calls import unwrap_model

    inner = unwrap_model(model)
    return hasattr(inner, "visual") and hasattr(inner, "encode_text")


def resolve_feature_kind(model, kind: str) -> str:
    """'image' or 'tower' for this model ('auto': image for a CLIP, tower for a timm classifier)."""
    if kind == "auto":
        return "image" if is_clip(model) else "tower"
    if kind == "image" and not is_clip(model):
        raise ValueError("features='image' needs a CLIP model; a timm classifier gives features='tower'")
    return kind


def _tower_features(model, images: torch.Tensor) -> torch.Tensor:
    # The pooled image-tower output before any projection or classification head.
    from crate_clip.eval.model_calls import unwrap_model

    inner = unwrap_model(model)
    tower = inner.visual if is_clip(inner) else inner
    tower = getattr(tower, "trunk", tower)          # open_clip TimmModel: the timm trunk, without the proj head
    if hasattr(tower, "forward_head"):
        return tower.forward_head(tower.forward_features(images), pre_logits=True)
    if hasattr(tower, "proj") and hasattr(tower, "transformer"):   # open_clip's own VisionTransformer
        proj, tower.proj = tower.proj, None
        try:
            return tower(images)
        finally:
            tower.proj = proj
    raise ValueError(f"features='tower': {type(tower).__name__} has neither forward_head nor an open_clip proj")


def batch_features(model, images: torch.Tensor, kind: str, normalize: bool, precision: str) -> torch.Tensor:
    """Float32 features of one batch: the CLIP image embedding or the tower's pooled features."""
    import torch
    import torch.nn.functional as F

    from crate_clip.eval.model_calls import autocast_context, image_features, unwrap_model

    with torch.no_grad():
        if kind == "image":
            feats = image_features(model, images, precision)
        else:
            dtype = next(unwrap_model(model).parameters()).dtype
            with autocast_context(precision, images.device):
                feats = _tower_features(model, images.to(dtype)).float()
        return F.normalize(feats, dim=-1, eps=1e-8) if normalize else feats


def extract_features(model, dataset, *, kind: str, normalize: bool = True, batch_size: int = 256,
                     device="cpu", precision: str = "fp32", num_workers: int = 0, max_images: int | None = None,
                     progress: bool = True, desc: str = "features") -> tuple[torch.Tensor, torch.Tensor, int]:
    """(features [N, D], labels [N], unreadable count) of a data set; ranks split it, every rank gets all;
    UnreadableDataError when no image could be read."""
    import torch

    from crate_clip.eval.distributed_batches import gather_objects
    from crate_clip.eval.eval_loop import EvalPass

    # no idle forward: features are computed per rank without collectives (plain models only)
    batches = EvalPass(model, dataset, batch_size=batch_size, num_workers=num_workers, max_images=max_images,
                       desc=desc, progress=progress)
    feats, labels, indices = [], [], []
    for batch in batches:
        feats.append(batch_features(model, batch.images.to(device), kind, normalize, precision).cpu())
        labels.append(batch.targets)
        indices.append(batch.indices)
    unreadable = len(batches.unreadable)
    mine = (torch.cat(feats) if feats else torch.zeros(0, 0), torch.cat(labels) if labels else torch.zeros(0, dtype=torch.int64),
            torch.cat(indices) if indices else torch.zeros(0, dtype=torch.int64), unreadable)
    gathered = gather_objects(mine)
    parts = [p for p in gathered if p[0].numel()]
    if not parts:
        check_unreadable(f"{desc} of {data_name(dataset)}", 0, sum(p[3] for p in gathered), 0.0)
    order = torch.cat([p[2] for p in parts]).argsort()   # sample order, whatever the rank split
    return (torch.cat([p[0] for p in parts])[order], torch.cat([p[1] for p in parts])[order],
            sum(p[3] for p in gathered))


# ---------------------------------------------------------------- feature cache
def image_weights_digest(model) -> str:
    """sha256 of the image tower's weights (the whole model for a timm classifier)."""
    import torch

    from crate_clip.eval.model_calls import unwrap_model

    inner = unwrap_model(model)
    tower = inner.visual if is_clip(inner) else inner
    digest = hashlib.sha256()
    for name, tensor in list(tower.named_parameters()) + list(tower.named_buffers()):
        digest.update(f"{name}:{tuple(tensor.shape)}:{tensor.dtype};".encode())
        digest.update(tensor.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


def feature_cache_key(model, data: str, preprocess, *, kind: str, normalize: bool, precision: str,
                      max_images: int | None, labels: str | None, classes: list | None = None) -> str:
    """Cache key: image-tower weights + the data (path, file sizes, folder -> class) + preprocessing + feature
    settings."""
    path = Path(str(data))
    stamp = sorted((p.name, p.stat().st_size) for p in path.iterdir())[:10000] if path.is_dir() else str(data)
    meta = json.dumps({"v": CACHE_VERSION, "data": str(path.resolve()) if path.exists() else str(data),
                       "stamp": stamp, "labels": labels, "preprocess": repr(preprocess), "kind": kind,
                       "normalize": normalize, "precision": precision, "max_images": max_images,
                       "classes": classes}, sort_keys=True)
    return hashlib.sha256((image_weights_digest(model) + meta).encode()).hexdigest()


def cached_features(model, dataset, data: str, preprocess, *, cache_dir, kind: str, normalize: bool,
                    precision: str, max_images, labels, **kwargs) -> tuple[torch.Tensor, torch.Tensor, dict]:
    """Features and labels from the cache when there (every rank), else extracted and saved by rank 0."""
    import torch

    from crate_clip.eval.distributed_batches import gather_objects, rank_and_world

    path = None
    if cache_dir is not None:
        classes = sorted({(Path(p).parent.name, label) for p, label in getattr(dataset, "samples", [])})
        key = feature_cache_key(model, data, preprocess, kind=kind, normalize=normalize, precision=precision,
                                max_images=max_images, labels=labels, classes=classes)
        path = Path(cache_dir) / f"linear_probe_features_{key[:40]}.pt"
        hits = gather_objects(path.is_file())
        if all(hits):
            try:
                saved = torch.load(path, map_location="cpu", weights_only=True)
                return saved["features"], saved["labels"], {"cache_hit": True, "unreadable": saved["unreadable"]}
            except Exception:   # a truncated or foreign file is a miss: rebuilt and overwritten
                pass
    feats, labs, unreadable = extract_features(model, dataset, kind=kind, normalize=normalize, precision=precision,
                                               max_images=max_images, **kwargs)
    if path is not None and rank_and_world()[0] == 0:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".tmp{os.getpid()}")
        torch.save({"features": feats, "labels": labs, "unreadable": unreadable}, tmp)
        os.replace(tmp, path)
    return feats, labs, {"cache_hit": False, "unreadable": unreadable}


# ---------------------------------------------------------------- the linear classifier
def train_linear(features: torch.Tensor, labels: torch.Tensor, num_classes: int, weight_decay: float, *,
                 lr: float = 0.1, epochs: int = 10, batch_size: int = 64, seed: int = 0) -> nn.Linear:
    """One nn.Linear on fixed features: AdamW, cross-entropy, per-step cosine LR from `lr` to 0, no warm-up."""
    import torch

    threads = torch.get_num_threads()
    # one thread: a 64-row step is all overhead, and on a busy machine extra threads made it ~13x slower
    torch.set_num_threads(1)
    try:
        with torch.enable_grad():   # callers such as the stage hook run evaluations under no_grad
            return _train_linear(features, labels, num_classes, weight_decay, lr, epochs, batch_size, seed)
    finally:
        torch.set_num_threads(threads)


def _train_linear(features, labels, num_classes, weight_decay, lr, epochs, batch_size, seed) -> nn.Linear:
    import torch
    import torch.nn.functional as F
    from torch import nn

    gen = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)
    clf = nn.Linear(features.shape[1], num_classes)
    opt = torch.optim.AdamW(clf.parameters(), lr=lr, weight_decay=weight_decay)
    n = len(features)
    steps_per_epoch = math.ceil(n / batch_size)
    total, step = epochs * steps_per_epoch, 0
    for _ in range(epochs):
        order = torch.randperm(n, generator=gen)
        for start in range(0, n, batch_size):
            for group in opt.param_groups:
                group["lr"] = 0.5 * (1 + math.cos(math.pi * step / total)) * lr
            idx = order[start:start + batch_size]
            loss = F.cross_entropy(clf(features[idx]), labels[idx])
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            step += 1
    return clf


def classification_metrics(logits: torch.Tensor, labels: torch.Tensor, num_classes: int) -> dict:
    """top-1, top-5 (top-k with k = min(5, classes)) and mean per-class recall."""
    import numpy as np

    logits = logits.detach()   # scores only: no graph
    topk = logits.topk(min(5, num_classes), dim=1).indices == labels.view(-1, 1)
    top1 = topk[:, 0].float()
    present = [c for c in range(num_classes) if (labels == c).any()]
    recall = [top1[labels == c].mean().item() for c in present]
    return {"top1": top1.mean().item(), "top5": topk.any(dim=1).float().mean().item(),
            "mean_per_class_recall": float(np.mean(recall))}


def search_weight_decay(train: tuple, val: tuple, num_classes: int, on_fit=None, **train_kw) -> tuple[float, dict]:
    """CLIP_benchmark's search: best val top-1 over the 7 coarse grid points, then +-8, 4, 2, 1 steps around it
    (`on_fit`: called after each fit, the progress display's)."""
    import torch

    grid = weight_decay_grid()
    scores: dict[int, float] = {}

    def score(i: int) -> float:
        if i not in scores:
            clf = train_linear(*train, num_classes, float(grid[i]), **train_kw)
            if on_fit:
                on_fit()
            with torch.no_grad():
                scores[i] = classification_metrics(clf(val[0]), val[1], num_classes)["top1"]
        return scores[i]

    def peak(candidates) -> int:
        return max(candidates, key=lambda i: (score(i), -i))   # ties: the smaller decay (as a strict '>' scan)

    best, span = peak(WD_COARSE), WD_FIRST_SPAN
    while span > 0:
        best = peak([max(best - span, 0), best, min(best + span, len(grid) - 1)])
        span //= 2
    return float(grid[best]), {"val_top1": scores[best], "wd_trials": len(scores)}


def split_train_val(labels: torch.Tensor, proportion: float, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Random (train, val) index split of the training data, `proportion` of it held out for validation."""
    import torch

    order = torch.randperm(len(labels), generator=torch.Generator().manual_seed(seed))
    n_val = max(1, int(round(proportion * len(labels))))
    return order[n_val:], order[:n_val]


def fewshot_indices(labels: torch.Tensor, k: int, seed: int) -> torch.Tensor:
    """k indices per class drawn with `seed` (all of a class's when it has fewer)."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    picks = []
    for c in labels.unique().tolist():
        members = (labels == c).nonzero().flatten()
        picks.append(members[torch.randperm(len(members), generator=gen)[:k]])
    return torch.cat(picks).sort().values


def probe(train_feats, train_labels, test_feats, test_labels, num_classes: int, settings: Settings,
          pool: torch.Tensor | None = None, split_seed: int | None = None, on_fit=None) -> dict:
    """Weight-decay search on a held-out split (unless fixed), retrain, test metrics.

    `pool` (few-shot) restricts the final training set to these indices of the non-validation part.
    """
    import torch

    train_kw = dict(lr=settings.lr, epochs=settings.epochs, batch_size=settings.probe_batch_size, seed=settings.seed)
    tr, va = split_train_val(train_labels, settings.val_proportion, settings.seed if split_seed is None else split_seed)
    if pool is not None:
        tr = tr[pool]
    info = {}
    if settings.weight_decay is None:
        wd, info = search_weight_decay((train_feats[tr], train_labels[tr]), (train_feats[va], train_labels[va]),
                                       num_classes, on_fit=on_fit, **train_kw)
    else:
        wd = settings.weight_decay
    final = tr if pool is not None else torch.cat([tr, va])   # few-shot: the k-shot set only
    clf = train_linear(train_feats[final], train_labels[final], num_classes, wd, **train_kw)
    if on_fit:
        on_fit()
    with torch.no_grad():
        metrics = classification_metrics(clf(test_feats), test_labels, num_classes)
    return {**metrics, "weight_decay": wd, "n_train": len(final), **info}


# ---------------------------------------------------------------- the evaluator
def _class_names(settings: Settings) -> list[str]:
    """The class names (file or built-in), else the training split's folder names: the classes both splits'
    folders are matched to by name (so a test split named or sorted differently keeps its labels)."""
    try:
        return resolve_classnames(settings.dataset, settings.train_data, settings.classnames)
    except FileNotFoundError:
        root = Path(settings.train_data)
        dirs = sorted(p.name for p in root.iterdir() if p.is_dir()) if root.is_dir() else []
        if dirs:
            return dirs
        raise ValueError(f"linear probe: cannot tell the number of classes of {settings.train_data}: give "
                         f"`classnames` (one name per line) or put classnames.txt beside the data") from None


def _check_labels(labels: torch.Tensor, num_classes: int, where: str) -> None:
    if labels.numel() and (labels.min() < 0 or labels.max() >= num_classes):
        raise ValueError(f"{where}: label {int(labels.max())} outside 0..{num_classes - 1}")


def run(model, settings: Settings, context) -> dict:
    """Linear-probe metrics of `model` (a CLIP or a timm classifier; all ranks call this)."""
    return linear_probe_evaluate(model, preprocess=context.preprocess, settings=settings, device=context.device,
                                 precision=context.precision, cache_dir=context.cache_dir, progress=context.progress)


def linear_probe_evaluate(model, *, preprocess, settings: Settings | dict, device="cpu", precision: str = "fp32",
                          cache_dir: str | Path | None = None, progress: bool = True, tokenizer=None) -> dict:
    """Linear-probe (or few-shot) metrics of `model` (a CLIP or a timm classifier; all ranks call this)."""
    from crate_clip.core.progress_lines import StepProgress
    from crate_clip.eval.eval_datasets import classification_dataset
    from crate_clip.eval.model_calls import check_precision

    settings = settings if isinstance(settings, Settings) else Settings(**settings)
    check_precision(precision)
    start = time.perf_counter()
    kind = resolve_feature_kind(model, settings.features)
    classnames = _class_names(settings)
    num_classes = len(classnames)
    common = dict(cache_dir=cache_dir, kind=kind, normalize=settings.normalize, precision=precision,
                  batch_size=settings.batch_size, device=device, num_workers=settings.num_workers, progress=progress)
    splits = {}
    for split, data, labels, limit in (("train", settings.train_data, settings.train_labels, settings.max_train_images),
                                       ("test", settings.data, settings.labels, settings.max_images)):
        dataset = classification_dataset(data, preprocess, dataset=settings.dataset, num_classes=num_classes,
                                         labels_file=labels, classnames=classnames)
        feats, labs, info = cached_features(model, dataset, data, preprocess, max_images=limit, labels=labels,
                                            desc=f"{split} features", **common)
        _check_labels(labs, num_classes, data)
        check_unreadable(f"linear probe {split} split {data}", len(labs), info["unreadable"],
                         settings.max_unreadable_fraction)
        splits[split] = (feats, labs, info)
    (xtr, ytr, itr), (xte, yte, ite) = splits["train"], splits["test"]
    extract_seconds = time.perf_counter() - start
    head = {"num_classes": num_classes, "feature_dim": xtr.shape[1], "n_test": len(yte), "features": kind,
            "n_unreadable": itr["unreadable"] + ite["unreadable"], "cache_hit": itr["cache_hit"] and ite["cache_hit"]}
    # the fits take minutes on big feature sets: their count (the weight-decay search's and the final one), whose
    # total the search decides as it goes
    with StepProgress("linear probe fits", unit="fit", enabled=progress, leave=False) as bar:
        if settings.fewshot_k is None:
            out = probe(xtr, ytr, xte, yte, num_classes, settings, on_fit=bar.update)
        else:
            out = fewshot_probe(xtr, ytr, xte, yte, num_classes, settings, on_fit=bar.update)
    return {**out, **head, "extract_seconds": extract_seconds,
            "probe_seconds": time.perf_counter() - start - extract_seconds}


def fewshot_probe(xtr, ytr, xte, yte, num_classes: int, settings: Settings, on_fit=None) -> dict:
    """Few-shot metrics: the probe on `fewshot_k` images per class, drawn with seeds 0..fewshot_seeds-1
    (mean and standard deviation over the draws)."""
    import numpy as np

    runs = []
    for seed in range(settings.fewshot_seeds):
        tr, _ = split_train_val(ytr, settings.val_proportion, settings.seed)
        pool = fewshot_indices(ytr[tr], settings.fewshot_k, seed)
        runs.append(probe(xtr, ytr, xte, yte, num_classes, settings, pool=pool, on_fit=on_fit))
    out = {"fewshot_k": settings.fewshot_k, "seeds": len(runs)}
    for key in ("top1", "top5", "mean_per_class_recall"):
        values = np.array([r[key] for r in runs])
        out[key], out[f"{key}_std"] = float(values.mean()), float(values.std(ddof=1)) if len(values) > 1 else 0.0
    out["weight_decay"] = float(np.exp(np.mean([np.log(r["weight_decay"]) for r in runs])))   # geometric mean
    out["n_train"] = runs[0]["n_train"]
    return out


def summary(metrics: dict) -> str:
    """One line: top-1 / top-5 / mean per-class recall (with their spread over seeds for few-shot)."""
    def pct(key):
        spread = f" ± {100 * metrics[key + '_std']:.2f}" if key + "_std" in metrics else ""
        return f"{100 * metrics[key]:.2f}%{spread}"
    what = f"{metrics['fewshot_k']}-shot probe ({metrics['seeds']} seeds)" if "fewshot_k" in metrics else "linear probe"
    return (f"{what}: top-1 {pct('top1')}  top-5 {pct('top5')}  mean per-class recall {pct('mean_per_class_recall')}"
            f"  ({metrics['features']} features, dim {metrics['feature_dim']}, wd {metrics['weight_decay']:.2g}, "
            f"{metrics['n_train']} train / {metrics['n_test']} test images)")


# ---------------------------------------------------------------- command line
def load_timm_classifier(name: str, pretrained: str | None, image_size: int | None, device="cpu"):
    """(model, eval preprocessing) of a timm classifier `name` with an optional weights file."""
    import timm
    from timm.data import create_transform, resolve_data_config

    from crate_clip.eval.model_loading import check_finite_weights

    kwargs = {"img_size": image_size} if image_size else {}
    model = timm.create_model(name, pretrained=False, checkpoint_path=pretrained or "", **kwargs)
    check_finite_weights(model, pretrained or name)
    config = resolve_data_config({"input_size": (3, image_size, image_size)} if image_size else {}, model=model)
    return model.to(device).eval(), create_transform(**config, is_training=False)
