"""Multi-process bodies of the training tests, launched with torchrun (not collected by pytest).

    train_workers.py zero OUT.json          ZeRO 1/2/3 engines: per-rank footprint + losses of 3 steps
    train_workers.py accum OUT.json         gradients / updated weights with k = 4 micro-batches vs k = 1
    train_workers.py gradpoison OUT_DIR     a finite loss with a NaN gradient on rank 1 at step 1, ZeRO 0-3
    train_workers.py lock OUT_DIR           ZeRO 2/3 engines with a locked pretrained text tower vs trainable
    train_workers.py evaluate WORKDIR       eval_fixtures.distributed_worker: distributed zero-shot, ZeRO 0/2/3
"""
from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import crate_clip  # noqa: E402,F401
from bench import zero_footprint  # noqa: E402  (test and bench helper, not library code)
from crate_clip.train.stage_setup.engine import build_engine, init_distributed, model_dtype  # noqa: E402
from crate_clip.train.run.run_config import config_from_dict, load_run_config  # noqa: E402
from crate_clip.train.loop.stage_loop import _make_loss, default_stream_factory, run_training  # noqa: E402
from crate_clip.train.stage_setup.stage_model import resolve_stage  # noqa: E402
from crate_clip.train.loop.train_step import forward_loss, train_step  # noqa: E402

ZERO_CASES = [(1, "fp32"), (2, "fp32"), (3, "fp32"), (1, "bf16"), (2, "bf16"), (3, "bf16")]


def _batch(rank: int, step: int, size: int = 16, batch: int = 4, context: int = 16):
    g = torch.Generator().manual_seed(1000 * rank + step)
    return torch.randn(batch, 3, size, size, generator=g), torch.randint(1, 2000, (batch, context), generator=g)


def zero_probe(out: Path) -> None:
    """Build one engine per (ZeRO stage, precision); measure what each rank holds; train 3 identical steps."""
    dist = init_distributed()
    results = []
    for zs, precision in ZERO_CASES:
        cfg = config_from_dict({
            "data": {"sources": ["unused"]}, "precision": precision,
            "deepspeed": {"zero_stage": zs,
                          "overrides": {"zero_optimization": {"stage3_param_persistence_threshold": 0}}},
            "stages": [{"name": "s", "image_size": 16, "context_length": 16, "samples": 64, "global_batch": 8,
                        "lr": 1e-3, "warmup_steps": 1}]}, check_paths=False)
        stage = resolve_stage(cfg, 0, dist.world_size)
        engine = build_engine(stage.build_model(), cfg, stage, dist)
        loss_fn, dtype = _make_loss(dist), model_dtype(precision)
        images, tokens = _batch(dist.rank, 0)
        loss, _ = forward_loss(engine, loss_fn, images.to(dtype), tokens)
        engine.backward(loss)
        grad_bytes = zero_footprint.gradient_bytes(engine)
        engine.step()
        losses = [float(loss)]
        for step in (1, 2):
            images, tokens = _batch(dist.rank, step)
            losses.append(train_step(engine, loss_fn, images, tokens, dist, dtype).loss)
        record = {"rank": dist.rank, "world_size": dist.world_size, "precision": precision,
                  "optimizer": type(engine.optimizer).__name__, "losses": losses,
                  "lr": engine.get_lr()[0], **zero_footprint.footprint(engine, grad_bytes)}
        results.append(record)
        engine.destroy()
    gathered = [None] * dist.world_size
    torch.distributed.all_gather_object(gathered, results)
    if dist.rank == 0:
        out.write_text(json.dumps([r for rank_results in gathered for r in rank_results], indent=1))


LOCK_CASES = [(2, "bf16", True), (2, "bf16", False), (3, "bf16", True), (3, "bf16", False)]


def _lock_cfg(zs: int, precision: str, lock: bool, text_file: Path):
    return config_from_dict({
        "data": {"sources": ["unused"]}, "precision": precision,
        "model": {"text_pretrained": str(text_file), "lock_text": lock, "lock_logit_scale": lock},
        "deepspeed": {"zero_stage": zs,
                      "overrides": {"zero_optimization": {"stage3_param_persistence_threshold": 0}}},
        "stages": [{"name": "s", "image_size": 16, "context_length": 16, "samples": 64, "global_batch": 8,
                    "lr": 2e-3, "warmup_steps": 1}]}, check_paths=False)


def lock_probe(out_dir: Path) -> None:
    """Per case: 6 steps on one fixed batch per rank; losses, footprint (and the frozen buffers' bytes), the
    parameters the optimizer updates, and whether the saved + consolidated text tower equals the source."""
    from crate_clip.models.clip_factory import read_state_dict
    from crate_clip.train.checkpointing.checkpoints import consolidated_state_dict
    from crate_clip.train.stage_setup.optim import param_groups
    from crate_clip.train.stage_setup.text_lock import is_text_key

    dist = init_distributed()
    source = read_state_dict(out_dir / "text.pt")
    text_keys = [k for k in source if is_text_key(k)] + ["logit_scale"]
    results = []
    for zs, precision, lock in LOCK_CASES:
        cfg = _lock_cfg(zs, precision, lock, out_dir / "text.pt")
        stage = resolve_stage(cfg, 0, dist.world_size)
        model = stage.build_model()
        trained = [n for g in param_groups(model, 0.2) for n in g["names"]]
        engine = build_engine(model, cfg, stage, dist)
        loss_fn, dtype = _make_loss(dist), model_dtype(precision)
        images, tokens = _batch(dist.rank, 0, batch=4)
        loss, _ = forward_loss(engine, loss_fn, images.to(dtype), tokens)
        engine.backward(loss)
        grad_bytes = zero_footprint.gradient_bytes(engine)
        engine.step()
        losses = [float(loss)] + [train_step(engine, loss_fn, images, tokens, dist, dtype).loss for _ in range(5)]
        live = {**dict(engine.module.named_parameters()), **dict(engine.module.named_buffers())}
        tag = f"zs{zs}-{precision}-{'lock' if lock else 'train'}"
        engine.save_checkpoint(str(out_dir / "ckpt"), tag=tag)
        record = {"rank": dist.rank, "zero_stage": zs, "precision": precision, "lock": lock, "losses": losses,
                  "buffer_bytes": zero_footprint.buffer_bytes(engine),
                  "frozen_live_equal": all(torch.equal(live[k].float().reshape(-1), source[k].float().reshape(-1))
                                           for k in text_keys if k in live and lock),
                  "text_requires_grad": sorted(k for k, p in engine.module.named_parameters()
                                               if is_text_key(k) and p.requires_grad),
                  "trained_names": trained, **zero_footprint.footprint(engine, grad_bytes)}
        engine.destroy()
        torch.distributed.barrier()
        if dist.rank == 0:
            state = consolidated_state_dict(out_dir / "ckpt" / tag)
            record["saved_text_equal"] = all(torch.equal(state[k].reshape(-1), source[k].float().reshape(-1))
                                             for k in text_keys)
            record["saved_keys"] = sorted(state)
        results.append(record)
    gathered = [None] * dist.world_size
    torch.distributed.all_gather_object(gathered, results)
    if dist.rank == 0:
        (out_dir / "lock.json").write_text(json.dumps([r for rank in gathered for r in rank], indent=1))


class PoisonedStream:
    """The real training stream, with the images of chosen batches made NaN or inf on one rank (`poisoned_rank`: 1 in
    a 2-rank job, whose rank 0 reads finite images; 0 in a world of one)."""

    def __init__(self, stream, rank: int, poison: dict[int, float], poisoned_rank: int = 1):
        self.stream, self.rank, self.poison, self.poisoned_rank = stream, rank, poison, poisoned_rank

    def __iter__(self):
        for images, tokens in self.stream:
            batch_no = self.stream.state_dict()["batches"]  # 1-based: batches consumed so far
            if self.rank == self.poisoned_rank and batch_no in self.poison:
                images = torch.full_like(images, self.poison[batch_no])
            yield images, tokens

    def state_dict(self):
        return self.stream.state_dict()

    def load_state_dict(self, state):
        self.stream.load_state_dict(state)

    def skip_counts(self):
        return self.stream.skip_counts()


TINY, CRATE_TEXT = "CRATE-alpha-CLIPA-tiny", "CRATE-alpha-CLIPA-tiny-crate-text"
# (ZeRO stage, text tower frozen, model): the last with a CRATE-alpha text tower
ACCUM_CASES = [(1, False, TINY), (2, False, TINY), (3, False, TINY), (2, True, TINY), (3, False, CRATE_TEXT)]
TEXT_FREE = ("logit_scale", "logit_bias")


def _one_stage_cfg(zs: int, precision: str, micro=None, global_batch: int = 16, model: str = TINY):
    return config_from_dict({
        "model": {"name": model}, "data": {"sources": ["unused"]}, "precision": precision,
        "deepspeed": {"zero_stage": zs,
                      "overrides": {"zero_optimization": {"stage3_param_persistence_threshold": 0}}},
        "stages": [{"name": "s", "image_size": 16, "context_length": 16, "samples": 4 * global_batch,
                    "global_batch": global_batch, "micro_batch": micro, "lr": 1e-3, "warmup_steps": 1,
                    "image_mask": "random", "image_mask_ratio": 0.5}]}, check_paths=False)


def _freeze_text(model) -> None:
    for name, p in model.named_parameters():
        if not name.startswith("visual.") and name not in TEXT_FREE:
            p.requires_grad_(False)


def _full_grads(engine) -> dict:
    from deepspeed.utils import safe_get_full_grad
    out = {}
    for name, p in engine.module.named_parameters():
        if p.requires_grad:
            g = safe_get_full_grad(p)
            out[name] = None if g is None else g.detach().float().clone()
    return out


def _full_weights(engine) -> dict:
    from deepspeed.utils import safe_get_full_fp32_param
    out = {}
    for name, p in engine.module.named_parameters():
        w = safe_get_full_fp32_param(p)  # None for a frozen parameter: not partitioned below ZeRO-3
        out[name] = (p if w is None else w).detach().float().clone()
    return out


def _max_diff(a: dict, b: dict) -> tuple[float, float]:
    """(max |a - b|, max |a|) over the tensors both hold."""
    diff = scale = 0.0
    for name, x in a.items():
        y = b.get(name)
        if x is None or y is None:
            continue
        diff = max(diff, (x - y).abs().max().item())
        scale = max(scale, x.abs().max().item())
    return diff, scale


def accum_probe(out: Path) -> None:
    """Per case: one step at k = 1 (micro 8) and one at k = 4 (micro 2), global batch 16 on 2 ranks, same
    data and RNG seed, random image mask (50%): compare the full gradients before the step and the weights."""
    dist = init_distributed()
    loss_fn = _make_loss(dist)
    results = []
    for zs, frozen, model_name in ACCUM_CASES:
        runs = {}
        for micro in (8, 2):
            cfg = _one_stage_cfg(zs, "fp32", micro, model=model_name)
            stage = resolve_stage(cfg, 0, dist.world_size)
            model = stage.build_model()
            if frozen:
                _freeze_text(model)
            engine = build_engine(model, cfg, stage, dist)
            grads = {}
            images, tokens = _batch(dist.rank, 0, batch=8)
            torch.manual_seed(77 + dist.rank)  # image token masks: same draws for both k
            res = train_step(engine, loss_fn, images, tokens, dist, torch.float32,
                             before_step=lambda e: grads.update(_full_grads(e)))
            runs[micro] = {"k": engine.gradient_accumulation_steps(), "loss": res.loss, "grads": grads,
                           "weights": _full_weights(engine), "grad_norm": res.grad_norm,
                           "n_grads": sum(g is not None for g in grads.values())}
            engine.destroy()
        g_diff, g_scale = _max_diff(runs[8]["grads"], runs[2]["grads"])
        w_diff, _ = _max_diff(runs[8]["weights"], runs[2]["weights"])
        w_moved, _ = _max_diff(runs[8]["weights"], _full_weights_of_fresh(zs, dist, model_name))
        results.append({"rank": dist.rank, "zero_stage": zs, "frozen_text": frozen, "model": model_name,
                        "k": [runs[8]["k"], runs[2]["k"]], "loss": [runs[8]["loss"], runs[2]["loss"]],
                        "grad_norm": [runs[8]["grad_norm"], runs[2]["grad_norm"]],
                        "n_grads": [runs[8]["n_grads"], runs[2]["n_grads"]],
                        "grad_max_diff": g_diff, "grad_max_abs": g_scale, "weight_max_diff": w_diff,
                        "weight_moved": w_moved})
    gathered = [None] * dist.world_size
    torch.distributed.all_gather_object(gathered, results)
    if dist.rank == 0:
        out.write_text(json.dumps([r for rank_results in gathered for r in rank_results], indent=1))


def _full_weights_of_fresh(zs: int, dist, model: str) -> dict:
    """The initial weights (to show the step moved them)."""
    cfg = _one_stage_cfg(zs, "fp32", 8, model=model)
    return {n: p.detach().clone() for n, p in resolve_stage(cfg, 0, dist.world_size).build_model().named_parameters()}


# (ZeRO stage, precision, micro-batch): every stage; ZeRO 1 with k = 2 micro-batches; the demo's ZeRO 0 fp32
GRADPOISON_CASES = [(0, "fp32", None), (1, "fp32", 2), (2, "bf16", None), (3, "fp32", None)]


def _norm_of(grads: dict) -> float:
    """The global L2 norm of the full (rank-averaged) gradients, in float64."""
    return sum(float(g.double().pow(2).sum()) for g in grads.values() if g is not None) ** 0.5


def gradpoison_probe(out_dir: Path) -> None:
    """Three steps per ZeRO stage; at step 1 rank 1's gradient of one weight is made NaN (the loss stays finite):
    the step must be skipped on every rank, counted, the weights kept, the schedule moved. Each step's reported
    norm beside the global L2 norm of the full gradients before clipping (read in before_step), and the ZeRO 0
    case's final weights beside the ZeRO 3 case's (the same fp32 math, clipped by train_step and by DeepSpeed).
    Then the real loop once per OUT_DIR/run_z*.yaml, its stream NaN on rank 1 at batch 2 (metrics.jsonl)."""
    dist = init_distributed()
    loss_fn = _make_loss(dist)
    results, final = [], {}
    for zs, precision, micro in GRADPOISON_CASES:
        cfg = _one_stage_cfg(zs, precision, micro, global_batch=8)
        stage = resolve_stage(cfg, 0, dist.world_size)
        engine = build_engine(stage.build_model(), cfg, stage, dist)
        param = dict(engine.module.named_parameters())["visual.head.proj.weight"]
        poison = {"on": False}
        param.register_hook(lambda g: g * float("nan") if poison["on"] and dist.rank == 1 else g)
        steps = []
        for step in range(3):
            poison["on"] = step == 1
            before, grads = _full_weights(engine), {}
            images, tokens = _batch(dist.rank, step)
            res = train_step(engine, loss_fn, images, tokens, dist, model_dtype(precision),
                             before_step=lambda e: grads.update(_full_grads(e)))
            moved, _ = _max_diff(before, _full_weights(engine))
            steps.append({"loss": res.loss, "skipped": res.skipped, "grad_norm": res.grad_norm,
                          "true_norm": _norm_of(grads), "weights_moved": moved, "lr": engine.get_lr()[0]})
        final[zs] = _full_weights(engine)
        results.append({"rank": dist.rank, "zero_stage": zs, "precision": precision, "steps": steps})
        engine.destroy()
    results[0]["weights_vs_zero3"] = _max_diff(final[0], final[3])[0]
    gathered = [None] * dist.world_size
    torch.distributed.all_gather_object(gathered, results)
    if dist.rank == 0:
        (out_dir / "gradpoison.json").write_text(json.dumps([r for rank in gathered for r in rank], indent=1))
    for config in sorted(out_dir.glob("run_z*.yaml")):
        def factory(cfg, stage, dist):
            return PoisonedStream(default_stream_factory(cfg, stage, dist), dist.rank, {2: float("nan")})

        run_training(load_run_config(config), stream_factory=factory, dist=dist)


if __name__ == "__main__":
    mode, arg = sys.argv[1], Path(sys.argv[2])
    if mode in ("zero", "accum", "gradpoison"):
        {"zero": zero_probe, "accum": accum_probe, "gradpoison": gradpoison_probe}[mode](arg)
        code = 0
    elif mode == "lock":
        lock_probe(arg)
        code = 0
    elif mode == "evaluate":   # ends the process itself
        from eval_fixtures import distributed_worker
        distributed_worker(str(arg))
    else:
        raise SystemExit(f"train_workers.py: unknown mode {mode!r}")
    torch.distributed.destroy_process_group()
    # leave without the interpreter's teardown: with every output written, C++ destructors at exit aborted a
    # worker now and then ("terminate called without an active exception", SIGABRT; ~1 in 20 runs of the
    # gradpoison and ZeRO probes, their JSON already on disk), which torchrun reports as a failed job
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
