"""CLIPA's inverse-scaling claim on the demo data, at equal training FLOPs as the step meter counts them.

Two arms per model width and seed, both trained by the real trainer (torchrun, DeepSpeed at the demo config's ZeRO
stage: 2 with torch's default AdamW when docs/inverse_scaling.md's results were measured, 0 with fused AdamW since;
webdataset shards of Fashion-MNIST) from the demo config (configs/demo/fashion_mnist.yaml: data, optimizer, batch):
  full   28 px / patch 7 (16 image tokens), 16 text tokens, the demo's peak rate, for `--samples` samples;
  clipa  21 px / patch 7 (9 tokens, image resize) with 8 text tokens (the 'random' text mask) for most samples,
         then a short full-length fine-tune (28 px, 16 text tokens) at a lower peak rate; its sample counts are
         set so that its training FLOPs (ResolvedStage.counts x samples, what the throughput meter counts) equal
         the full arm's. The fine-tune is the paper's: patch 7, so the grid grows from 3x3 to 4x4;
  clipa-p9  the same, but the fine-tune keeps the 3x3 grid at patch 9 (the kernel PI-resized from 7, what the
         demo does) at 27 px, the size 9 px patches tile (28 px would drop a pixel row and column: issue 39): its
         fine-tune costs fewer FLOPs per sample, so its first stage gets more samples.
Checkpoints are evaluated zero-shot at the input their arm's fine-tune trains on (28 px; clipa-p9: 27 px) on
`--eval-images` test images spread over the classes (the curve); a low-resolution checkpoint reaches it as the
fine-tune does (clipa: the grid grown, `--resize grid`; clipa-p9: the grid kept, `--resize patch`). Each final
model is scored on all `--final-images` (10,000) test images with each image's top-1 kept (issue 39 item 3). For
each arm: the final top-1; its difference from the full arm's final top-1 (same seed) with a paired standard error
(per-image agreement: d_i = correct_arm_i - correct_full_i, SE = sqrt(var(d) / n), seeds pooled); and the training
FLOPs to reach the full arm's final top-1 two ways, linear between checkpoints: the first checkpoint that crosses
it (a low-resolution model run at the fine-tune's input may cross it before its fine-tune), and the arm's final
model's: the FLOPs from which its curve stays at or above it to the end ("not reached" when the final model
ends below). Writes its section of docs/inverse_scaling.md (between `inverse-scaling-study` markers; the other
section is bench/bench_inverse_scaling_law.py's), docs/inverse_scaling.json and docs/inverse_scaling.png.

    python bench/bench_inverse_scaling.py                 # the study (about 90 min on the idle 2-core machine)
    python bench/bench_inverse_scaling.py --smoke         # a few seconds of training: the script works
    python bench/bench_inverse_scaling.py --from-record   # no training: the section again from the stored JSON
"""
from __future__ import annotations

import argparse
import copy
import datetime as dt
import json
import math
import os
import platform
import shlex
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from bench.demo_runs import DEMO_CONFIG, absolute_deepspeed  # noqa: E402
from bench.report import section_head, write_section  # noqa: E402
from bench.seed_spread import sd as seed_sd  # noqa: E402
from bench.seed_spread import seed_spread  # noqa: E402

DOCS = ROOT / "docs"
WIDTHS = {"w128": "CRATE-alpha-CLIPA-tiny", "w64": "CRATE-alpha-CLIPA-tiny-w64"}
FULL, LOW = dict(image_size=28, context_length=16, text_mask="truncate"), \
    dict(image_size=21, context_length=8, text_mask="random")
FINETUNE_SHARE = 0.2      # of the full arm's samples: CLIPA's short full-length stage (the paper: ~17%)
FINETUNE_LR_RATIO = 0.1   # its peak rate / the first stage's (the paper: 1/20; the demo: see its config)
ARMS = ("full", "clipa", "clipa-p9")
# the fine-tune's (image size, patch): the grid grows to 4x4, or the 3x3 grid is kept at 27 px (patches that tile)
FINE = {"clipa": (28, 7), "clipa-p9": (27, 9)}
SECTION = "inverse-scaling-study"
HOW_TO_READ = ("**How to read ±** (the one convention of README.md, BENCHMARKS.md and docs/): each ± says what it "
               "holds. A spread over seeds is the sample standard deviation, ddof 1 (\"SD\"). A contrast between "
               "two runs of the same seed scored on the same test images has a paired standard error over the "
               "images (\"SE paired over images\": d_i = correct_a_i - correct_b_i, SE = sqrt(var(d) / n)); it "
               "holds the test set's noise, not the training runs'. So a contrast also gets its spread over seeds: "
               "the SE of the mean of the seeds' own differences (\"SE over seeds\", SD / sqrt(seeds)), its t on "
               "seeds - 1 degrees of freedom and its 95% t interval; a contrast's sign is claimed only where that "
               "interval leaves out zero (`bench/seed_spread.py`).")
DOC_HEAD = ("# Inverse scaling on Fashion-MNIST\n\nWritten by `bench/bench_inverse_scaling.py` (the compute-matched "
            "study) and `bench/bench_inverse_scaling_law.py` (the inverse scaling law), each between its own markers "
            "(do not edit by hand).\n\n" + HOW_TO_READ + "\n")


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--samples", type=int, default=51200, help="the full arm's training samples (default 51200)")
    p.add_argument("--evals", type=int, default=8, help="checkpoints evaluated per arm (default 8)")
    p.add_argument("--eval-images", type=int, default=2000, help="test images per checkpoint of the curve "
                                                                 "(default 2000)")
    p.add_argument("--final-images", type=int, default=10000, help="test images scoring each final model, each "
                                                                   "image's top-1 kept (default all 10,000)")
    p.add_argument("--seeds", type=int, default=3)
    p.add_argument("--widths", nargs="+", default=list(WIDTHS), choices=list(WIDTHS))
    p.add_argument("--arms", nargs="+", default=list(ARMS), choices=list(ARMS))
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--out", type=Path, default=ROOT / "bench" / "out" / "inverse_scaling", help="runs folder")
    p.add_argument("--data-dir", type=Path, default=None,
                   help="training shards (DIR/train) and zero-shot set (DIR/test) already written; default: the "
                        "demo's, data/fashion_mnist, written first if missing")
    p.add_argument("--docs", type=Path, default=DOCS, help="where the table, JSON and plot go (default docs/)")
    p.add_argument("--label", default="", help="a note printed above the table (e.g. 'reduced configuration')")
    p.add_argument("--from-record", action="store_true",
                   help="train nothing: rewrite the section and JSON in --docs from its stored record (the seeds' "
                        "statistics recomputed, the paired SEs as measured)")
    p.add_argument("--smoke", action="store_true", help="tiny runs (1 seed, 1 width, 256 samples, the full and "
                                                        "clipa-p9 arms unless --arms is given): checks the script, "
                                                        "measures nothing; writes under --out only")
    args = p.parse_args(argv)
    if args.smoke:
        args.samples, args.evals, args.eval_images, args.seeds, args.widths = 256, 2, 100, 1, ["w64"]
        args.final_images = args.eval_images
        if "--arms" not in (argv if argv is not None else sys.argv[1:]):
            args.arms = ["full", "clipa-p9"]
        args.docs = args.out / "docs"
        args.label = args.label or "smoke run: measures nothing"
    return args


def stage(name: str, shape: dict, samples: int, lr: float, base: dict, warmup: int, patch: int = 7) -> dict:
    """A run-config stage of the demo's batch and weight decay with `shape` (size, text length, masks) and `patch`;
    every image token unless `shape` masks them (the demo's own stage 0 masks, an arm's does not by default)."""
    warmup = max(0, min(warmup, samples // base["global_batch"] // 4))   # short (smoke) stages: a shorter warm-up
    return {**{k: base[k] for k in ("global_batch", "weight_decay")}, "image_mask": "none", "name": name,
            "patch_size": patch, **shape, "samples": samples, "lr": lr, "warmup_steps": warmup}


def flops_per_sample(cfg_dict: dict) -> list[float]:
    """Training FLOPs per sample of each stage, as the step meter counts them (ResolvedStage.counts)."""
    from crate_clip.train.run.run_config import config_from_dict
    from crate_clip.train.stage_setup.stage_model import resolve_stage

    # the evaluations count no training FLOPs (and the demo's eval.full_image_size is not every arm's)
    cfg = config_from_dict({**cfg_dict, "eval": {**cfg_dict.get("eval", {}), "after_each_stage": False}},
                           check_paths=False)
    return [resolve_stage(cfg, i).counts.flops for i in range(len(cfg.stages))]


def arm_stages(arm: str, model: str, samples: int, base_cfg: dict) -> list[dict]:
    """The arm's stages; the clipa arm's sample counts set to the full arm's FLOPs (whole batches)."""
    base, lr, batch = base_cfg["stages"][0], base_cfg["stages"][0]["lr"], base_cfg["stages"][0]["global_batch"]
    full = [stage("full", FULL, samples, lr, base, 40)]
    if arm == "full":
        return full
    size, patch = FINE[arm]
    fine_shape = {**FULL, "image_size": size}
    probe = {**base_cfg, "model": {"name": model},
             "stages": [stage("low", LOW, 4 * batch, lr, base, 1),
                        stage("fine", fine_shape, 4 * batch, lr, base, 1, patch),
                        stage("full", FULL, 4 * batch, lr, base, 1)]}
    f_low, f_fine, f_full = flops_per_sample(probe)
    fine = max(batch, round(FINETUNE_SHARE * samples / batch) * batch)
    low = max(batch, int((samples * f_full - fine * f_fine) / f_low) // batch * batch)
    return [stage("low", LOW, low, lr, base, 40),
            stage("fine", fine_shape, fine, lr * FINETUNE_LR_RATIO, base, max(1, fine // batch // 10), patch)]


def run_config(model: str, seed: int, stages: list[dict], run_dir: Path, base_cfg: dict, every: int,
               data_dir: Path) -> dict:
    """The demo config with this arm's model, seed and stages; checkpoints every `every` steps, all kept; no
    after-stage evaluations or probes (the study evaluates the checkpoints itself)."""
    cfg = copy.deepcopy(base_cfg)
    cfg["run"].update(output_dir=str(run_dir), seed=seed, name=run_dir.name)
    cfg["model"]["name"] = model
    cfg["stages"] = stages
    cfg["data"]["sources"] = [str(data_dir / "train")]
    cfg["deepspeed"] = absolute_deepspeed(cfg["deepspeed"])
    cfg["checkpoint"] = {**cfg.get("checkpoint", {}), "every_steps": every, "keep_last": 10_000}
    cfg["eval"]["after_each_stage"] = False
    cfg["eval"].pop("full_image_size", None)   # the demo's 27 px is not every arm's last stage
    cfg["eval"]["evals"][0]["data"] = str(data_dir / "test")
    cfg["logging"]["diagnostics_every"] = 0
    return cfg


def train(cfg: dict, run_dir: Path, nproc: int) -> float:
    """One training run by the real trainer (torchrun; one process: the trainer alone); returns its wall seconds.
    A finished run is reused."""
    from crate_clip.train.demo import launch_command

    config = run_dir.with_suffix(".yaml")
    done = run_dir.with_suffix(".done")
    text = yaml.safe_dump(cfg, sort_keys=False)
    if done.is_file() and config.is_file() and config.read_text() == text:
        return json.loads(done.read_text())["wall_seconds"]
    run_dir.parent.mkdir(parents=True, exist_ok=True)
    config.write_text(text)
    cmd = launch_command(str(config), nproc, [], resume=False, overwrite=True)
    if nproc == 1:   # one process needs no launcher (torchrun's own start-up: ~3 s of CPU)
        cmd = [sys.executable, "-m", "crate_clip.train.cli", *cmd[cmd.index("--config"):]]
    env = dict(os.environ)   # a thread count the user set is kept; else the cores shared by the processes
    env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 2) // nproc)))
    t0 = time.perf_counter()
    with run_dir.with_suffix(".log").open("w") as log:
        rc = subprocess.run(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT).returncode
    wall = time.perf_counter() - t0
    if rc:
        raise RuntimeError(f"{run_dir}: training failed (exit {rc}); see {run_dir.with_suffix('.log')}")
    done.write_text(json.dumps({"wall_seconds": wall}))
    return wall


def evaluate_checkpoints(run_dir: Path, cfg: dict, flops: list[float], eval_images: int, final: dict) -> list[dict]:
    """(training FLOPs, samples, top-1) of every checkpoint of the run, zero-shot at the input of its last stage
    (a low-resolution checkpoint: the grid grown when the last stage keeps its patch, else the grid kept) on
    `eval_images` test images; the final checkpoint's is `final` (score_final: more images)."""
    import torch

    from crate_clip.checkpoint_io.checkpoint_record import read_record
    from crate_clip.eval.model_loading import load_eval_model
    from crate_clip.eval.registry import EvalContext, parse_eval, run_task

    torch.set_num_threads(os.cpu_count() or 1)
    batch = cfg["stages"][0]["global_batch"]
    steps = [s["samples"] // batch for s in cfg["stages"]]
    spec = {**cfg["eval"]["evals"][0], "max_images": eval_images, "batch_size": 500, "num_workers": 0}
    points = []
    for tag in sorted((run_dir / "checkpoints").iterdir()):
        if not (tag.is_dir() and _complete(tag)):
            continue
        progress = read_record(tag).progress
        idx, step = progress.stage_index, progress.step
        done_flops = sum(steps[i] * batch * flops[i] for i in range(idx)) + step * batch * flops[idx]
        if tag.name == final["checkpoint"]:
            points.append({"stage": idx, "step": step, "flops": done_flops, "top1": final["top1"],
                           "samples": progress.samples_seen, "images": final["eval_images"]})
            continue
        last = cfg["stages"][-1]
        resize = "grid" if cfg["stages"][idx]["patch_size"] == last["patch_size"] else "patch"
        model, preprocess, tokenizer, _ = load_eval_model(str(tag), image_size=last["image_size"], resize=resize)
        ctx = EvalContext(tokenizer=tokenizer, preprocess=preprocess, device="cpu", precision="fp32",
                          cache_dir=None, progress=False)
        top1 = run_task(model, parse_eval(spec), ctx)["top1"]
        points.append({"stage": idx, "step": step, "flops": done_flops, "top1": top1,
                       "samples": progress.samples_seen, "images": eval_images})
    return sorted(points, key=lambda p: p["flops"])


def final_tag(run_dir: Path) -> Path:
    """The run's last checkpoint (the highest stage and step)."""
    from crate_clip.checkpoint_io.checkpoint_record import read_record

    progress = {t: read_record(t).progress for t in (run_dir / "checkpoints").iterdir() if t.is_dir() and _complete(t)}
    if not progress:
        raise SystemExit(f"bench_inverse_scaling: {run_dir} holds no complete checkpoint; rerun to retrain it")
    return max(progress, key=lambda t: (progress[t].stage_index, progress[t].step))


def score_final(run_dir: Path, cfg: dict, images: int) -> dict:
    """Zero-shot top-1 of the run's final checkpoint at its last stage's input on `images` test images, with each
    image's 0/1 correctness (index order), for paired standard errors; kept beside the run (`<run>.final.json`)
    and reused while the run is unchanged."""
    import torch

    from crate_clip.eval.model_loading import load_eval_model
    from crate_clip.eval.registry import EvalContext, run_task

    cache, done = run_dir.with_suffix(".final.json"), run_dir.with_suffix(".done")
    if cache.is_file() and cache.stat().st_mtime >= done.stat().st_mtime:
        kept = json.loads(cache.read_text())
        if kept["eval_images"] == images:
            return kept
    torch.set_num_threads(os.cpu_count() or 1)
    tag = final_tag(run_dir)
    model, preprocess, tokenizer, _ = load_eval_model(str(tag), image_size=cfg["stages"][-1]["image_size"])
    ctx = EvalContext(tokenizer=tokenizer, preprocess=preprocess, device="cpu", precision="fp32", cache_dir=None,
                      progress=False, per_image=True)
    spec = {**cfg["eval"]["evals"][0], "max_images": images, "batch_size": 500, "num_workers": 0}
    metrics = run_task(model, spec, ctx)
    result = {"checkpoint": tag.name, "eval_images": images, "top1": metrics["top1"],
              "correct": [int(label == top1) for _, label, top1 in metrics["per_image"]]}
    cache.write_text(json.dumps(result))
    return result


def paired(a: list[int], b: list[float]) -> tuple[float, float]:
    """(mean of b_i - a_i, its standard error sqrt(var(d) / n)) over the same images."""
    d = [y - x for x, y in zip(a, b, strict=True)]
    n = len(d)
    mean = sum(d) / n
    return mean, math.sqrt(sum((v - mean) ** 2 for v in d) / max(1, n - 1) / n)


def pooled_paired(pairs: list[tuple[list[int], list[int]]]) -> tuple[float, float]:
    """paired() of the per-image mean over seeds of (b_i - a_i): one difference, its SE holding the seeds' spread."""
    per_image = [sum(b[i] - a[i] for a, b in pairs) / len(pairs) for i in range(len(pairs[0][0]))]
    return paired([0] * len(per_image), per_image)


def write_doc_section(path: Path, name: str, text: str) -> None:
    """Replace `name`'s section of the page (between its BEGIN / END markers; appended when absent), so that the
    study and bench/bench_inverse_scaling_law.py each rewrite only their own part of docs/inverse_scaling.md."""
    if not path.is_file():
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(DOC_HEAD)
    write_section(name, text, path)


def _complete(tag: Path) -> bool:
    from crate_clip.checkpoint_io.checkpoint_record import read_record
    return read_record(tag) is not None   # its crate_clip.json present and well formed


CHANCE = {"flops": 0.0, "top1": 0.1}   # an untrained 10-class model


def _crossing(prev: dict, p: dict, target: float) -> float:
    """The FLOPs between two points where the line through them reaches `target` (p at or above it)."""
    if p["top1"] == prev["top1"]:
        return p["flops"]
    t = (target - prev["top1"]) / (p["top1"] - prev["top1"])
    return prev["flops"] + max(0.0, min(1.0, t)) * (p["flops"] - prev["flops"])


def flops_to_reach(points: list[dict], target: float) -> float | None:
    """The training FLOPs at which the curve first reaches `target` (linear between points), None if never."""
    prev = CHANCE
    for p in points:
        if p["top1"] >= target:
            return _crossing(prev, p, target)
        prev = p
    return None


def flops_to_stay(points: list[dict], target: float) -> float | None:
    """The training FLOPs from which the curve stays at or above `target` to its end (the last upward crossing,
    linear between points): what the arm's final model needed; None when the final model ends below it."""
    if not points or points[-1]["top1"] < target:
        return None
    below = [i for i, p in enumerate(points) if p["top1"] < target]
    if not below:
        return _crossing(CHANCE, points[0], target)
    return _crossing(points[below[-1]], points[below[-1] + 1], target)


def _shares(need: list[float | None], mine: list[dict], per_seed_full: dict) -> dict:
    """The FLOPs each seed needed as a share of its full arm's, over the seeds that reached it."""
    reached = [n / per_seed_full[r["seed"]]["total_flops"] for n, r in zip(need, mine) if n is not None]
    return {"reached": len(reached), "mean": float(np.mean(reached)) if reached else None,
            "std": seed_sd(reached) if reached else None}


def summarize(runs: list[dict]) -> list[dict]:
    """Per width and arm: final top-1, its paired difference from the full arm's final (same width and seed), and
    the FLOPs to the full arm's final top-1 (the first crossing, and the final model's), over seeds."""
    rows = []
    for width in sorted({r["width"] for r in runs}):
        per_seed_full = {r["seed"]: r for r in runs if r["width"] == width and r["arm"] == "full"}
        for arm in ARMS:
            mine = [r for r in runs if r["width"] == width and r["arm"] == arm and r["seed"] in per_seed_full]
            if not mine:
                continue
            finals = [100 * r["points"][-1]["top1"] for r in mine]
            targets = [per_seed_full[r["seed"]]["points"][-1]["top1"] for r in mine]
            first = _shares([flops_to_reach(r["points"], t) for r, t in zip(mine, targets)], mine, per_seed_full)
            final = _shares([flops_to_stay(r["points"], t) for r, t in zip(mine, targets)], mine, per_seed_full)
            row = {"width": width, "model": WIDTHS[width], "arm": arm, "seeds": len(mine),
                   "final_top1_mean": float(np.mean(finals)), "final_top1_std": seed_sd(finals),
                   "final_images": mine[0]["points"][-1].get("images"),
                   "total_flops": float(np.mean([r["total_flops"] for r in mine])),
                   # the first checkpoint crossing (a low-resolution model may cross before its fine-tune)
                   "reached": first["reached"], "flops_share_mean": first["mean"], "flops_share_std": first["std"],
                   # the arm's final model: from where its curve stays at or above the target to the end
                   "final_reached": final["reached"], "final_share_mean": final["mean"],
                   "final_share_std": final["std"],
                   "samples": mine[0]["samples"],
                   # the arm's recipe: the demo claims these figures only for a run of it (train/demo.py)
                   "stages": mine[0].get("stages")}
            if arm != "full" and all("correct" in r for r in mine):
                diff, se = pooled_paired([(per_seed_full[r["seed"]]["correct"], r["correct"]) for r in mine])
                row["vs_full_mean"], row["vs_full_se"] = 100 * diff, 100 * se
            if arm != "full" and len(mine) > 1:   # the training runs' noise, which the paired SE does not hold
                row["vs_full_seeds"] = seed_record([f - 100 * t for f, t in zip(finals, targets)])
            rows.append(row)
    return rows


def seed_record(values: list[float]) -> dict:
    """seed_spread() of one contrast's per-seed values, as the JSON records it."""
    spread = seed_spread(values)
    return {"per_seed": values, "sd": spread.sd, "se": spread.se, "t": spread.t, "df": spread.df,
            "low": spread.low, "high": spread.high}


def seed_cell(record: dict | None) -> str:
    """A contrast's spread over seeds as a table cell: '± 0.29 (t +9.1, 2 df; +1.42 to +3.94)'."""
    if not record:
        return "-"
    return (f"± {record['se']:.2f} (t {record['t']:+.1f}, {record['df']} df; {record['low']:+.2f} to "
            f"{record['high']:+.2f})")


def versus_cell(row: dict) -> str:
    """A row's difference from the full arm, ± its SE paired over images, as a table cell ('-' without one)."""
    return f"{row['vs_full_mean']:+.2f} ± {row['vs_full_se']:.2f}" if "vs_full_mean" in row else "-"


def _share_cell(mean: float | None, std: float | None, reached: int, seeds: int) -> str:
    if mean is None:
        return "not reached"
    spread = f" ± {100 * std:.0f}" if reached > 1 else ""   # one seed has no spread, not a spread of 0
    return f"{100 * mean:.0f}{spread}%" + ("" if reached == seeds else f" ({reached}/{seeds} seeds)")


def markdown(args, meta: dict, rows: list[dict]) -> str:
    lines = section_head("Full resolution vs CLIPA at equal training FLOPs (`bench/bench_inverse_scaling.py`)",
                         args.label, meta)
    lines += [f"Arms: **full** = 28 px / patch 7, 16 text tokens, {args.samples:,} samples; **clipa** = 21 px / "
              f"patch 7 with 8 text tokens (random text mask), then a fine-tune at 28 px / 16 tokens on "
              f"{FINETUNE_SHARE:.0%} of the full arm's samples at {FINETUNE_LR_RATIO:g}x the peak rate, its "
              f"first stage sized to the same training FLOPs (step meter); the fine-tune at patch 7 (the paper's: "
              f"the grid grows to 4x4); **clipa-p9** = the same with the fine-tune at 27 px / patch 9 (the 3x3 "
              f"grid kept, the kernel PI-resized; the demo's shape; 27 px: the size 9 px patches tile). Zero-shot "
              f"top-1 at the input of each arm's fine-tune (28 px; clipa-p9 27 px; low-res checkpoints reach it "
              f"as the fine-tune does: clipa `--resize grid`, clipa-p9 `--resize patch`): the curve's checkpoints "
              f"on {args.eval_images:,} test images, each final model on {args.final_images:,}. 'vs full' = the "
              "final top-1 minus the full arm's (same seed) ± its paired standard error (per-image agreement, "
              "seeds pooled), and over seeds: ± the SE of the mean of the seeds' own differences, its t on seeds - 1 "
              "df and 95% interval (the training runs' noise, which the paired SE does not hold; a difference "
              "stands where that interval leaves out zero). 'FLOPs to the full arm's final top-1', as a share "
              "of the full arm's FLOPs: **first crossing** = the first checkpoint that reaches it (an arm may "
              "reach it before its end, then lose it); **final model** = from where the curve stays at or above "
              "it to the end, so the model the arm ends with has it ('not reached' when the final model ends "
              "below).", "",
              "| width | arm | seeds | samples | final top-1 (%, ± SD over seeds) | vs full (points, ± SE paired "
              "over images) | vs full over seeds (± SE, t, 95% interval) | FLOPs to full's final: first crossing "
              "(± SD) | FLOPs to full's final: final model (± SD) |", "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        first = _share_cell(r["flops_share_mean"], r["flops_share_std"], r["reached"], r["seeds"])
        final = _share_cell(r.get("final_share_mean"), r.get("final_share_std"), r.get("final_reached", 0),
                            r["seeds"])
        spread = f" ± {r['final_top1_std']:.2f}" if r["seeds"] > 1 else ""
        samples = " + ".join(f"{s:,}" for s in r["samples"])
        lines.append(f"| {r['model']} | {r['arm']} | {r['seeds']} | {samples} | "
                     f"{r['final_top1_mean']:.2f}{spread} | {versus_cell(r)} | "
                     f"{seed_cell(r.get('vs_full_seeds'))} | {first} | {final} |")
    lines += ["", "± after a top-1 or a share: the sample standard deviation over seeds (ddof 1); see "
                  "\"How to read ±\" above. ![top-1 vs FLOPs](inverse_scaling.png)"]
    return "\n".join(lines)


def rewrite_from_record(docs: Path) -> None:
    """The section and JSON again from the stored record alone, no training: the seeds' statistics recomputed from
    each run's record, the paired image-level SEs as measured (the per-image lists stay beside the runs)."""
    record = json.loads((docs / "inverse_scaling.json").read_text())
    measured = {(r["width"], r["arm"]): r for r in record["rows"]}
    rows = summarize(record["runs"])
    for row in rows:
        kept = measured[(row["width"], row["arm"])]
        if "vs_full_se" in kept and "vs_full_se" not in row:
            row["vs_full_mean"], row["vs_full_se"] = kept["vs_full_mean"], kept["vs_full_se"]
    meta = {k: v for k, v in record.items() if k not in ("rows", "runs")}
    args = argparse.Namespace(**{k: meta[k] for k in ("samples", "eval_images", "final_images", "label")})
    (docs / "inverse_scaling.json").write_text(json.dumps({**meta, "rows": rows, "runs": record["runs"]}, indent=1))
    write_kept_head(docs / "inverse_scaling.md", SECTION, markdown(args, meta, rows), meta["date"])


def write_kept_head(path: Path, name: str, text: str, date: str) -> None:
    """write_doc_section(), with the section's paragraph saying when, where and how it ran (the one that starts with
    the run's `date`) kept as the page has it: a note added there about how the run was made stays when the
    section is rewritten from its record."""
    page = path.read_text() if path.is_file() else ""
    begin = page.find(f"<!-- BEGIN {name} -->")
    old = page[begin:page.find(f"<!-- END {name} -->", begin)].split("\n\n") if begin >= 0 else []
    kept = next((part for part in old if part.startswith(date)), None)
    new = [kept if kept and part.startswith(date) else part for part in text.split("\n\n")]
    write_doc_section(path, name, "\n\n".join(new))


def write_docs(args, runs: list[dict], rows: list[dict], started: str, wall: float) -> None:
    args.docs.mkdir(parents=True, exist_ok=True)
    load = os.getloadavg()[2] if hasattr(os, "getloadavg") else float("nan")   # how busy the machine was
    meta = {"date": started, "machine": f"{platform.machine()} {os.cpu_count()} CPU cores, load {load:.1f} "
                                        f"(15-min average when written)",
            "command": shlex.join(["python", "bench/bench_inverse_scaling.py", *args.argv]), "wall_seconds": wall,
            "label": args.label, "samples": args.samples, "eval_images": args.eval_images,
            "final_images": args.final_images, "finetune_share": FINETUNE_SHARE,
            "finetune_lr_ratio": FINETUNE_LR_RATIO}
    slim = [{k: v for k, v in r.items() if k != "correct"} for r in runs]   # per-image lists stay beside the runs
    (args.docs / "inverse_scaling.json").write_text(json.dumps({**meta, "rows": rows, "runs": slim}, indent=1))
    write_doc_section(args.docs / "inverse_scaling.md", SECTION, markdown(args, meta, rows))
    plot(runs, args.docs / "inverse_scaling.png")


def plot(runs: list[dict], path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    colors = {("w128", "full"): "tab:blue", ("w128", "clipa"): "tab:red", ("w128", "clipa-p9"): "tab:green",
              ("w64", "full"): "tab:cyan", ("w64", "clipa"): "tab:orange", ("w64", "clipa-p9"): "tab:olive"}
    labelled = set()
    for r in runs:
        key = (r["width"], r["arm"])
        xs = [p["flops"] / 1e12 for p in r["points"]]
        ys = [100 * p["top1"] for p in r["points"]]
        ax.plot(xs, ys, "o-", ms=3, lw=1, color=colors.get(key), alpha=0.8,
                label=None if key in labelled else f"{WIDTHS[r['width']]} {r['arm']}")
        labelled.add(key)
    ax.set_xlabel("training FLOPs (TFLOP, step meter)")
    ax.set_ylabel("zero-shot top-1 at the fine-tune's input (%)")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def data_folder(given: Path | None) -> Path:
    """The folder holding train/ and test/: the one given (checked), or the demo's, written if missing."""
    from crate_clip.train.demo import prepare_data

    if given is None:
        given = ROOT / "data" / "fashion_mnist"
        prepare_data(given / "train", given / "test")
    elif not (given / "train").is_dir() or not (given / "test" / "classnames.txt").is_file():
        raise SystemExit(f"bench_inverse_scaling: --data-dir {given}: no train/ shards and test/classnames.txt "
                         "there; fix: give a folder the demo wrote (python -m crate_clip.train.demo --data-dir DIR), "
                         "or leave --data-dir out")
    return given


def main(argv=None) -> int:
    from crate_clip.train.demo import run_recipe

    args = parse_args(argv)
    if args.from_record:
        rewrite_from_record(args.docs)
        return 0
    args.argv = list(argv) if argv is not None else sys.argv[1:]
    base_cfg = yaml.safe_load(DEMO_CONFIG.read_text())
    data_dir = data_folder(args.data_dir)
    started, t0 = dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"), time.perf_counter()
    batch = base_cfg["stages"][0]["global_batch"]
    runs = []
    for seed in range(args.seeds):            # seed-major: an interrupted study still has whole seeds
        for width in args.widths:
            for arm in args.arms:
                stages = arm_stages(arm, WIDTHS[width], args.samples, base_cfg)
                total_steps = sum(s["samples"] for s in stages) // batch
                every = max(1, total_steps // args.evals)
                run_dir = args.out / f"{width}_{arm}_s{seed}"
                cfg = run_config(WIDTHS[width], seed, stages, run_dir, base_cfg, every, data_dir)
                flops = flops_per_sample({**cfg, "stages": stages})
                print(f"[inverse-scaling] {run_dir.name}: stages {[s['samples'] for s in stages]} samples, "
                      f"{sum(s['samples'] * f for s, f in zip(stages, flops)) / 1e12:.2f} TFLOP", flush=True)
                wall = train(cfg, run_dir, args.nproc)
                final = score_final(run_dir, cfg, args.final_images)
                points = evaluate_checkpoints(run_dir, cfg, flops, args.eval_images, final)
                runs.append({"width": width, "arm": arm, "seed": seed, "wall_seconds": wall, "points": points,
                             "samples": [s["samples"] for s in stages], "stages": run_recipe(stages),
                             "total_flops": sum(s["samples"] * f for s, f in zip(stages, flops)),
                             "correct": final["correct"]})
                print(f"[inverse-scaling] {run_dir.name}: final top-1 {100 * points[-1]['top1']:.2f}% "
                      f"({wall:.0f} s training)", flush=True)
                write_docs(args, runs, summarize(runs), started, time.perf_counter() - t0)   # kept up to date
    print(markdown(args, json.loads((args.docs / "inverse_scaling.json").read_text()), summarize(runs)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
