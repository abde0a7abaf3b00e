"""The CRATE-alpha text tower against the transformer text tower it replaces, on a CPU.

Demo arms (the demo recipe, configs/demo/fashion_mnist.yaml, run one after the other with the same image tower):
  transformer   CRATE-alpha-CLIPA-tiny: the demo's transformer text tower (width 64, 2 layers, 2 heads)
  crate_params  CRATE-alpha-CLIPA-tiny-crate-text: CRATE-alpha text tower at about the same parameters (64/2/2)
  crate_flops   CRATE-alpha-CLIPA-tiny-crate-text-w52: CRATE-alpha text tower at about the same FLOPs (52/2/2)
per arm: zero-shot top-1 after each stage, the demo's linear probe, training samples/s per stage, and the text
tower's per-layer coding rate and sparsity over training (the white-box probe, logging.diagnostics_every).

Step time (--steptime): the text towers of CRATE-alpha-CLIPA-L-14 (CLIPA's transformer, 1024/24/16) and of
CRATE-alpha-CLIPA-L-14-crate-text (CRATE-alpha, 1024/24/16) alone, forward + backward of batch 8 x 32 tokens in one
process, steps of the two alternated in the same run; the ratio of their medians. Beside it, the three demo arms'
whole CLIPs at the demo's stage-1 shape, one step each alternated in one process (their samples/s in the demo runs
depend on what else loads the shared machine while each runs).

    python bench/bench_text_tower.py --steptime [--steps 5]       # ~3 min on 2 idle cores
    python bench/bench_text_tower.py --demo [--fraction 1.0] [--data-dir DIR]   # three demo runs, ~5-16 min each
    python bench/bench_text_tower.py --write                      # the `text-tower` section of BENCHMARKS.md
Each part keeps its numbers in bench/out/text_tower/*.json; --write assembles what is there.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import threading
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "bench")]

from demo_runs import demo_stages, run_demo  # noqa: E402

OUT = ROOT / "bench" / "out" / "text_tower"
ARMS = {"transformer": "CRATE-alpha-CLIPA-tiny", "crate_params": "CRATE-alpha-CLIPA-tiny-crate-text",
        "crate_flops": "CRATE-alpha-CLIPA-tiny-crate-text-w52"}
ARM_LABELS = {"transformer": "transformer text (demo)", "crate_params": "CRATE-α text, equal parameters",
              "crate_flops": "CRATE-α text, equal text FLOPs"}
STEP_TOWERS = {"transformer": "CRATE-alpha-CLIPA-L-14", "crate": "CRATE-alpha-CLIPA-L-14-crate-text"}
STEP_BATCH, STEP_TOKENS = 8, 32
DEMO_STEP_BATCH = 32   # one demo process's share of the global batch of 64


# ------------------------------------------------------------------ the text towers alone
def text_tower(model_name: str, context_length: int | None = None) -> torch.nn.Module:
    """The text tower of a CLIP config (with its projection), built as open_clip builds it."""
    import open_clip

    import crate_clip  # noqa: F401  (registers the configs and the CRATE-alpha text tower)

    cfg = open_clip.get_model_config(model_name)
    text_cfg = dict(cfg["text_cfg"], **({"context_length": context_length} if context_length else {}))
    return open_clip.model._build_text_tower(cfg["embed_dim"], text_cfg)


def _tokens(tower, batch: int, length: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(1, min(getattr(tower, "vocab_size", 1000), 1000), (batch, length), generator=g)
    ids[:, -1] = ids.max() + 1   # an end-of-text position for argmax pooling
    return ids


def _step(tower, ids) -> None:
    """Forward and backward of one batch (the mean square of the projected features as the loss)."""
    tower.zero_grad(set_to_none=True)
    tower(ids).square().mean().backward()


def text_flops(tower, length: int, batch: int = 2) -> float:
    """Forward + backward FLOPs per sample of a text tower at `length` tokens (attention as its matmuls)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.utils.flop_counter import FlopCounterMode

    with sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as counter:
        _step(tower, _tokens(tower, batch, length))
    tower.zero_grad(set_to_none=True)
    return counter.get_total_flops() / batch


def steptime(steps: int) -> dict:
    """Median fwd+bwd seconds of the L/14-sized CRATE-alpha and transformer text towers, alternated."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    torch.manual_seed(0)
    towers = {kind: text_tower(name).train() for kind, name in STEP_TOWERS.items()}
    ids = {kind: _tokens(t, STEP_BATCH, STEP_TOKENS) for kind, t in towers.items()}
    times = {kind: [] for kind in towers}
    load = []
    with sdpa_kernel(SDPBackend.MATH):   # the kernel training uses on a CPU (attention: auto)
        for round_ in range(1 + steps):   # round 0 warms up
            for kind, tower in towers.items():
                t0 = time.perf_counter()
                _step(tower, ids[kind])
                if round_:
                    times[kind].append(time.perf_counter() - t0)
            load.append(os.getloadavg()[0])
    median = {k: sorted(v)[len(v) // 2] for k, v in times.items()}
    return {"median_s": median, "times_s": times, "ratio": median["crate"] / median["transformer"],
            "params": {k: sum(p.numel() for p in t.parameters()) for k, t in towers.items()},
            "flops": {k: text_flops(t, STEP_TOKENS) for k, t in towers.items()},
            "threads": torch.get_num_threads(), "load": [min(load), max(load)], "steps": steps}


def demo_steptime(steps: int) -> dict:
    """Median training-step seconds (forward, CLIP loss, backward) of the three demo arms' whole CLIPs at the
    demo's full-resolution stage shape (28 px at patch 7, 16 tokens, one process's batch of 32), on one thread as
    each demo process runs, the arms alternated; ratios to the transformer arm."""
    from open_clip.loss import ClipLoss
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from crate_clip.models import create_clip
    from crate_clip.eval.whitebox import find_crate_tower

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    models = {arm: create_clip(name, image_size=28, context_length=16).train() for arm, name in ARMS.items()}
    for model in models.values():
        find_crate_tower(model).set_patch_size(7)
    images = torch.randn(DEMO_STEP_BATCH, 3, 28, 28, generator=torch.Generator().manual_seed(0))
    ids = _tokens(models["transformer"], DEMO_STEP_BATCH, 16)
    loss_fn, times = ClipLoss(), {arm: [] for arm in models}
    try:
        with sdpa_kernel(SDPBackend.MATH):
            for round_ in range(1 + steps):   # round 0 warms up
                for arm, model in models.items():
                    t0 = time.perf_counter()
                    model.zero_grad(set_to_none=True)
                    loss_fn(*model(images, ids)[:3]).backward()
                    if round_:
                        times[arm].append(time.perf_counter() - t0)
    finally:
        torch.set_num_threads(threads)
    median = {k: sorted(v)[len(v) // 2] for k, v in times.items()}
    return {"median_s": median, "ratio": {k: v / median["transformer"] for k, v in median.items()},
            "batch": DEMO_STEP_BATCH, "steps": steps}


# ------------------------------------------------------------------ the demo arms
class LoadSampler:
    """The 1-minute load average every 10 s while a run goes on (the machine is shared)."""

    def __init__(self):
        self.samples, self._stop = [], threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self):
        while not self._stop.wait(10.0):
            self.samples.append(os.getloadavg()[0])

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()


def shortened(fraction: float) -> list[str]:
    """--set overrides running `fraction` of each demo stage's samples (warm-up scaled alike); none at 1."""
    if fraction >= 1.0:
        return []
    out = []
    for i, s in enumerate(demo_stages()):
        steps = max(1, round(fraction * s["samples"] / s["global_batch"]))
        out += [f"stages.{i}.samples={steps * s['global_batch']}",
                f"stages.{i}.warmup_steps={min(s.get('warmup_steps', 0), steps // 4)}"]
    return out


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]


def arm_numbers(run_dir: Path, model_name: str) -> dict:
    """What one finished demo run says: zero-shot per stage and size, linear probe, samples/s per stage, the text
    tower's size and FLOPs, and its white-box diagnostics at each measurement."""
    rows = read_jsonl(run_dir / "metrics.jsonl")
    stages = sorted({r["stage_index"] for r in rows})
    last = {s: [r for r in rows if r["stage_index"] == s][-1] for s in stages}
    probe = json.loads((run_dir / "linear_probe.json").read_text()) if (run_dir / "linear_probe.json").is_file() else {}
    context = demo_stages()[0]["context_length"]
    tower = text_tower(model_name, context)
    return {
        "model": model_name,
        "zeroshot": [{k: r[k] for k in ("stage_index", "image_size", "top1")}
                     for r in read_jsonl(run_dir / "results.jsonl")],
        "linear_probe_top1": probe.get("top1"),
        "samples_per_s": {s: last[s]["samples_per_s"] for s in stages},   # from the stage start, probe included
        "flops_per_sample": {s: last[s]["flops_per_sample"] for s in stages},
        "text_params": sum(p.numel() for p in text_tower(model_name).parameters()),
        "text_params_trained": sum(p.numel() for p in tower.parameters()),
        "text_flops": text_flops(tower, context),
        "whitebox_text": [{"samples_seen": r["samples_seen"], "stage_index": r["stage_index"], "step": r["step"],
                           **{k: r["whitebox_text"][k] for k in ("coding_rate", "l0", "probe_captions")}}
                          for r in rows if r.get("whitebox_text")],
    }


def demo(fraction: float, reuse: bool, data_dir: Path | None = None) -> dict:
    """The three arms, one after the other on the same data, each with the load average sampled during it."""
    out = {"fraction": fraction, "overrides": shortened(fraction), "arms": {}}
    for arm, model in ARMS.items():
        run_dir = OUT / arm
        with LoadSampler() as load:
            wall = run_demo(run_dir, out["overrides"] + [f"model.name={model}", "logging.progress=false"],
                            data_dir=data_dir, reuse=reuse)
        out["arms"][arm] = {**arm_numbers(run_dir, model), "wall_seconds": wall,
                            "load": {"mean": sum(load.samples) / max(len(load.samples), 1),
                                     "min": min(load.samples, default=None), "max": max(load.samples, default=None)}}
        (OUT / "demo.json").write_text(json.dumps(out, indent=1))   # after each arm: a stopped run keeps the rest
        print(f"[bench] {arm}: {json.dumps({k: v for k, v in out['arms'][arm].items() if k != 'whitebox_text'})}",
              flush=True)
    return out


# ------------------------------------------------------------------ BENCHMARKS.md
def _pct(x) -> str:
    return "-" if x is None else f"{100 * x:.2f}%"


def _load(load: dict) -> str:
    return f"{load['mean']:.1f} ({load['min']:.1f}-{load['max']:.1f})"


def _zeroshot(arm: dict, stage: int, size: int):
    return next((r["top1"] for r in arm["zeroshot"] if (r["stage_index"], r["image_size"]) == (stage, size)), None)


def over_training(recs: list[dict]) -> list[dict]:
    """The first measurement, then each stage's middle one and its last."""
    picks = [recs[0]]
    for stage in sorted({r["stage_index"] for r in recs}):
        own = [r for r in recs if r["stage_index"] == stage]
        picks += [r for r in (own[len(own) // 2], own[-1]) if r is not picks[-1]]
    return picks


def demo_markdown(d: dict) -> list[str]:
    """The demo comparison: one table of results, one of the text tower's diagnostics."""
    from report import markdown_table

    arms = d["arms"]
    base = arms.get("transformer")
    full = demo_stages()[-1]["image_size"]   # the fine-tune's input (27 px since issue 39; stage 0 is evaluated there)
    rows = []
    for arm, a in arms.items():
        ratio = (f" ({a['text_flops'] / base['text_flops']:.2f}x)" if base else "")
        rows.append([ARM_LABELS[arm], f"`{a['model']}`", f"{a['text_params']:,} ({a['text_params_trained']:,})",
                     f"{a['text_flops'] / 1e6:.2f}{ratio}", _pct(_zeroshot(a, 0, 21)), _pct(_zeroshot(a, 0, full)),
                     _pct(_zeroshot(a, 1, full)), _pct(a["linear_probe_top1"]),
                     " / ".join(f"{a['flops_per_sample'][s] / 1e6:.0f}" for s in sorted(a["flops_per_sample"])),
                     " / ".join(f"{a['samples_per_s'][s]:.0f}" for s in sorted(a["samples_per_s"])),
                     f"{a['wall_seconds']:.0f}", _load(a["load"])])
    lines = [markdown_table(["arm", "model", "text params (as trained, 16 tokens)", "text MFLOP / sample (fwd+bwd)",
                             "zero-shot after stage 0 (21 px)", f"stage 0 at {full} px", f"after stage 1 ({full} px)",
                             "linear probe", "CLIP train MFLOP / sample (stage 0 / 1)", "samples/s (stage 0 / 1)",
                             "wall s", "load average (min-max)"], rows)]
    captions = next((a["whitebox_text"][0]["probe_captions"] for a in arms.values() if a["whitebox_text"]), 0)
    lines += ["", f"Text tower diagnostics over training (the white-box probe on {captions} class-name prompts of the "
              "eval set, each over its own tokens; per layer: coding rate R^c / normalised L0 of the ISTA code; the "
              "first measurement, then each stage's middle and end; the transformer text tower has no ISTA codes):", ""]
    wb_rows = []
    for arm, a in arms.items():
        recs = a["whitebox_text"]
        if not recs:
            continue
        for r in over_training(recs):
            wb_rows.append([ARM_LABELS[arm], f"{r['samples_seen']:,} (stage {r['stage_index']}, step {r['step']})"]
                           + [f"{c:.2f} / {l0:.3f}" for c, l0 in zip(r["coding_rate"], r["l0"])])
    depth = max((len(a["whitebox_text"][0]["coding_rate"]) for a in arms.values() if a["whitebox_text"]), default=0)
    lines.append(markdown_table(["arm", "samples seen"] + [f"layer {i + 1}" for i in range(depth)], wb_rows))
    return lines


def steptime_markdown(s: dict) -> list[str]:
    """The step-time comparison."""
    from report import markdown_table

    rounds = [c / t for c, t in zip(s["times_s"]["crate"], s["times_s"]["transformer"])]

    rows = [[kind, f"`{STEP_TOWERS[kind]}`", f"{s['params'][kind]:,}", f"{s['flops'][kind] / 1e9:.1f}",
             f"{s['median_s'][kind]:.1f} s", f"{min(s['times_s'][kind]):.1f}-{max(s['times_s'][kind]):.1f} s"]
            for kind in ("transformer", "crate")]
    return [markdown_table(["text tower", "config", "parameters", "GFLOP / sample (fwd+bwd)",
                            f"median step ({STEP_BATCH} x {STEP_TOKENS} tokens)", "step range"], rows), "",
            f"**CRATE-α / transformer step time: {s['ratio']:.2f}x** "
            f"(FLOPs {s['flops']['crate'] / s['flops']['transformer']:.2f}x; the ratio within each round of the "
            f"alternation ranged {min(rounds):.2f}-{max(rounds):.2f}); "
            f"{s['steps']} alternated steps each after one warm-up, {s['threads']} torch threads, load average "
            f"{s['load'][0]:.1f}-{s['load'][1]:.1f} during the steps."] + demo_steptime_markdown(s.get("demo_arms"))


def demo_steptime_markdown(d: dict | None) -> list[str]:
    """The demo arms' step-time ratios (a load-independent view of their samples/s)."""
    if not d:
        return []
    ratios = ", ".join(f"{ARM_LABELS[arm]} {d['ratio'][arm]:.2f}x ({d['median_s'][arm] * 1e3:.0f} ms)"
                       for arm in ARMS if arm != "transformer")
    return ["", f"**The demo arms' whole CLIPs, one training step each, alternated in one process** (28 px at patch "
            f"7, 16 tokens, batch {d['batch']} = one demo process's share, one thread as each demo process runs, "
            f"forward + CLIP loss + backward, median of {d['steps']}): step time against the transformer text arm "
            f"({d['median_s']['transformer'] * 1e3:.0f} ms): {ratios}."]


def write(note: str) -> str:
    """Assemble the BENCHMARKS.md section from the saved parts."""
    from report import machine_line, write_section

    lines = ["## Text tower: CRATE-α against the transformer (`bench/bench_text_tower.py`)", "", machine_line(), ""]
    if (OUT / "demo.json").is_file():
        d = json.loads((OUT / "demo.json").read_text())
        full = d["fraction"] >= 1
        length = "full length" if full else f"both stages cut to {d['fraction']:.0%} of their samples"
        command = "python bench/bench_text_tower.py --demo" + ("" if full else f" --fraction {d['fraction']}")
        lines += [f"**Demo recipe** (configs/demo/fashion_mnist.yaml, {length}; 2 training processes; `{command}`). "
                  "The same image tower in every arm; only `model.name` differs. Text parameters at the config's 32 "
                  "tokens (in brackets at the 16 tokens the demo trains with); text FLOPs counted by torch on the "
                  "text tower alone at 16 tokens. samples/s from each stage's start to its end (the white-box probe "
                  "included, evaluation excluded).", ""] + demo_markdown(d) + [""]
    if (OUT / "steptime.json").is_file():
        s = json.loads((OUT / "steptime.json").read_text())
        lines += [f"**Step time of a CLIPA L/14-sized text tower** (`python bench/bench_text_tower.py --steptime "
                  f"--steps {s['steps']}`: each text tower alone, one process, forward + backward, SDPA math kernel):",
                  ""]
        lines += steptime_markdown(s) + [""]
    if note:
        lines += [note]
    text = "\n".join(lines).rstrip()
    write_section("text-tower", text)
    return text


def main(argv=None) -> int:
    """Run the parts asked for; print (and with --write record) the result."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steptime", action="store_true", help="time the L/14-sized text towers")
    p.add_argument("--steps", type=int, default=5, help="timed steps per tower")
    p.add_argument("--demo", action="store_true", help="train the three demo arms")
    p.add_argument("--fraction", type=float, default=1.0, help="share of each demo stage's samples to run")
    p.add_argument("--data-dir", type=Path, help="the demo data's folder (written there when missing; default: "
                   "the demo's data/fashion_mnist)")
    p.add_argument("--reuse", action="store_true", help="keep finished demo runs of the same command")
    p.add_argument("--write", action="store_true", help="write the section into BENCHMARKS.md")
    p.add_argument("--note", default="", help="a paragraph for BENCHMARKS.md (conditions, reading)")
    args = p.parse_args(argv)
    OUT.mkdir(parents=True, exist_ok=True)
    if args.steptime:
        result = {**steptime(args.steps), "demo_arms": demo_steptime(4 * args.steps)}
        (OUT / "steptime.json").write_text(json.dumps(result, indent=1))
        print(json.dumps(result, indent=1))
    if args.demo:
        demo(args.fraction, args.reuse, args.data_dir)
    if args.write:
        print(write(args.note))
    return 0


if __name__ == "__main__":
    sys.exit(main())
