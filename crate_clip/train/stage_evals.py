"""The evaluations after each stage: which are due, running them on all ranks, recording them in results.jsonl.

A stage's evaluations are due at its own image size and, after a low-resolution stage, at the full size.
results.jsonl is the record of which are done, so a run killed between two of them runs exactly the missing
ones on resume, and the stage's final checkpoint is kept (CheckpointManager's `protect`) until all are done.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch.distributed as tdist

from crate_clip.models.patch_change import create_clip_at_patch, tower_patch_size
from crate_clip.train.engine import DistInfo
from crate_clip.train.metrics_log import RESULTS_FILE, MetricsLog, read_jsonl
from crate_clip.train.run_config import RunConfig

if TYPE_CHECKING:
    from crate_clip.train.stage_loop import Progress


def evaluate_after_stage(cfg: RunConfig, stage_index: int, weights: dict, progress: Progress,
                         log: MetricsLog, dist: DistInfo) -> list[dict]:
    """Zero-shot evaluation of the stage's consolidated weights on all ranks (images split across them),
    at the stage's resolution and, after a low-resolution stage, also at the full resolution; evaluations
    already in results.jsonl are not repeated. The fp32 weights run under autocast in the training precision
    (bf16 matmuls are several times faster)."""
    from eval.registry import summary_line
    from eval.stage_hook import evaluate_stage

    spec_types = {e.name: e.type for e in cfg.eval.evals}
    missing = agreed_missing_evals(cfg, stage_index, dist)
    stage = cfg.stages[stage_index]
    records = []
    for size, evals in missing.items():
        # at the patch size the weights carry (a stage may have changed it)
        model = create_clip_at_patch(cfg.model.name, weights, image_size=size, context_length=stage.context_length,
                                     pos_embed_resize=cfg.model.pos_embed_resize)
        model.to(dist.device).eval()
        results = evaluate_stage(model, model_name=cfg.model.name, evals=evals,
                                 image_size=size, device=dist.device, precision=cfg.precision,
                                 cache_dir=str(cfg.run_dir / "eval_cache"), progress=dist.is_main,
                                 bert_vocab=cfg.model.bert_vocab)
        for name, res in results.items():
            record = {"stage_index": stage_index, "stage_name": stage.name, "eval": name, "image_size": size,
                      "stage_image_size": stage.image_size, "patch_size": tower_patch_size(model),
                      "context_length": stage.context_length,
                      "samples_seen": progress.samples_seen, "global_step": progress.global_step,
                      **{k: v for k, v in res.items() if isinstance(v, (int, float, str, list)) or v is None}}
            records.append(record)
            log.log_eval(record, summary_line(res, eval_type=spec_types[name]))
        del model
    return records


def missing_evals(cfg: RunConfig, stage_index: int) -> dict[int, list]:
    """image size -> the declared evaluations of the stage not yet in results.jsonl at that size."""
    if not (cfg.eval.after_each_stage and cfg.eval.evals):
        return {}
    stage = cfg.stages[stage_index]
    sizes = [stage.image_size] + ([cfg.full_image_size] if cfg.full_image_size != stage.image_size else [])
    done = {(r.get("eval"), r.get("image_size")) for r in read_jsonl(cfg.run_dir / RESULTS_FILE)
            if r.get("stage_index") == stage_index}
    missing = {size: [e for e in cfg.eval.evals if (e.name, size) not in done] for size in sizes}
    return {size: evals for size, evals in missing.items() if evals}


def agreed_missing_evals(cfg: RunConfig, stage_index: int, dist: DistInfo) -> dict[int, list]:
    """missing_evals as rank 0 (which writes results.jsonl) sees it, on every rank: all run the same ones."""
    missing = missing_evals(cfg, stage_index)
    if dist.world_size == 1:
        return missing
    box = [missing]
    tdist.broadcast_object_list(box, src=0)
    return box[0]
