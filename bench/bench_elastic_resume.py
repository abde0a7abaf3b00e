"""Elastic resume (CPU, gloo): the time to resume a checkpoint at another world size (DeepSpeed's universal
conversion + load) against a resume at the same size, for the tiny model and a B/16 image tower; and the
global-batch sample keys of the 50 steps after a resume at 1, 2 and 4 processes against the uninterrupted run.
Writes the `elastic-resume` section of BENCHMARKS.md.

    .venv/bin/python bench/bench_elastic_resume.py            # ~9 min on 2 cores, 18 GB in /tmp

Every run is the real trainer (crate_clip.train.loop.stage_loop.run_training under torchrun) through
tests/elastic_workers.py, which records each batch's keys, the engine state after a load and the load's seconds.
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))
sys.path.insert(0, str(ROOT / "tests"))

from elastic_workers import global_batches, losses  # noqa: E402
from report import machine_line, markdown_table, write_section  # noqa: E402
from train_fixtures import run_env, torchrun_cmd  # noqa: E402

WORKER = ROOT / "tests" / "elastic_workers.py"
FASHION_MNIST = "/usr/share/datasets/fashion-mnist"
# (label, model, image size, context length): the tiny model, and CRATE-alpha-B/16 with open_clip's 12-layer
# text tower (CRATE-alpha-CLIP-B-16: 136 M trainable parameters) at a small image size: the load is timed, not steps
MODELS = [("tiny", "CRATE-alpha-CLIPA-tiny", 16, 16), ("B/16 image tower", "CRATE-alpha-CLIP-B-16", 32, 16)]
BATCH, CANONICAL = 16, 8
KEY_STEPS = 50


def _config(root: Path, name: str, data: Path, model: str, image_size: int, context: int, steps: int,
            every: int) -> Path:
    """A one-stage ZeRO-2 fp32 run config of `steps` steps, a checkpoint every `every` steps (all kept)."""
    cfg = {"run": {"name": name, "output_dir": str(root / name), "seed": 3}, "model": {"name": model},
           "data": {"sources": [str(data)], "num_workers": 0, "shuffle_buffer": 20, "canonical_streams": CANONICAL},
           "stages": [{"name": "s", "image_size": image_size, "context_length": context, "samples": BATCH * steps,
                       "global_batch": BATCH, "lr": 1e-3, "warmup_steps": 1}],
           "precision": "fp32", "deepspeed": {"zero_stage": 2},
           "checkpoint": {"every_steps": every, "keep_last": steps}, "eval": {"evals": []},
           "logging": {"every_steps": 1, "progress": False, "tensorboard": False, "plot": False}}
    path = root / f"{name}.yaml"
    path.write_text(yaml.safe_dump(cfg, sort_keys=False))
    return path


def _launch(nproc: int, config: Path, out: Path, *extra: str) -> float:
    """One torchrun job of the worker; returns its wall seconds."""
    cmd = [str(WORKER) if c.endswith("train_workers.py") else c for c in torchrun_cmd(nproc, str(config), str(out),
                                                                                       *extra)]
    start = time.perf_counter()
    proc = subprocess.run(cmd, env=run_env(), cwd=ROOT, capture_output=True, text=True, timeout=3600)
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}")
    return time.perf_counter() - start


def _resume(root: Path, config: Path, run: str, tag: str, name: str, nproc: int) -> dict:
    """Resume checkpoint `tag` of run `run` with `nproc` processes; returns the loaded state record."""
    _launch(nproc, config, root / f"{name}.out", "--resume", str(root / run / "checkpoints" / tag),
            "--set", f"run.output_dir={root / name}")
    return json.loads((root / f"{name}.out" / "state_loaded.json").read_text())


def _parameter_count(model: str, image_size: int, context: int) -> int:
    import crate_clip  # noqa: F401  (registers the model configs)
    from crate_clip.models import create_clip
    return sum(p.numel() for p in create_clip(model, image_size=image_size, context_length=context).parameters())


def resume_times(root: Path, data: Path) -> list[list[str]]:
    """Per model: a 2-process run of 3 steps; its step-2 checkpoint resumed at 2 processes (the baseline), then at
    1 (conversion + load), then at 1 again (the converted folder: load only)."""
    rows = []
    for label, model, size, context in MODELS:
        tag = "stage0-step00000002"
        config = _config(root, f"time-{model}", data, model, size, context, steps=3, every=2)
        _launch(2, config, root / f"time-{model}.out", "--dump-at", tag)
        saved = json.loads((root / f"time-{model}.out" / "state_saved.json").read_text())
        same = _resume(root, config, f"time-{model}", tag, f"time-{model}-at2", 2)
        first = _resume(root, config, f"time-{model}", tag, f"time-{model}-at1", 1)
        again = _resume(root, config, f"time-{model}", tag, f"time-{model}-at1-again", 1)
        exact = all(r["tensors"] == saved["tensors"] and r["steps"] == saved["steps"] for r in (same, first, again))
        base, values = same["load_seconds"], _parameter_count(model, size, context)
        for what, record in (("2 -> 2 processes (same size, DeepSpeed's plain load)", same),
                             ("2 -> 1: conversion to universal + load", first),
                             ("2 -> 1 again: load of the converted folder", again)):
            rows.append([label, f"{values / 1e6:.1f} M in {len(saved['tensors']) // 3}", what,
                         f"{record['load_seconds']:.1f}",
                         f"{record['load_seconds'] / base:.1f}x", "yes" if exact else "NO"])
    return rows


def key_sequences(root: Path, data: Path) -> list[list[str]]:
    """The uninterrupted 2-process run of 4 + 50 steps; its step-4 checkpoint resumed at 1, 2 and 4 processes."""
    _, model, size, context = MODELS[0]
    tag = "stage0-step00000004"
    config = _config(root, "keys", data, model, size, context, steps=4 + KEY_STEPS, every=4)
    _launch(2, config, root / "keys.out")
    ref, ref_losses = global_batches(root / "keys.out", 2), losses(root / "keys")
    rows = []
    for nproc in (1, 2, 4):
        _resume(root, config, "keys", tag, f"keys-at{nproc}", nproc)
        got, got_losses = global_batches(root / f"keys-at{nproc}.out", nproc), losses(root / f"keys-at{nproc}")
        same = sum(ref[step] == keys for step, keys in got.items())
        worst = max(abs(loss - ref_losses[s]) / abs(ref_losses[s]) for s, loss in got_losses.items())
        rows.append([str(nproc), f"{same} / {len(got)}", "identical" if same == len(got) == KEY_STEPS else "DIFFERS",
                     f"{worst:.1e}"])
    return rows


def section(times: list[list[str]], keys: list[list[str]]) -> str:
    """The BENCHMARKS.md section of the two tables."""
    return "\n\n".join([
        "## Elastic resume (`bench/bench_elastic_resume.py`)",
        "Command: `PYTHONPATH=. .venv/bin/python bench/bench_elastic_resume.py` (about 9 min on 2 shared cores, "
        "18 GB of checkpoints in a temporary folder).",
        f"One-stage ZeRO-2 fp32 runs on Fashion-MNIST shards, global batch {BATCH}, {CANONICAL} canonical streams, "
        "2 processes (gloo, one thread each). Resume time: the seconds `_load_checkpoint` takes in the resumed job "
        "(engine already built), on rank 0; baseline: the resume of the same checkpoint at the same size. "
        "B/16 image tower: CRATE-alpha-CLIP-B-16 (CRATE-alpha B/16 image tower and a 12-layer text tower, all "
        "trained) at 32 px. `exact`: every parameter's fp32 weights and AdamW moments and the step counts after "
        "the load have the sha256 of the saved ones. The conversion is paid once per checkpoint; the later load of "
        "the converted folder runs in one process, while the two processes of the same-size load share the 2 "
        "cores.",
        markdown_table(["model", "parameters (tensors)", "resume", "seconds", "vs same size", "exact"], times),
        f"Global-batch keys (webdataset `__key__`) of the {KEY_STEPS} training steps after a resume at step 4 of "
        "an uninterrupted 2-process run of the tiny model (the trainer's stream, the stream-state table of the "
        "checkpoint split for the new size; 1 and 4 processes load the universal checkpoint), and the largest "
        "relative difference of their losses (fp32; the same math summed in another order):",
        markdown_table(["processes after the resume", "steps with identical keys", "sequence", "max loss rel. diff"],
                       keys),
        machine_line() + " (2 cores shared with other jobs: compare ratios, not absolute times)"])


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--keep", default=None, help="run in this folder and keep it (default: a temporary one)")
    args = p.parse_args()
    from crate_clip.data.sources.fashion_mnist import write_fashion_mnist_shards

    with tempfile.TemporaryDirectory(prefix="bench_elastic_") as tmp:
        root = Path(args.keep or tmp)
        root.mkdir(parents=True, exist_ok=True)
        data = root / "data"
        if not data.is_dir():
            write_fashion_mnist_shards(data, split="train", samples_per_shard=64, limit=512,
                                       source_dir=FASHION_MNIST)
        times, keys = resume_times(root, data), key_sequences(root, data)
    text = section(times, keys)
    write_section("elastic-resume", text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
