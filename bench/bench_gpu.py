"""GPU benchmark, one prepared script for a run of under ten minutes on one GPU (bf16, DeepSpeed ZeRO-1, 1 process).

Training steps through the trainer's own engine and step function, in two groups:

- image tower vs ViT: CRATE-alpha-CLIP-B-16 beside open_clip's ViT-B-16 at 224 px / 32 tokens, eager and
  compiled. Both carry the same CLIP-BPE text tower (width 512, 12 layers, 8 heads; only the output
  projections differ, to 1024 vs 512 dimensions), trained in both, so the step-time ratio is about the image
  tower (target: CRATE-alpha <= 1.3x ViT).
- the paper's recipe: one row per stage of configs/datacomp/crate_alpha_clipa_{b-16,l-14}.yaml as the
  config trains it: CLIPA's text tower (width 1024, 24 layers) locked, image size, text length, image mask and
  gradient checkpointing from the config (the locked tower gets random weights here: same kernels, no
  download). MFU target: >= 40% for B/16 at 224 px on an H100/H200-class GPU.

Per row: samples/s, step time, model FLOPs per sample (torch's FlopCounterMode over one forward + backward of
the model that trains, on the meta device: a locked text tower counts its forward only), TFLOP/s, MFU against
the GPU's dense bf16 peak, peak memory. Then the training stream's images/s with `decode: cpu` (PIL in one
worker) and `decode: device` (batched torchvision.io.decode_jpeg + crop/resize on the GPU), and the worker's
share of the device path, on bench_data.py's DataComp-like shards (bench/out/datacomp_like; written here when
missing, which needs the Debian data packages: on a machine without them carry that folder along).

    python bench/bench_gpu.py --out DIR       # on the GPU machine: the `gpu` section of BENCHMARKS.md, and
                                              # DIR/bench_gpu.json (rewritten after every case) + bench_gpu.md
    python bench/bench_gpu.py --smoke         # the same code paths with tiny models on the CPU (compiling the
                                              # towers there takes minutes)

The cases run in order of priority under one time budget (--budget-s): a case that would start after it is
recorded as skipped, a compiled one already when less than 150 s are left, so the script ends in about
budget + 1-2 minutes (the data-stream rates and start-up).
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

PRECISION = "bf16"
STEPS, SMOKE_STEPS = 10, 3          # timed steps per case (after 3 warm-up steps)
MIN_STEPS = 2                       # timed even when the budget ran out during warm-up (compilation)
NOT_MEASURED_ON_CPU = ("Without a GPU this run measured none of the targets: the rows are tiny models on the CPU "
                       "that check the code paths (eager and compiled, MFU by model FLOPs); the GPU's samples/s, "
                       "MFU, compiled/eager speed-up, compile time, peak memory and device JPEG decoding are not "
                       "measured.")


@dataclass(frozen=True)
class Case:
    """One timed training configuration."""
    group: str                      # "vs ViT" or "recipe"
    model: str
    image_size: int
    tokens: int
    batch: int                      # samples per step (one process: the micro-batch, k = 1)
    compile: bool = False
    lock_text: bool = False
    lock_logit_scale: bool = False
    image_mask: str = "none"
    image_mask_ratio: float = 0.0
    grad_checkpointing: bool = False


@dataclass(frozen=True)
class Pair:
    """The image-tower comparison: two models with the same text tower, at one size."""
    crate: str
    vit: str
    image_size: int
    tokens: int
    batch: int

    def cases(self, compile_: bool) -> list[Case]:
        """The two models of the pair, eager or compiled."""
        return [Case("vs ViT", m, self.image_size, self.tokens, self.batch, compile_) for m in (self.crate, self.vit)]


PAIR = Pair("CRATE-alpha-CLIP-B-16", "ViT-B-16", 224, 32, 256)
SMOKE_PAIR = Pair("CRATE-alpha-CLIPA-tiny", "ViT-tiny-fmnist", 28, 16, 16)   # same tiny text tower
# run config -> samples per step at each of its image sizes: 512 = the configs' global batch 32,768 over 64
# GPUs; L/14 at 224 px at half that (its activations at 512 would need ~92 GiB: crate-clip plan)
RECIPES = {"configs/datacomp/crate_alpha_clipa_b-16.yaml": {80: 512, 224: 512},
           "configs/datacomp/crate_alpha_clipa_l-14.yaml": {84: 512, 224: 256}}
SMOKE_MODEL, SMOKE_SIZES, SMOKE_BATCH = "CRATE-alpha-CLIPA-tiny", {80: 16, 224: 28}, 16


def recipe_cases(path: str, batches: dict, model: str | None = None, sizes: dict | None = None) -> list[Case]:
    """One case per stage of a shipped run config, as it trains (text lock, masks, checkpointing); `model`
    and `sizes` shrink it for the smoke run."""
    from crate_clip.train.run.run_config import load_run_config

    cfg = load_run_config(ROOT / path, check_paths=False)
    m = cfg.model
    return [Case("recipe", model or m.name, (sizes or {}).get(s.image_size, s.image_size), s.context_length,
                 batches[s.image_size], lock_text=m.lock_text, lock_logit_scale=m.lock_logit_scale,
                 image_mask=s.image_mask, image_mask_ratio=s.image_mask_ratio,
                 grad_checkpointing=m.grad_checkpointing) for s in cfg.stages]


def all_cases(smoke: bool) -> list[Case]:
    """In order of priority (the budget may stop the last ones): the ViT comparison, the recipes, compiled."""
    if smoke:
        pair = SMOKE_PAIR
        recipes = recipe_cases(next(iter(RECIPES)), {s: SMOKE_BATCH for s in SMOKE_SIZES}, SMOKE_MODEL, SMOKE_SIZES)
    else:
        pair = PAIR
        recipes = [c for path, batches in RECIPES.items() for c in recipe_cases(path, batches)]
    return pair.cases(False) + recipes + pair.cases(True)


# ---------------------------------------------------------------------------------------------- training
def _cfg(case: Case):
    """A one-stage run config of the case, its text lock included (the stage's model is built without reading
    model.text_pretrained: random weights, the kernels of the locked tower)."""
    from crate_clip.train.run.run_config import config_from_dict
    lock = {"lock_text": case.lock_text, "lock_logit_scale": case.lock_logit_scale,
            "text_pretrained": "not-read" if case.lock_text else None}
    return config_from_dict({
        "model": {"name": case.model, "grad_checkpointing": case.grad_checkpointing, "compile": case.compile, **lock},
        "data": {"sources": ["unused"]}, "precision": PRECISION, "deepspeed": {"zero_stage": 1},
        "stages": [{"name": f"{case.image_size}px", "image_size": case.image_size, "context_length": case.tokens,
                    "samples": 10 ** 6, "global_batch": case.batch, "lr": 1e-4, "warmup_steps": 1,
                    "image_mask": case.image_mask, "image_mask_ratio": case.image_mask_ratio}]}, check_paths=False)


def train_case(dist, case: Case, steps: int, budget_s: float) -> dict:
    """Build the engine as training does, run 3 warm-up steps, then time `steps` steps (fewer if the budget
    runs out, but at least MIN_STEPS)."""
    from crate_clip.train.stage_setup.engine import build_engine, model_dtype
    from crate_clip.train.loop.stage_loop import _make_loss
    from crate_clip.train.stage_setup.stage_model import resolve_stage
    from crate_clip.train.reporting.throughput import device_peak_tflops
    from crate_clip.train.loop.train_step import train_step

    cuda = dist.device.startswith("cuda")
    cfg = _cfg(case)
    stage = resolve_stage(cfg, 0, dist.world_size)
    dtype = model_dtype(PRECISION)
    flops = stage.counts.flops   # the trainer's own count: the step meter and `crate-clip plan` report it too
    # read_files=False: the locked text tower keeps random weights (same kernels as CLIPA's, no download)
    engine = build_engine(stage.build_model(read_files=False), cfg, stage, dist)
    loss_fn = _make_loss(dist)
    images = torch.randn(case.batch, 3, case.image_size, case.image_size)
    images = images.pin_memory() if cuda else images
    text = torch.randint(1, 30000, (case.batch, case.tokens))   # ids every tokenizer's vocabulary holds
    t_start = time.perf_counter()
    for _ in range(3):  # warm-up (and compilation)
        train_step(engine, loss_fn, images, text, dist, dtype)
    warm_s = time.perf_counter() - t_start
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    times = []
    while len(times) < MIN_STEPS or (len(times) < steps and time.perf_counter() - t_start < budget_s):
        t0 = time.perf_counter()
        train_step(engine, loss_fn, images, text, dist, dtype)  # ends with one host sync
        times.append(time.perf_counter() - t0)
    step_s = sorted(times)[len(times) // 2]
    peak = device_peak_tflops(dist.device)
    tflops = case.batch * flops / step_s / 1e12
    mem = torch.cuda.max_memory_allocated() / 2 ** 30 if cuda else None
    engine.destroy()
    return {**asdict(case), "text_tower": text_tower(case), "steps_timed": len(times), "warmup_s": warm_s,
            "first_steps_extra_s": warm_s - 3 * step_s,   # compiled: the compile time; eager: allocator warm-up
            "step_s": step_s, "samples_per_s": case.batch / step_s, "gflops_per_sample": flops / 1e9,
            "tflops": tflops, "mfu": tflops / peak if peak else None, "peak_memory_gib": mem}


def text_tower(case: Case) -> str:
    """The case's text tower in words: its shape and whether it trains."""
    import open_clip

    text = open_clip.get_model_config(case.model)["text_cfg"]
    return f"{text['width']} wide x {text['layers']}, {'locked' if case.lock_text else 'trained'}"


def run_cases(dist, cases: list[Case], steps: int, budget_s: float, out: Path | None = None) -> list[dict]:
    """Every case in order; one that fails (e.g. out of memory) or finds the budget spent is recorded as such.
    Each result is printed, and written to out/bench_gpu.json, as soon as it is there."""
    t0, results = time.perf_counter(), []
    for case in cases:
        left = budget_s - (time.perf_counter() - t0)
        if left < (150 if case.compile else 30):   # compilation alone takes minutes
            r = {**asdict(case), "text_tower": text_tower(case), "error": "skipped: time budget spent"}
        else:
            try:
                r = train_case(dist, case, steps, budget_s=min(left - 10, 150 if case.compile else 90))
            except Exception as exc:  # record it, free the memory, go on with the next case
                r = {**asdict(case), "text_tower": text_tower(case), "error": f"{type(exc).__name__}: {exc}"}
        gc.collect()
        if dist.device.startswith("cuda"):
            torch.cuda.empty_cache()
        results.append(r)
        print(json.dumps(r), flush=True)
        if out is not None:
            out.mkdir(parents=True, exist_ok=True)
            (out / "bench_gpu.json").write_text(json.dumps({"train": results}, indent=1))
    return results


# ---------------------------------------------------------------------------------------------- data stream
def _loader_rate(pattern: str, size: int, decode: str, device: str, batches: int, ship_only: bool = False) -> float:
    """Images/s of the training stream (1 worker process = 1 CPU core of decoding) on `pattern`'s shards:
    decode 'cpu' (PIL in the worker) or 'device' (worker ships JPEG bytes + boxes; `device` decodes in this
    process). ship_only: the worker's share of the device path alone (the batches are not decoded)."""
    from crate_clip.data.device_decode import DeviceJpegBatch
    from crate_clip.data.train_stream import StreamConfig, build_train_stream

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


# ---------------------------------------------------------------------------------------------- report
def _num(x: float) -> str:
    """Three significant figures or the integer part, whichever is longer."""
    return f"{x:.0f}" if abs(x) >= 100 else f"{x:.3g}"


def _row(r: dict) -> str:
    head = (f"| {r['group']} | {r['model']} | {r['text_tower']} | {r['image_size']} | {r['tokens']} | "
            f"{r['image_mask']} | {r['batch']} | {'yes' if r['compile'] else 'no'} |")
    if "error" in r:
        return head + f" error: {r['error'][:80]} | | | | | | |"
    mfu = f"{r['mfu']:.0%}" if r["mfu"] is not None else "-"
    mem = f"{r['peak_memory_gib']:.1f}" if r["peak_memory_gib"] is not None else "-"
    return head + (f" {_num(r['samples_per_s'])} | {_num(1000 * r['step_s'])} | {_num(r['gflops_per_sample'])} | "
                   f"{_num(r['tflops'])} | {mfu} | {mem} | {r['first_steps_extra_s']:.1f} |")


def summary_lines(results: list[dict], pair: Pair) -> list[str]:
    """The targets: CRATE-alpha / ViT step time, the recipe's MFU, the token-reduction speed-up."""
    ok = [r for r in results if "error" not in r]
    lines = []
    for compiled in (False, True):
        crate, vit = (next((r for r in ok if r["group"] == "vs ViT" and r["model"] == m and r["compile"] == compiled),
                           None) for m in (pair.crate, pair.vit))
        if crate and vit:
            lines.append(f"{pair.crate} / {pair.vit} step time at {pair.image_size} px / {pair.tokens} tokens, same "
                         f"text tower, {'compiled' if compiled else 'eager'}: **{crate['step_s'] / vit['step_s']:.2f}x** "
                         "(target <= 1.3x).")
    recipe = [r for r in ok if r["group"] == "recipe" and not r["compile"]]
    first = [r for r in recipe if r["model"] == recipe[0]["model"]] if recipe else []
    if len(first) >= 2:
        lo, hi = min(first, key=lambda r: r["image_size"]), max(first, key=lambda r: r["image_size"])
        if hi["mfu"] is not None:
            lines.append(f"{hi['model']} (text locked) MFU at {hi['image_size']} px: **{hi['mfu']:.0%}** "
                         "(target >= 40%).")
        lines.append(f"Token reduction, {lo['model']} at {lo['image_size']} px vs {hi['image_size']} px: "
                     f"{lo['samples_per_s'] / hi['samples_per_s']:.1f}x samples/s (ideal, the FLOP ratio: "
                     f"{hi['gflops_per_sample'] / lo['gflops_per_sample']:.1f}x).")
    return lines


def markdown(results: list[dict], decode: list[dict] | str, device_name: str, pair: Pair) -> str:
    """The BENCHMARKS.md section: the step table, the target lines, the stream table."""
    from report import machine_line
    lines = [machine_line(), "", f"Device: {device_name}. {PRECISION}, ZeRO-1, 1 process, median step of the timed "
             "steps; FLOPs: FlopCounterMode over one forward + backward of the model that trains.", "",
             "| group | model | text tower | px | tokens | image mask | batch | compile | samples/s | step ms | "
             "GFLOP/sample | TFLOP/s | MFU | peak GiB | first 3 steps' extra s |", "|" + "---|" * 15]
    lines += [_row(r) for r in results] + [""] + summary_lines(results, pair)
    if device_name == "CPU":
        lines += ["", NOT_MEASURED_ON_CPU]
    lines += ["", "Training stream (bench_data.py's DataComp-like shards, batch 32, 1 worker process), images/s:", ""]
    if isinstance(decode, str):
        return "\n".join(lines + [f"not measured: {decode}"])
    lines += ["| px | decode: cpu (per worker core) | decode: device, end to end | device path, worker share "
              "(per core) |", "|---|---|---|---|"]
    for r in decode:
        lines.append(f"| {r['image_size']} | {r['cpu_decode_images_per_s_per_core']:.0f} | "
                     f"{r['device_decode_images_per_s']:.0f} ({r['device']}) | "
                     f"{r['device_path_worker_images_per_s_per_core']:.0f} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    """Run the benchmark (see the module docstring)."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--smoke", action="store_true", help="tiny models, a few steps (a CPU check of every code path)")
    p.add_argument("--out", default=None, help="folder for bench_gpu.json and bench_gpu.md")
    p.add_argument("--budget-s", type=float, help="start no new training case after this long (default: 480 s on "
                                                  "a GPU, 1800 s for --smoke, whose CPU steps are slow)")
    args = p.parse_args(argv)
    from crate_clip.train.stage_setup.engine import init_distributed
    dist = init_distributed()
    cuda = dist.device.startswith("cuda")
    smoke = args.smoke or not cuda
    if cuda:
        torch.backends.cuda.matmul.allow_tf32 = True
    budget = args.budget_s or (1800.0 if smoke else 480.0)
    out = Path(args.out) if args.out else None
    results = run_cases(dist, all_cases(smoke), SMOKE_STEPS if smoke else STEPS, budget, out)
    try:
        decode = decode_rates(dist.device, sizes=(84,) if smoke else (224, 84), batches=2 if smoke else 12)
        print(json.dumps(decode), flush=True)
    except Exception as exc:  # e.g. no shards and no Debian data to write them: the step table still counts
        decode = f"{type(exc).__name__}: {exc}"
        print(f"decode rates not measured: {decode}", flush=True)
    device_name = torch.cuda.get_device_name() if cuda else "CPU"
    md = markdown(results, decode, device_name, SMOKE_PAIR if smoke else PAIR)
    print(md)
    if out is not None:
        (out / "bench_gpu.json").write_text(json.dumps({"train": results, "decode": decode}, indent=1))
        (out / "bench_gpu.md").write_text(md)
    if not smoke:
        from report import write_section
        write_section("gpu", "## GPU (`bench/bench_gpu.py`)\n\n" + md)
    torch.distributed.destroy_process_group()
    return 0


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    sys.exit(main())
