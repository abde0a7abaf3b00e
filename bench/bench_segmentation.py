"""Zero-shot segmentation benchmark on composite Fashion-MNIST scenes: class-agnostic mask AP50 and mean best IoU
of MaskCut on the demo-trained CRATE-alpha tower, a ViT tower of matching shape trained the same way, and
random-initialised towers; plus the white-box diagnostics' share of the CRATE demo's training time.

Needs (see BENCHMARKS.md for the commands): the scenes `crate-clip shards scenes --out data/fmnist_scenes`, and
the two demo runs runs/crate_demo (default demo config) and runs/vit_demo (`--set model.name=ViT-tiny-fmnist`).

    python bench/bench_segmentation.py [--scenes data/fmnist_scenes] [--write]
"""
import argparse
import contextlib
import io
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "bench")]


def _segment(model: str, scenes: str, out: Path, facet: str = "projection", size: int = 56,
             limit: int | None = None) -> dict:
    from eval.whitebox_cli import segment_entry

    args = ["--model", model, "--data", scenes, "--out", str(out), "--image-size", str(size), "--facet", facet,
            "--overlays", "8"] + (["--limit", str(limit)] if limit else [])
    with contextlib.redirect_stdout(io.StringIO()):
        rc = segment_entry(args)
    if rc:
        raise RuntimeError(f"crate-clip segment {' '.join(args)} failed ({rc})")
    return json.loads((out / "metrics.json").read_text())


def diagnostics_share(run_dir: Path) -> dict:
    """Seconds spent in the diagnostics vs. the stages' wall time, both from the run's own metrics.jsonl
    (samples_per_s counts from the stage start, diagnostics included: elapsed = step * batch / samples_per_s)."""
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    per_stage = {}
    for r in records:
        per_stage.setdefault(r["stage_index"], []).append(r)
    diag = elapsed = 0.0
    for recs in per_stage.values():
        first, last = recs[0], recs[-1]
        batch = (last["samples_seen"] - first["samples_seen"]) / max(last["step"] - first["step"], 1)
        elapsed += last["step"] * batch / last["samples_per_s"]
        wb = [r["whitebox"] for r in recs if r.get("whitebox")]
        diag += wb[-1]["seconds_total"] if wb else 0.0
    return {"diagnostics_seconds": diag, "training_seconds": elapsed, "share": diag / elapsed if elapsed else None,
            "measurements": sum(1 for r in records if r.get("whitebox"))}


def main(argv=None) -> int:
    """Run every configuration; print (and with --write record) the markdown table."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--scenes", default=str(ROOT / "data" / "fmnist_scenes"))
    p.add_argument("--out", default=str(ROOT / "bench" / "out" / "segmentation"))
    p.add_argument("--limit", type=int, help="the first N scenes only")
    p.add_argument("--only", type=int, nargs="*", help="run these configuration indices (default all)")
    p.add_argument("--write", action="store_true", help="write the section into BENCHMARKS.md")
    args = p.parse_args(argv)
    out = Path(args.out)
    crate, vit = ROOT / "runs" / "crate_demo", ROOT / "runs" / "vit_demo"
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
    share = diagnostics_share(crate)
    md = markdown(rows, share, rows[0][2])
    print(md)
    if args.write:
        from report import write_section
        write_section("segmentation", md)
    return 0


def markdown(rows, share: dict, first: dict) -> str:
    """The BENCHMARKS.md section."""
    from report import machine_line

    facet_name = {"projection": "U^T LN(Z) (ViT: keys)", "output": "block output"}
    lines = ["## White-box toolkit: zero-shot segmentation and diagnostics cost (`bench/bench_segmentation.py`)", "",
             machine_line(), "",
             f"MaskCut (tau 0.3, up to 3 masks, last block, no CRF) on {first['images']} composite scenes "
             f"(56 px, {first['objects']} Fashion-MNIST test objects on textured backgrounds, "
             "`crate-clip shards scenes --out data/fmnist_scenes --count 500`), towers run at 56 px (14x14 patches "
             "of 4 px; trained at 20 then 28 px). Class-agnostic mask AP50 / AP from pycocotools; mean best IoU = "
             "mean over ground-truth objects of the best IoU of any predicted mask.", "",
             "| tower | features | mask AP50 | mask AP | mean best IoU | masks |", "|---|---|---:|---:|---:|---:|"]
    for name, facet, m in rows:
        lines.append(f"| {name} | {facet_name[facet]} | {100 * m['ap50']:.1f} | {100 * m['ap']:.1f} | "
                     f"{m['mean_best_iou']:.3f} | {m['masks']} |")
    if share["share"] is not None:
        lines += ["", f"Diagnostics during the CRATE demo run (64 probe images): "
                      f"{share['measurements']} measurements, {share['diagnostics_seconds']:.1f} s of "
                      f"{share['training_seconds']:.0f} s of training steps = {100 * share['share']:.2f}% "
                      "(timed inside the same run; the 5% budget)."]
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
