"""Multi-process bodies of the training tests, launched with torchrun (not collected by pytest).

    train_workers.py zero OUT.json          ZeRO 1/2/3 engines: per-rank footprint + losses of 3 steps
    train_workers.py nonfinite CONFIG.yaml  a run whose stream yields NaN/inf images on rank 1 at set steps
    train_workers.py lock OUT_DIR           ZeRO 2/3 engines with a locked pretrained text tower vs trainable
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import crate_clip  # noqa: E402,F401
from bench import zero_footprint  # noqa: E402  (test and bench helper, not library code)
from crate_clip.train.engine import build_engine, init_distributed, model_dtype  # noqa: E402
from crate_clip.train.run_config import config_from_dict, load_run_config  # noqa: E402
from crate_clip.train.stage_loop import (_make_loss, build_stage_model, default_stream_factory,  # noqa: E402
                                         forward_loss, run_training, train_step, NonFiniteLossError)

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
        stage = cfg.stages[0]
        engine = build_engine(build_stage_model(cfg, stage, None), cfg, stage, dist)
        loss_fn, dtype = _make_loss(dist), model_dtype(precision)
        images, tokens = _batch(dist.rank, 0)
        loss, _ = forward_loss(engine, loss_fn, images.to(dtype), tokens)
        engine.backward(loss)
        grad_bytes = zero_footprint.gradient_bytes(engine)
        engine.step()
        losses = [float(loss)]
        for step in (1, 2):
            images, tokens = _batch(dist.rank, step)
            losses.append(train_step(engine, loss_fn, images, tokens, dist, dtype)[0])
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
    from crate_clip.train.checkpoints import consolidated_state_dict
    from crate_clip.train.optim import param_groups
    from crate_clip.train.text_lock import is_text_key

    dist = init_distributed()
    source = read_state_dict(out_dir / "text.pt")
    text_keys = [k for k in source if is_text_key(k)] + ["logit_scale"]
    results = []
    for zs, precision, lock in LOCK_CASES:
        cfg = _lock_cfg(zs, precision, lock, out_dir / "text.pt")
        stage = cfg.stages[0]
        model = build_stage_model(cfg, stage, None)
        trained = [n for g in param_groups(model, 0.2) for n in g["names"]]
        engine = build_engine(model, cfg, stage, dist)
        loss_fn, dtype = _make_loss(dist), model_dtype(precision)
        images, tokens = _batch(dist.rank, 0, batch=4)
        loss, _ = forward_loss(engine, loss_fn, images.to(dtype), tokens)
        engine.backward(loss)
        grad_bytes = zero_footprint.gradient_bytes(engine)
        engine.step()
        losses = [float(loss)] + [train_step(engine, loss_fn, images, tokens, dist, dtype)[0] for _ in range(5)]
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
    """The real training stream, with the images of chosen batches made NaN or inf on rank 1 only."""

    def __init__(self, stream, rank: int, poison: dict[int, float]):
        self.stream, self.rank, self.poison = stream, rank, poison

    def __iter__(self):
        for images, tokens in self.stream:
            batch_no = self.stream.state_dict()["batches"]  # 1-based: batches consumed so far
            if self.rank == 1 and batch_no in self.poison:
                images = torch.full_like(images, self.poison[batch_no])
            yield images, tokens

    def state_dict(self):
        return self.stream.state_dict()

    def load_state_dict(self, state):
        self.stream.load_state_dict(state)

    def skip_counts(self):
        return self.stream.skip_counts()


def nonfinite_run(config: Path) -> int:
    """Batch 3 is NaN, batches 7, 8, 9 are inf (rank 1): one skip, then a stop after 3 in a row."""
    cfg = load_run_config(config)
    poison = {3: float("nan"), 7: float("inf"), 8: float("nan"), 9: float("inf")}

    def factory(cfg, stage, index, dist):
        return PoisonedStream(default_stream_factory(cfg, stage, index, dist), dist.rank, poison)

    try:
        run_training(cfg, stream_factory=factory)
    except NonFiniteLossError as exc:
        print(f"NONFINITE-STOP: {exc}", flush=True)
        return 3
    return 0


if __name__ == "__main__":
    mode, arg = sys.argv[1], Path(sys.argv[2])
    if mode == "zero":
        zero_probe(arg)
        code = 0
    elif mode == "lock":
        lock_probe(arg)
        code = 0
    else:
        code = nonfinite_run(arg)
    torch.distributed.destroy_process_group()
    sys.exit(code)
