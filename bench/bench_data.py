"""Data stream throughput: our TrainStream vs open_clip_train.data.get_wds_dataset on the same shards.

Shards are DataComp-like (JPEGs with max side 512, 12-digit keys, .txt captions), made from real local
images: Noto emoji renderings and Fashion-MNIST pictures, upscaled to 320-512 px. Both loaders read the
same shards in resampled mode, crop with random-resized-crop (area 0.4-1.0, bicubic), normalise, and
tokenize to 32 tokens, with the same worker count. open_clip_train's data code fails with webdataset
>= 1.0 (KeyError 'fname' in its group_by_keys_nothrow, checked here each run), so the baseline runs in a
throwaway venv under bench/out/ with webdataset 0.2.86 from PyPI (and pandas, which it imports).

    .venv/bin/python bench/bench_data.py            # writes the `data` section of BENCHMARKS.md
    .venv/bin/python bench/bench_data.py --order    # writes the `data-order` section (canonical streams)

`--order`: the cost of cutting every batch from canonical streams (each DataLoader worker yields one slice
per stream, this process joins a step's slices) against the per-worker layout built from the same code
(each worker yields whole batches of its own stream), same shards, workers and batch; and the global-batch
key sequence after a resume at 1, 2 and 4 simulated ranks against an uninterrupted 2-rank run.
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

    from crate_clip.data.shard_writer import write_shards
    from crate_clip.data.sources.emoji import emoji_samples
    from crate_clip.data.sources.fashion_mnist import fashion_mnist_samples

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
    """Throughput of crate_clip.data.train_stream."""
    sys.path.insert(0, str(ROOT))
    from crate_clip.data.train_stream import StreamConfig, build_train_stream

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
ORDER_BATCH, ORDER_WORKERS = 32, 2


def _order_config(pattern: str, workers: int, **kw):
    sys.path.insert(0, str(ROOT))
    from crate_clip.data.train_stream import StreamConfig

    return StreamConfig(sources=[pattern], num_workers=workers, shuffle_buffer=200, **kw)


def canonical_batches(pattern: str, size: int, streams: int):
    """Batches of a one-rank stream cut from `streams` canonical streams (slices joined in this process)."""
    from crate_clip.data.train_stream import build_train_stream

    return build_train_stream(_order_config(pattern, ORDER_WORKERS, canonical_streams=streams), image_size=size,
                              context_length=CONTEXT, text_mask="truncate", batch_size=ORDER_BATCH)


def per_worker_batches(pattern: str, size: int):
    """Baseline layout: every worker yields whole batches of its own stream, taken in worker turn, nothing
    joined (the stream's own DataLoader over one canonical stream per worker, a slice being a whole batch)."""
    from crate_clip.data.train_stream import build_train_stream

    stream = build_train_stream(_order_config(pattern, ORDER_WORKERS, canonical_streams=ORDER_WORKERS),
                                image_size=size, context_length=CONTEXT, text_mask="truncate",
                                batch_size=ORDER_BATCH * ORDER_WORKERS)
    return ((images, tokens) for images, tokens, _ in stream._loader() if images is not None)


def key_sequences(pattern: str, steps: int, resume_at: int, size: int = 32) -> dict:
    """Global-batch keys of `steps` steps after a resume at step `resume_at` of a 2-rank, 2-worker run, for
    1, 2 and 4 simulated ranks (1 worker each), and of the uninterrupted run."""
    from crate_clip.data.stream_layout import merge_stream_states, split_stream_state
    from crate_clip.data.train_stream import build_train_stream

    def ranks(world: int, workers: int) -> list:
        cfg = _order_config(pattern, workers)
        return [build_train_stream(cfg, image_size=size, context_length=CONTEXT, text_mask="truncate",
                                   batch_size=ORDER_BATCH // world, rank=r, world_size=world) for r in range(world)]

    def keys(streams: list, n: int) -> list:
        iters, out = [iter(s) for s in streams], []
        for _ in range(n):
            for it in iters:
                next(it)
            out.append([k for s in streams for k in s.batch_keys])
        return out

    uninterrupted = keys(ranks(2, 2), resume_at + steps)[resume_at:]
    first = ranks(2, 2)
    keys(first, resume_at)
    table = merge_stream_states([s.state_dict() for s in first])
    out = {"uninterrupted": uninterrupted}
    for world in (1, 2, 4):
        streams = ranks(world, 1)
        for r, s in enumerate(streams):
            s.load_state_dict(split_stream_state(table, r, world))
        out[world] = keys(streams, steps)
    return out


ORDER_LAYOUTS = {"per-worker": "per-worker batches (baseline)", "c2": f"canonical streams C={ORDER_WORKERS}",
                 "c8": f"canonical streams C={4 * ORDER_WORKERS}"}


def order_child(pattern: str, size: int, layout: str, warmup: int, measure: int) -> dict:
    """Samples/s of one layout, and the CPU time (this process and its DataLoader workers) per sample, which
    other jobs on the machine do not inflate."""
    import gc
    import resource

    if layout == "per-worker":
        batches = per_worker_batches(pattern, size)
    else:
        batches = canonical_batches(pattern, size, {"c2": ORDER_WORKERS, "c8": 4 * ORDER_WORKERS}[layout])
    start = [resource.getrusage(who) for who in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN)]
    it = iter(batches)
    rate = time_batches(it, warmup, measure)
    it.close()      # the DataLoader's workers exit: their CPU time lands in RUSAGE_CHILDREN
    del it, batches
    gc.collect()
    end = [resource.getrusage(who) for who in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN)]
    cpu = sum(e.ru_utime + e.ru_stime - s.ru_utime - s.ru_stime for s, e in zip(start, end))
    return {"samples_per_s": rate, "cpu_ms_per_sample": 1000 * cpu / ((warmup + measure) * ORDER_BATCH)}


def order_section(pattern: str, args) -> str:
    """Throughput of canonical streams vs the per-worker layout, and the key sequences after resumes."""
    rows = []
    for size in (224, 84):
        results = {name: [] for name in ORDER_LAYOUTS}
        for rep in range(args.repeats):
            for name in (list(ORDER_LAYOUTS) if rep % 2 == 0 else list(ORDER_LAYOUTS)[::-1]):  # alternate
                results[name].append(run_child(Path(sys.executable), "--child", "order", "--layout", name,
                                               "--pattern", pattern, "--size", str(size), "--warmup",
                                               str(args.warmup), "--measure", str(args.measure)))
        base = results["per-worker"]
        for name, label in ORDER_LAYOUTS.items():
            rate = [r["samples_per_s"] for r in results[name]]
            cpu = [r["cpu_ms_per_sample"] for r in results[name]]
            ratios = sorted(r / b["samples_per_s"] for r, b in zip(rate, base))
            cpu_ratio = median(cpu) / median(b["cpu_ms_per_sample"] for b in base)
            rows.append(f"| {size} | {label} | {median(rate):.0f} | {median(ratios):.2f}x ({ratios[0]:.2f}-"
                        f"{ratios[-1]:.2f}x) | {median(cpu):.2f} | {cpu_ratio:.2f}x |")
            print(rows[-1], flush=True)
    steps, resume_at = 50, 20
    seqs = key_sequences(pattern, steps, resume_at)
    ref = seqs["uninterrupted"]
    lines = [f"| {w} | {sum(a == b for a, b in zip(seqs[w], ref))} / {steps} | "
             f"{'identical' if seqs[w] == ref else 'DIFFERENT'} |" for w in (1, 2, 4)]
    print("\n".join(lines), flush=True)
    from report import machine_line

    return "\n".join([
        "## Data order: canonical streams (`bench/bench_data.py --order`)",
        f"Same DataComp-like shards as the `data` section; resampled mode, one rank, {ORDER_WORKERS} DataLoader workers, "
        f"batch {ORDER_BATCH}, {args.measure} batches timed after {args.warmup} warm-up, {args.repeats} alternating runs "
        "of each layout in fresh processes (median, range of the per-run ratios). Baseline: the per-worker layout "
        "built from the same reading and decoding code (each worker yields whole batches of its own stream). "
        "Canonical streams: every batch holds batch/C samples of each of C streams; each worker yields per step one "
        "item with the slices of its block of streams, this process joins the workers' items (C="
        f"{ORDER_WORKERS}: one stream per worker; C={4 * ORDER_WORKERS}: four per worker). CPU ms per sample: user + system time of the process and its workers over "
        "the warm-up and timed batches, which other jobs on the machine do not inflate.",
        "", "| image size | layout | samples/s | vs baseline | CPU ms / sample | CPU vs baseline |",
        "| --- | --- | --- | --- | --- | --- |", *rows, "",
        f"Global-batch keys (webdataset `__key__`) of the {steps} steps after a resume at step {resume_at} of a 2-rank, "
        "2-worker run (state merged with `merge_stream_states`, split with `split_stream_state`), 1 worker per rank, "
        "against the uninterrupted 2-rank run:", "",
        "| ranks after the resume | steps with identical keys | sequence |", "| --- | --- | --- |", *lines, "",
        machine_line() + " (2 cores shared with other jobs: compare ratios, not absolute rates)",
    ])


def main(argv=None) -> int:
    """Run every configuration, print the table, write BENCHMARKS.md's `data` section."""
    p = argparse.ArgumentParser()
    p.add_argument("--child", choices=("ours", "baseline", "order"))
    p.add_argument("--layout", choices=tuple(ORDER_LAYOUTS))
    p.add_argument("--pattern")
    p.add_argument("--size", type=int)
    p.add_argument("--workers", type=int)
    p.add_argument("--warmup", type=int, default=4)
    p.add_argument("--measure", type=int, default=30)
    p.add_argument("--num-samples", type=int, default=0)
    p.add_argument("--repeats", type=int, default=3, help="alternating ours/baseline pairs per setting")
    p.add_argument("--no-write", action="store_true")
    p.add_argument("--order", action="store_true", help="canonical-stream section only (`data-order`)")
    args = p.parse_args(argv)
    if args.child == "order":
        print(json.dumps(order_child(args.pattern, args.size, args.layout, args.warmup, args.measure)))
        return 0
    if args.child:
        if args.child == "ours":
            rate = ours(args.pattern, args.size, args.workers, args.warmup, args.measure)
        else:
            rate = baseline(args.pattern, args.size, args.workers, args.warmup, args.measure, args.num_samples)
        print(json.dumps({"samples_per_s": rate}))
        return 0

    OUT.mkdir(parents=True, exist_ok=True)
    pattern = make_shards()
    if args.order:
        md = order_section(pattern, args)
        if not args.no_write:
            from report import write_section
            write_section("data-order", md)
        print(md)
        return 0
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
