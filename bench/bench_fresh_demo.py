"""Issue 55 item 4: a fresh clone's `make demo` and the demo's step, before and after, in one script run:

    .venv/bin/python bench/bench_fresh_demo.py --before c1f1cdc --after HEAD   # ~25 min on 2 cores

Each commit is cloned afresh into a temporary folder (no venv, no data, no run) and `make demo` runs there as a
user's first command does: the venv installed, the data written, both stages trained, evaluated and exported. Per
commit: the wall clock and CPU of `make demo`, the seconds its install took (until make's install target marks the
venv installed), each stage's training seconds and step (the run's metrics.jsonl: a stage's last record's
samples over its samples/s, per step), the wall of the rest (start-up, evaluations, probe, export), and the final
zero-shot top-1. The runs go one after the other (before first; `--rounds 2` adds after, before). Output:
bench/out/fresh_demo/ (each run's console and results.json) and BENCHMARKS.md's `fresh-demo` section unless
--no-write.
"""
from __future__ import annotations

import argparse
import json
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "bench" / "out" / "fresh_demo"
sys.path.insert(0, str(ROOT / "bench"))
RUN = Path("runs") / "fashion_mnist_demo"   # the demo config's run.output_dir, in the clone
INSTALLED = Path(".venv") / ".installed"   # make's install target touches it last: its mtime ends the install


def clone(commit: str, parent: Path) -> Path:
    tree = parent / f"clone-{commit}"
    subprocess.run(["git", "clone", "-q", str(ROOT), str(tree)], check=True)
    subprocess.run(["git", "-C", str(tree), "checkout", "-q", commit], check=True)
    return tree


def make_demo(tree: Path, log: Path) -> dict:
    """`make demo` in `tree`, its console into `log`: wall, CPU (the children's), seconds the install took."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start_wall, start = time.time(), time.monotonic()
    with log.open("w") as f:
        rc = subprocess.run(["make", "demo"], cwd=tree, stdout=f, stderr=subprocess.STDOUT).returncode
    wall = time.monotonic() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if rc:
        raise RuntimeError(f"make demo failed in {tree} (exit {rc}):\n{log.read_text()[-3000:]}")
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return {"wall_s": wall, "cpu_s": cpu, "install_s": (tree / INSTALLED).stat().st_mtime - start_wall}


def stages(run_dir: Path) -> list[dict]:
    """Per stage: training seconds, steps and seconds a step, from metrics.jsonl."""
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    out = []
    for index in sorted({r["stage_index"] for r in records}):
        recs = [r for r in records if r["stage_index"] == index]
        first, last = recs[0], recs[-1]
        batch = (last["samples_seen"] - first["samples_seen"]) / max(last["step"] - first["step"], 1)
        seconds = last["step"] * batch / last["samples_per_s"]
        out.append({"stage": index, "steps": last["step"], "train_s": seconds, "step_ms": 1e3 * seconds / last["step"]})
    return out


def final_top1(run_dir: Path) -> float | None:
    """The last zero-shot top-1 in results.jsonl (the final model's)."""
    rows = [json.loads(line) for line in (run_dir / "results.jsonl").read_text().splitlines() if line.strip()]
    scores = [r["top1"] for r in rows if isinstance(r.get("top1"), (int, float))]
    return scores[-1] if scores else None


def one_run(commit: str, label: str, parent: Path) -> dict:
    sha = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", commit], capture_output=True, text=True,
                         check=True).stdout.strip()
    tree = clone(sha, parent)
    print(f"[bench] {label} = {sha}: make demo in {tree}", flush=True)
    run = make_demo(tree, OUT / f"{label}-{sha}.log")
    run.update(arm=label, commit=sha, stages=stages(tree / RUN), top1=final_top1(tree / RUN))
    run["rest_s"] = run["wall_s"] - run["install_s"] - sum(s["train_s"] for s in run["stages"])
    shutil.rmtree(tree, ignore_errors=True)   # a clone's venv is ~6 GB
    print(f"[bench] {json.dumps(run)}", flush=True)
    return run


def table(runs: list[dict]) -> str:
    from report import markdown_table

    rows = [[str(i + 1), r["arm"], f"`{r['commit']}`", f"{int(r['wall_s'] // 60)}:{r['wall_s'] % 60:04.1f}",
             f"{r['cpu_s']:.0f}",
             f"{r['install_s']:.0f}", " / ".join(f"{s['train_s']:.0f}" for s in r["stages"]),
             " / ".join(f"{s['step_ms']:.1f}" for s in r["stages"]), f"{r['rest_s']:.0f}",
             f"{100 * r['top1']:.2f}%" if r["top1"] is not None else "-"] for i, r in enumerate(runs)]
    return markdown_table(["run", "arm", "commit", "make demo (m:s)", "CPU (s)", "install (s)", "stages' training (s)",
                           "step (ms, per stage)", "the rest (s)", "final zero-shot top-1"], rows)


def markdown(runs: list[dict], command: str) -> str:
    from report import cpu_model, machine_line

    by_arm = {arm: [r for r in runs if r["arm"] == arm] for arm in ("before", "after")}
    pairs = [{r["arm"]: r for r in runs[i:i + 2]} for i in range(0, len(runs) - 1, 2)]   # back-to-back pairs
    wall = ", ".join(f"{p['after']['wall_s'] / p['before']['wall_s']:.3f}" for p in pairs)
    step = ", ".join(f"{p['after']['stages'][0]['step_ms'] / p['before']['stages'][0]['step_ms']:.3f}" for p in pairs)
    return f"""## Issue 55: a fresh clone's `make demo`, before and after (`bench/bench_fresh_demo.py`)

`{command}`; {machine_line()}, {cpu_model()}. Each commit cloned afresh into a temporary folder (no venv, data or
run) and `make demo` run there, one run after the other (the machine's drift falls on the later one: a pair in the
other order, `--after-first --append`, adds the runs to the table): install (until make marks the venv installed;
uv's cache as the machine had it), the two stages' training (metrics.jsonl) and the rest (system-data check, data
written, start-up, evaluations, the white-box probe, export, exit).

{table(runs)}

After / before, per back-to-back pair: `make demo` {wall}x the wall clock, stage 0's step {step}x; the same commit's
runs differ by up to {_drift(by_arm):.0f}% in stage 0's step (the machine's drift). The issue 53 goal (a fresh \
clone to its result in under 4 minutes on 2 cores) is \
{"met" if max(r["wall_s"] for r in by_arm["after"]) < 240 else "not met"}."""


def section(record: dict) -> str:
    """The section of a results.json record: every run, under the commands that made them."""
    return markdown(record["runs"], "`; then `".join(record["commands"]))


def _drift(by_arm: dict) -> float:
    """The largest spread (%) of stage 0's step between runs of one commit."""
    steps = [[r["stages"][0]["step_ms"] for r in rs] for rs in by_arm.values() if len(rs) > 1]
    return max((100 * (max(s) / min(s) - 1) for s in steps), default=0.0)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--before", default="c1f1cdc", help="commit before the change (default: %(default)s)")
    p.add_argument("--after", default="HEAD", help="commit after it (default: %(default)s)")
    p.add_argument("--rounds", type=int, default=1, help="1: before, after; 2: before, after, after, before")
    p.add_argument("--after-first", action="store_true", help="each round's pair in the other order: after, before")
    p.add_argument("--append", action="store_true", help="add the runs to results.json's and write the section from "
                                                         "all of them (a later pair in the other order)")
    p.add_argument("--no-write", action="store_true", help="results.json only, BENCHMARKS.md untouched")
    p.add_argument("--from-json", action="store_true", help="the section again from bench/out/fresh_demo/results.json")
    args = p.parse_args()
    from report import print_section   # torch with it: after the arguments

    if args.from_json:
        record = json.loads((OUT / "results.json").read_text())
        print_section("fresh-demo", section(record), args.no_write)
        return 0
    OUT.mkdir(parents=True, exist_ok=True)
    order = [("before", args.before), ("after", args.after)][::-1 if args.after_first else 1]
    plan = [pair for i in range(args.rounds) for pair in (order if i % 2 == 0 else order[::-1])]
    with tempfile.TemporaryDirectory(prefix="fresh-demo-") as tmp:
        runs = [one_run(commit, label, Path(tmp)) for label, commit in plan]
    command = (f".venv/bin/python bench/bench_fresh_demo.py --before {args.before} --after {args.after}"
               + (f" --rounds {args.rounds}" if args.rounds != 1 else "")
               + (" --after-first" if args.after_first else "") + (" --append" if args.append else ""))
    record = {"commands": [command], "runs": runs}
    if args.append:
        kept = json.loads((OUT / "results.json").read_text())
        record = {"commands": kept["commands"] + [command], "runs": kept["runs"] + runs}
    (OUT / "results.json").write_text(json.dumps(record, indent=1))
    print_section("fresh-demo", section(record), args.no_write)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
