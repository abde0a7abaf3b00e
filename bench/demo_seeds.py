"""The demo over several seeds, with paired standard errors: does the fine-tune lose against its own start?

    .venv/bin/python bench/demo_seeds.py --runs-dir DIR [--seeds 0 1 2] [--data data/fashion_mnist/test]

For each seed, DIR/seed<N> is a finished `python -m crate_clip.train.demo --set run.seed=N --run-dir DIR/seed<N>`
run (one is trained there first when its export is missing: ~15-20 min each on a 2-core CPU). Both ends of the
fine-tune are then scored on every test image at the same input, 27 px with 9 px patches (the demo's eval mode):
the stage-0 final checkpoint (21 px / patch 7, its 3x3 grid kept and the kernel PI-resized: `--resize patch`) and
the final checkpoint, each by `crate-clip eval zeroshot --per-image-out`. The difference's standard error comes
from per-image agreement: d_i = correct_final_i - correct_stage0_i, SE = sqrt(var(d) / n) (images both models get
right or wrong add nothing). Prints one row per seed, the mean ± SD over seeds (ddof 1), and the mean gain twice:
± its paired SE (the seeds' image-level SEs combined: the test set's noise) and ± its SE over seeds with a t on
seeds - 1 df and a 95% interval (the training runs' noise; the gain's sign stands only where that interval leaves
out zero): docs/inverse_scaling.md, "How to read ±".
"""
import argparse
import csv
import json
import math
import re
import subprocess
import sys
from pathlib import Path
from typing import Optional

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.demo_runs import run_demo  # noqa: E402
from bench.seed_spread import mean_paired_se, sd, seed_spread  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
EVAL_SIZE, STAGE0 = 27, 0
PROBE_LINE = re.compile(r"linear probe: top-1 ([\d.]+)%")


def stage_end_tag(run_dir: Path, stage: int) -> Path:
    """The final checkpoint of `stage` (the rotation keeps every finished stage's last one)."""
    steps = yaml.safe_load((run_dir / "run_config.yaml").read_text())["stages"][stage]
    tag = run_dir / "checkpoints" / f"stage{stage}-step{steps['samples'] // steps['global_batch']:08d}"
    if not tag.is_dir():
        raise SystemExit(f"{run_dir}: no {tag.name} (the stage's final checkpoint); rerun the demo there")
    return tag


def per_image_eval(model: Path, data: Path, out: Path, extra: list[str]) -> dict:
    """`crate-clip eval zeroshot` of `model` at 27 px with its per-image top-1 classes in `out` (reused when
    there); returns {"top1": ..., "correct": [0/1 per image, in index order]}."""
    metrics = out.with_suffix(".json")
    if not (out.is_file() and metrics.is_file()):
        cmd = [sys.executable, "-m", "crate_clip.cli", "eval", "zeroshot", "--model", str(model), "--data", str(data),
               "--dataset", "fashion_mnist", "--image-size", str(EVAL_SIZE), "--batch-size", "500", "--no-progress",
               "--output", str(metrics), "--per-image-out", str(out), *extra]
        print("[bench]", " ".join(cmd[1:]), flush=True)
        subprocess.run(cmd, check=True, cwd=ROOT)
    with out.open() as f:
        correct = [int(r["label"] == r["top1"]) for r in csv.DictReader(f)]
    return {"top1": json.loads(metrics.read_text())["top1"], "correct": correct}


def paired(a: list[int], b: list[int]) -> tuple[float, float]:
    """(mean of b_i - a_i, its standard error sqrt(var(d) / n)) over the same images."""
    d = [y - x for x, y in zip(a, b, strict=True)]
    n = len(d)
    mean = sum(d) / n
    return mean, math.sqrt(sum((v - mean) ** 2 for v in d) / (n - 1) / n)


def run_results(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "results.jsonl").read_text().splitlines() if line.strip()]


def probe_top1(run_dir: Path) -> float | None:
    """The demo's linear probe of its export, from its console (`<run>.log` as demo_runs writes it, or `<run>.err`
    of a --json run); None when the run skipped the probe."""
    for console in (run_dir.with_suffix(".log"), run_dir.with_suffix(".err")):
        found = PROBE_LINE.findall(console.read_text()) if console.is_file() else []
        if found:
            return float(found[-1]) / 100
    return None


def seed_row(runs_dir: Path, seed: int, data: Path, probe_images: int | None) -> dict:
    run_dir = runs_dir / f"seed{seed}"
    if not (run_dir / "export").is_dir():
        run_demo(run_dir, [f"run.seed={seed}"], probe_train_images=probe_images, reuse=True)
    start = per_image_eval(stage_end_tag(run_dir, STAGE0), data, runs_dir / f"seed{seed}_stage0.csv",
                           ["--resize", "patch"])
    final = per_image_eval(run_dir / "checkpoints", data, runs_dir / f"seed{seed}_final.csv", [])
    gain, se = paired(start["correct"], final["correct"])
    logged = {(r["stage_index"], r["image_size"]): r["top1"] for r in run_results(run_dir)}
    return {"seed": seed, "stage0_21": logged.get((0, 21)), "stage0_27": start["top1"], "final_27": final["top1"],
            "probe": probe_top1(run_dir), "gain": gain, "se": se, "n": len(final["correct"]),
            # the trainer's own stage evaluations of the same weights, as a check on the two evals above
            "logged_stage0_27": logged.get((0, EVAL_SIZE)), "logged_final_27": logged.get((1, EVAL_SIZE))}


def mean_std(values: list[float]) -> str:
    values = [v for v in values if v is not None]
    if not values:
        return "-"
    return f"{100 * sum(values) / len(values):.2f} ± {100 * sd(values):.2f}"


def table(rows: list[dict]) -> str:
    return seeds_table(rows, [("stage 0 @21", "stage0_21"), ("stage 0 @27 (patch)", "stage0_27"),
                              ("final @27", "final_27"), ("linear probe", "probe")], "final - stage 0 @27")


def seeds_table(rows: list[dict], columns: list[tuple[str, str]], gain: str) -> str:
    """A row per seed with `columns` ((header, key) of a top-1 in [0, 1]) and the seed's paired contrast (its 'gain'
    and 'se'), then the mean row: each column's mean ± SD over seeds, the contrast's SE paired over images beside its
    spread over seeds (bench/seed_spread.py)."""
    pct = lambda v: "-" if v is None else f"{100 * v:.2f}"   # noqa: E731
    z = lambda g, se: g / se if se else 0   # noqa: E731   (identical predictions: no spread to scale by)
    lines = ["| seed | " + " | ".join(h for h, _ in columns) + f" | {gain} (± SE paired over images) |",
             "|---" * (len(columns) + 2) + "|"]
    for r in rows:
        lines.append(f"| {r['seed']} | " + " | ".join(pct(r[k]) for _, k in columns)
                     + f" | {100 * r['gain']:+.2f} ± {100 * r['se']:.2f} (z {z(r['gain'], r['se']):+.1f}) |")
    mean = sum(r["gain"] for r in rows) / len(rows)
    se = mean_paired_se([r["se"] for r in rows])
    over_seeds = seed_spread([100 * r["gain"] for r in rows]).text()
    lines.append("| mean ± SD over seeds | " + " | ".join(mean_std([r[k] for r in rows]) for _, k in columns)
                 + f" | {100 * mean:+.2f} ± {100 * se:.2f} (z {z(mean, se):+.1f}); {over_seeds} |")
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--runs-dir", type=Path, required=True, help="the seeds' run folders: DIR/seed<N>")
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--data", type=Path, default=ROOT / "data" / "fashion_mnist" / "test")
    p.add_argument("--probe-train-images", type=int, help="passed to a demo run this script starts")
    p.add_argument("--json", type=Path, help="also write the rows here")
    args = p.parse_args()
    rows = [seed_row(args.runs_dir, s, args.data, args.probe_train_images) for s in args.seeds]
    report(rows, [("stage0_27", "stage0_27", "logged_stage0_27"), ("final_27", "final_27", "logged_final_27")],
           table(rows), args.json)


def report(rows: list[dict], checked: list[tuple[str, str, str]], text: str, json_path: Optional[Path]) -> None:
    """Say each score measured here that differs from the trainer's own evaluation of the same weights (`checked`:
    (label, key here, key of the logged score)), print the table `text`, and write the rows to `json_path`."""
    for r in rows:
        for label, ours, logged in checked:
            if r[logged] is not None and abs(r[ours] - r[logged]) > 1e-9:
                print(f"[bench] seed {r['seed']}: {label} {r[ours]:.4f} here, {r[logged]:.4f} in the run's "
                      "results.jsonl", flush=True)
    print(text)
    if json_path:
        json_path.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
