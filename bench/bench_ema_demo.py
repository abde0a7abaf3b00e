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
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.demo_runs import run_demo  # noqa: E402
from bench.demo_seeds import paired, per_image_eval, report, run_results, seeds_table  # noqa: E402

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
    """The seeds' rows and their mean, as demo_seeds' table: EMA - live beside both kinds' scores."""
    return seeds_table(rows, [("stage 0 live @21", "live_stage0_21"), ("stage 0 EMA @21", "ema_stage0_21"),
                              ("final live @27", "live_27"), ("final EMA @27", "ema_27")], "EMA - live @27")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--runs-dir", type=Path, required=True, help="the seeds' run folders: DIR/seed<N>")
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--decay", type=float, default=0.99, help="train.ema.decay of a run this script starts")
    p.add_argument("--data", type=Path, default=ROOT / "data" / "fashion_mnist" / "test")
    p.add_argument("--json", type=Path, help="also write the rows here")
    args = p.parse_args()
    rows = [seed_row(args.runs_dir, s, args.data, args.decay) for s in args.seeds]
    report(rows, [("EMA @27", "ema_27", "logged_ema_27")], table(rows), args.json)


if __name__ == "__main__":
    main()
