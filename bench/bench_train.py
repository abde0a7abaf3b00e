"""Training benchmark (CPU, 2 processes, gloo): throughput per stage, ZeRO 0-3 per-rank memory, and the
low-resolution speed-up against its ideal FLOP ratio. Writes the `train` section of BENCHMARKS.md.

    .venv/bin/python bench/bench_train.py            # ~3-4 min on 2 cores
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

DEMO = ROOT / "configs" / "demo" / "fashion_mnist.yaml"
MODEL = "CRATE-alpha-CLIPA-tiny"
BATCH_PER_RANK = 128
LOW, FULL = 20, 28  # the demo's stage sizes
TIMED_STEPS = 12


# ------------------------------------------------------------------ worker (runs under torchrun)
def _cfg(zero_stage: int, image_size: int, precision: str = "bf16"):
    from crate_clip.train.run.run_config import config_from_dict
    return config_from_dict({
        "model": {"name": MODEL}, "data": {"sources": ["unused"]}, "precision": precision,
        "deepspeed": {"zero_stage": zero_stage,
                      "overrides": {"zero_optimization": {"stage3_param_persistence_threshold": 0}}},
        "stages": [{"name": f"{image_size}px", "image_size": image_size, "context_length": 16,
                    "samples": 10 ** 6, "global_batch": 2 * BATCH_PER_RANK, "lr": 1e-3, "warmup_steps": 1}]},
        check_paths=False)


def _flops_per_sample(image_size: int) -> float:
    """Forward + backward FLOPs of one training sample (torch's FLOP counter on the plain model)."""
    from torch.utils.flop_counter import FlopCounterMode

    from crate_clip.models import create_clip
    model = create_clip(MODEL, image_size=image_size, context_length=16)
    images, tokens = torch.randn(8, 3, image_size, image_size), torch.randint(1, 1000, (8, 16))
    with FlopCounterMode(display=False) as counter:
        image_f, text_f, scale = model(image=images, text=tokens)
        (scale * image_f @ text_f.T).logsumexp(1).mean().backward()
    return counter.get_total_flops() / 8


def worker(out: Path) -> None:
    """Per-rank footprint of ZeRO 0-3 and timed steps at the demo's two stage sizes."""
    import zero_footprint  # bench/zero_footprint.py
    from crate_clip.train.stage_setup.engine import build_engine, init_distributed, model_dtype
    from crate_clip.train.loop.stage_loop import _make_loss
    from crate_clip.train.stage_setup.stage_model import resolve_stage
    from crate_clip.train.loop.train_step import forward_loss, train_step

    dist = init_distributed()
    rows = []
    for zs in (0, 1, 2, 3):
        cfg = _cfg(zs, 16)
        stage = resolve_stage(cfg, 0, dist.world_size)
        engine = build_engine(stage.build_model(), cfg, stage, dist)
        images, tokens = torch.randn(8, 3, 16, 16, dtype=torch.bfloat16), torch.randint(1, 1000, (8, 16))
        loss, _ = forward_loss(engine, _make_loss(dist), images, tokens)
        engine.backward(loss)
        grads = zero_footprint.gradient_bytes(engine)
        engine.step()
        rows.append({"kind": "footprint", "rank": dist.rank, **zero_footprint.footprint(engine, grads)})
        engine.destroy()
    # both stages' engines alive at once, steps timed alternately: machine-load drift hits both alike
    engines, batches, times = {}, {}, {LOW: [], FULL: []}
    for size in (LOW, FULL):
        cfg = _cfg(2, size)
        stage = resolve_stage(cfg, 0, dist.world_size)
        engines[size] = build_engine(stage.build_model(), cfg, stage, dist)
        batches[size] = (torch.randn(BATCH_PER_RANK, 3, size, size), torch.randint(1, 1000, (BATCH_PER_RANK, 16)))
    loss_fn, dtype = _make_loss(dist), model_dtype("bf16")
    for round_ in range(2 + TIMED_STEPS):
        for size in (LOW, FULL):
            t0 = time.perf_counter()
            train_step(engines[size], loss_fn, *batches[size], dist, dtype)
            if round_ >= 2:
                times[size].append(time.perf_counter() - t0)
    for size in (LOW, FULL):
        rows.append({"kind": "step", "rank": dist.rank, "image_size": size,
                     "step_s": sorted(times[size])[len(times[size]) // 2],
                     "flops_per_sample": _flops_per_sample(size) if dist.rank == 0 else None})
        engines[size].destroy()
    gathered = [None] * dist.world_size
    torch.distributed.all_gather_object(gathered, rows)
    if dist.rank == 0:
        out.write_text(json.dumps([r for part in gathered for r in part]))
    torch.distributed.destroy_process_group()


# ------------------------------------------------------------------ driver
def _torchrun(*args: str) -> list[str]:
    from crate_clip.train.stage_setup.engine import _free_port
    return [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_addr", "127.0.0.1",
            "--master_port", str(_free_port()), *args]


def _env() -> dict:
    return dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))


def end_to_end(tmp: Path) -> list[dict]:
    """A shortened demo run (real shards, 2 processes, ZeRO-2): samples/s at the end of each stage."""
    from crate_clip.train.demo import prepare_data
    from crate_clip.train.reporting.metrics_log import read_jsonl

    train_dir, _ = prepare_data(ROOT / "data" / "fashion_mnist")
    run_dir = tmp / "e2e"
    cmd = _torchrun("-m", "crate_clip.train.cli", "--config", str(DEMO), "--set", f"run.output_dir={run_dir}",
                    "--set", f"data.sources=[{train_dir}]", "--set", "eval.evals=[]", "--set", "stages.0.samples=25600",
                    "--set", "stages.1.samples=12800", "--set", "logging.progress=false")
    subprocess.run(cmd, env=_env(), cwd=ROOT, check=True, capture_output=True)
    records = read_jsonl(run_dir / "metrics.jsonl")
    last = {}
    for r in records:
        last[r["stage_index"]] = r
    return [last[i] for i in sorted(last)]


def _mib(n) -> str:
    return f"{n / 2 ** 20:.1f}" if n is not None else "-"


def markdown(rows: list[dict], e2e: list[dict]) -> str:
    """The BENCHMARKS.md section."""
    from report import machine_line

    fp = {r["zero_stage"]: r for r in rows if r["kind"] == "footprint" and r["rank"] == 0}
    base = fp[0]
    lines = ["## Training (`bench/bench_train.py`)", "", machine_line(), "",
             f"**Per-rank memory under ZeRO 0-3** ({MODEL}, {base['param_numel_total'] / 1e6:.2f} M parameters, "
             "bf16 with fp32 master weights and AdamW, world size 2; read from the engines' own tensors, "
             "rank 0). Ratio = total against ZeRO-0 in the same run.", "",
             "| ZeRO | params MiB | grads MiB | fp32 master MiB | Adam state MiB | total MiB | vs ZeRO-0 |",
             "| --- | --- | --- | --- | --- | --- | --- |"]
    for zs in range(4):
        r = fp[zs]
        total = sum(r[k] or 0 for k in ("param_bytes", "grad_bytes", "master_bytes", "optimizer_state_bytes"))
        base_total = sum(base[k] or 0 for k in ("param_bytes", "grad_bytes", "master_bytes", "optimizer_state_bytes"))
        r["total"] = total
        lines.append(f"| {zs} | {_mib(r['param_bytes'])} | {_mib(r['grad_bytes'])} | {_mib(r['master_bytes'])} | "
                     f"{_mib(r['optimizer_state_bytes'])} | {_mib(total)} | {total / base_total:.2f}x |")
    lines += ["", "ZeRO-0 is DeepSpeed's bf16 wrapper (whole fp32 master copy and Adam state on every rank). Gradients "
              "are counted after backward: DeepSpeed 0.19's ZeRO-1 reduces into per-rank partitions in the backward "
              "just as ZeRO-2 does, so the two coincide here; its communication buckets (reduce_bucket_size) come "
              "on top for both."]
    steps = {r["image_size"]: r for r in rows if r["kind"] == "step" and r["rank"] == 0}
    flops = {s: r["flops_per_sample"] for s, r in steps.items()}
    speed = steps[FULL]["step_s"] / steps[LOW]["step_s"]
    ideal = flops[FULL] / flops[LOW]
    lines += ["", f"**Low-resolution speed-up** (ZeRO-2, bf16, {BATCH_PER_RANK} samples per rank per step, "
              f"synthetic batches, median of {TIMED_STEPS} steps timed alternately with the other stage after 2 "
              "warm-up steps; FLOPs from torch's FLOP counter)",
              "", "| stage | step time | samples/s | train GFLOP / sample |", "| --- | --- | --- | --- |"]
    for s in (LOW, FULL):
        lines.append(f"| {s} px | {steps[s]['step_s'] * 1e3:.0f} ms | {2 * BATCH_PER_RANK / steps[s]['step_s']:.0f} | "
                     f"{flops[s] / 1e9:.3f} |")
    lines += ["", f"Speed-up of {LOW} px over {FULL} px: **{speed:.2f}x** measured vs **{ideal:.2f}x** ideal (FLOP ratio). "
              "The gap is the part of a step that does not shrink with the image: the text tower, the 49,408-row "
              "token embedding's dense gradient, the AdamW update and the ZeRO-2 reduce-scatter / all-gather.",
              "", "**End to end** (shortened demo: real Fashion-MNIST shards, data stream with 1 worker per rank, "
              "2 processes, ZeRO-2, bf16):", "", "| stage | image size | samples/s (stage average) |",
              "| --- | --- | --- |"]
    for r in e2e:
        lines.append(f"| {r['stage_index']} {r['stage_name']} | {r['image_size']} px | {r['samples_per_s']:.0f} |")
    return "\n".join(lines)


def main() -> int:
    """Run the benchmark and write its BENCHMARKS.md section."""
    if len(sys.argv) > 2 and sys.argv[1] == "--worker":
        worker(Path(sys.argv[2]))
        return 0
    from report import write_section

    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        out = tmp / "rows.json"
        subprocess.run(_torchrun(str(Path(__file__).resolve()), "--worker", str(out)), env=_env(), cwd=ROOT,
                       check=True)
        rows = json.loads(out.read_text())
        e2e = end_to_end(tmp)
    text = markdown(rows, e2e)
    print(text)
    write_section("train", text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
