"""Zero-shot classification: text classifier from class names x templates, then top-1/top-5 accuracy.
The task `zeroshot` (`crate-clip eval zeroshot`, `type: zeroshot`): its settings, run, summary and checks are here.

Numbers match open_clip's zero-shot path (build_zero_shot_classifier + open_clip_train.zero_shot):
classifier = normalised mean of normalised template embeddings; logits = 100 * image_features @ classifier.

No torch at import: the settings serve the CLI's --help and a config's validation, so torch and the evaluation
modules built on it are imported inside the functions that run the task.
"""
from __future__ import annotations

import time
from pathlib import Path
from typing import TYPE_CHECKING, ClassVar, Literal, Optional, Sequence

from pydantic import Field

from crate_clip.eval.class_sets import (BUILTIN_DATASETS, CLASSNAMES_FILE, DEFAULT_DATASET, DEFAULT_TEMPLATES,
                                        TEMPLATE_SETS, TEMPLATES_FILE, dataset_name, resolve_classnames,
                                        resolve_templates, template_text)
from crate_clip.eval.eval_settings import EvalSettings
from crate_clip.eval.unreadable_images import DEFAULT_MAX_UNREADABLE_FRACTION, check_unreadable, data_name

if TYPE_CHECKING:
    import torch

CLASSES_PER_BATCH = 10   # as open_clip: 10 classes x all templates per text forward


class ZeroshotSettings(EvalSettings):
    """Zero-shot classification: text classifier from class names x templates, then top-1/top-5 accuracy."""

    has_details: ClassVar[bool] = True   # `--details`: the per-class table
    has_per_image: ClassVar[bool] = True   # `--per-image-out FILE`: each image's top-1 class (paired comparisons)
    type: Literal["zeroshot"] = Field("zeroshot", description="the task (an entry without a type is a zeroshot one)")
    dataset: Optional[str] = Field(None, description=f"{' | '.join(BUILTIN_DATASETS)} (built-in class names) | any "
                                   f"name with classnames or {CLASSNAMES_FILE} beside the data (default: the data's "
                                   f"own {CLASSNAMES_FILE}, else {DEFAULT_DATASET}; a built-in set that disagrees "
                                   "with the data's own is refused)")
    templates: Optional[str] = Field(None, description=f"{' | '.join(TEMPLATE_SETS)} | a file of '{{}}' "
                                                       f"or '{{c}}' lines (default: {TEMPLATES_FILE} beside the "
                                                       f"data, else the dataset's, {DEFAULT_TEMPLATES})")
    classnames: Optional[str] = Field(None, description="file with one class name per line, in label order")
    labels: Optional[str] = Field(None, description="ground truth for a flat val folder (`file label` lines, "
                                                    "one label per line, or Kaggle's LOC_val_solution.csv)")


Settings = ZeroshotSettings   # the task's schema, by the name every task module gives it (crate_clip.eval.registry)


def build_text_classifier(model, tokenizer, classnames: Sequence[str], templates: Sequence, *, device="cpu",
                          precision: str = "fp32", progress: bool = True) -> torch.Tensor:
    """[embed_dim, num_classes] classifier: per class the normalised mean of normalised template embeddings."""
    import torch

    from crate_clip.core.progress_lines import progress as shown_progress
    from crate_clip.eval.model_calls import text_features

    chunks = []
    starts = range(0, len(classnames), CLASSES_PER_BATCH)
    with torch.no_grad():
        for start in shown_progress(starts, "text classifier", unit="batch", enabled=progress):
            names = classnames[start:start + CLASSES_PER_BATCH]
            tokens = tokenizer([template_text(t, c) for c in names for t in templates]).to(device)
            feats = text_features(model, tokens, precision).reshape(len(names), len(templates), -1).mean(dim=1)
            chunks.append(feats / feats.norm(dim=1, keepdim=True))
        return torch.cat(chunks).T.contiguous()


def cached_text_classifier(model, tokenizer, classnames, templates, *, device="cpu", precision="fp32",
                           cache_dir: str | Path | None = None, progress: bool = True) -> tuple[torch.Tensor, dict]:
    """The text classifier from the on-disk cache when every rank has it, else built (rank 0 saves it)."""
    from crate_clip.eval.classifier_cache import cache_path, classifier_key, load_cached, save_cached
    from crate_clip.eval.distributed_batches import all_ranks_agree, rank_and_world

    start = time.perf_counter()
    info = {"cache_hit": False, "cache_path": None}
    cached = None
    if cache_dir is not None:
        path = cache_path(cache_dir, classifier_key(model, tokenizer, classnames, templates, precision))
        info["cache_path"] = str(path)
        cached = load_cached(path, len(classnames))
    # All ranks build together (ZeRO-3 text forwards are collective) unless every rank has the file.
    if all_ranks_agree(cached is not None):
        weights, info["cache_hit"] = cached.to(device), True
    else:
        weights = build_text_classifier(model, tokenizer, classnames, templates, device=device,
                                        precision=precision, progress=progress)
        if cache_dir is not None and rank_and_world()[0] == 0:
            save_cached(Path(info["cache_path"]), weights)
    info["classifier_seconds"] = time.perf_counter() - start
    return weights, info


def zero_shot_evaluate(model, tokenizer, dataset, classnames: Sequence[str], templates: Sequence, *,
                       batch_size: int = 256, device="cpu", precision: str = "fp32",
                       cache_dir: str | Path | None = None, num_workers: int = 0, progress: bool = True,
                       max_images: int | None = None,
                       max_unreadable_fraction: float = DEFAULT_MAX_UNREADABLE_FRACTION,
                       per_image: bool = False) -> dict:
    """Zero-shot top-1/top-5/mean-per-class accuracy of `model` on `dataset` (all ranks call this); refused
    (UnreadableDataError) when more than `max_unreadable_fraction` of the images cannot be read. `per_image`:
    also `metrics["per_image"]`, every readable image's (index, label, top-1 class) in index order, for paired
    comparisons of two models on the same images."""
    import torch

    from crate_clip.eval.distributed_batches import all_reduce_sum, gather_objects
    from crate_clip.eval.eval_loop import EvalPass, evaluation_mode
    from crate_clip.eval.model_calls import check_precision, dummy_images, image_features

    check_precision(precision)
    classnames = list(classnames)
    _check_class_count(dataset, classnames)
    batches = EvalPass(model, dataset, batch_size=batch_size, num_workers=num_workers, max_images=max_images,
                       desc="zero-shot images", progress=progress,
                       idle=lambda: image_features(model, dummy_images(model, device), precision))  # ZeRO-3 in step
    counts = torch.zeros(3, len(classnames), dtype=torch.float64)   # images, top-1 hits, top-5 hits per class
    with evaluation_mode(model):   # the text classifier too
        classifier, cache_info = cached_text_classifier(model, tokenizer, classnames, templates, device=device,
                                                        precision=precision, cache_dir=cache_dir,
                                                        progress=progress and batches.rank == 0)
        start = time.perf_counter()
        rows = []
        for batch in batches:
            top1 = _score_batch(model, batch, classifier, counts, device=device, precision=precision)
            rows += zip(batch.indices.tolist(), batch.targets.tolist(), top1.tolist())
    metrics = _summary(all_reduce_sum(counts), batches.unreadable, batches.world, classnames, cache_info,
                       time.perf_counter() - start)
    if per_image:   # every rank's rows, merged in index order
        metrics["per_image"] = sorted(row for part in gather_objects(rows) for row in part)
    check_unreadable(f"zero-shot on {data_name(dataset)}", metrics["n_images"], metrics["n_unreadable"],
                     max_unreadable_fraction, batches.unreadable)
    return metrics


def _score_batch(model, batch, classifier: torch.Tensor, counts: torch.Tensor, *, device,
                 precision: str) -> torch.Tensor:
    # As open_clip_train.zero_shot: logits = 100 * features @ classifier; a hit is the label in the top-k.
    # Returns the batch's top-1 classes.
    import torch

    from crate_clip.eval.model_calls import image_features

    labels = batch.targets
    _check_labels(labels, counts.shape[1])
    logits = 100.0 * image_features(model, batch.images.to(device), precision) @ classifier
    ranked = logits.topk(min(5, counts.shape[1]), dim=1).indices.cpu()
    hits = ranked == labels.view(-1, 1)
    counts[0].index_add_(0, labels, torch.ones(len(labels), dtype=torch.float64))
    counts[1].index_add_(0, labels, hits[:, 0].double())
    counts[2].index_add_(0, labels, hits.any(dim=1).double())
    return ranked[:, 0]   # the same top-1 the hits count


def _check_class_count(dataset, classnames) -> None:
    expected = getattr(dataset, "num_classes", None) or len(getattr(dataset, "classes", classnames))
    if expected is not None and expected != len(classnames):
        raise ValueError(f"{len(classnames)} class names but the data set has {expected} classes; they must agree")


def _check_labels(labels: torch.Tensor, num_classes: int) -> None:
    if labels.numel() and (labels.min() < 0 or labels.max() >= num_classes):
        raise ValueError(f"label {int(labels.max())} outside 0..{num_classes - 1}: the data has more classes "
                         f"than the {num_classes} class names")


def _summary(counts: torch.Tensor, unreadable: list[str], world: int, classnames, cache_info: dict,
             seconds: float) -> dict:
    import torch

    from crate_clip.eval.distributed_batches import all_reduce_sum

    n_unreadable = int(all_reduce_sum(torch.tensor([len(unreadable)], dtype=torch.int64)).item())
    images, top1, top5 = counts
    n = int(images.sum().item())
    seen = images > 0
    per_class = [{"class": name, "n": int(images[i]), "top1": float(top1[i] / images[i]) if seen[i] else None,
                  "top5": float(top5[i] / images[i]) if seen[i] else None} for i, name in enumerate(classnames)]
    return {
        "top1": float(top1.sum() / n) if n else 0.0,
        "top5": float(top5.sum() / n) if n else 0.0,
        "mean_per_class": float((top1[seen] / images[seen]).mean()) if n else 0.0,
        "per_class": per_class,
        "n_images": n,
        "n_unreadable": n_unreadable,
        "unreadable_examples": unreadable[:20],   # this rank's first few, for the report
        "num_classes": len(classnames),
        "world_size": world,
        "images_per_second": n / seconds if seconds > 0 else None,
        **cache_info,
    }


# ---------------------------------------------------------------- the task
def run(model, settings: Settings, context) -> dict:
    """Zero-shot metrics of `model` on the settings' data (all ranks call this)."""
    from crate_clip.eval.eval_datasets import classification_dataset

    classnames = resolve_classnames(settings.dataset, settings.data, settings.classnames)
    name = dataset_name(settings.dataset, settings.data)
    templates = resolve_templates(settings.templates, name, settings.data)
    dataset = classification_dataset(settings.data, context.preprocess, dataset=name,
                                     num_classes=len(classnames), labels_file=settings.labels, classnames=classnames)
    return zero_shot_evaluate(model, context.tokenizer, dataset, classnames, templates,
                              cache_dir=context.cache_dir, per_image=context.per_image,
                              **context.loop_args(settings))


def data_problems(settings: Settings) -> list[tuple[str, str]]:
    """The class names must come from somewhere: a `classnames` file that exists, a built-in set, or
    classnames.txt beside the data."""
    if settings.classnames:
        if Path(settings.classnames).is_file():
            return []
        return [("classnames", f"{settings.classnames!r} does not exist; fix: a file with one class name per "
                               "line, in label order")]
    try:
        resolve_classnames(settings.dataset, settings.data)
    except ValueError as err:   # a built-in set that disagrees with the data's own classnames.txt
        return [("dataset", str(err))]
    except FileNotFoundError:
        return [("dataset", f"{settings.dataset!r} has no built-in class names ({', '.join(BUILTIN_DATASETS)}) "
                            f"and there is no {CLASSNAMES_FILE} beside {settings.data!r}; fix: set classnames: "
                            f"FILE (one class name per line, in label order), put {CLASSNAMES_FILE} beside the "
                            "data, or use a built-in dataset name")]
    return []


def summary(metrics: dict) -> str:
    """One line for the console."""
    return (f"zero-shot: top-1 {100 * metrics['top1']:.2f}%  top-5 {100 * metrics['top5']:.2f}%  "
            f"mean per class {100 * metrics['mean_per_class']:.2f}%  on {metrics['n_images']} images "
            f"({metrics['n_unreadable']} unreadable)")


def details(metrics: dict) -> str:
    """The per-class accuracy table."""
    rows = [f"{'class':<32} {'images':>7} {'top-1':>7} {'top-5':>7}"]
    for row in metrics["per_class"]:
        top1, top5 = (f"{100 * row[k]:.1f}" if row[k] is not None else "-" for k in ("top1", "top5"))
        rows.append(f"{row['class'][:32]:<32} {row['n']:>7} {top1:>7} {top5:>7}")
    return "\n".join(rows)
