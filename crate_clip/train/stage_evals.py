"""The evaluations after each stage: which are due, running them on all ranks, recording them in results.jsonl."""
from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import TYPE_CHECKING

from crate_clip.models import create_clip
from crate_clip.train.engine import DistInfo
from crate_clip.train.metrics_log import RESULTS_FILE, MetricsLog, read_jsonl
from crate_clip.train.run_config import RunConfig

if TYPE_CHECKING:
    from crate_clip.train.stage_loop import Progress


def evaluate_after_stage(cfg: RunConfig, stage_index: int, weights: dict, progress: Progress,
                         log: MetricsLog, dist: DistInfo) -> list[dict]:
    """Zero-shot evaluation of the stage's consolidated weights on all ranks (images split across them),
    at the stage's resolution and, after a low-resolution stage, also at the full resolution. The fp32
    weights run under autocast in the training precision (bf16 matmuls are several times faster)."""
    if not (cfg.eval.after_each_stage and cfg.eval.evals):
        return []
    from eval.stage_hook import evaluate_stage

    stage = cfg.stages[stage_index]
    sizes = [stage.image_size] + ([cfg.full_image_size] if cfg.full_image_size != stage.image_size else [])
    records = []
    for size in sizes:
        model = create_clip(cfg.model.name, image_size=size, context_length=stage.context_length, pretrained=weights)
        model.to(dist.device).eval()
        results = evaluate_stage(model, model_name=cfg.model.name, evals=[dataclasses.asdict(e) for e in cfg.eval.evals],
                                 image_size=size, device=dist.device, precision=cfg.precision,
                                 cache_dir=str(cfg.run_dir / "eval_cache"), progress=dist.is_main)
        for name, res in results.items():
            record = {"stage_index": stage_index, "stage_name": stage.name, "eval": name, "image_size": size,
                      "stage_image_size": stage.image_size, "context_length": stage.context_length,
                      "samples_seen": progress.samples_seen, "global_step": progress.global_step,
                      **{k: v for k, v in res.items() if isinstance(v, (int, float, str, list)) or v is None}}
            records.append(record)
            log.log_eval(record)
        del model
    return records


def stage_evaluated(run_dir: Path, stage_index: int) -> bool:
    """True when results.jsonl holds a row of the stage."""
    return any(r.get("stage_index") == stage_index for r in read_jsonl(run_dir / RESULTS_FILE))
