"""Does train.ema help the demo? Its EMA weights against its live weights, paired over the test images, per seed.

    .venv/bin/python bench/bench_ema_demo.py --runs-dir DIR [--seeds 0 1 2] [--decay 0.99] [--data DIR/test]

For each seed, DIR/seed<N> is a finished demo run with train.ema on (`python -m crate_clip.train.demo --set
run.seed=N --set train.ema.decay=D --set train.ema.every_steps=1 --set train.ema.start_step=0`; trained there first
when its export is missing, ~5 min each on a 2-core CPU). Its final checkpoint is exported with `--weights ema`
(DIR/seed<N>/export-ema) beside the trainer's export of the live weights, and both are scored on every test image at
27 px (`crate-clip eval zeroshot --per-image-out`, as bench/demo_seeds.py does); the difference's standard error comes
from per-image agreement. Stage 0's ends (21 px) are read from the run's results.jsonl, where the trainer evaluated
both kinds of weights. Prints one row per seed, the mean +- std over seeds (the seeds' own spread) and the pooled
paired difference.
"""
import argparse
import json
import math
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.demo_runs import run_demo  # noqa: E402
from bench.demo_seeds import mean_std, paired, per_image_eval, run_results  # noqa: E402
from bench.seed_spread import seed_spread  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


def ema_overrides(seed: int, decay: float) -> list[str]:
    return [f"run.seed={seed}", f"train.ema.decay={decay}", "train.ema.every_steps=1", "train.ema.start_step=0"]


def seed_row(runs_dir: Path, seed: int, data: Path, decay: float) -> dict:
    run_dir = runs_dir / f"seed{seed}"
    if not (run_dir / "export").is_dir():
        run_demo(run_dir, ema_overrides(seed, decay), data_dir=data.parent, probe_train_images=0, reuse=True)
    if not (run_dir / "export-ema").is_dir():
        subprocess.run([sys.executable, "-m", "crate_clip.cli", "export", str(run_dir), "--weights", "ema", "--out",
                        str(run_dir / "export-ema"), "--no-verify"], check=True, cwd=ROOT)
    live = per_image_eval(f"local-dir:{run_dir / 'export'}", data, run_dir / "export.csv", [])
    ema = per_image_eval(f"local-dir:{run_dir / 'export-ema'}", data, run_dir / "export-ema.csv", [])
    gain, se = paired(live["correct"], ema["correct"])
    logged = {(r["stage_index"], r["image_size"], r.get("weights", "live")): r["top1"] for r in run_results(run_dir)
              if r.get("at", "stage_end") == "stage_end" and r.get("resize", "grid") == "grid"}
    return {"seed": seed, "live_stage0_21": logged.get((0, 21, "live")), "ema_stage0_21": logged.get((0, 21, "ema")),
            "live_27": live["top1"], "ema_27": ema["top1"], "gain": gain, "se": se, "n": len(live["correct"]),
            "logged_ema_27": logged.get((1, 27, "ema"))}   # the trainer's evaluation of the same EMA weights


def table(rows: list[dict]) -> str:
    """The seeds' rows and their mean, in the demo_seeds table's form: the gain's SE paired over images beside its
    spread over seeds (bench/seed_spread.py)."""
    pct = lambda v: "-" if v is None else f"{100 * v:.2f}"   # noqa: E731
    lines = ["| seed | stage 0 live @21 | stage 0 EMA @21 | final live @27 | final EMA @27 "
             "| EMA - live @27 (± SE paired over images) |", "|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['seed']} | {pct(r['live_stage0_21'])} | {pct(r['ema_stage0_21'])} | {pct(r['live_27'])} | "
                     f"{pct(r['ema_27'])} | {100 * r['gain']:+.2f} ± {100 * r['se']:.2f} "
                     f"(z {r['gain'] / r['se'] if r['se'] else 0:+.1f}) |")
    gain = sum(r["gain"] for r in rows) / len(rows)
    se = math.sqrt(sum(r["se"] ** 2 for r in rows)) / len(rows)   # seeds' test-set noise, independent fits
    over_seeds = seed_spread([100 * r["gain"] for r in rows]).text()
    lines.append(f"| mean ± SD over seeds | {mean_std([r['live_stage0_21'] for r in rows])} | "
                 f"{mean_std([r['ema_stage0_21'] for r in rows])} | {mean_std([r['live_27'] for r in rows])} | "
                 f"{mean_std([r['ema_27'] for r in rows])} | {100 * gain:+.2f} ± {100 * se:.2f} "
                 f"(z {gain / se if se else 0:+.1f}); {over_seeds} |")
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--runs-dir", type=Path, required=True, help="the seeds' run folders: DIR/seed<N>")
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--decay", type=float, default=0.99, help="train.ema.decay of a run this script starts")
    p.add_argument("--data", type=Path, default=ROOT / "data" / "fashion_mnist" / "test")
    p.add_argument("--json", type=Path, help="also write the rows here")
    args = p.parse_args()
    rows = [seed_row(args.runs_dir, s, args.data, args.decay) for s in args.seeds]
    for r in rows:
        if r["logged_ema_27"] is not None and abs(r["ema_27"] - r["logged_ema_27"]) > 1e-9:
            print(f"[bench] seed {r['seed']}: EMA @27 {r['ema_27']:.4f} here, {r['logged_ema_27']:.4f} in the run's "
                  "results.jsonl", flush=True)
    print(table(rows))
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
