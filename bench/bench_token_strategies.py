"""CLIPA's image-token strategies compared the paper's way on the demo's data (issue 53 item 1): every arm trains on
the same samples, first on fewer image tokens, then the same short full-length fine-tune; the final models are
scored zero-shot on all 10,000 test images and set against the training FLOPs the step meter counts.

Arms, per token budget k of the 4x4 grid of 28 px / patch 7 (16 patch tokens), text always 16 tokens:
  full            28 px / patch 7, every token, in both stages (the same schedule: the reference)
  resize-grow-k   the image resized to 21 px (k = 9) or 14 px (k = 4) at patch 7; the fine-tune at 28 px / patch 7
                  grows the grid (the position embedding interpolated): CLIPA's resize
  resize-keep-k   the same first stage; the fine-tune keeps the grid at full resolution with larger patches (the
                  kernel PI-resized): 27 px / patch 9 (3x3) or 28 px / patch 14 (2x2), what the demo does
  random-k        28 px / patch 7 with a random k of the 16 tokens kept (CLIPA's random masking)
  block-k         28 px / patch 7 with one square block of k tokens kept, placed at random
  grid-4          28 px / patch 7 with one token of each 2x2 window kept (only k = 4)
Then the paper's inverse scaling law at equal samples over the widths given (--widths: 64, 128, 256): the same
arms per width, so the loss from fewer tokens can be read against the tower's width.

Each arm's first stage trains `--samples` samples at the demo's peak rate, then the fine-tune `--finetune-samples`
at 1/10 of it (the demo's ratio). Contrasts with the full arm: the per-image paired difference (SE over the 10,000
images, seeds pooled) and the seeds' own spread (bench/seed_spread.py: SE over seeds, t, 95% interval); a claim
stands only where the seeds' interval leaves out zero.

    python bench/bench_token_strategies.py --seeds 3                   # the study (~6 min a run on 2 cores)
    python bench/bench_token_strategies.py --smoke                     # a few steps: the script works
    python bench/bench_token_strategies.py --from-record               # the section again from the JSON

Writes docs/token_strategies.json, docs/token_strategies.png and the `token-strategies` section of
docs/inverse_scaling.md (the runs under bench/out/token_strategies; a finished run is reused).
"""
from __future__ import annotations

import argparse
import copy
import datetime as dt
import json
import os
import platform
import shlex
import sys
import time
from pathlib import Path

import numpy as np
import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from bench.bench_inverse_scaling import (DOCS, FINETUNE_LR_RATIO, data_folder, flops_per_sample,  # noqa: E402
                                         pooled_paired, run_config, score_final, seed_cell, seed_record, stage,
                                         train, versus_cell, write_doc_section)
from bench.demo_runs import DEMO_CONFIG  # noqa: E402
from bench.report import section_head  # noqa: E402
from bench.seed_spread import sd as seed_sd  # noqa: E402

SECTION = "token-strategies"
WIDTHS = {"w64": "CRATE-alpha-CLIPA-tiny-w64", "w128": "CRATE-alpha-CLIPA-tiny", "w256": "CRATE-alpha-CLIPA-tiny-w256"}
TEXT = {"context_length": 16, "text_mask": "truncate"}
FULL = {"image_size": 28, "patch_size": 7, "image_mask": "none", "image_mask_ratio": 0.0}
LOW_SIZE = {9: 21, 4: 14}             # the resized input whose 7 px patches make k tokens
KEEP_FINE = {9: (27, 9), 4: (28, 14)}  # full resolution with the k-token grid kept: (size, patch)
ARMS = ("full", "resize-grow-9", "resize-keep-9", "random-9", "block-9",
        "resize-grow-4", "resize-keep-4", "random-4", "block-4", "grid-4")


def arm_shapes(arm: str) -> tuple[dict, dict]:
    """(the first stage's image shape, the fine-tune's) of an arm."""
    if arm == "full":
        return FULL, FULL
    kind, k = arm.rsplit("-", 1)[0], int(arm.rsplit("-", 1)[1])
    if kind == "resize-grow":
        return {**FULL, "image_size": LOW_SIZE[k]}, FULL
    if kind == "resize-keep":
        size, patch = KEEP_FINE[k]
        return {**FULL, "image_size": LOW_SIZE[k]}, {**FULL, "image_size": size, "patch_size": patch}
    drop = (16 - k) / 16   # random and block keep round(16 (1 - drop)) = k tokens; grid keeps 4 whatever the ratio
    return {**FULL, "image_mask": kind, "image_mask_ratio": drop if kind != "grid" else 0.0}, FULL


def arm_tokens(arm: str) -> str:
    """The image tower's patch tokens in the arm's first stage and in its fine-tune: '9 -> 16'."""
    from crate_clip.models.token_masks import num_kept_tokens

    def tokens(shape: dict) -> int:
        side = shape["image_size"] // shape["patch_size"]
        return num_kept_tokens(shape["image_mask"], (side, side), shape["image_mask_ratio"])

    low, fine = arm_shapes(arm)
    return f"{tokens(low)} -> {tokens(fine)}"


def arm_stages(arm: str, samples: int, finetune: int, base_cfg: dict) -> list[dict]:
    """The arm's two run-config stages: `samples` on its reduced tokens, then `finetune` at full length."""
    base = base_cfg["stages"][0]
    low, fine = arm_shapes(arm)

    def shape(s: dict) -> dict:   # the stage keys besides the patch (stage() sets it)
        return {**TEXT, **{k: v for k, v in s.items() if k != "patch_size"}}

    return [stage("low", shape(low), samples, base["lr"], base, 40, low["patch_size"]),
            stage("fine", shape(fine), finetune, base["lr"] * FINETUNE_LR_RATIO, base,
                  max(1, finetune // base["global_batch"] // 10), fine["patch_size"])]


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--samples", type=int, default=40960, help="first-stage samples of every arm (default 40960)")
    p.add_argument("--finetune-samples", type=int, default=10240, help="fine-tune samples (default 10240)")
    p.add_argument("--final-images", type=int, default=10000, help="test images scoring each final model")
    p.add_argument("--seeds", type=int, default=3)
    p.add_argument("--first-seed", type=int, default=0, help="run seeds from this one (the record keeps the rest)")
    p.add_argument("--widths", nargs="+", default=["w128"], choices=list(WIDTHS))
    p.add_argument("--arms", nargs="+", default=list(ARMS), choices=list(ARMS))
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--out", type=Path, default=ROOT / "bench" / "out" / "token_strategies", help="runs folder")
    p.add_argument("--data-dir", type=Path, default=None, help="train/ shards and test/ set (default: the demo's)")
    p.add_argument("--docs", type=Path, default=DOCS, help="where the section, JSON and plot go (default docs/)")
    p.add_argument("--label", default="", help="a note printed above the table")
    p.add_argument("--from-record", action="store_true", help="train nothing: the section again from the JSON")
    p.add_argument("--smoke", action="store_true", help="a few steps of two arms: checks the script, measures "
                                                        "nothing; writes under --out only")
    args = p.parse_args(argv)
    if args.smoke:
        args.samples, args.finetune_samples, args.final_images, args.seeds = 128, 64, 100, 1
        if "--arms" not in (argv if argv is not None else sys.argv[1:]):
            args.arms = ["full", "block-4"]
        args.docs, args.label = args.out / "docs", args.label or "smoke run: measures nothing"
    return args


# ------------------------------------------------------------------------------------------------ the table
def summarize(runs: list[dict]) -> list[dict]:
    """Per width and arm: the final top-1 over seeds, its training FLOPs as a share of the full arm's, and its
    difference from the full arm's final top-1 (same width and seed): paired over images, and over seeds."""
    rows = []
    for width in [w for w in WIDTHS if any(r["width"] == w for r in runs)]:
        full = {r["seed"]: r for r in runs if r["width"] == width and r["arm"] == "full"}
        for arm in ARMS:
            mine = [r for r in runs if r["width"] == width and r["arm"] == arm]
            if not mine:
                continue
            finals = [100 * r["top1"] for r in mine]
            row = {"width": width, "model": WIDTHS[width], "arm": arm, "seeds": len(mine),
                   "tokens": mine[0]["tokens"], "top1_mean": float(np.mean(finals)),
                   "top1_sd": seed_sd(finals) if len(finals) > 1 else None,
                   "total_flops": float(np.mean([r["total_flops"] for r in mine])), "stages": mine[0]["stages"]}
            paired_seeds = [r for r in mine if r["seed"] in full]
            if arm != "full" and paired_seeds:
                row["flops_share"] = row["total_flops"] / float(np.mean([full[r["seed"]]["total_flops"]
                                                                         for r in paired_seeds]))
                scored = [r for r in paired_seeds if "correct" in r and "correct" in full[r["seed"]]]
                if scored:   # the seeds whose per-image scores are beside the runs (another checkout: some or none)
                    diff, se = pooled_paired([(full[r["seed"]]["correct"], r["correct"]) for r in scored])
                    row["vs_full_mean"], row["vs_full_se"] = 100 * diff, 100 * se
                    row["vs_full_paired_seeds"] = sorted(r["seed"] for r in scored)
                if len(paired_seeds) > 1:
                    row["vs_full_seeds"] = seed_record([100 * (r["top1"] - full[r["seed"]]["top1"])
                                                        for r in paired_seeds])
            rows.append(row)
    return rows


def paired_cell(row: dict) -> str:
    """versus_cell, naming the seeds it pools where they are not all of the row's (per-image scores of the others
    were left in another checkout)."""
    seeds = row.get("vs_full_paired_seeds")
    some = seeds is not None and len(seeds) < row["seeds"]
    return versus_cell(row) + (f" (seed{'s' if len(seeds) > 1 else ''} {', '.join(map(str, seeds))})" if some else "")


def markdown(meta: dict, rows: list[dict]) -> str:
    lines = section_head("Image-token strategies at equal samples, the paper's way "
                         "(`bench/bench_token_strategies.py`)", meta["label"], meta)
    lines += [f"Every arm: {meta['samples']:,} samples on its reduced image tokens (text: 16 tokens), then the same "
              f"fine-tune of {meta['finetune_samples']:,} samples at full length and {FINETUNE_LR_RATIO:g}x the "
              "peak rate; the demo's data, batch and optimizer. Tokens: the image tower's patch tokens in the first "
              "stage -> in the fine-tune. Final models scored zero-shot at their fine-tune's input on "
              f"{meta['final_images']:,} test images. 'vs full': the final top-1 minus the full arm's (same seed), "
              "± its SE paired over images (seeds pooled); over seeds: ± the SE of the seeds' own differences, t "
              "and 95% interval (a difference stands only where that interval leaves out zero). FLOPs: training "
              "FLOPs as the step meter counts them, the share of the full arm's.", "",
              "| width | arm | seeds | tokens | training FLOPs (TFLOP; share of full) | final top-1 (%, ± SD over "
              "seeds) | vs full (points, ± SE paired over images) | vs full over seeds (± SE, t, 95% interval) |",
              "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        share = f"; {100 * r['flops_share']:.0f}%" if "flops_share" in r else ""
        spread = f" ± {r['top1_sd']:.2f}" if r.get("top1_sd") is not None else ""
        lines.append(f"| {r['model']} | {r['arm']} | {r['seeds']} | {r['tokens']} | "
                     f"{r['total_flops'] / 1e12:.1f}{share} | {r['top1_mean']:.2f}{spread} | {paired_cell(r)} | "
                     f"{seed_cell(r.get('vs_full_seeds'))} |")
    lines += ["", "± after a top-1: the sample standard deviation over seeds (ddof 1). "
                  "![top-1 vs training FLOPs](token_strategies.png)"]
    return "\n".join(lines)


def plot(rows: list[dict], path: Path) -> None:
    """Final top-1 (mean over seeds, bars: SD) against training FLOPs, one marker per arm and width."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7.5, 4.5))
    markers = {"full": "*", "resize-grow": "o", "resize-keep": "s", "random": "^", "block": "D", "grid": "v"}
    for r in rows:
        kind = r["arm"].rsplit("-", 1)[0] if r["arm"] != "full" else "full"
        ax.errorbar(r["total_flops"] / 1e12, r["top1_mean"], yerr=r.get("top1_sd") or 0, fmt=markers[kind],
                    ms=7, capsize=3, label=f"{r['width']} {r['arm']}")
    ax.set_xlabel("training FLOPs (TFLOP, step meter)")
    ax.set_ylabel("final zero-shot top-1 (%)")
    ax.legend(fontsize=7, ncol=2)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write_docs(meta: dict, runs: list[dict], measured: list[dict] = ()) -> None:
    """The JSON, the section and the plot of `runs`; a paired difference that cannot be recomputed (the per-image
    scores are not beside the runs: another checkout) is taken from the rows `measured` before."""
    rows = summarize(runs)
    before = {(r["width"], r["arm"]): r for r in measured}
    for row in rows:
        kept = before.get((row["width"], row["arm"]), {})
        # kept only where it pooled every seed the row has now (a record without the list pooled all its seeds)
        kept_seeds = kept.get("vs_full_paired_seeds", list(range(kept.get("seeds", 0))))
        if "vs_full_se" in kept and len(kept_seeds) > len(row.get("vs_full_paired_seeds", [])) \
                and len(kept_seeds) == row["seeds"]:
            row["vs_full_mean"], row["vs_full_se"] = kept["vs_full_mean"], kept["vs_full_se"]
            row["vs_full_paired_seeds"] = kept_seeds
    meta["docs"].mkdir(parents=True, exist_ok=True)
    record = {**{k: v for k, v in meta.items() if k != "docs"}, "rows": rows,
              "runs": [{k: v for k, v in r.items() if k != "correct"} for r in runs]}
    (meta["docs"] / "token_strategies.json").write_text(json.dumps(record, indent=1))
    write_doc_section(meta["docs"] / "inverse_scaling.md", SECTION, markdown(meta, rows))
    plot(rows, meta["docs"] / "token_strategies.png")


# ------------------------------------------------------------------------------------------------ the runs
def one_run(args, base_cfg: dict, data_dir: Path, width: str, arm: str, seed: int) -> dict:
    """Train (or reuse) one arm for one seed and score its final model."""
    from crate_clip.train.demo import run_recipe

    stages = arm_stages(arm, args.samples, args.finetune_samples, base_cfg)
    run_dir = args.out / f"{width}_{arm}_s{seed}"
    cfg = run_config(WIDTHS[width], seed, stages, run_dir, base_cfg, 0, data_dir)
    flops = flops_per_sample({**cfg, "stages": stages})
    wall = train(cfg, run_dir, args.nproc)
    final = score_final(run_dir, cfg, args.final_images)
    tokens = arm_tokens(arm)
    run = {"width": width, "arm": arm, "seed": seed, "wall_seconds": wall, "tokens": tokens,
           "samples": [s["samples"] for s in stages], "stages": run_recipe(stages), "top1": final["top1"],
           "total_flops": sum(s["samples"] * f for s, f in zip(stages, flops)), "correct": final["correct"]}
    print(f"[token-strategies] {run_dir.name}: {tokens} tokens, {run['total_flops'] / 1e12:.1f} TFLOP, final "
          f"top-1 {100 * final['top1']:.2f}% ({wall:.0f} s training)", flush=True)
    return run


def recorded_runs(docs: Path, out: Path, redone: set) -> list[dict]:
    """The runs of the stored record whose (width, arm, seed) this invocation does not redo, each with its
    per-image correctness where its score is still beside the run (score_final's `<run>.final.json`)."""
    path = docs / "token_strategies.json"
    runs = json.loads(path.read_text())["runs"] if path.is_file() else []
    kept = [r for r in runs if (r["width"], r["arm"], r["seed"]) not in redone]
    for r in kept:
        scored = out / f"{r['width']}_{r['arm']}_s{r['seed']}.final.json"
        if scored.is_file():
            r["correct"] = json.loads(scored.read_text())["correct"]
    return kept


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.from_record:
        record = json.loads((args.docs / "token_strategies.json").read_text())
        write_docs({**{k: v for k, v in record.items() if k not in ("rows", "runs")}, "docs": args.docs},
                   recorded_runs(args.docs, args.out, set()), record["rows"])
        return 0
    base_cfg = copy.deepcopy(yaml.safe_load(DEMO_CONFIG.read_text()))
    data_dir = data_folder(args.data_dir)
    seeds = range(args.first_seed, args.first_seed + args.seeds)
    todo = [(w, a, s) for s in seeds for w in args.widths for a in args.arms]   # seed-major: whole seeds first
    runs = recorded_runs(args.docs, args.out, set(todo)) if not args.smoke else []
    record_file = args.docs / "token_strategies.json"
    measured = json.loads(record_file.read_text())["rows"] if record_file.is_file() and not args.smoke else []
    load = os.getloadavg()[2] if hasattr(os, "getloadavg") else float("nan")
    meta = {"date": dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
            "machine": f"{platform.machine()} {os.cpu_count()} CPU cores, load {load:.1f} (15-min average)",
            "command": shlex.join(["python", "bench/bench_token_strategies.py",
                                   *(argv if argv is not None else sys.argv[1:])]),
            "label": args.label, "samples": args.samples, "finetune_samples": args.finetune_samples,
            "final_images": args.final_images, "docs": args.docs}
    t0 = time.perf_counter()
    for width, arm, seed in todo:
        runs.append(one_run(args, base_cfg, data_dir, width, arm, seed))
        meta["wall_seconds"] = time.perf_counter() - t0
        write_docs(meta, runs, measured)   # kept up to date: an interrupted study keeps what it measured
    print(markdown(meta, summarize(runs)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
