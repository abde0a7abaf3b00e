"""The evaluation entry the trainer calls on ALL ranks after each stage: evaluators declared as data."""
from pathlib import Path

import torch

from crate_clip.eval.eval_settings import EvalSettings
from crate_clip.eval.model_calls import unwrap_model
from crate_clip.eval.model_loading import eval_tokenizer, eval_transform
from crate_clip.eval.registry import EvalContext, parse_eval, run_task


def evaluate_stage(model, *, model_name: str, evals: list[dict | EvalSettings], image_size: int, device="cpu",
                   precision: str = "fp32", cache_dir: str | Path | None = None,
                   progress: bool = True, bert_vocab: str | None = None) -> dict[str, dict]:
    """Run every declared evaluation on `model` (plain or a DeepSpeed engine, any ZeRO stage) at `image_size`."""
    specs = [parse_eval(spec) for spec in evals]   # fail on a bad key before any forward
    inner = unwrap_model(model)
    context = EvalContext(tokenizer=eval_tokenizer(model_name, inner, bert_vocab),  # no training reduction mask
                          preprocess=eval_transform(inner, image_size), device=device, precision=precision,
                          cache_dir=cache_dir, progress=progress)
    results = {}
    for spec in specs:
        with torch.no_grad():
            results[spec.name] = run_task(model, spec, context)
    return results
