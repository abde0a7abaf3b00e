"""Multi-process body of tests/test_train_elastic.py and bench/bench_elastic_resume.py, launched with torchrun
(not collected by pytest).

    elastic_workers.py CONFIG OUT_DIR [--resume X] [--dump-at TAG] [--set KEY=VALUE ...]

The training run of CONFIG (crate_clip.train.loop.stage_loop.run_training, the real stream, engine and checkpoints).
Observed, not changed: every rank appends the __key__s of each batch it takes to OUT_DIR/keys_rank<r>.jsonl;
after a checkpoint is loaded (a resume) the engine's state is written to OUT_DIR/state_loaded.json, and after
the save of checkpoint TAG to OUT_DIR/state_saved.json: sha256 of every parameter's full fp32 master value and
AdamW moments, the step counts, the optimizer groups' settings, the lr, the schedule position, DeepSpeed's
global step, and the buffers (a locked text tower), plus the seconds the load took. global_batches and losses
read these records back.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import crate_clip  # noqa: E402,F401
from crate_clip.train.loop import stage_loop  # noqa: E402
from crate_clip.train.run.run_config import load_run_config  # noqa: E402


class KeyRecorder:
    """The real training stream; each batch's sample keys appended to a JSONL file as it is taken."""

    def __init__(self, stream, path: Path):
        self.stream, self.path = stream, path

    def __iter__(self):
        for batch in self.stream:
            state = self.stream.state_dict()
            with open(self.path, "a") as f:
                f.write(json.dumps({"epoch": state["epoch"], "batch": state["batches"],
                                    "keys": self.stream.batch_keys}) + "\n")
            yield batch

    def __getattr__(self, name):   # state_dict, load_state_dict, skip counters...: the stream's own
        return getattr(self.stream, name)


def _digest(tensor: torch.Tensor) -> str:
    return hashlib.sha256(tensor.detach().float().contiguous().cpu().numpy().tobytes()).hexdigest()


def engine_state(engine) -> dict:
    """Digests of the engine's full training state (every rank must call it: the full tensors are gathered)."""
    from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state

    optimizer = engine.optimizer
    if hasattr(optimizer, "_hp_optimizer_states_linked"):
        # ZeRO 1/2 link every group's optimizer-state views after the first group's first step, when the later
        # groups have no state yet; linking again lets safe_get_full_optimizer_state read every group
        optimizer._hp_optimizer_states_linked = False
        optimizer._lazy_init_hp_params_optimizer_state()
    base = getattr(optimizer, "optimizer", optimizer)
    tensors = {}
    for name, param in engine.module.named_parameters():
        full = safe_get_full_fp32_param(param)   # None without ZeRO: the parameter and its state are whole
        tensors[f"{name}:fp32"] = _digest(param if full is None else full)
        for key in ("exp_avg", "exp_avg_sq"):
            state = base.state[param][key] if full is None else safe_get_full_optimizer_state(param, key)
            tensors[f"{name}:{key}"] = _digest(state)
    buffers = {}
    for name, buffer in engine.module.named_buffers():
        owner, _, attr = name.rpartition(".")
        if attr not in engine.module.get_submodule(owner)._non_persistent_buffers_set:
            buffers[name] = _digest(buffer)
    return {"tensors": tensors, "buffers": buffers,
            "steps": sorted({float(s["step"]) for s in base.state.values() if "step" in s}),
            # torch's AdamW increments a step tensor in place: two states sharing one would count twice
            "shared_step_tensors": len(base.state) - len({id(s["step"]) for s in base.state.values()}),
            "groups": [{k: g[k] for k in ("lr", "weight_decay", "betas", "eps", "initial_lr")}
                       for g in base.param_groups],
            "lr": engine.get_lr(), "schedule_step": engine.lr_scheduler.last_epoch,
            "global_steps": engine.global_steps}


def global_batches(out: Path, world: int) -> dict:
    """(epoch, batch in epoch) -> the global batch's sample keys recorded in OUT_DIR: the ranks' batches in rank
    order, for the batches every rank took."""
    ranks = [{(r["epoch"], r["batch"]): r["keys"] for r in map(json.loads, (out / f"keys_rank{k}.jsonl").open())}
             for k in range(world)]
    steps = set.intersection(*(set(r) for r in ranks))
    return {step: [key for r in ranks for key in r[step]] for step in sorted(steps)}


def losses(run_dir: Path) -> dict:
    """Global step -> training loss, from a run folder's metrics.jsonl."""
    return {r["step"]: r["loss"] for r in map(json.loads, (run_dir / "metrics.jsonl").open())}


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("config")
    p.add_argument("out")
    p.add_argument("--resume", default=None)
    p.add_argument("--dump-at", default=None)
    p.add_argument("--set", dest="overrides", action="append", default=[])
    args = p.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    load, save = stage_loop._load_checkpoint, stage_loop._save

    def write_state(engine, name: str, **extra) -> None:
        state = engine_state(engine)
        if torch.distributed.get_rank() == 0:
            (out / name).write_text(json.dumps({**state, **extra}, indent=1))

    def loading(run, engine, stage, tag_dir, universal, job_wide=()):
        start = time.perf_counter()
        rank_state = load(run, engine, stage, tag_dir, universal, job_wide)
        seconds = time.perf_counter() - start
        write_state(engine, "state_loaded.json", load_seconds=seconds, universal=universal)
        return rank_state

    def saving(loop, stream_state=None):
        tag_dir = save(loop, stream_state)
        if tag_dir.name == args.dump_at:
            write_state(loop.engine, "state_saved.json")
        return tag_dir

    def recording(cfg, stage, dist):
        return KeyRecorder(stage_loop.default_stream_factory(cfg, stage, dist), out / f"keys_rank{dist.rank}.jsonl")

    stage_loop._load_checkpoint, stage_loop._save = loading, saving
    cfg = load_run_config(args.config, args.overrides)
    stage_loop.run_training(cfg, resume=args.resume, stream_factory=recording)
    return 0


if __name__ == "__main__":
    sys.exit(main())
