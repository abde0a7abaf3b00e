"""White-box diagnostics during training: every `logging.diagnostics_every` steps, the per-layer coding rate and
ISTA sparsity of a fixed probe batch from the first eval set, into that step's metrics.jsonl record (key
'whitebox') and TensorBoard,
and the per-layer curves at a few points in training for the end-of-run figure.

ZeRO-3 partitions the parameters: there every rank gathers the tower's weights (a collective) into a plain
copy of the tower built at stage start, and rank 0 computes; under ZeRO 0-2 rank 0 reads the engine's tower.
"""
from __future__ import annotations

import time
from typing import Optional

import torch

from eval.class_sets import resolve_classnames
from eval.eval_datasets import ShardSamples, classification_dataset, subset_indices
from eval.model_loading import eval_transform
from eval.whitebox import find_crate_tower, layer_diagnostics

WHITEBOX_KEY = "whitebox"


def _probe_images(cfg, image_size: int, model, count: int) -> torch.Tensor:
    """The first eval set's images, `count` of them spread evenly, preprocessed at `image_size`."""
    spec = cfg.eval.evals[0]
    dataset = getattr(spec, "dataset", "custom")
    names = resolve_classnames(dataset, spec.data, getattr(spec, "classnames", None))
    data = classification_dataset(spec.data, eval_transform(getattr(model, "module", model), image_size),
                                  dataset=dataset, num_classes=len(names),
                                  labels_file=getattr(spec, "labels", None), classnames=names)
    if isinstance(data, ShardSamples):
        images = []
        for item in data:
            images.append(item[0])
            if len(images) == count:
                break
    else:
        images = [data[int(i)][0] for i in subset_indices(len(data), count)]
    if not images:
        raise ValueError(f"logging.diagnostics_every: the probe set eval.evals[0].data={spec.data!r} has no images")
    return torch.stack(images)


def shadow_tower(stage, trunk):
    """A plain CRATE-alpha tower shaped like `trunk` (the engine's, whose ZeRO-3 parameters are shards): the
    stage's model's tower (ResolvedStage.build_model), at the trunk's patch size (an attribute, right even while
    the weights are partitioned)."""
    tower = find_crate_tower(stage.build_model(read_files=False, train=False))
    tower.set_patch_size(trunk.patch_size)   # the same unless the weights came at another patch size
    return tower


class WhiteboxProbe:
    """Computes and logs the diagnostics of one stage's tower on a fixed probe batch."""

    def __init__(self, cfg, stage, engine, dist):
        self.every = cfg.logging.diagnostics_every
        self.dist = dist
        self.zero3 = stage.zero_stage == 3
        self.trunk = find_crate_tower(engine)
        self.images = (_probe_images(cfg, stage.image_size, engine, cfg.logging.diagnostics_images)
                       if dist.is_main else None)
        self.seconds = 0.0
        # ZeRO-3: a plain tower on rank 0 to load the gathered weights into (the engine's hold shards only)
        self.shadow = None
        if self.zero3 and dist.is_main:
            self.shadow = shadow_tower(stage, self.trunk).to(dist.device)

    @classmethod
    def for_stage(cls, cfg, stage, engine, dist, log) -> Optional["WhiteboxProbe"]:
        """The stage's probe, or None when diagnostics are off or the tower is not CRATE-alpha (said once)."""
        if not cfg.logging.diagnostics_every:
            return None
        if find_crate_tower(engine) is None:
            log.print("[whitebox] the image tower is not CRATE-alpha: logging.diagnostics_every is ignored")
            return None
        return cls(cfg, stage, engine, dist)

    def _tower(self):
        if not self.zero3:
            return self.trunk
        # imported here: this module is also loaded to draw plots from metrics files, where DeepSpeed (a second to
        # import) has no use
        import deepspeed

        with deepspeed.zero.GatheredParameters(list(self.trunk.parameters()), modifier_rank=None):
            if self.dist.is_main:
                self.shadow.load_state_dict({k: v.detach().clone() for k, v in self.trunk.state_dict().items()})
        return self.shadow

    def due(self, step: int, last: bool) -> bool:
        """Whether this step is measured (every N steps and at the stage's end); the same on every rank."""
        return step % self.every == 0 or last

    def measure(self) -> dict:
        """{'whitebox': per-layer diagnostics} on rank 0 ({} elsewhere); all ranks must call it under ZeRO-3."""
        t0 = time.perf_counter()
        tower = self._tower()  # a collective under ZeRO-3
        if not self.dist.is_main:
            return {}
        was_training = tower.training
        tower.eval()
        result = layer_diagnostics(tower, self.images)
        tower.train(was_training)
        self.seconds += time.perf_counter() - t0
        return {WHITEBOX_KEY: {**result, "probe_images": len(self.images), "seconds_total": self.seconds}}


def whitebox_scalars(record: dict) -> dict:
    """TensorBoard tags -> values of a metrics record's per-layer diagnostics (none when it has none)."""
    result = record.get(WHITEBOX_KEY) or {}
    out = {}
    for i, (rate, l0) in enumerate(zip(result.get("coding_rate", []), result.get("l0", []))):
        out[f"whitebox/coding_rate/layer{i:02d}"] = rate
        out[f"whitebox/l0/layer{i:02d}"] = l0
    return out


def draw_whitebox_curves(records: list[dict], axes, points: int = 5) -> bool:
    """Per-layer coding rate and normalised L0 at up to `points` moments of training on two matplotlib axes."""
    recs = [r for r in records if r.get(WHITEBOX_KEY)]
    if not recs:
        return False
    picks = sorted({round(i * (len(recs) - 1) / max(points - 1, 1)) for i in range(points)})
    cmap = __import__("matplotlib").colormaps["viridis"]
    for j, i in enumerate(picks):
        r = {**recs[i], **recs[i][WHITEBOX_KEY]}
        layers = range(1, len(r["coding_rate"]) + 1)
        color = cmap(j / max(len(picks) - 1, 1))
        label = f"{r['samples_seen']:,} samples (stage {r['stage_index']})"
        axes[0].errorbar(layers, r["coding_rate"], yerr=r["coding_rate_std"], color=color, marker="o", ms=3,
                         lw=1, capsize=2, label=label)
        axes[1].plot(layers, r["l0"], color=color, marker="o", ms=3, lw=1, label=label)
    axes[0].set_title("coding rate R^c of U^T LN(Z) (probe batch)", fontsize=9)
    axes[1].set_title("ISTA code: normalised L0 = 1 - zero fraction", fontsize=9)
    for ax in axes:
        ax.set_xlabel("layer")
        ax.set_xticks(list(layers))
        ax.legend(fontsize=7)
    return True
