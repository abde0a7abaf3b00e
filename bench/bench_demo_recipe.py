"""The demo's recipe against full-resolution training at equal FLOPs, over seeds (issue 53 item 2).

For each seed, two runs on the demo's data:
  the demo as shipped      `python -m crate_clip.train.demo --set run.seed=N` (bench/demo_runs.py)
  full resolution          the token-strategies study's full arm: 28 px / patch 7, every image token, 16 text tokens,
                           one stage at the demo's peak rate, its samples set so that its training FLOPs equal the
                           demo's (the step meter's count, whole batches)
Both finals are scored zero-shot on all 10,000 test images, each at its own input. The contrast is given paired over
images (the test set's noise) beside the seeds' own spread (bench/seed_spread.py): docs/inverse_scaling.md, "How to
read ±". Writes docs/demo_recipe.json, which the demo reads to print the comparison for a run of the same recipe.

    python bench/bench_demo_recipe.py --seeds 0 1 2      # ~15 min a seed on a quiet 2-core CPU

The demo runs land in --out as seed<N>/ (bench/demo_seeds.py reads the same layout for the per-stage table) and
the full-resolution runs as full_s<N>/; finished runs are reused.
"""
from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import shlex
import sys
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from bench.bench_inverse_scaling import (DOCS, flops_per_sample, paired, run_config, score_final, stage,  # noqa: E402
                                         train)
from bench.bench_token_strategies import FULL, TEXT  # noqa: E402
from bench.demo_runs import DEMO_CONFIG, run_demo  # noqa: E402
from bench.demo_seeds import per_image_eval  # noqa: E402
from bench.seed_spread import mean_paired_se, sd, seed_spread  # noqa: E402

RECORD = "demo_recipe.json"


def full_run(seed: int, flops: float, base_cfg: dict, out: Path, data_dir: Path, nproc: int) -> dict:
    """The full-resolution run of `flops` training FLOPs for `seed`, trained (or reused) and scored."""
    base = base_cfg["stages"][0]
    shape = {**TEXT, **{k: v for k, v in FULL.items() if k != "patch_size"}}
    probe = stage("full", shape, base["global_batch"], base["lr"], base, 40, FULL["patch_size"])
    per_sample = flops_per_sample({**base_cfg, "stages": [probe]})[0]
    samples = round(flops / per_sample / base["global_batch"]) * base["global_batch"]
    stages = [stage("full", shape, samples, base["lr"], base, 40, FULL["patch_size"])]
    run_dir = out / f"full_s{seed}"
    cfg = run_config(base_cfg["model"]["name"], seed, stages, run_dir, base_cfg, 0, data_dir)
    wall = train(cfg, run_dir, nproc)
    final = score_final(run_dir, cfg, 10_000)
    return {"samples": samples, "flops": samples * per_sample, "top1": final["top1"], "correct": final["correct"],
            "wall_seconds": wall}


def demo_run(seed: int, out: Path, data_dir: Path) -> dict:
    """The shipped demo for `seed` (reused when finished), its training FLOPs and its final scored per image."""
    from crate_clip.train.demo import training_flops

    run_dir = out / f"seed{seed}"
    wall = run_demo(run_dir, [f"run.seed={seed}"], data_dir=data_dir, reuse=True)
    final = per_image_eval(run_dir / "checkpoints", data_dir / "test", out / f"seed{seed}_final.csv", [])
    return {"flops": training_flops(run_dir)[0], "top1": final["top1"], "correct": final["correct"],
            "wall_seconds": wall}


def summary(rows: list[dict]) -> dict:
    """Means and SDs over seeds (ddof 1) of both arms, and the contrast full - demo: paired over images (the
    seeds' image-level SEs combined) and its spread over seeds."""
    demo, full = [r["demo_top1"] for r in rows], [r["full_top1"] for r in rows]
    diffs = [100 * (f - d) for d, f in zip(demo, full)]
    spread = seed_spread(diffs)
    return {"seeds": len(rows), "demo_mean": 100 * sum(demo) / len(demo), "demo_sd": 100 * sd(demo),
            "full_mean": 100 * sum(full) / len(full), "full_sd": 100 * sd(full),
            "full_minus_demo": spread.mean, "paired_se": 100 * mean_paired_se([r["se"] for r in rows]),
            "over_seeds": spread.text(), "supported": spread.supported}


def markdown(record: dict) -> str:
    s = record["summary"]
    lines = [f"_{record['date']}, {record['machine']}; `{record['command']}`_", "",
             f"| seed | the demo ({record['demo_flops'] / 1e12:.2f} TFLOP) | full resolution, equal FLOPs "
             f"({record['full_samples']:,} samples) | full - demo (± SE paired over images) |", "|---|---:|---:|---:|"]
    for r in record["rows"]:
        lines.append(f"| {r['seed']} | {100 * r['demo_top1']:.2f}% | {100 * r['full_top1']:.2f}% | "
                     f"{100 * r['diff']:+.2f} ± {100 * r['se']:.2f} |")
    lines.append(f"| mean ± SD over seeds | {s['demo_mean']:.2f} ± {s['demo_sd']:.2f}% | {s['full_mean']:.2f} ± "
                 f"{s['full_sd']:.2f}% | {s['full_minus_demo']:+.2f} ± {s['paired_se']:.2f}; {s['over_seeds']} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    from crate_clip.train.demo import _run_config, run_recipe

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--out", type=Path, default=ROOT / "bench" / "out" / "demo_recipe", help="runs folder")
    p.add_argument("--data-dir", type=Path, default=ROOT / "data" / "fashion_mnist")
    p.add_argument("--docs", type=Path, default=DOCS, help=f"where {RECORD} goes (default docs/)")
    p.add_argument("--nproc", type=int, default=2)
    args = p.parse_args(argv)
    base_cfg = yaml.safe_load(DEMO_CONFIG.read_text())
    rows = []
    for seed in args.seeds:
        demo = demo_run(seed, args.out, args.data_dir)
        full = full_run(seed, demo["flops"], base_cfg, args.out, args.data_dir, args.nproc)
        diff, se = paired(demo["correct"], full["correct"])
        rows.append({"seed": seed, "demo_top1": demo["top1"], "full_top1": full["top1"], "diff": diff, "se": se,
                     "demo_flops": demo["flops"], "full_flops": full["flops"], "full_samples": full["samples"],
                     "demo_wall_seconds": demo["wall_seconds"], "full_wall_seconds": full["wall_seconds"]})
        print(f"[demo-recipe] seed {seed}: the demo {100 * demo['top1']:.2f}%, full resolution at equal FLOPs "
              f"{100 * full['top1']:.2f}% ({100 * diff:+.2f} ± {100 * se:.2f})", flush=True)
    load = os.getloadavg()[2] if hasattr(os, "getloadavg") else float("nan")
    record = {"date": dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
              "machine": f"{platform.machine()} {os.cpu_count()} CPU cores, load {load:.1f} (15-min average)",
              "command": shlex.join(["python", "bench/bench_demo_recipe.py", *(argv or sys.argv[1:])]),
              # the stages as the demo reads them (defaults filled in), so that the demo finds its own recipe
              "model": base_cfg["model"]["name"], "recipe": run_recipe(_run_config(str(DEMO_CONFIG), [])["stages"]),
              "demo_flops": rows[0]["demo_flops"], "full_samples": rows[0]["full_samples"],
              "full_shape": {**TEXT, **FULL}, "rows": rows, "summary": summary(rows)}
    (args.docs / RECORD).write_text(json.dumps(record, indent=1) + "\n")
    print(markdown(record))
    return 0


if __name__ == "__main__":
    sys.exit(main())
