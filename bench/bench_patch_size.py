"""Patch-size change between stages at equal training compute, on the demo data:
    (a) 20 px / patch 4 (25 tokens), then 28 px / patch 4 (49 tokens): CLIPA's image-size reduction;
    (b) 28 px / patch 7 (16 tokens), then 28 px / patch 4, the kernel resized with pi_resize (FlexiViT);
    (c) as (b) with bilinear resizing (the CRATE-alpha paper's jax.image.resize).
The demo config gives everything else (tower, optimizer, data); the arms set both stages themselves, so the
comparison does not move when the demo's own recipe does. The 28 px / patch 4 stage is the same in all three;
the first stage of (b) and (c) gets as many samples as make its training FLOPs (torch's FLOP counter on the
stage's model, forward + backward) equal to (a)'s. Zero-shot top-1 after each stage on the 10,000 test
images, printed as a BENCHMARKS.md table.

    .venv/bin/python bench/bench_patch_size.py [--only a,b,c] [--set KEY=VALUE ...]   # 3 demo runs, ~15 min
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))
from report import markdown_table  # noqa: E402  (bench/ on the path, as the other benches)

DEMO = ROOT / "configs" / "demo" / "fashion_mnist.yaml"


def flops_per_sample(model_name: str, image_size: int, patch: int, context_length: int) -> float:
    """Training FLOPs (forward + backward) per sample of the tower at `patch` px patches, counted by torch."""
    from torch.utils.flop_counter import FlopCounterMode

    from crate_clip.models import create_clip
    model = create_clip(model_name, image_size=image_size, context_length=context_length, patch_size=patch)
    images, tokens = torch.randn(4, 3, image_size, image_size), torch.randint(1, 1000, (4, context_length))
    with FlopCounterMode(display=False) as counter:
        image_f, text_f, scale = model(image=images, text=tokens)[:3]
        (scale * image_f @ text_f.T).logsumexp(1).mean().backward()
    return counter.get_total_flops() / 4


# the arms' shared schedule: batch 64 (the demo's; 10 classes make larger contrastive batches mostly
# false negatives), stage 0 at (a)'s budget, then a short 28 px / patch 4 stage
BATCH, STAGE0_SAMPLES, STAGE0_WARMUP = 64, 64_000, 40
STAGE1 = {"samples": 19_200, "lr": 5e-4, "warmup_steps": 20}


def variants(cfg) -> dict[str, dict]:
    """name -> (overrides, training FLOPs per stage) of the three arms, FLOP-matched on the first stage."""
    name, ctx0, ctx1 = cfg.model.name, cfg.stages[0].context_length, cfg.stages[1].context_length
    f_low = flops_per_sample(name, 20, 4, ctx0)
    f_p7 = flops_per_sample(name, 28, 7, ctx0)
    f_full = flops_per_sample(name, 28, 4, ctx1)
    budget0 = STAGE0_SAMPLES * f_low
    # whole global batches; the warm-up keeps its share of the stage's steps
    samples_p7 = int(budget0 / f_p7) // BATCH * BATCH
    warmup_p7 = max(1, round(STAGE0_WARMUP * samples_p7 / STAGE0_SAMPLES))
    common = [f"stages.{i}.global_batch={BATCH}" for i in (0, 1)] + [
        "stages.1.image_size=28", "stages.1.patch_size=4", *(f"stages.1.{k}={v}" for k, v in STAGE1.items())]
    low = ["stages.0.image_size=20", "stages.0.patch_size=4", f"stages.0.samples={STAGE0_SAMPLES}",
           f"stages.0.warmup_steps={STAGE0_WARMUP}"]
    # keep_last 3: stage 0's last checkpoint outlives stage 1's two, for the evaluation at the change
    p7 = ["stages.0.image_size=28", "stages.0.patch_size=7", f"stages.0.samples={samples_p7}",
          f"stages.0.warmup_steps={warmup_p7}", "checkpoint.keep_last=3"]
    stage1 = STAGE1["samples"] * f_full
    return {
        "a": {"label": "(a) 20 px / p4 -> 28 px / p4", "overrides": common + low,
              "flops": (budget0, stage1), "samples": (STAGE0_SAMPLES, STAGE1["samples"])},
        "b": {"label": "(b) 28 px / p7 -> 28 px / p4, pi_resize",
              "overrides": common + p7 + ["stages.1.patch_resize=pi_resize"],
              "flops": (samples_p7 * f_p7, stage1), "samples": (samples_p7, STAGE1["samples"])},
        "c": {"label": "(c) 28 px / p7 -> 28 px / p4, bilinear",
              "overrides": common + p7 + ["stages.1.patch_resize=bilinear"],
              "flops": (samples_p7 * f_p7, stage1), "samples": (samples_p7, STAGE1["samples"])},
    }


def at_the_change(run_dir: Path, resize: str, cfg) -> float:
    """Zero-shot top-1 at 28 px of stage 0's last checkpoint moved to patch 4 by `resize`, before any stage-1
    step: how much of the patch-7 function each resize keeps. The demo's own evaluation (its first
    eval.evals entry, on the test images the demo wrote), run as after a stage."""
    from crate_clip.eval.model_loading import load_eval_model
    from crate_clip.eval.stage_hook import evaluate_stage

    stage0 = sorted((run_dir / "checkpoints").glob("stage0-step*"))[-1]
    model, _, _, model_name = load_eval_model(str(stage0), image_size=28)
    model.visual.trunk.set_patch_size(4, resize)
    spec = cfg.eval.evals[0].model_copy(update={"data": str(ROOT / cfg.eval.evals[0].data)})
    return evaluate_stage(model, model_name=model_name, evals=[spec], image_size=28, precision=cfg.precision,
                          progress=False)[spec.name]["top1"]


def run_arm(key: str, arm: dict, extra: list[str], runs: Path, cfg) -> dict:
    """One demo run (no final probe); returns its results.jsonl rows and wall time (and, for a patch
    change, the top-1 right after it)."""
    run_dir = runs / f"patch_bench_{key}"
    cmd = [sys.executable, "-m", "crate_clip.train.demo", "--run-dir", str(run_dir), "--probe-train-images", "0"]
    for o in arm["overrides"] + extra:
        cmd += ["--set", o]
    print(" ".join(cmd), flush=True)
    t0 = time.perf_counter()
    subprocess.run(cmd, cwd=ROOT, check=True)
    seconds = time.perf_counter() - t0
    rows = [json.loads(line) for line in (run_dir / "results.jsonl").read_text().splitlines() if line.strip()]
    resize = next((o.split("=", 1)[1] for o in arm["overrides"] if o.startswith("stages.1.patch_resize=")), None)
    change = at_the_change(run_dir, resize, cfg) if resize else None
    return {"rows": rows, "seconds": seconds, "command": cmd[1:], "at_change": change}


def markdown(arms: dict, done: dict) -> str:
    """The BENCHMARKS.md table: FLOPs and zero-shot top-1 after each stage per arm."""
    header = ["arm", "stage 0 samples", "stage 0 TFLOP", "stage 1 samples", "stage 1 TFLOP",
              "top-1 after stage 0 (its size / 28 px)", "right after the change to p4 (28 px)",
              "top-1 after stage 1 (28 px)", "wall s"]
    cells = []
    for key, res in done.items():
        arm = arms[key]
        by = {(r["stage_index"], r["image_size"]): 100 * r["top1"] for r in res["rows"]}
        s0 = " / ".join(f"{v:.2f}%" for (i, _), v in sorted(by.items()) if i == 0)
        cells.append([arm["label"], f"{arm['samples'][0]:,}", f"{arm['flops'][0] / 1e12:.1f}",
                      f"{arm['samples'][1]:,}", f"{arm['flops'][1] / 1e12:.1f}", s0,
                      "-" if res.get("at_change") is None else f"{100 * res['at_change']:.2f}%",
                      f"{by.get((1, 28), float('nan')):.2f}%", f"{res['seconds']:.0f}"])
    return markdown_table(header, cells)


def main() -> int:
    """Run the chosen arms one after the other and print the table."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--only", default="a,b,c", help="comma-separated arms to run (default a,b,c)")
    p.add_argument("--runs", default=str(ROOT / "runs"), help="parent folder of the run folders")
    p.add_argument("--set", dest="overrides", action="append", default=[], help="extra demo override, all arms")
    args = p.parse_args()
    from crate_clip.train.run.run_config import load_run_config
    cfg = load_run_config(DEMO, args.overrides, check_paths=False)
    arms = variants(cfg)
    done = {}
    for key in args.only.split(","):
        done[key] = run_arm(key, arms[key], args.overrides, Path(args.runs), cfg)
        print(markdown(arms, done), flush=True)
    out = Path(args.runs) / "patch_bench.json"
    out.write_text(json.dumps({k: {**arms[k], **v} for k, v in done.items()}, indent=1))
    print(f"\n{markdown(arms, done)}\n(written to {out})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
