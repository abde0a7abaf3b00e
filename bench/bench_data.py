"""Data stream throughput: our TrainStream vs open_clip_train.data.get_wds_dataset on the same shards.

Shards are DataComp-like (JPEGs with max side 512, 12-digit keys, .txt captions), made from real local
images: Noto emoji renderings and Fashion-MNIST pictures, upscaled to 320-512 px. Both loaders read the
same shards in resampled mode, crop with random-resized-crop (area 0.4-1.0, bicubic), normalise, and
tokenize to 32 tokens, with the same worker count. open_clip_train's data code fails with webdataset
>= 1.0 (KeyError 'fname' in its group_by_keys_nothrow, checked here each run), so the baseline runs in a
throwaway venv under bench/out/ with webdataset 0.2.86 from PyPI (and pandas, which it imports).

    .venv/bin/python bench/bench_data.py            # writes the `data` section of BENCHMARKS.md
"""
from __future__ import annotations

import argparse
import json
import random
import subprocess
import sys
import time
from statistics import median
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "bench" / "out"
SHARDS = OUT / "datacomp_like"
SIZES = (224, 112, 84)
WORKERS = (1, 2)
BATCH = 32
CONTEXT = 32


# ---------------------------------------------------------------------------------------------- shards
def make_shards(n: int = 480, per_shard: int = 60) -> str:
    """DataComp-like shards of real images at 320-512 px (max side 512); returns the brace pattern."""
    sys.path.insert(0, str(ROOT))
    from PIL import Image

    from data_pipelines.shard_writer import write_shards
    from data_pipelines.sources.emoji import emoji_samples
    from data_pipelines.sources.fashion_mnist import fashion_mnist_samples

    rng = random.Random(0)

    def resized(img: Image.Image) -> Image.Image:
        long_side, short_side = 512, rng.randint(320, 512)
        size = (long_side, short_side) if rng.random() < 0.5 else (short_side, long_side)
        return img.convert("RGB").resize(size, Image.BICUBIC)

    def samples():
        emoji = emoji_samples(limit=n // 2)
        fashion = fashion_mnist_samples("train", limit=n // 2)
        for e, f in zip(emoji, fashion):
            for s in (e, f):
                yield {**s, "image": resized(s["image"])}

    result = write_shards(samples(), SHARDS, per_shard, max_side=512, quality=90, progress=False)
    return result["pattern"]


# ---------------------------------------------------------------------------------------------- loaders
def time_batches(batches, warmup: int, measure: int) -> float:
    """Samples per second over `measure` batches after `warmup` batches."""
    it = iter(batches)
    for _ in range(warmup):
        next(it)
    start, n = time.perf_counter(), 0
    for _ in range(measure):
        images, _ = next(it)
        n += images.shape[0]
    return n / (time.perf_counter() - start)


def ours(pattern: str, size: int, workers: int, warmup: int, measure: int) -> float:
    """Throughput of data_pipelines.train_stream."""
    sys.path.insert(0, str(ROOT))
    from data_pipelines.train_stream import StreamConfig, build_train_stream

    cfg = StreamConfig(sources=[pattern], num_workers=workers, shuffle_buffer=200)
    stream = build_train_stream(cfg, image_size=size, context_length=CONTEXT, text_mask="truncate",
                                batch_size=BATCH)
    return time_batches(stream, warmup, measure)


def baseline(pattern: str, size: int, workers: int, warmup: int, measure: int, num_samples: int) -> float:
    """Throughput of open_clip_train.data.get_wds_dataset (run inside the webdataset 0.2.86 venv)."""
    import open_clip
    from open_clip.transform import AugmentationCfg
    from open_clip_train.data import get_wds_dataset

    tok = open_clip.get_tokenizer("ViT-B-16")
    preprocess = open_clip.image_transform(size, is_train=True, aug_cfg=AugmentationCfg(scale=(0.4, 1.0)))
    # open_clip cuts its resampled stream into "epochs" of train_num_samples: make one epoch outlast the timing.
    args = argparse.Namespace(train_data=pattern, val_data=None, train_num_samples=max(num_samples, 10**7),
                              dataset_resampled=True, train_data_upsampling_factors=None, seed=0,
                              batch_size=BATCH, world_size=1, workers=workers)
    data = get_wds_dataset(args, preprocess, True, tokenizer=lambda t: tok(t, context_length=CONTEXT))
    return time_batches(data.dataloader, warmup, measure)


# ---------------------------------------------------------------------------------------------- venvs
def throwaway_venv(name: str, packages: list[str]) -> Path:
    """A venv under bench/out/ with `packages`, also seeing the main venv's packages; returns its python."""
    venv = OUT / name
    py = venv / "bin" / "python"
    marker = venv / ".ready"
    if not marker.exists():
        if not py.exists():
            subprocess.run([sys.executable, "-c", f"import venv; venv.create({str(venv)!r}, with_pip=True)"],
                           check=True)
        site = subprocess.run([str(py), "-c", "import site; print(site.getsitepackages()[0])"], check=True,
                              capture_output=True, text=True).stdout.strip()
        main_site = [p for p in sys.path if p.endswith("site-packages")][0]
        # Appended after the venv's own site-packages, so a webdataset installed there shadows the main one.
        Path(site, "zz_main_venv.pth").write_text(main_site + "\n")
        subprocess.run([str(py), "-m", "pip", "install", "-q", *packages], check=True)
        marker.touch()
    return py


def run_child(py: Path, *args: str) -> dict:
    """Run this script's child mode with another interpreter; returns its JSON line or the error text."""
    proc = subprocess.run([str(py), __file__, *args], capture_output=True, text=True, cwd=ROOT)
    for line in reversed(proc.stdout.splitlines()):
        if line.startswith("{"):
            return json.loads(line)
    return {"error": (proc.stderr or proc.stdout).strip().splitlines()[-1] if (proc.stderr or proc.stdout) else "?"}


def check_webdataset_1(pattern: str, num_samples: int) -> str:
    """What open_clip_train's loader does with webdataset 1.0.2 (the version this project uses)."""
    py = throwaway_venv("venv-wds102", ["pandas"])
    out = run_child(py, "--child", "baseline", "--pattern", pattern, "--size", "84", "--workers", "0",
                    "--warmup", "0", "--measure", "1", "--num-samples", str(num_samples))
    return out.get("error", "works")


# ---------------------------------------------------------------------------------------------- main
def main(argv=None) -> int:
    """Run every configuration, print the table, write BENCHMARKS.md's `data` section."""
    p = argparse.ArgumentParser()
    p.add_argument("--child", choices=("ours", "baseline"))
    p.add_argument("--pattern")
    p.add_argument("--size", type=int)
    p.add_argument("--workers", type=int)
    p.add_argument("--warmup", type=int, default=4)
    p.add_argument("--measure", type=int, default=30)
    p.add_argument("--num-samples", type=int, default=0)
    p.add_argument("--repeats", type=int, default=3, help="alternating ours/baseline pairs per setting")
    p.add_argument("--no-write", action="store_true")
    args = p.parse_args(argv)
    if args.child:
        if args.child == "ours":
            rate = ours(args.pattern, args.size, args.workers, args.warmup, args.measure)
        else:
            rate = baseline(args.pattern, args.size, args.workers, args.warmup, args.measure, args.num_samples)
        print(json.dumps({"samples_per_s": rate}))
        return 0

    OUT.mkdir(parents=True, exist_ok=True)
    pattern = make_shards()
    num_samples = sum(json.loads(f.read_text())["successes"] for f in SHARDS.glob("*_stats.json"))
    wds1 = check_webdataset_1(pattern, num_samples)
    print(f"open_clip_train with webdataset 1.0.2: {wds1}")
    base_py = throwaway_venv("venv-wds0286", ["pandas", "webdataset==0.2.86"])
    rows = []
    for size in SIZES:
        for workers in WORKERS:
            common = ["--pattern", pattern, "--size", str(size), "--workers", str(workers),
                      "--warmup", str(args.warmup), "--measure", str(args.measure), "--num-samples", str(num_samples)]
            pairs = []
            for rep in range(args.repeats):
                # Alternate the order so neither loader always runs on a warmer (or busier) machine.
                order = ("ours", "baseline") if (size + workers + rep) % 2 else ("baseline", "ours")
                res = {name: run_child(base_py if name == "baseline" else Path(sys.executable), "--child", name, *common)
                       for name in order}
                o, b = res["ours"].get("samples_per_s"), res["baseline"].get("samples_per_s")
                print(f"{size:4d} px  {workers} workers  ours {o or res['ours']}  open_clip {b or res['baseline']}",
                      flush=True)
                if o and b:
                    pairs.append((o, b))
            rows.append((size, workers, pairs))
    table = ["| image size | workers | ours (samples/s) | open_clip get_wds_dataset (samples/s) | ratio (median) "
             "| ratio range | target |", "| --- | --- | --- | --- | --- | --- | --- |"]
    for size, workers, pairs in rows:
        target = {84: ">= 1.5x", 224: ">= 1.0x"}.get(size, "")
        if not pairs:
            table.append(f"| {size} | {workers} | n/a | n/a | n/a | n/a | {target} |")
            continue
        ratios = sorted(o / b for o, b in pairs)
        table.append(f"| {size} | {workers} | {median(o for o, _ in pairs):.0f} | {median(b for _, b in pairs):.0f} "
                     f"| {median(ratios):.2f}x | {ratios[0]:.2f}-{ratios[-1]:.2f}x | {target} |")
    from report import machine_line, write_section

    md = "\n".join([
        "## Data stream throughput (`bench/bench_data.py`)",
        f"Same {num_samples} DataComp-like samples (JPEG, max side 512, real emoji / Fashion-MNIST images upscaled "
        f"to 320-512 px) in {len(list(SHARDS.glob('*.tar')))} shards; resampled mode, random resized crop "
        f"(area 0.4-1.0, bicubic), normalise, tokenize to {CONTEXT}; batch {BATCH}; {args.measure} batches timed "
        f"after warm-up, {args.repeats} alternating runs of each loader per row (median shown). Baseline: `open_clip_train.data.get_wds_dataset` (open_clip 3.3.0) run in a throwaway "
        f"venv with webdataset 0.2.86, because with webdataset 1.0.2 it fails: `{wds1}`.",
        "", *table, "", machine_line() + " (2 cores shared with other jobs: compare ratios, not absolute rates)",
    ])
    if not args.no_write:
        write_section("data", md)
    print(md)
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    sys.exit(main())
