"""White-box diagnostics during training: every `logging.diagnostics_every` steps, the per-layer coding rate and
ISTA sparsity of each CRATE-alpha tower on a fixed probe batch, into that step's metrics.jsonl record and
TensorBoard, and the per-layer curves at a few points in training for the end-of-run figure.

The image tower is probed with images of the first eval set (record key 'whitebox'), a CRATE-alpha text tower with
that set's class-name prompts (key 'whitebox_text'), the same prompts at every step so the numbers compare across
steps; both through crate_clip.eval.whitebox's block_diagnostics (the text tower's over each caption's own tokens).

ZeRO-3 partitions the parameters: there every rank gathers a tower's weights (a collective) into a plain copy of
the tower built at stage start, and rank 0 computes; under ZeRO 0-2 rank 0 reads the engine's tower.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable, Optional

import torch

from crate_clip.eval.class_sets import dataset_name, resolve_classnames, resolve_templates, template_text
from crate_clip.eval.eval_datasets import ShardSamples, classification_dataset, subset_indices
from crate_clip.eval.model_loading import eval_tokenizer, eval_transform
from crate_clip.eval.whitebox import find_crate_tower, layer_diagnostics
from crate_clip.eval.whitebox_text import find_crate_text_tower, text_layer_diagnostics

WHITEBOX_KEY = "whitebox"
WHITEBOX_TEXT_KEY = "whitebox_text"
# metrics.jsonl key -> (TensorBoard tag prefix, plot row title)
TOWER_KEYS = {WHITEBOX_KEY: ("whitebox", "image tower"), WHITEBOX_TEXT_KEY: ("whitebox_text", "text tower")}


def _probe_set(cfg) -> tuple:
    """(eval entry, data-set name, class names) of the first eval set, the white-box probes' source."""
    spec = cfg.eval.evals[0]
    dataset = dataset_name(getattr(spec, "dataset", "custom"), spec.data)
    return spec, dataset, resolve_classnames(dataset, spec.data, getattr(spec, "classnames", None))


def _probe_images(cfg, image_size: int, model, count: int) -> torch.Tensor:
    """The first eval set's images, `count` of them spread evenly, preprocessed at `image_size`."""
    spec, dataset, names = _probe_set(cfg)
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


def probe_captions(cfg, count: int) -> list[str]:
    """The first eval set's class-name prompts (every class with every template, in that order), `count` of them
    spread evenly: fixed text, the same at every step and stage."""
    spec, dataset, names = _probe_set(cfg)
    templates = resolve_templates(getattr(spec, "templates", None), dataset, spec.data)
    prompts = [template_text(t, c) for c in names for t in templates]
    return [prompts[int(i)] for i in subset_indices(len(prompts), count)]


def _probe_tokens(cfg, model, count: int) -> torch.Tensor:
    """probe_captions tokenized at the model's context length, as the evaluation tokenizes (no reduction mask)."""
    inner = getattr(model, "module", model)
    tokenizer = eval_tokenizer(cfg.model.tokenizer or cfg.model.name, inner, cfg.model.bert_vocab)
    return tokenizer(probe_captions(cfg, count))


def shadow_towers(stage, image, text) -> tuple:
    """Plain CRATE-alpha towers shaped like the engine's `image` and `text` towers (whose ZeRO-3 parameters are
    shards; None: no copy): the towers of one stage model (ResolvedStage.build_model), the image tower at the
    engine tower's patch size (an attribute, right even while the weights are partitioned)."""
    plain = stage.build_model(read_files=False, train=False)
    image_shadow = find_crate_tower(plain) if image is not None else None
    if image_shadow is not None:
        image_shadow.set_patch_size(image.patch_size)   # the same unless the weights came at another patch size
    return image_shadow, find_crate_text_tower(plain) if text is not None else None


@dataclass
class ProbedTower:
    """One tower under the probe: the engine's tower, its fixed inputs (rank 0), how to diagnose it, where to log."""
    key: str                                   # metrics.jsonl key (TOWER_KEYS)
    tower: torch.nn.Module                     # the engine's (ZeRO-3: partitioned parameters)
    inputs: Optional[torch.Tensor]             # rank 0 only: images, or token ids of the probe captions
    diagnose: Callable[[torch.nn.Module, torch.Tensor], dict]
    count_name: str                            # 'probe_images' / 'probe_captions'
    shadow: Optional[torch.nn.Module] = None   # ZeRO-3, rank 0: a plain copy to gather the weights into
    seconds: float = 0.0


class WhiteboxProbe:
    """Computes and logs the diagnostics of one stage's CRATE-alpha towers on fixed probe batches."""

    def __init__(self, cfg, stage, engine, dist):
        self.every = cfg.logging.diagnostics_every
        self.dist = dist
        self.zero3 = stage.zero_stage == 3
        count, main = cfg.logging.diagnostics_images, dist.is_main
        image, text = find_crate_tower(engine), find_crate_text_tower(engine)
        # ZeRO-3: plain towers on rank 0 to load the gathered weights into (the engine's hold shards only)
        shadows = shadow_towers(stage, image, text) if self.zero3 and main else (None, None)
        self.towers = []
        if image is not None:
            images = _probe_images(cfg, stage.image_size, engine, count) if main else None
            self.towers.append(ProbedTower(WHITEBOX_KEY, image, images, layer_diagnostics, "probe_images",
                                           shadows[0]))
        if text is not None:
            tokens = _probe_tokens(cfg, engine, count) if main else None
            self.towers.append(ProbedTower(WHITEBOX_TEXT_KEY, text, tokens, text_layer_diagnostics, "probe_captions",
                                           shadows[1]))
        for probed in self.towers:
            if probed.shadow is not None:
                probed.shadow.to(dist.device)

    @classmethod
    def for_stage(cls, cfg, stage, engine, dist, log) -> Optional["WhiteboxProbe"]:
        """The stage's probe, or None when diagnostics are off or neither tower is CRATE-alpha (said once)."""
        if not cfg.logging.diagnostics_every:
            return None
        if find_crate_tower(engine) is None and find_crate_text_tower(engine) is None:
            log.print("[whitebox] neither tower is CRATE-alpha: logging.diagnostics_every is ignored")
            return None
        return cls(cfg, stage, engine, dist)

    def _tower(self, probed: ProbedTower):
        if not self.zero3:
            return probed.tower
        # imported here: this module is also loaded to draw plots from metrics files, where DeepSpeed (a second to
        # import) has no use
        import deepspeed

        with deepspeed.zero.GatheredParameters(list(probed.tower.parameters()), modifier_rank=None):
            if self.dist.is_main:
                probed.shadow.load_state_dict({k: v.detach().clone() for k, v in probed.tower.state_dict().items()})
        return probed.shadow

    def due(self, step: int, last: bool) -> bool:
        """Whether this step is measured (every N steps and at the stage's end); the same on every rank."""
        return step % self.every == 0 or last

    def measure(self) -> dict:
        """{'whitebox': ..., 'whitebox_text': ...} per-layer diagnostics of each CRATE-alpha tower on rank 0 ({}
        elsewhere); all ranks must call it under ZeRO-3."""
        out = {}
        for probed in self.towers:
            t0 = time.perf_counter()
            tower = self._tower(probed)  # a collective under ZeRO-3
            if not self.dist.is_main:
                continue
            was_training = tower.training
            tower.eval()
            result = probed.diagnose(tower, probed.inputs)
            tower.train(was_training)
            probed.seconds += time.perf_counter() - t0
            out[probed.key] = {**result, probed.count_name: len(probed.inputs), "seconds_total": probed.seconds}
        return out


def whitebox_scalars(record: dict) -> dict:
    """TensorBoard tags -> values of a metrics record's per-layer diagnostics (none when it has none)."""
    out = {}
    for key, (tag, _) in TOWER_KEYS.items():
        result = record.get(key) or {}
        for i, (rate, l0) in enumerate(zip(result.get("coding_rate", []), result.get("l0", []))):
            out[f"{tag}/coding_rate/layer{i:02d}"] = rate
            out[f"{tag}/l0/layer{i:02d}"] = l0
    return out


def whitebox_keys(records: list[dict]) -> list[str]:
    """The towers (TOWER_KEYS) whose diagnostics some record holds, image first."""
    return [key for key in TOWER_KEYS if any(r.get(key) for r in records)]


def draw_whitebox_curves(records: list[dict], axes, points: int = 5, key: str = WHITEBOX_KEY) -> bool:
    """Per-layer coding rate and normalised L0 of one tower (`key`) at up to `points` moments of training on two
    matplotlib axes."""
    recs = [r for r in records if r.get(key)]
    if not recs:
        return False
    picks = sorted({round(i * (len(recs) - 1) / max(points - 1, 1)) for i in range(points)})
    cmap = __import__("matplotlib").colormaps["viridis"]
    for j, i in enumerate(picks):
        r = {**recs[i], **recs[i][key]}
        layers = range(1, len(r["coding_rate"]) + 1)
        color = cmap(j / max(len(picks) - 1, 1))
        label = f"{r['samples_seen']:,} samples (stage {r['stage_index']})"
        axes[0].errorbar(layers, r["coding_rate"], yerr=r["coding_rate_std"], color=color, marker="o", ms=3,
                         lw=1, capsize=2, label=label)
        axes[1].plot(layers, r["l0"], color=color, marker="o", ms=3, lw=1, label=label)
    tower = TOWER_KEYS[key][1]
    axes[0].set_title(f"{tower}: coding rate R^c of U^T LN(Z) (probe batch)", fontsize=9)
    axes[1].set_title(f"{tower}: ISTA code, normalised L0 = 1 - zero fraction", fontsize=9)
    for ax in axes:
        ax.set_xlabel("layer")
        ax.set_xticks(list(layers))
        ax.legend(fontsize=7)
    return True
