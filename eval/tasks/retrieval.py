"""Image<->text retrieval on captioned shards (`.jpg` + `.txt`): recall@1/5/10, mean and median rank.
The task `retrieval` (`crate-clip eval retrieval`, `type: retrieval`): its settings, run and summary are here.

No torch at import: the settings serve the CLI's --help and a config's validation, so torch and the evaluation
modules built on it are imported inside the functions that run the task."""
from __future__ import annotations

import time
from typing import TYPE_CHECKING, ClassVar, Literal

from pydantic import Field

from crate_clip.eval.eval_settings import EvalSettings
from crate_clip.eval.unreadable_images import DEFAULT_MAX_UNREADABLE_FRACTION, check_unreadable, data_name

if TYPE_CHECKING:
    import torch

    from crate_clip.eval.eval_datasets import ShardSamples

RECALL_KS = (1, 5, 10)
SIMILARITY_ROWS = 4096   # images per block of the similarity matrix (bounds memory at N x 4096 floats)


class RetrievalSettings(EvalSettings):
    """Image<->text retrieval on captioned shards (`.jpg` + `.txt`): recall@1/5/10, mean and median rank."""

    has_details: ClassVar[bool] = False
    type: Literal["retrieval"] = Field("retrieval", description="the task")


Settings = RetrievalSettings   # the task's schema, by the name every task module gives it (crate_clip.eval.registry)


def retrieval_evaluate(model, tokenizer, dataset: ShardSamples, *, batch_size: int = 256, device="cpu",
                       precision: str = "fp32", num_workers: int = 0, progress: bool = True,
                       max_images: int | None = None,
                       max_unreadable_fraction: float = DEFAULT_MAX_UNREADABLE_FRACTION) -> dict:
    """Recall@k in both directions over all readable (image, caption) pairs (all ranks call this); refused
    (UnreadableDataError) when more than `max_unreadable_fraction` of the images cannot be read."""
    import torch

    from crate_clip.eval.distributed_batches import all_reduce_sum
    from crate_clip.eval.eval_loop import EvalPass
    from crate_clip.eval.model_calls import check_precision, dummy_images, image_features, text_features

    check_precision(precision)
    if getattr(dataset, "target", "txt") != "txt":
        raise ValueError("retrieval needs captioned shards (.txt members); these were opened for .cls labels")

    def idle():   # both towers run on every rank at every step (ZeRO-3 gathers are collective)
        image_features(model, dummy_images(model, device), precision)
        text_features(model, tokenizer([""]).to(device), precision)

    batches = EvalPass(model, dataset, batch_size=batch_size, num_workers=num_workers, max_images=max_images,
                       desc="retrieval", progress=progress, idle=idle)
    indices, images, texts, unreadable = [], [], [], batches.unreadable
    start = time.perf_counter()
    for batch in batches:
        images.append(image_features(model, batch.images.to(device), precision).cpu())
        texts.append(text_features(model, tokenizer(batch.targets).to(device), precision).cpu())
        indices.append(batch.indices)
    world = batches.world
    n_read, n_unreadable = all_reduce_sum(torch.tensor([sum(map(len, indices)), len(unreadable)])).tolist()
    check_unreadable(f"retrieval on {data_name(dataset)}", n_read, n_unreadable, max_unreadable_fraction, unreadable)
    image_feats, text_feats = _gathered_in_order(indices, images, texts)
    metrics = recall_metrics(image_feats, text_feats)
    seconds = time.perf_counter() - start
    return {**metrics, "n_pairs": len(image_feats), "n_unreadable": n_unreadable,
            "unreadable_examples": unreadable[:20], "world_size": world,
            "pairs_per_second": len(image_feats) / seconds if seconds > 0 else None}


def _gathered_in_order(indices, images, texts) -> tuple[torch.Tensor, torch.Tensor]:
    import torch

    from crate_clip.eval.distributed_batches import gather_objects

    empty = torch.zeros(0, dtype=torch.int64)
    local = (torch.cat(indices) if indices else empty,
             torch.cat(images) if images else None, torch.cat(texts) if texts else None)
    parts = [p for p in gather_objects(local) if p[1] is not None]   # some rank read pairs (check_unreadable)
    order = torch.cat([p[0] for p in parts]).argsort()
    return torch.cat([p[1] for p in parts])[order], torch.cat([p[2] for p in parts])[order]


def recall_metrics(image_feats: torch.Tensor, text_feats: torch.Tensor) -> dict:
    """Recall@k, mean and median rank (1 = best) where pair i's image matches caption i."""
    import numpy as np
    import torch

    n = len(image_feats)
    positive = (image_feats * text_feats).sum(dim=1)
    rank_i2t = torch.zeros(n, dtype=torch.int64)
    rank_t2i = torch.zeros(n, dtype=torch.int64)
    for start in range(0, n, SIMILARITY_ROWS):
        sims = image_feats[start:start + SIMILARITY_ROWS] @ text_feats.T
        rows = torch.arange(start, min(start + SIMILARITY_ROWS, n))
        sims[torch.arange(len(rows)), rows] = positive[rows]   # the same number on both sides of '>'
        rank_i2t[rows] = (sims > positive[rows, None]).sum(dim=1)
        rank_t2i += (sims > positive[None, :]).sum(dim=0)
    metrics = {}
    for name, ranks in (("image_to_text", rank_i2t), ("text_to_image", rank_t2i)):
        for k in RECALL_KS:
            metrics[f"{name}_R@{k}"] = float((ranks < k).double().mean())
        metrics[f"{name}_mean_rank"] = float(ranks.double().mean() + 1)
        metrics[f"{name}_median_rank"] = float(np.floor(np.median(ranks.numpy())) + 1)
    return metrics


# ---------------------------------------------------------------- the task
def run(model, settings: Settings, context) -> dict:
    """Recall@k of `model` on the settings' captioned shards (all ranks call this)."""
    from crate_clip.eval.eval_datasets import ShardSamples, shard_urls

    dataset = ShardSamples(shard_urls(settings.data), context.preprocess, target="txt")
    return retrieval_evaluate(model, context.tokenizer, dataset, **context.loop_args(settings))


def summary(metrics: dict) -> str:
    """One line for the console."""
    return ("retrieval: " + "  ".join(f"{k} {100 * v:.2f}%" for k, v in metrics.items() if "_R@" in k)
            + f"  on {metrics['n_pairs']} pairs ({metrics['n_unreadable']} unreadable)")
