"""What the white-box diagnostics cost the demo: the same shortened demo training with `logging.diagnostics_every`
N (the demo config's 25) and 0 (off), alternated in pairs (on/off, then off/on, ...) so drift in the machine's
load falls on both arms; reports the ratio of training seconds (on / off) per pair and overall, and the probe's
own share of the 'on' runs' training time (timed inside those runs). The budget: at most 5% slower.

Each stage of the demo config is cut to a whole number of `diagnostics_every`-step blocks (`--fraction` of its
steps, at least one block), so the probe runs as often per step as in the full demo (plus each stage's end).

    python bench/bench_diagnostics_overhead.py [--pairs 2] [--fraction 0.15] [--precision fp32] [--write]
"""
import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "bench")]

from demo_runs import DEMO_CONFIG, demo_stages, run_demo, stage_times  # noqa: E402


def shortened(stages: list[dict], every: int, fraction: float) -> list[str]:
    """--set overrides cutting each stage to max(1, round(fraction * steps / every)) blocks of `every` steps."""
    out = []
    for i, s in enumerate(stages):
        steps = s["samples"] // s["global_batch"]
        blocks = max(1, round(fraction * steps / every))
        out += [f"stages.{i}.samples={blocks * every * s['global_batch']}",
                f"stages.{i}.warmup_steps={min(s.get('warmup_steps', 0), blocks * every // 4)}"]
    return out


def main(argv=None) -> int:
    """Run the pairs; print (and with --write record) the result."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--config", default=str(DEMO_CONFIG))
    p.add_argument("--pairs", type=int, default=2)
    p.add_argument("--every", type=int, default=25, help="logging.diagnostics_every of the 'on' runs")
    p.add_argument("--fraction", type=float, default=0.15, help="share of each stage's steps to run")
    p.add_argument("--precision", default="fp32", help="run-config precision (this CPU has no native bf16)")
    p.add_argument("--out", default=str(ROOT / "bench" / "out" / "diagnostics_overhead"))
    p.add_argument("--note", default="", help="a paragraph for BENCHMARKS.md about the conditions of this run")
    p.add_argument("--reuse", action="store_true", help="keep finished runs of the same command in --out")
    p.add_argument("--write", action="store_true", help="write the section into BENCHMARKS.md")
    args = p.parse_args(argv)
    stages = demo_stages(args.config)
    common = shortened(stages, args.every, args.fraction) + [
        f"precision={args.precision}", "logging.progress=false", "eval.evals.0.max_images=1000"]
    rows = []
    for pair in range(args.pairs):
        arms = (args.every, 0) if pair % 2 == 0 else (0, args.every)
        result = {}
        for every in arms:
            run_dir = Path(args.out) / f"pair{pair}_every{every}"
            wall = run_demo(run_dir, common + [f"logging.diagnostics_every={every}"], config=args.config,
                            probe_train_images=0, reuse=args.reuse)
            result[every] = {**stage_times(run_dir), "wall_seconds": wall}
        on, off = result[args.every], result[0]
        rows.append((on, off))
        print(f"pair {pair}: training {on['training_seconds']:.1f} s with diagnostics vs {off['training_seconds']:.1f} s "
              f"without = x{on['training_seconds'] / off['training_seconds']:.3f}; probe {on['probe_seconds']:.1f} s "
              f"({on['measurements']} measurements, {100 * on['probe_share']:.2f}% of the run)", flush=True)
    md = markdown(rows, args, common)
    print(md)
    if args.write:
        from report import write_section
        write_section("diagnostics-overhead", md)
    return 0


def markdown(rows, args, common: list[str]) -> str:
    """The BENCHMARKS.md section."""
    from report import machine_line

    on_total = sum(on["training_seconds"] for on, _ in rows)
    off_total = sum(off["training_seconds"] for _, off in rows)
    probe_total = sum(on["probe_seconds"] for on, _ in rows)
    lines = ["## White-box diagnostics: cost in the demo (`bench/bench_diagnostics_overhead.py`)", "",
             machine_line() + " (the demo's 2 training processes, 1 thread each)", "",
             f"The demo config shortened (`{' '.join('--set ' + o for o in common)}`), "
             f"{rows[0][0]['samples']:,} samples per run, `logging.diagnostics_every` {args.every} vs 0, "
             f"{args.pairs} pairs alternating the order. Training seconds = the stages' elapsed time from the "
             "runs' own metrics.jsonl (stage start to last step; evaluation, export and start-up excluded).", "",
             "| pair | with diagnostics (s) | without (s) | ratio | probe inside the run (s) | probe share |",
             "|---|---:|---:|---:|---:|---:|"]
    for i, (on, off) in enumerate(rows):
        lines.append(f"| {i} | {on['training_seconds']:.1f} | {off['training_seconds']:.1f} | "
                     f"{on['training_seconds'] / off['training_seconds']:.3f} | {on['probe_seconds']:.1f} | "
                     f"{100 * on['probe_share']:.2f}% |")
    lines.append(f"| all | {on_total:.1f} | {off_total:.1f} | {on_total / off_total:.3f} | {probe_total:.1f} | "
                 f"{100 * probe_total / on_total:.2f}% |")
    lines += ["", f"Command: `flock /work/notes/cpu.lock python bench/bench_diagnostics_overhead.py --pairs {args.pairs} "
              f"--fraction {args.fraction} --precision {args.precision} --write`. The ratio carries the run-to-run "
              "noise of a shared machine; the probe share (timed around each measurement inside the same runs) "
              "is the cost itself."]
    if args.note:
        lines += ["", args.note]
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
