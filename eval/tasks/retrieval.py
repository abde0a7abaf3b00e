"""Image-text retrieval: recall@1/5/10 in both directions over captioned shards (.jpg + .txt)."""
from __future__ import annotations

from typing import Literal

from pydantic import Field

from crate_clip.eval.eval_datasets import ShardSamples, shard_urls
from crate_clip.eval.eval_settings import EvalSettings
from crate_clip.eval.retrieval import retrieval_evaluate


class Settings(EvalSettings):
    """Retrieval settings (only the shared ones)."""

    type: Literal["retrieval"] = Field("retrieval", description="the task")


def run(model, settings: Settings, context) -> dict:
    """Recall@k of `model` on the settings' captioned shards (all ranks call this)."""
    dataset = ShardSamples(shard_urls(settings.data), context.preprocess, target="txt")
    return retrieval_evaluate(model, context.tokenizer, dataset, **context.loop_args(settings))


def summary(metrics: dict) -> str:
    """One line for the console."""
    return ("retrieval: " + "  ".join(f"{k} {100 * v:.2f}%" for k, v in metrics.items() if "_R@" in k)
            + f"  on {metrics['n_pairs']} pairs ({metrics['n_unreadable']} unreadable)")
