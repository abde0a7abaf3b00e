"""GPU benchmark, one prepared script for a ~10-minute run on one GPU (bf16, DeepSpeed ZeRO-1, 1 process):

    training steps of CRATE-alpha-CLIPA-B/16 and L/14 at 84 px / 8 and 32 tokens and at 224 px / 32 tokens,
    with and without torch.compile of the towers, beside open_clip's ViT-B-16 built the same way:
    samples/s, step time, model TFLOP/s (FLOPs counted), MFU vs the GPU's bf16 peak, peak memory;
    training-stream images/s with `decode: cpu` (PIL in one worker) and `decode: device` (batched
    torchvision.io.decode_jpeg + crop/resize on the GPU), and the worker's share of the device path;
    the token-reduction speed-up of B/16 at 84 px / 8 tokens vs 224 px / 32 tokens (ideal: the FLOP ratio).

    python bench/bench_gpu.py                 # on the GPU machine; writes the `gpu` section of BENCHMARKS.md
    python bench/bench_gpu.py --smoke         # tiny model, CPU, ~1 min: proves the script runs
    python bench/bench_gpu.py --out DIR       # also writes DIR/bench_gpu.json

Targets (issue 11): MFU >= 40% for B/16 at 224 px on an H100/H200-class GPU; CRATE-alpha-B/16 step time
<= 1.3x ViT-B/16's. Each case runs under a time guard so the whole script stays inside its budget.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

# (model, image px, text tokens, batch per step, compile)
GPU_CASES = [
    ("CRATE-alpha-CLIPA-B-16", 84, 8, 1024, False),
    ("CRATE-alpha-CLIPA-B-16", 84, 32, 1024, False),
    ("CRATE-alpha-CLIPA-B-16", 224, 32, 256, False),
    ("ViT-B-16", 224, 32, 256, False),
    ("CRATE-alpha-CLIPA-B-16", 224, 32, 256, True),
    ("ViT-B-16", 224, 32, 256, True),
    ("CRATE-alpha-CLIPA-B-16", 84, 8, 1024, True),
    ("CRATE-alpha-CLIPA-L-14", 84, 8, 512, False),
    ("CRATE-alpha-CLIPA-L-14", 224, 32, 128, False),
]
SMOKE_CASES = [("CRATE-alpha-CLIPA-tiny", 16, 8, 16, False), ("CRATE-alpha-CLIPA-tiny", 32, 16, 16, False)]


def _cfg(model: str, size: int, tokens: int, batch: int, compile_: bool, precision: str):
    from crate_clip.train.run_config import config_from_dict
    return config_from_dict({
        "model": {"name": model, "compile": compile_}, "data": {"sources": ["unused"]}, "precision": precision,
        "deepspeed": {"zero_stage": 1},
        "stages": [{"name": f"{size}px", "image_size": size, "context_length": tokens, "samples": 10 ** 6,
                    "global_batch": batch, "lr": 1e-4, "warmup_steps": 1}]}, check_paths=False)


def train_case(dist, model: str, size: int, tokens: int, batch: int, compile_: bool, precision: str,
               steps: int, budget_s: float) -> dict:
    """Build the engine as training does, run warm-up steps, then time `steps` steps (or until the budget)."""
    from crate_clip.train.engine import build_engine, model_dtype
    from crate_clip.train.stage_loop import _make_loss
    from crate_clip.train.stage_model import resolve_stage
    from crate_clip.train.throughput import device_peak_tflops
    from crate_clip.train.train_step import train_step

    cfg = _cfg(model, size, tokens, batch, compile_, precision)
    stage = resolve_stage(cfg, 0, dist.world_size)
    engine = build_engine(stage.build_model(), cfg, stage, dist)
    loss_fn, dtype = _make_loss(dist), model_dtype(precision)
    images = torch.randn(batch, 3, size, size).pin_memory() if dist.device.startswith("cuda") else \
        torch.randn(batch, 3, size, size)
    text = torch.randint(1, 40000, (batch, tokens))
    t_start = time.perf_counter()
    for _ in range(3):  # warm-up (and compilation)
        train_step(engine, loss_fn, images, text, dist, dtype)
    warm_s = time.perf_counter() - t_start
    if dist.device.startswith("cuda"):
        torch.cuda.reset_peak_memory_stats()
    times = []
    while len(times) < steps and time.perf_counter() - t_start < budget_s:
        t0 = time.perf_counter()
        train_step(engine, loss_fn, images, text, dist, dtype)  # ends with one host sync
        times.append(time.perf_counter() - t0)
    step_s = sorted(times)[len(times) // 2]
    flops = stage.counts.flops
    peak = device_peak_tflops(dist.device)
    tflops = batch * flops / step_s / 1e12
    mem = torch.cuda.max_memory_allocated() / 2 ** 30 if dist.device.startswith("cuda") else None
    engine.destroy()
    del engine
    if dist.device.startswith("cuda"):
        torch.cuda.empty_cache()
    return {"model": model, "image_size": size, "tokens": tokens, "batch": batch, "compile": compile_,
            "steps_timed": len(times), "warmup_s": warm_s, "step_s": step_s, "samples_per_s": batch / step_s,
            "gflops_per_sample": flops / 1e9, "tflops": tflops, "mfu": tflops / peak if peak else None,
            "peak_memory_gib": mem}


def _loader_rate(pattern: str, size: int, decode: str, device: str, batches: int, ship_only: bool = False) -> float:
    """Images/s of the training stream (1 worker process = 1 CPU core of decoding) on `pattern`'s shards:
    decode 'cpu' (PIL in the worker) or 'device' (worker ships JPEG bytes + boxes; `device` decodes in this
    process). ship_only: the worker's share of the device path alone (the batches are not decoded)."""
    from data_pipelines.device_decode import DeviceJpegBatch
    from data_pipelines.train_stream import StreamConfig, build_train_stream

    cfg = StreamConfig(sources=[pattern], num_workers=1, shuffle_buffer=200)
    stream = build_train_stream(cfg, image_size=size, context_length=32, text_mask="truncate", batch_size=32,
                                decode=decode, device=device)
    it = _raw_batches(stream) if ship_only else iter(stream)
    next(it)  # worker start-up
    t0, n = time.perf_counter(), 0
    for _ in range(batches):
        images, _ = next(it)
        n += len(images)
        if isinstance(images, torch.Tensor) and images.is_cuda:
            torch.cuda.synchronize()
    assert not ship_only or isinstance(images, DeviceJpegBatch)
    return n / (time.perf_counter() - t0)


def _raw_batches(stream):
    """The stream's batches as the workers send them (decode: device batches stay undecoded)."""
    for images, tokens, meta in stream._loader():
        if images is not None:
            yield images, tokens


def decode_rates(device: str, sizes=(224, 84), batches: int = 12) -> list[dict]:
    """Loader images/s at each size with CPU decode and with device decode, on DataComp-like shards."""
    from bench_data import SHARDS, make_shards
    pattern = make_shards() if not any(SHARDS.glob("*.tar")) else f"{SHARDS}/{{00000000..00000007}}.tar"
    rows = []
    for size in sizes:
        rows.append({"image_size": size, "device": device,
                     "cpu_decode_images_per_s_per_core": _loader_rate(pattern, size, "cpu", device, batches),
                     "device_decode_images_per_s": _loader_rate(pattern, size, "device", device, batches),
                     "device_path_worker_images_per_s_per_core": _loader_rate(pattern, size, "device", device,
                                                                             batches, ship_only=True)})
    return rows


def _markdown(results: list[dict], decode: dict, device_name: str) -> str:
    from report import machine_line
    lines = [machine_line(), "", f"Device: {device_name}. bf16, ZeRO-1, 1 process, median step of the timed steps.", "",
             "| model | px | tokens | batch | compile | samples/s | GFLOP/sample | TFLOP/s | MFU | peak GiB |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        if "error" in r:
            lines.append(f"| {r['model']} | {r['image_size']} | {r['tokens']} | {r['batch']} | {r['compile']} | "
                         f"error: {r['error'][:60]} | | | | |")
            continue
        mfu = f"{r['mfu']:.0%}" if r["mfu"] is not None else "-"
        mem = f"{r['peak_memory_gib']:.1f}" if r["peak_memory_gib"] is not None else "-"
        lines.append(f"| {r['model']} | {r['image_size']} | {r['tokens']} | {r['batch']} | {r['compile']} | "
                     f"{r['samples_per_s']:.0f} | {r['gflops_per_sample']:.1f} | {r['tflops']:.1f} | {mfu} | {mem} |")
    ok = {(r["model"], r["image_size"], r["tokens"], r["compile"]): r for r in results if "error" not in r}
    lo, hi = ok.get(("CRATE-alpha-CLIPA-B-16", 84, 8, False)), ok.get(("CRATE-alpha-CLIPA-B-16", 224, 32, False))
    if lo and hi:
        lines += ["", f"Token reduction B/16, 84 px / 8 tokens vs 224 px / 32: {lo['samples_per_s'] / hi['samples_per_s']:.1f}x "
                      f"samples/s (ideal, the FLOP ratio: {hi['gflops_per_sample'] / lo['gflops_per_sample']:.1f}x)."]
    vit = ok.get(("ViT-B-16", 224, 32, False))
    if vit and hi:
        lines.append(f"CRATE-alpha-B/16 step time / ViT-B/16's at 224 px: {hi['step_s'] / vit['step_s']:.2f}x (target <= 1.3x).")
    lines += ["", "Training stream (bench_data.py's DataComp-like shards, batch 32, 1 worker process), images/s:", "",
              "| px | decode: cpu (per worker core) | decode: device, end to end | device path, worker share "
              "(per core) |", "|---|---|---|---|"]
    for r in decode:
        lines.append(f"| {r['image_size']} | {r['cpu_decode_images_per_s_per_core']:.0f} | "
                     f"{r['device_decode_images_per_s']:.0f} ({r['device']}) | "
                     f"{r['device_path_worker_images_per_s_per_core']:.0f} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    """Run the benchmark (see the module docstring)."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--smoke", action="store_true", help="tiny model, a few steps (CPU check of the script)")
    p.add_argument("--out", default=None, help="folder for bench_gpu.json")
    p.add_argument("--budget-s", type=float, default=540.0, help="stop starting new cases after this long")
    args = p.parse_args(argv)
    from crate_clip.train.engine import init_distributed
    dist = init_distributed()
    cuda = dist.device.startswith("cuda")
    precision = "bf16"
    cases = SMOKE_CASES if args.smoke or not cuda else GPU_CASES
    steps = 3 if args.smoke or not cuda else 10
    if cuda:
        torch.backends.cuda.matmul.allow_tf32 = True
    t0, results = time.perf_counter(), []
    for case in cases:
        left = args.budget_s - (time.perf_counter() - t0)
        if left < 30:
            results.append({"model": case[0], "image_size": case[1], "tokens": case[2], "batch": case[3],
                            "compile": case[4], "error": "skipped: time budget spent"})
            continue
        try:
            r = train_case(dist, *case, precision=precision, steps=steps, budget_s=min(left - 10, 120))
        except Exception as exc:  # e.g. out of memory: record it, go on with the next case
            r = {"model": case[0], "image_size": case[1], "tokens": case[2], "batch": case[3], "compile": case[4],
                 "error": f"{type(exc).__name__}: {exc}"}
            if cuda:
                torch.cuda.empty_cache()
        results.append(r)
        print(json.dumps(r), flush=True)
    decode = decode_rates(dist.device, sizes=(84,) if args.smoke else (224, 84), batches=2 if args.smoke else 12)
    print(json.dumps(decode), flush=True)
    device_name = torch.cuda.get_device_name() if cuda else "CPU"
    md = _markdown(results, decode, device_name)
    print(md)
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / "bench_gpu.json").write_text(json.dumps({"train": results, "decode": decode}, indent=1))
        (Path(args.out) / "bench_gpu.md").write_text(md)
    if cuda and not args.smoke:
        from report import write_section
        write_section("gpu", "## GPU (bench/bench_gpu.py)\n\n" + md)
    torch.distributed.destroy_process_group()
    return 0


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    sys.exit(main())
