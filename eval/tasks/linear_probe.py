"""Linear probe / few-shot classification on cached image features (CLIP_benchmark protocol, eval/linear_probe.py)."""
from __future__ import annotations

from crate_clip.eval import linear_probe
from crate_clip.eval.linear_probe import Settings, summary  # noqa: F401  (the task's schema and console line)


def run(model, settings: Settings, context) -> dict:
    """Linear-probe metrics of `model` (a CLIP or a timm classifier; all ranks call this)."""
    return linear_probe.run(model, preprocess=context.preprocess, settings=settings, device=context.device,
                            precision=context.precision, cache_dir=context.cache_dir, progress=context.progress)
