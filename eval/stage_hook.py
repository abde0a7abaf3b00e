"""The evaluation entry the trainer calls on ALL ranks after each stage: evaluators declared as data."""
from pathlib import Path

import torch

from eval.class_sets import resolve_classnames, resolve_templates
from eval.eval_datasets import ShardSamples, classification_dataset, shard_urls
from eval.model_calls import unwrap_model
from eval.model_loading import eval_tokenizer, eval_transform
from eval.retrieval import retrieval_evaluate
from eval.zeroshot import zero_shot_evaluate

EVAL_TYPES = ("zeroshot", "retrieval")
REQUIRED_KEYS = ("name", "type", "data")
OPTIONAL_KEYS = {"dataset": "custom", "templates": None, "batch_size": 256, "max_images": None,
                 "labels": None, "classnames": None, "num_workers": 0}


def check_eval_spec(spec: dict) -> dict:
    """The eval dict with defaults filled in; a missing or unknown key raises an error naming it."""
    missing = [k for k in REQUIRED_KEYS if k not in spec]
    unknown = sorted(set(spec) - set(REQUIRED_KEYS) - set(OPTIONAL_KEYS))
    if missing or unknown:
        raise ValueError(f"eval {spec.get('name', '?')!r}: missing keys {missing}, unknown keys {unknown} "
                         f"(allowed: {list(REQUIRED_KEYS) + list(OPTIONAL_KEYS)})")
    if not str(spec["data"]).strip():
        raise ValueError(f"eval {spec['name']!r}: key 'data' is empty (a val folder or shard pattern is needed)")
    if spec["type"] not in EVAL_TYPES:
        raise ValueError(f"eval {spec['name']!r}: type must be one of {EVAL_TYPES}, got {spec['type']!r}")
    return {**OPTIONAL_KEYS, **spec}


def run_eval(model, tokenizer, preprocess, spec: dict, *, device="cpu", precision="fp32",
             cache_dir: str | Path | None = None, progress: bool = True) -> dict:
    """Run one declared evaluation (zero-shot classification or retrieval) and return its metrics."""
    spec = check_eval_spec(spec)
    common = dict(batch_size=spec["batch_size"], device=device, precision=precision,
                  num_workers=spec["num_workers"], progress=progress, max_images=spec["max_images"])
    if spec["type"] == "retrieval":
        dataset = ShardSamples(shard_urls(spec["data"]), preprocess, target="txt")
        return retrieval_evaluate(model, tokenizer, dataset, **common)
    classnames = resolve_classnames(spec["dataset"], spec["data"], spec["classnames"])
    templates = resolve_templates(spec["templates"], spec["dataset"])
    dataset = classification_dataset(spec["data"], preprocess, dataset=spec["dataset"],
                                     num_classes=len(classnames), labels_file=spec["labels"])
    return zero_shot_evaluate(model, tokenizer, dataset, classnames, templates, cache_dir=cache_dir, **common)


def evaluate_stage(model, *, model_name: str, evals: list[dict], image_size: int, device="cpu",
                   precision: str = "fp32", cache_dir: str | Path | None = None,
                   progress: bool = True, bert_vocab: str | None = None) -> dict[str, dict]:
    """Run every declared evaluation on `model` (plain or a DeepSpeed engine, any ZeRO stage) at `image_size`."""
    specs = [check_eval_spec(spec) for spec in evals]   # fail on a bad key before any forward
    inner = unwrap_model(model)
    tokenizer = eval_tokenizer(model_name, inner, bert_vocab)  # deterministic: no training reduction mask
    preprocess = eval_transform(inner, image_size)
    results = {}
    for spec in specs:
        with torch.no_grad():
            results[spec["name"]] = run_eval(model, tokenizer, preprocess, spec, device=device,
                                             precision=precision, cache_dir=cache_dir, progress=progress)
    return results
