"""Zero-shot segmentation benchmark on composite Fashion-MNIST scenes: class-agnostic mask AP50 and mean best IoU
of MaskCut on the demo-trained CRATE-alpha tower, a ViT tower of matching shape trained the same way, and
random-initialised towers; plus the white-box diagnostics' share of the CRATE demo's training time.

Needs the scenes (`crate-clip shards scenes --out data/fmnist_scenes --count 500`) and the two demo runs
runs/crate_demo (the demo config) and runs/vit_demo (the same with `model.name=ViT-tiny-fmnist`); `--train` makes
both first, through the same trainer and recipe (`--set KEY=VALUE` overrides go to both):

    python bench/bench_segmentation.py [--train [--set precision=fp32 ...]] [--scenes data/fmnist_scenes]
                                       [--figures] [--write]
"""
import argparse
import contextlib
import io
import json
import shutil
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "bench")]


def _segment(model: str, scenes: str, out: Path, facet: str = "projection", size: int = 56,
             limit: int | None = None) -> dict:
    from crate_clip.eval.whitebox_cli import segment_entry

    args = ["--model", model, "--data", scenes, "--out", str(out), "--image-size", str(size), "--facet", facet,
            "--overlays", "8"] + (["--max-images", str(limit)] if limit else [])
    with contextlib.redirect_stdout(io.StringIO()):
        rc = segment_entry(args)
    if rc:
        raise RuntimeError(f"crate-clip segment {' '.join(args)} failed ({rc})")
    return json.loads((out / "metrics.json").read_text())


TOWER_OVERRIDES = {"crate": [], "vit": ["model.name=ViT-tiny-fmnist"]}   # the demo config's tower is CRATE-alpha
# the recipe the segmentation numbers were measured with: 20 px then 28 px at patch 4, so the maps have a 7x7
# token grid at 28 px (the demo config trains at patch 7: a 4x4 grid), and the ViT tower, which has no stage
# patch change, trains on the same schedule
RECIPE = ["stages.0.image_size=20", "stages.0.patch_size=4", "stages.0.samples=89600", "stages.0.global_batch=256",
          "stages.0.lr=2e-3", "stages.0.warmup_steps=40", "stages.0.crop_scale=[0.7,1.0]",
          "stages.1.image_size=28", "stages.1.patch_size=4", "stages.1.samples=38400", "stages.1.global_batch=256",
          "stages.1.lr=5e-4", "stages.1.warmup_steps=10", "stages.1.crop_scale=[1.0,1.0]"]


def train_towers(run_dirs: dict, which: list[str], overrides: list[str]) -> None:
    """The demo at the segmentation recipe (CRATE-alpha) and/or with the ViT tower of matching shape."""
    from demo_runs import run_demo

    for tower in which:
        wall = run_demo(run_dirs[tower], RECIPE + overrides + TOWER_OVERRIDES[tower])
        print(f"[bench] {tower} demo run {run_dirs[tower]}: {wall:.0f} s", flush=True)


def trained_accuracy(run_dir: Path) -> dict:
    """The run's final zero-shot top-1 and (when the demo ran it) linear-probe top-1."""
    results = [json.loads(line) for line in (run_dir / "results.jsonl").read_text().splitlines() if line.strip()]
    probe = run_dir / "linear_probe.json"
    final = results[-1]
    return {"zeroshot": final["top1"], "n_images": final["n_images"], "image_size": final["image_size"],
            "samples": final.get("samples_seen"),
            "stage_sizes": list(dict.fromkeys(r["stage_image_size"] for r in results)),
            "linear_probe": json.loads(probe.read_text())["top1"] if probe.is_file() else None}


def refresh_figures(crate: Path, vit: Path, scenes: str) -> None:
    """docs/whitebox_training_curve.png (the CRATE run's plot) and docs/whitebox_demo.png (maps and masks)."""
    import whitebox_figure

    shutil.copyfile(crate / "training_curve.png", ROOT / "docs" / "whitebox_training_curve.png")
    whitebox_figure.main(["--scenes", scenes, "--crate-run", str(crate), "--vit-run", str(vit)])


def main(argv=None) -> int:
    """Run every configuration; print (and with --write record) the markdown table."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--scenes", default=str(ROOT / "data" / "fmnist_scenes"))
    p.add_argument("--out", default=str(ROOT / "bench" / "out" / "segmentation"))
    p.add_argument("--limit", type=int, help="the first N scenes only")
    p.add_argument("--only", type=int, nargs="*", help="run these configuration indices (default all)")
    p.add_argument("--write", action="store_true", help="write the section into BENCHMARKS.md")
    p.add_argument("--crate-run", default=str(ROOT / "runs" / "crate_demo"), help="the CRATE-alpha demo run")
    p.add_argument("--vit-run", default=str(ROOT / "runs" / "vit_demo"), help="the ViT demo run")
    p.add_argument("--train", nargs="*", choices=sorted(TOWER_OVERRIDES),
                   help="first train these towers with the demo into their runs (bare --train: both)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="with --train: a run-config override for the demo runs (repeatable)")
    p.add_argument("--figures", action="store_true", help="redraw docs/whitebox_*.png from the two runs")
    args = p.parse_args(argv)
    out = Path(args.out)
    crate, vit = Path(args.crate_run), Path(args.vit_run)
    if args.train is not None:
        train_towers({"crate": crate, "vit": vit}, args.train or sorted(TOWER_OVERRIDES), args.overrides)
    configs = [
        ("CRATE-α tiny, demo-trained", f"local-dir:{crate / 'export'}", "projection"),
        ("CRATE-α tiny, demo-trained", f"local-dir:{crate / 'export'}", "output"),
        ("ViT tiny (same shape), demo-trained", f"local-dir:{vit / 'export'}", "projection"),
        ("ViT tiny (same shape), demo-trained", f"local-dir:{vit / 'export'}", "output"),
        ("CRATE-α tiny, random init", "CRATE-alpha-CLIPA-tiny", "projection"),
        ("ViT tiny, random init", "ViT-tiny-fmnist", "projection"),
    ]
    rows = []
    for i, (name, model, facet) in enumerate(configs):
        if args.only is not None and i not in args.only:
            done = out / f"run{i}" / "metrics.json"  # from an earlier (parallel) run
            if not done.is_file():
                continue
            m = json.loads(done.read_text())
        else:
            m = _segment(model, args.scenes, out / f"run{i}", facet, limit=args.limit)
        rows.append((name, facet, m))
        print(f"{name:<40} {facet:<10} AP50 {100 * m['ap50']:5.1f}  AP {100 * m['ap']:5.1f}  "
              f"mean best IoU {m['mean_best_iou']:.3f}  masks {m['masks']}", flush=True)
    if args.only is not None and len(rows) < len(configs):
        return 0  # a partial (parallel) run: the table is made by a run that finds every result
    from demo_runs import stage_times

    trained = {"CRATE-α": trained_accuracy(crate), "ViT": trained_accuracy(vit)}
    md = markdown(rows, stage_times(crate), rows[0][2], trained, " ".join(argv if argv is not None else sys.argv[1:]))
    print(md)
    if args.figures:
        refresh_figures(crate, vit, args.scenes)
    if args.write:
        from report import write_section
        write_section("segmentation", md)
    return 0


def markdown(rows, share: dict, first: dict, trained: dict, command: str) -> str:
    """The BENCHMARKS.md section."""
    from report import machine_line

    facet_name = {"projection": "U^T LN(Z) (ViT: keys)", "output": "block output"}
    lines = ["## White-box toolkit: zero-shot segmentation and diagnostics cost (`bench/bench_segmentation.py`)", "",
             machine_line(), "",
             f"MaskCut (tau 0.3, up to 3 masks, last block, no CRF) on {first['images']} composite scenes "
             f"(56 px, {first['objects']} Fashion-MNIST test objects on textured backgrounds, "
             "`crate-clip shards scenes --out data/fmnist_scenes --count 500`), towers run at 56 px (14x14 patches "
             f"of 4 px; trained at {' then '.join(str(x) for x in trained['CRATE-α']['stage_sizes'])} px). "
             "Class-agnostic mask AP50 / AP from pycocotools; mean best IoU = "
             "mean over ground-truth objects of the best IoU of any predicted mask.", "",
             "| tower | features | mask AP50 | mask AP | mean best IoU | masks |", "|---|---|---:|---:|---:|---:|"]
    for name, facet, m in rows:
        lines.append(f"| {name} | {facet_name[facet]} | {100 * m['ap50']:.1f} | {100 * m['ap']:.1f} | "
                     f"{m['mean_best_iou']:.3f} | {m['masks']} |")
    lines += ["", "Trained towers (final zero-shot top-1 on the Fashion-MNIST test images; linear probe as the demo "
                  "prints it): " + "; ".join(
                      f"{name} ({t['samples']:,} samples) {100 * t['zeroshot']:.2f}% zero-shot at {t['image_size']} px"
                      + (f", linear probe {100 * t['linear_probe']:.2f}%" if t["linear_probe"] is not None else "")
                      for name, t in trained.items()) + "."]
    if share["probe_share"] is not None:
        lines += ["", f"Diagnostics during the CRATE demo run (64 probe images): {share['measurements']} measurements, "
                      f"{share['probe_seconds']:.1f} s of {share['training_seconds']:.0f} s of training steps = "
                      f"{100 * share['probe_share']:.2f}% (timed inside the same run)."]
    lines += ["", f"Command: `flock /work/notes/cpu.lock python bench/bench_segmentation.py {command}`"]
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
