"""Issue 55 item 1: torch.compile of both towers on the CPU against eager, one training step as a rank of the demo
runs it (one thread, the rank's batch, the tower's token mask, open_clip's ClipLoss, the fused AdamW), in one script
run:

    .venv/bin/python bench/bench_compile.py --rounds 2 --steps 40   # ~15 min on 2 cores (compiling is most of it)
    .venv/bin/python bench/bench_compile.py --smoke                 # a few steps: the script works
    .venv/bin/python bench/bench_compile.py --from-json             # the section again from results.json

Shapes (each a stage the trainer builds a new model for, so each compiles afresh):
  demo-s0   the demo's stage 0: CRATE-alpha-CLIPA-tiny at 21 px / patch 7, 3 of 9 tokens kept at random, 8 text
            tokens, 32 samples a rank (its global batch of 64 on 2 ranks)
  demo-s1   the demo's fine-tune: 27 px / patch 9, every token, 16 text tokens, 32 a rank
  wide      the CLIPA B/16 image tower (width 768, 12 blocks) at 64 px / patch 16 (16 tokens), a 4-layer text
            tower of width 256 and 16 tokens, 16 samples a rank: a wider tower at a small batch and low resolution
Eager and compiled copies of each shape's model (the same initial weights) train side by side in one process, their
steps alternated (the machine's drift falls on both): the compiled copy's first step (the compile), the medians of
the timed steps, the peak RSS before and after the compile, the graphs dynamo compiled. demo-s1 runs after demo-s0
in the same process: what a compiled demo meets at its stage change. `--rounds` runs start with an empty inductor
cache (a first run on the machine), one more reuses the last one's (a second run). Output: bench/out/compile/
results.json and, unless --no-write, BENCHMARKS.md's `compile` section.
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))
OUT = ROOT / "bench" / "out" / "compile"

SHAPES = {
    "demo-s0": dict(model="CRATE-alpha-CLIPA-tiny", image_size=21, patch_size=7, mask=("random", 0.67), context=8,
                    batch=32, text_cfg=None),
    "demo-s1": dict(model="CRATE-alpha-CLIPA-tiny", image_size=27, patch_size=9, mask=("none", 0.0), context=16,
                    batch=32, text_cfg=None),
    "wide": dict(model="CRATE-alpha-CLIPA-B-16", image_size=64, patch_size=16, mask=("none", 0.0), context=16,
                 batch=16, text_cfg={"width": 256, "heads": 4, "layers": 4, "hf_tokenizer_name": None}),
}


# ------------------------------------------------------------------------------------------------- one arm (child)
def build(shape: dict, compiled: bool):
    """The shape's model (the trainer's factory, mask and compile), its fused AdamW and open_clip's ClipLoss."""
    import torch
    from open_clip import ClipLoss

    from crate_clip.models.clip_factory import create_clip, set_image_token_mask
    from crate_clip.train.stage_setup.optim import build_optimizer
    from crate_clip.train.stage_setup.stage_model import compile_towers

    torch.manual_seed(0)
    model = create_clip(shape["model"], image_size=shape["image_size"], context_length=shape["context"],
                        patch_size=shape["patch_size"], text_cfg=shape["text_cfg"])
    set_image_token_mask(model, *shape["mask"])
    model.train()
    if compiled:
        compile_towers(model)
    opt = build_optimizer(model, lr=1e-4, weight_decay=0.1, betas=(0.9, 0.95), eps=1e-6)
    return model, opt, ClipLoss()


def one_step(model, opt, loss_fn, images, tokens) -> float:
    """Forward, loss, backward, optimizer step; its wall seconds."""
    start = time.perf_counter()
    image_f, text_f, scale = model(images, tokens)[:3]
    loss = loss_fn(image_f, text_f, scale)
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    return time.perf_counter() - start


def run_shape(name: str, steps: int) -> dict:
    """Eager and compiled copies of one shape's model (the same initial weights) in this process: the compiled
    copy's first step (the compile), then `steps` steps of each, alternated, so that the machine's drift falls on
    both alike; the peak RSS before and after the compile; the graphs dynamo compiled for the shape."""
    import torch
    import torch._dynamo.utils as dynamo_utils

    shape = SHAPES[name]
    eager, compiled = build(shape, False), build(shape, True)
    vocab = eager[0].vocab_size if hasattr(eager[0], "vocab_size") else 32000
    gen = torch.Generator().manual_seed(1)
    images = torch.randn(shape["batch"], 3, shape["image_size"], shape["image_size"], generator=gen)
    tokens = torch.randint(1, vocab, (shape["batch"], shape["context"]), generator=gen)
    warm = [one_step(*eager, images, tokens) for _ in range(3)]
    rss_eager = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    graphs0 = dynamo_utils.counters["stats"].get("unique_graphs", 0)
    first = one_step(*compiled, images, tokens)
    times = {"eager": [], "compiled": []}
    for _ in range(steps):
        times["eager"].append(one_step(*eager, images, tokens))
        times["compiled"].append(one_step(*compiled, images, tokens))
    eager_s, compiled_s = statistics.median(times["eager"]), statistics.median(times["compiled"])
    return {"shape": name, "eager_first_s": warm[0], "compiled_first_s": first, "eager_step_s": eager_s,
            "compiled_step_s": compiled_s, "compile_s": first - eager_s,
            "graphs": dynamo_utils.counters["stats"].get("unique_graphs", 0) - graphs0,
            "peak_rss_mib_eager": rss_eager,
            "peak_rss_mib_compiled": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}


def child(names: list[str], steps: int) -> dict:
    """The shapes in order in this process (two: a stage change, the second compiled with the first's cache)."""
    import torch
    torch.set_num_threads(1)   # a rank of the demo's 2 on 2 cores
    return {"shapes": [run_shape(n, steps) for n in names]}


# ------------------------------------------------------------------------------------------------- the parent
def spawn(names: list[str], steps: int, cache: Path) -> dict:
    """Run the shapes in a fresh interpreter, inductor's cache in `cache`; its JSON result."""
    cmd = [sys.executable, __file__, "--child", ",".join(names), "--steps", str(steps)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TORCHINDUCTOR_CACHE_DIR": str(cache)}
    done = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, env=env)
    if done.returncode != 0:
        raise SystemExit(f"shapes {names} failed:\n{done.stderr[-4000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def measure(names: list[str], rounds: int, steps: int) -> list[dict]:
    """`rounds` runs with an empty compile cache, then one more with the cache the last one left (what a second
    run on the machine finds)."""
    runs = []
    with tempfile.TemporaryDirectory(prefix="inductor_cache_") as parent:
        for r in range(rounds + 1):
            cache = Path(parent) / str(min(r, rounds - 1))
            runs.append({"cache": "warm" if r == rounds else "empty", **spawn(names, steps, cache)})
            print(json.dumps(runs[-1]), flush=True)
    return runs


# ------------------------------------------------------------------------------------------------- report
def table(results: dict) -> str:
    """One row per shape and run: step times, speed-up, compile, the steps that repay it, graphs, peak RSS."""
    from report import markdown_table
    rows = []
    for runs in results.values():
        for i, run in enumerate(runs):
            for sh in run["shapes"]:
                saved = sh["eager_step_s"] - sh["compiled_step_s"]
                rows.append([sh["shape"], f"{i + 1} ({run['cache']} cache)", f"{1e3 * sh['eager_step_s']:.1f}",
                             f"{1e3 * sh['compiled_step_s']:.1f}", f"{sh['eager_step_s'] / sh['compiled_step_s']:.2f}",
                             f"{sh['compile_s']:.1f}", f"{sh['compile_s'] / saved:,.0f}" if saved > 0 else "never",
                             str(sh["graphs"]), f"{sh['peak_rss_mib_eager']:.0f} -> {sh['peak_rss_mib_compiled']:.0f}"])
    return markdown_table(["shape", "run", "eager step (ms)", "compiled step (ms)", "speed-up", "compile (s)",
                           "steps to repay it", "graphs", "peak RSS (MiB)"], rows)


SHAPE_WORDS = """- demo-s0: the demo's stage 0 (CRATE-alpha-CLIPA-tiny, 21 px / patch 7, 3 of 9 tokens kept at random,
  8 text tokens, 32 samples a rank); demo-s1: its fine-tune (27 px / patch 9, every token, 16 text tokens, 32 a rank);
- wide: the CLIPA B/16 image tower (width 768, 12 blocks) at 64 px / patch 16 (16 tokens), a 4-layer text tower of
  width 256 and 16 tokens, 16 samples a rank."""


def markdown(results: dict, command: str, note: str = "") -> str:
    """The `compile` section of BENCHMARKS.md."""
    from report import cpu_model, machine_line
    runs = len(next(iter(results.values())))
    return f"""## Issue 55: torch.compile of both towers on the CPU (`bench/bench_compile.py`)

`{command}`; {machine_line()}, {cpu_model()}. One process, one thread (a rank of the demo's 2 on 2 cores), a step
as the trainer runs it (the towers compiled as `model.compile: true` does it; open_clip's ClipLoss and the fused
AdamW eager). Eager and compiled copies of each shape's model train side by side, their steps alternated, so the
machine's drift falls on both; step times are medians. Compile: the compiled copy's first step less an eager step;
steps to repay it: compile / (eager - compiled step). A stage change builds a new model, which compiles afresh:
demo-s1 runs after demo-s0 in the same process, so its graphs are the stage change's recompiles. Runs 1-{runs - 1}
start with an empty inductor cache (a first run on a machine), run {runs} with the cache the run before it left (a
second run). Shapes:
{SHAPE_WORDS}

{table(results)}

{reading(results)}{" " + note if note else ""}"""


def reading(results: dict) -> str:
    """The ranges the table holds, and what they mean for the demo's stages (model.compile's default)."""
    shapes = [(run["cache"], sh) for runs in results.values() for run in runs for sh in run["shapes"]]
    speed = [sh["eager_step_s"] / sh["compiled_step_s"] for _, sh in shapes]
    cold = [sh["compile_s"] for cache, sh in shapes if cache == "empty"]
    warm = [sh["compile_s"] for cache, sh in shapes if cache == "warm"]
    more = [sh["peak_rss_mib_compiled"] - sh["peak_rss_mib_eager"] for _, sh in shapes]
    return (f"Compiled steps {min(speed):.2f}-{max(speed):.2f}x as fast as eager; compiling {min(cold):.0f}-"
            f"{max(cold):.0f} s a stage with an empty cache, {min(warm):.1f}-{max(warm):.1f} s with a warm one; the "
            f"process's peak RSS {min(more):.0f}-{max(more):.0f} MiB higher with the compiled copy. The demo's stages "
            "take 3,840 and 320 steps: with an empty cache (a fresh clone) neither repays its compile, so "
            "`model.compile` stays off by default and each stage says so in its `[compile]` line. One CPU class "
            "(the machine above); a GPU is not measured (bench/bench_gpu.py runs both).")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--steps", type=int, default=30, help="timed steps after the first (default 30)")
    p.add_argument("--smoke", action="store_true", help="one run of 3 steps of the demo's stage change (writes no "
                                                        "section)")
    p.add_argument("--from-json", action="store_true", help="the section again from bench/out/compile/results.json")
    p.add_argument("--no-write", action="store_true", help="results.json only, BENCHMARKS.md untouched")
    p.add_argument("--note", default="", help="a line about the conditions, printed under the table")
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = p.parse_args()
    from report import print_section   # torch with it: after the arguments

    if args.child:
        print(json.dumps(child(args.child.split(","), args.steps)))
        return 0
    if args.from_json:
        record = json.loads((OUT / "results.json").read_text())
        print_section("compile", markdown(record["results"], record["command"], record.get("note", "")), args.no_write)
        return 0
    rounds, steps = (1, 3) if args.smoke else (args.rounds, args.steps)
    arms = [["demo-s0", "demo-s1"]] if args.smoke else [["demo-s0", "demo-s1"], ["wide"]]
    results = {" -> ".join(names): measure(names, rounds, steps) for names in arms}
    command = ".venv/bin/python bench/bench_compile.py" + (" --smoke" if args.smoke else
                                                            f" --rounds {rounds} --steps {steps}")
    if not args.smoke:   # a smoke run leaves the measurement's record alone
        OUT.mkdir(parents=True, exist_ok=True)
        (OUT / "results.json").write_text(json.dumps({"command": command, "note": args.note, "results": results},
                                                     indent=1))
    print_section("compile", markdown(results, command, args.note), args.no_write or args.smoke)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
