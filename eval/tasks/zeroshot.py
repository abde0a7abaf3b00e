"""Zero-shot classification: top-1, top-5 and mean per-class accuracy against prompt-built class embeddings."""
from __future__ import annotations

from pathlib import Path
from typing import Literal, Optional

from pydantic import Field

from crate_clip.eval.class_sets import (BUILTIN_CLASSNAMES, BUILTIN_TEMPLATES, CLASSNAMES_FILE, DEFAULT_DATASET,
                                        DEFAULT_TEMPLATES, TEMPLATES_FILE, dataset_name, resolve_classnames,
                                        resolve_templates)
from crate_clip.eval.eval_datasets import classification_dataset
from crate_clip.eval.eval_settings import EvalSettings
from crate_clip.eval.zeroshot import zero_shot_evaluate


class Settings(EvalSettings):
    """Zero-shot classification settings."""

    type: Literal["zeroshot"] = Field("zeroshot", description="the task (an entry without a type is a zeroshot one)")
    dataset: Optional[str] = Field(None, description="imagenet1k | fashion_mnist (built-in class names) | any "
                                   f"name with classnames or {CLASSNAMES_FILE} beside the data (default: the data's "
                                   f"own {CLASSNAMES_FILE}, else {DEFAULT_DATASET}; a built-in set that disagrees "
                                   "with the data's own is refused)")
    templates: Optional[str] = Field(None, description=f"{' | '.join(BUILTIN_TEMPLATES)} | a file of '{{}}' "
                                                       f"or '{{c}}' lines (default: {TEMPLATES_FILE} beside the "
                                                       f"data, else the dataset's, {DEFAULT_TEMPLATES})")
    classnames: Optional[str] = Field(None, description="file with one class name per line, in label order")
    labels: Optional[str] = Field(None, description="ground truth for a flat val folder (`file label` lines, "
                                                    "one label per line, or Kaggle's LOC_val_solution.csv)")


def run(model, settings: Settings, context) -> dict:
    """Zero-shot metrics of `model` on the settings' data (all ranks call this)."""
    classnames = resolve_classnames(settings.dataset, settings.data, settings.classnames)
    name = dataset_name(settings.dataset, settings.data)
    templates = resolve_templates(settings.templates, name, settings.data)
    dataset = classification_dataset(settings.data, context.preprocess, dataset=name,
                                     num_classes=len(classnames), labels_file=settings.labels, classnames=classnames)
    return zero_shot_evaluate(model, context.tokenizer, dataset, classnames, templates,
                              cache_dir=context.cache_dir, **context.loop_args(settings))


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
        return [("dataset", f"{settings.dataset!r} has no built-in class names ({', '.join(BUILTIN_CLASSNAMES)}) "
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
