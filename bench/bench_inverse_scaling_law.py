"""CLIPA's inverse scaling law on the demo data: does the accuracy lost to fewer image tokens shrink as the image
tower grows? (CLIPA, Li et al. 2023, Figure 1.)

Three image-tower widths (CRATE-alpha-CLIPA-tiny-w64, the demo's w128, -w256; depth 4, the same text tower) each
train three times, at 4, 9 and 16 image tokens: 14, 21 and 28 px at 7 px patches (2x2, 3x3, 4x4 grids: every size a
multiple of the patch, issue 39; the images resized, CLIPA's cheapest token reduction), 16 text tokens throughout.
Within a width every run spends the same training FLOPs as the step meter counts them (ResolvedStage.counts): the
16-token run trains on `--samples` samples, a shorter one on proportionally more (whole batches). Everything else is
the demo config's (batch 64, peak rate 2e-3, 40 warm-up steps, weight decay 0.1, fp32, its ZeRO stage). The
16-token run is bench/bench_inverse_scaling.py's `full` arm (same config, same run folder): a study run of the same
--samples, --evals and --out is reused, and the reverse.

Each run's final checkpoint is scored zero-shot at its own input (the resolution it trained at) on every one of the
10,000 Fashion-MNIST test images, with each image's top-1 kept, so that the change of a short run from its width's
16-token run (negative: accuracy lost to the shorter tokens) has a paired standard error (per-image agreement:
d_i = correct_short_i - correct_16_i, SE = sqrt(var(d) / n)), and so does the question itself: the change at the
widest tower minus the change at the narrowest, per image, with its own paired SE. Seeds add the training noise
the paired SE does not hold.

    python bench/bench_inverse_scaling_law.py                       # the sweep: 3 seeds, ~75 min on the idle 2-core CPU
    python bench/bench_inverse_scaling_law.py --samples 12800 --seeds 1 --label "reduced: 25% of the samples"
    python bench/bench_inverse_scaling_law.py --quick               # seconds of training: the script works
    python bench/bench_inverse_scaling_law.py --from-record         # no training: the section from the JSON

Writes its section of docs/inverse_scaling.md (between `inverse-scaling-law` markers; the study's section is the
other script's), docs/inverse_scaling_law.json and docs/inverse_scaling_law.png.
"""
from __future__ import annotations

import argparse
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

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench import bench_inverse_scaling as study  # noqa: E402
from bench.report import section_head  # noqa: E402

WIDTHS = {"w64": "CRATE-alpha-CLIPA-tiny-w64", "w128": "CRATE-alpha-CLIPA-tiny",
          "w256": "CRATE-alpha-CLIPA-tiny-w256"}
PATCH = 7
TOKENS = {4: 14, 9: 21, 16: 28}   # image tokens -> image size at 7 px patches (2x2, 3x3, 4x4 grids)
REFERENCE = 16                    # the token length the others are compared with (the study's full arm)
SECTION = "inverse-scaling-law"
FULL_SIZE = ("The full size: `python bench/bench_inverse_scaling_law.py` (3 widths x 4 / 9 / 16 tokens x 3 seeds, "
             "51,200 samples at 16 tokens: about 75 min on the idle 2-core machine, 24-27 min a seed); `--seeds`, "
             "`--widths`, `--tokens` and `--samples` size it down, and `python bench/bench_inverse_scaling_law.py "
             "--quick` checks the script in seconds of training.")



def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--samples", type=int, default=51200, help="the 16-token run's training samples (default 51200, "
                                                              "the study's full arm)")
    p.add_argument("--seeds", type=int, default=3)
    p.add_argument("--widths", nargs="+", default=list(WIDTHS), choices=list(WIDTHS))
    p.add_argument("--tokens", nargs="+", type=int, default=list(TOKENS), choices=list(TOKENS))
    p.add_argument("--evals", type=int, default=8, help="checkpoints written per run (as the study's, so that its "
                                                        "full arm is this sweep's 16-token run; default 8)")
    p.add_argument("--eval-images", type=int, default=10000, help="test images scored per final model (default all "
                                                                  "10,000)")
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--out", type=Path, default=study.ROOT / "bench" / "out" / "inverse_scaling", help="runs folder")
    p.add_argument("--data-dir", type=Path, default=None, help="as bench_inverse_scaling.py's --data-dir")
    p.add_argument("--docs", type=Path, default=study.DOCS, help="where the section, JSON and plot go (default docs/)")
    p.add_argument("--label", default="", help="a note printed above the table (e.g. 'reduced: 25%% of the samples')")
    p.add_argument("--from-record", action="store_true",
                   help="train nothing: rewrite the section and JSON in --docs from its stored record (the seeds' "
                        "statistics recomputed, the paired SEs as measured)")
    p.add_argument("--quick", action="store_true", help="tiny runs (1 seed, w64, 4 and 16 tokens, 256 samples, 50 "
                                                        "test images; its 16-token run is the study's --smoke full "
                                                        "arm): checks the script, measures nothing; writes under "
                                                        "--out only")
    args = p.parse_args(argv)
    if args.quick:
        args.samples, args.evals, args.eval_images, args.seeds = 256, 2, 100, 1
        given = argv if argv is not None else sys.argv[1:]
        if "--widths" not in given:
            args.widths = ["w64"]
        if "--tokens" not in given:
            args.tokens = [4, REFERENCE]
        args.docs = args.out / "docs"
        args.label = args.label or "quick run: measures nothing"
    if REFERENCE not in args.tokens:
        p.error(f"--tokens must include {REFERENCE} (the run the others are compared with)")
    return args


def token_stages(model: str, tokens: list[int], samples: int, base_cfg: dict) -> dict[int, dict]:
    """Each token length's one stage, at the same step-meter FLOPs as `samples` samples at 16 tokens; the 16-token
    stage is the study's full arm."""
    base, lr, batch = base_cfg["stages"][0], base_cfg["stages"][0]["lr"], base_cfg["stages"][0]["global_batch"]
    shape = lambda t: {**study.FULL, "image_size": TOKENS[t]}   # noqa: E731   16 text tokens, truncated
    probe = [study.stage(f"t{t}", shape(t), 4 * batch, lr, base, 1, PATCH) for t in tokens]
    flops = dict(zip(tokens, study.flops_per_sample({**base_cfg, "model": {"name": model}, "stages": probe})))
    stages = {}
    for t in tokens:
        n = samples if t == REFERENCE else max(batch, round(samples * flops[REFERENCE] / flops[t] / batch) * batch)
        stages[t] = study.arm_stages("full", model, samples, base_cfg)[0] if t == REFERENCE else \
            study.stage(f"tokens{t}", shape(t), n, lr, base, 40, PATCH)
    return stages


def run_name(width: str, tokens: int, seed: int) -> str:
    return f"{width}_full_s{seed}" if tokens == REFERENCE else f"{width}_tokens{tokens}_s{seed}"


def _pairs(runs: list[dict], width: str, tokens: int, seed_list: list[int]) -> list[tuple[list[int], list[int]]]:
    """Per seed with both runs: (the 16-token run's per-image correctness, the `tokens` run's), one width."""
    by = {(r["width"], r["tokens"], r["seed"]): r["correct"] for r in runs}
    return [(by[(width, REFERENCE, s)], by[(width, tokens, s)]) for s in seed_list
            if (width, REFERENCE, s) in by and (width, tokens, s) in by]


def _seed_changes(top1: dict, width: str, tokens: int, seeds: list[int]) -> list[float]:
    """Each seed's change (points) of the `tokens` run from its width's 16-token run, for the seeds with both."""
    return [100 * (top1[(width, tokens, s)] - top1[(width, REFERENCE, s)]) for s in seeds
            if (width, tokens, s) in top1 and (width, REFERENCE, s) in top1]


def summarize(runs: list[dict]) -> dict:
    """Per width and token length: top-1 over seeds and its change from 16 tokens (paired SE, seeds pooled; and
    over seeds); per short token length: the change at the widest width minus at the narrowest (per image, paired
    SE; and over seeds). Runs without per-image lists (a stored record) give the seeds' statistics only."""
    widths = [w for w in WIDTHS if any(r["width"] == w for r in runs)]
    tokens = sorted({r["tokens"] for r in runs})
    seeds = sorted({r["seed"] for r in runs})
    per_image = all("correct" in r for r in runs)
    top1 = {(r["width"], r["tokens"], r["seed"]): r["top1"] for r in runs}
    rows = []
    for w in widths:
        for t in tokens:
            mine = [r for r in runs if r["width"] == w and r["tokens"] == t]
            if not mine:
                continue
            mine_top1 = [100 * r["top1"] for r in mine]
            row = {"width": w, "model": WIDTHS[w], "tokens": t, "image_size": TOKENS[t], "seeds": len(mine),
                   "samples": mine[0]["samples"], "total_flops": mine[0]["total_flops"],
                   "top1_mean": float(np.mean(mine_top1)), "top1_std": study.seed_sd(mine_top1)}
            pairs = _pairs(runs, w, t, seeds) if per_image else []
            if t != REFERENCE and pairs:
                row["change_mean"], row["change_se"] = (100 * v for v in study.pooled_paired(pairs))
            changes = _seed_changes(top1, w, t, seeds)
            if t != REFERENCE and len(changes) > 1:   # the training runs' noise, which the paired SE does not hold
                row["change_seeds"] = study.seed_record(changes)
            rows.append(row)
    contrasts = []
    small, large = widths[0], widths[-1]
    for t in (t for t in tokens if t != REFERENCE and small != large):
        # each seed's own contrast (the wide tower's change minus the narrow one's): the training runs' noise
        both = [s for s in seeds if _seed_changes(top1, small, t, [s]) and _seed_changes(top1, large, t, [s])]
        if not both:
            continue
        per_seed = [_seed_changes(top1, large, t, [s])[0] - _seed_changes(top1, small, t, [s])[0] for s in both]
        contrast = {"tokens": t, "small": small, "large": large, "seeds": len(both),
                    "difference": float(np.mean(per_seed)), "per_seed": per_seed}
        if per_image:
            # per seed, per image: the narrow tower's change, then the wide one's (each against its 16-token run)
            changes = {w: {s: [b - a for a, b in zip(*_pairs(runs, w, t, [s])[0])] for s in both}
                       for w in (small, large)}
            contrast["difference"], contrast["se"] = (100 * v for v in study.pooled_paired(
                [(changes[small][s], changes[large][s]) for s in both]))
        if len(both) > 1:
            contrast["over_seeds"] = study.seed_record(per_seed)
        contrasts.append(contrast)
    return {"rows": rows, "contrasts": contrasts}


def markdown(args, meta: dict, summary: dict) -> str:
    lines = section_head("The inverse scaling law: image tokens x tower width at equal FLOPs "
                         f"(`bench/{Path(__file__).name}`)", args.label, meta)
    lines += [f"Within a width every run spends the training FLOPs of {args.samples:,} samples at 16 image tokens "
              f"(step meter); 4 / 9 / 16 tokens = 14 / 21 / 28 px at 7 px patches (2x2 / 3x3 / 4x4), 16 text "
              f"tokens, the demo's batch, rate and schedule; no fine-tune. Zero-shot top-1 of each final model at "
              f"its own input on {args.eval_images:,} test images. Change = top-1 at the token length minus at 16 "
              f"tokens, same width and seed (negative: accuracy lost to the shorter tokens), ± its paired standard "
              f"error (per-image agreement, seeds pooled), and over seeds: ± the SE of the mean of the seeds' own "
              f"changes, its t on seeds - 1 df and 95% interval (the training runs' noise, which the paired SE does "
              f"not hold).", "",
              "| width | image tokens | image px | samples | training TFLOP | seeds | zero-shot top-1 (%, ± SD over "
              "seeds) | change from 16 tokens (points, ± SE paired over images) | change over seeds (± SE, t, 95% "
              "interval) |", "|---|---|---|---|---|---|---|---|---|"]
    for r in summary["rows"]:
        spread = f" ± {r['top1_std']:.2f}" if r["seeds"] > 1 else ""
        change = f"{r['change_mean']:+.2f} ± {r['change_se']:.2f}" if "change_mean" in r else "-"
        lines.append(f"| {r['model']} | {r['tokens']} | {r['image_size']} | {r['samples']:,} | "
                     f"{r['total_flops'] / 1e12:.2f} | {r['seeds']} | {r['top1_mean']:.2f}{spread} | {change} | "
                     f"{study.seed_cell(r.get('change_seeds'))} |")
    lines += ["", "± after a top-1: the sample standard deviation over seeds (ddof 1); see \"How to read ±\" above."]
    if summary["contrasts"]:
        lines += ["", "Does the loss to shorter tokens shrink as the tower grows? The change at the widest tower minus "
                      "the change at the narrowest, per image (positive: the wider tower loses less or gains more), ± "
                      "its paired standard error over the test images; then over seeds, from each seed's own "
                      "contrast (their spread is the training runs' noise, which the paired standard error does not "
                      "hold): the contrast's sign stands only where the seeds' 95% interval leaves out zero.", ""]
        lines += [contrast_line(c) for c in summary["contrasts"]]
    lines += ["", FULL_SIZE, "", "![top-1 vs image tokens, one line per width](inverse_scaling_law.png)"]
    return "\n".join(lines)


def contrast_line(c: dict) -> str:
    """One width contrast: the paired SE over images, then the spread over seeds and whether it sets the sign."""
    paired = f" ± {c['se']:.2f} SE paired over images (z {c['difference'] / c['se']:+.1f})" if c.get("se") else ""
    seeds = ", ".join(f"{v:+.2f}" for v in c["per_seed"])
    spread = c.get("over_seeds")
    if spread:
        verdict = "the seeds set its sign" if spread["low"] > 0 or spread["high"] < 0 else \
            "the seeds do not set its sign"
        over = (f"; over {c['seeds']} seeds ± {spread['se']:.2f} SE (t {spread['t']:+.1f} on {spread['df']} df, 95% "
                f"interval {spread['low']:+.2f} to {spread['high']:+.2f}): {verdict}")
    else:
        over = f"; {c['seeds']} seed: no spread over seeds"
    return (f"- {c['tokens']} tokens: {WIDTHS[c['large']]} vs {WIDTHS[c['small']]}: {c['difference']:+.2f} points"
            f"{paired}{over} (per seed {seeds})")


def rewrite_from_record(docs: Path) -> None:
    """The section and JSON again from the stored record alone, no training: the seeds' statistics recomputed from
    each run's record, the paired image-level SEs as measured (the per-image lists stay beside the runs)."""
    record = json.loads((docs / "inverse_scaling_law.json").read_text())
    summary = summarize(record["runs"])
    rows = {(r["width"], r["tokens"]): r for r in record["rows"]}
    for row in summary["rows"]:
        kept = rows[(row["width"], row["tokens"])]
        row.update({k: kept[k] for k in ("change_mean", "change_se") if k in kept})
    contrasts = {c["tokens"]: c for c in record["contrasts"]}
    for c in summary["contrasts"]:
        c.update({k: contrasts[c["tokens"]][k] for k in ("difference", "se") if k in contrasts[c["tokens"]]})
    meta = {k: v for k, v in record.items() if k not in ("rows", "contrasts", "runs")}
    args = argparse.Namespace(**{k: meta[k] for k in ("samples", "eval_images", "label")})
    (docs / "inverse_scaling_law.json").write_text(json.dumps({**meta, **summary, "runs": record["runs"]}, indent=1))
    study.write_kept_head(docs / "inverse_scaling.md", SECTION, markdown(args, meta, summary), meta["date"])


def write_docs(args, runs: list[dict], started: str, wall: float) -> None:
    args.docs.mkdir(parents=True, exist_ok=True)
    load = os.getloadavg()[2] if hasattr(os, "getloadavg") else float("nan")
    meta = {"date": started, "machine": f"{platform.machine()} {os.cpu_count()} CPU cores, load {load:.1f} "
                                        f"(15-min average when written)",
            "command": shlex.join(["python", f"bench/{Path(__file__).name}", *args.argv]),
            "wall_seconds": wall, "label": args.label, "samples": args.samples, "eval_images": args.eval_images}
    summary = summarize(runs)
    slim = [{k: v for k, v in r.items() if k != "correct"} for r in runs]   # per-image lists stay beside the runs
    (args.docs / "inverse_scaling_law.json").write_text(json.dumps({**meta, **summary, "runs": slim}, indent=1))
    study.write_doc_section(args.docs / "inverse_scaling.md", SECTION, markdown(args, meta, summary))
    plot(summary["rows"], args.docs / "inverse_scaling_law.png")


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax, bx) = plt.subplots(1, 2, figsize=(10, 4))
    for w in WIDTHS:
        mine = sorted((r for r in rows if r["width"] == w), key=lambda r: r["tokens"])
        if not mine:
            continue
        ax.errorbar([r["tokens"] for r in mine], [r["top1_mean"] for r in mine],
                    yerr=[r["top1_std"] for r in mine], marker="o", capsize=3, label=WIDTHS[w])
        short = [r for r in mine if "change_mean" in r]
        if short:
            bx.errorbar([r["tokens"] for r in short], [r["change_mean"] for r in short],
                        yerr=[r["change_se"] for r in short], marker="o", capsize=3, label=WIDTHS[w])
    ax.set_xlabel("image tokens (equal training FLOPs within a width)")
    ax.set_ylabel("zero-shot top-1 (%)")
    bx.set_xlabel("image tokens")
    bx.set_ylabel("top-1 minus the 16-token run's (points, paired SE)")
    bx.axhline(0, color="grey", lw=0.8)
    for a in (ax, bx):
        a.set_xticks(sorted(TOKENS))
        a.grid(alpha=0.3)
        if a.get_legend_handles_labels()[0]:   # the changes' panel is empty until a short run has its 16-token pair
            a.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.from_record:
        rewrite_from_record(args.docs)
        return 0
    args.argv = list(argv) if argv is not None else sys.argv[1:]
    base_cfg = yaml.safe_load(study.DEMO_CONFIG.read_text())
    data_dir = study.data_folder(args.data_dir)
    started, t0 = dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"), time.perf_counter()
    batch = base_cfg["stages"][0]["global_batch"]
    runs = []
    for seed in range(args.seeds):            # seed-major: an interrupted sweep still has whole seeds
        for width in args.widths:
            model = WIDTHS[width]
            for tokens, stg in token_stages(model, args.tokens, args.samples, base_cfg).items():
                # `evals` checkpoints a run: the study's spacing, so that the 16-token run is its full arm
                every = max(1, stg["samples"] // batch // args.evals)
                run_dir = args.out / run_name(width, tokens, seed)
                cfg = study.run_config(model, seed, [stg], run_dir, base_cfg, every, data_dir)
                flops = study.flops_per_sample({**cfg, "stages": [stg]})[0] * stg["samples"]
                print(f"[inverse-scaling-law] {run_dir.name}: {stg['samples']} samples at {TOKENS[tokens]} px, "
                      f"{flops / 1e12:.2f} TFLOP", flush=True)
                wall = study.train(cfg, run_dir, args.nproc)
                scored = study.score_final(run_dir, cfg, args.eval_images)
                runs.append({"width": width, "model": model, "tokens": tokens, "seed": seed,
                             "samples": stg["samples"], "total_flops": flops, "wall_seconds": wall,
                             "top1": scored["top1"], "checkpoint": scored["checkpoint"],
                             "correct": scored["correct"]})
                print(f"[inverse-scaling-law] {run_dir.name}: top-1 {100 * scored['top1']:.2f}% "
                      f"({wall:.0f} s training)", flush=True)
                write_docs(args, runs, started, time.perf_counter() - t0)   # kept up to date
    print(markdown(args, json.loads((args.docs / "inverse_scaling_law.json").read_text()), summarize(runs)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
