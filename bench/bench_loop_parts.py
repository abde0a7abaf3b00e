"""Issue 52 item 6: the stage loop as parts is no slower. bench/bench_open_clip_train.py's two arms, crate-clip
(the demo's model and DeepSpeed settings, `crate-clip train --nproc 2`, 60 steps) and open_clip_train, with
crate-clip run from two commits, in one script run:

    .venv/bin/python bench/bench_loop_parts.py --before 28e766c --after HEAD     # ~1 min a round on 2 cores

- Each commit is checked out as a git worktree in a temporary folder (removed at the end), with the links that
  make its packages importable by path (crate_clip/data -> data_pipelines, crate_clip/eval, crate_clip/configs)
  and its .venv -> this checkout's venv. Its runs start with PYTHONPATH=<tree> and cwd=<tree>, which come before
  the venv's editable finder (that maps crate_clip to this checkout), so the launcher and its torchrun ranks
  (`python -m ...`) import the commit's code, not this working tree's; each run records which file it imported.
- open_clip_train is bench_open_clip_train's arm as it is (its side venv and entry script); the crate_clip it
  imports for the model's registration is the "before" tree's.
- Rounds alternate the order: before, after, open_clip_train, then open_clip_train, after, before, ... so that
  before and after are back to back in every round. Per round: after / before of the steady-state samples/s (the
  goal: >= 0.98), of step time and of CPU a step, and crate-clip / open_clip_train for each commit. Each run
  records the CPU the rest of the machine used meanwhile, as bench_open_clip_train does.
- Output under bench/out/loop_parts/ (each run's console and run folder, runs.jsonl as they end, results.json);
  the section `loop-parts` of BENCHMARKS.md unless --no-write.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "bench" / "out" / "loop_parts"
sys.path.insert(0, str(ROOT / "bench"))
import bench_open_clip_train as oct_bench  # noqa: E402
from report import cpu_model, machine_line, markdown_table, write_section  # noqa: E402

# what the editable install maps into crate_clip, as links inside a worktree
PACKAGE_LINKS = {"crate_clip/data": "../data_pipelines", "crate_clip/eval": "../eval",
                 "crate_clip/configs": "../configs"}
OPEN_CLIP = "open_clip_train"
HEADING = "Issue 52: the stage loop as parts, no slower"


# ------------------------------------------------------------------------------------------------- the trees
def add_tree(commit: str, parent: Path, name: str) -> dict:
    """A detached worktree of `commit` whose packages import by path; its name, commit and folder."""
    sha = subprocess.run(["git", "-C", str(ROOT), "rev-parse", commit], check=True, capture_output=True,
                         text=True).stdout.strip()
    tree = parent / name
    subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", str(tree), sha], check=True,
                   capture_output=True)
    for link, target in PACKAGE_LINKS.items():
        (tree / link).symlink_to(target)
    (tree / ".venv").symlink_to(ROOT / ".venv")
    return {"name": name, "commit": sha, "tree": tree}


def remove_tree(tree: Path) -> None:
    subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(tree)], check=False)


def tree_env(tree: Path) -> dict:
    """bench_open_clip_train's environment with the tree first on the path."""
    return {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", "PYTHONPATH": str(tree)}


def imported_from(tree: Path) -> str:
    """The stage loop's file a process started like the tree's runs imports (the check that the tree is used)."""
    probe = "import crate_clip.train.loop.stage_loop as m; print(m.__file__)"
    return subprocess.run([str(ROOT / ".venv" / "bin" / "python"), "-c", probe], cwd=tree, env=tree_env(tree),
                          check=True, capture_output=True, text=True).stdout.strip()


def tree_deepspeed(tree: Path) -> dict:
    """The tree's demo config's deepspeed section (a DeepSpeed file it names made absolute)."""
    demo = tree / "configs" / "demo" / "fashion_mnist.yaml"
    section = dict(yaml.safe_load(demo.read_text())["deepspeed"])
    if section.get("config"):
        section["config"] = str((demo.parent / section["config"]).resolve())
    return section


# ------------------------------------------------------------------------------------------------- the runs
def run_crate_clip(arm: dict, work: Path, steps: int) -> dict:
    """bench_open_clip_train's crate-clip arm with the tree's code and the tree's demo DeepSpeed settings."""
    config = oct_bench.crate_clip_config(work / "run", steps)
    config["deepspeed"] = tree_deepspeed(arm["tree"])
    (work / "config.yaml").write_text(json.dumps(config))   # JSON is YAML
    result = oct_bench.run_arm(arm["name"], oct_bench.crate_clip_command(work / "config.yaml"),
                               tree_env(arm["tree"]), arm["tree"], work / "output.log")
    result["points"] = oct_bench.crate_clip_points(work / "run")
    return result


def run_open_clip(baseline_py: Path, tree: Path, work: Path, steps: int) -> dict:
    """bench_open_clip_train's open_clip_train arm (cwd = its work folder, where it writes ./logs)."""
    return oct_bench.run_arm(OPEN_CLIP, oct_bench.open_clip_command(baseline_py, steps), tree_env(tree), work,
                             work / "output.log")


def round_order(index: int) -> list[str]:
    """before, after, open_clip_train in even rounds, the reverse in odd ones."""
    order = ["before", "after", OPEN_CLIP]
    return order if index % 2 == 0 else order[::-1]


# ------------------------------------------------------------------------------------------------- report
def _ratio(a: dict, b: dict, key: str) -> float:
    return a[key] / b[key]


def round_rows(runs: list[dict], rounds: int) -> list[list[str]]:
    """Per round: after / before and each commit against open_clip_train."""
    rows = []
    for i in range(rounds):
        by_arm = {r["arm"]: r for r in runs if r["round"] == i}
        before, after, oc = by_arm["before"], by_arm["after"], by_arm[OPEN_CLIP]
        load = max(r["others_cores"] for r in by_arm.values())
        rows.append([f"{i + 1} ({' '.join(round_order(i)).replace(OPEN_CLIP, 'oct')})",
                     f"{_ratio(after, before, 'samples_per_s'):.3f}", f"{_ratio(after, before, 'step_ms'):.3f}",
                     f"{_ratio(after, before, 'cpu_ms_per_step'):.3f}",
                     f"{_ratio(before, oc, 'samples_per_s'):.2f}", f"{_ratio(after, oc, 'samples_per_s'):.2f}",
                     f"{_ratio(before, oc, 'cpu_ms_per_step'):.2f}", f"{_ratio(after, oc, 'cpu_ms_per_step'):.2f}",
                     f"{load:.2f}"])
    return rows


def _span(values: list[float]) -> str:
    """Range, geometric mean and the standard error of that mean (from the rounds' spread of log ratios)."""
    logs = [math.log(v) for v in values]
    error = statistics.stdev(logs) / math.sqrt(len(logs)) if len(logs) > 1 else float("nan")
    return (f"{min(values):.3f}-{max(values):.3f} over {len(values)} rounds (geometric mean "
            f"{statistics.geometric_mean(values):.3f}, standard error {100 * error:.1f}%)")


def _ends(runs: list[dict]) -> str:
    """Each arm's median launch to first step, last step to exit and wall (s)."""
    parts = []
    for arm in ("before", "after", OPEN_CLIP):
        mine = [r for r in runs if r["arm"] == arm]
        parts.append(f"{arm} {statistics.median(r['first_step_s'] for r in mine):.1f} / "
                     f"{statistics.median(r['exit_after_s'] for r in mine):.1f} / "
                     f"{statistics.median(r['wall_s'] for r in mine):.1f}")
    return "; ".join(parts)


def markdown(runs: list[dict], trees: list[dict], rounds: int, command: str, steps: int,
             heading: str = HEADING) -> str:
    per_run = markdown_table(
        ["run", "round", "arm", "samples/s", "step (ms)", "CPU a step (ms)", "window (steps)", "wall (s)",
         "launch to 1st step (s)", "last step to exit (s)", "rest of machine (cores busy)"],
        [[str(i + 1), str(r["round"] + 1), r["arm"], f"{r['samples_per_s']:.1f}", f"{r['step_ms']:.0f}",
          f"{r['cpu_ms_per_step']:.0f}", f"{r['window_steps']:.0f}", f"{r['wall_s']:.1f}",
          f"{r['first_step_s']:.1f}", f"{r['exit_after_s']:.1f}", f"{r['others_cores']:.2f}"]
         for i, r in enumerate(runs)])
    rows = round_rows(runs, rounds)
    per_round = markdown_table(
        ["round (order)", "after / before samples/s", "step time", "CPU a step", "before / oct samples/s",
         "after / oct samples/s", "before / oct CPU a step", "after / oct CPU a step", "rest of machine (max)"], rows)
    speed, cpu, before_oc, after_oc = ([float(r[i]) for r in rows] for i in (1, 3, 4, 5))
    commits = ", ".join(f"{t['name']} = `{t['commit'][:7]}`" for t in trees)
    return f"""## {heading} (`bench/bench_loop_parts.py`)

`{command}`; {machine_line()}, {cpu_model()}, {os.cpu_count()} cores (what the rest of the machine kept busy: the last column). Commits: {commits}, each
run from its own worktree (PYTHONPATH and cwd = the tree). Each run is bench_open_clip_train's arm as it is:
crate-clip trains `{oct_bench.MODEL}` at {oct_bench.IMAGE_SIZE} px, fp32, global batch {oct_bench.GLOBAL_BATCH}
on {oct_bench.NPROC} processes with the demo's DeepSpeed settings (from each tree's demo config), {steps} steps;
oct = open_clip_train on the same data and schedule. Samples/s and step time: wall clock from step
{oct_bench.WARM_STEPS} to the last step on the trainer's own log points; CPU a step: the whole job's CPU over
that window.

{per_run}

Per round (before and after back to back; above 1 in samples/s is the first named faster):

{per_round}

After / before samples/s {_span(speed)} (goal >= 0.98); CPU a step {_span(cpu)}.
crate-clip / open_clip_train samples/s: before {_span(before_oc)}; after {_span(after_oc)}.
Launch to the end of the first step / last step to exit / wall, medians in s (the first step: the step-
{oct_bench.WARM_STEPS} log point less the steps after the first at the steady step time, alike for all arms):
{_ends(runs)}."""


# ------------------------------------------------------------------------------------------------- main
def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--before", default="28e766c", help="commit before the change (default: %(default)s)")
    parser.add_argument("--after", default="HEAD", help="commit after it (default: %(default)s)")
    parser.add_argument("--rounds", type=int, default=4, help="rounds of the three runs, order alternating")
    parser.add_argument("--steps", type=int, default=oct_bench.STEPS, help="steps a run (default: %(default)s)")
    parser.add_argument("--no-write", action="store_true", help="print the section, leave BENCHMARKS.md alone")
    parser.add_argument("--section", default="loop-parts", help="BENCHMARKS.md section to write (default: %(default)s)")
    parser.add_argument("--heading", default=HEADING, help="the section's heading")
    args = parser.parse_args()
    OUT.mkdir(parents=True, exist_ok=True)
    oct_bench.make_shards()
    from bench_data import throwaway_venv
    baseline_py = throwaway_venv("venv-wds0286", ["pandas", "webdataset==0.2.86"])
    parent = Path(tempfile.mkdtemp(prefix="bench_loop_parts_"))
    trees = []
    try:
        trees = [add_tree(args.before, parent, "before"), add_tree(args.after, parent, "after")]
        runs = measure(trees, baseline_py, args.rounds, args.steps)
    finally:
        for tree in trees:
            remove_tree(tree["tree"])
        shutil.rmtree(parent, ignore_errors=True)
    command = (f".venv/bin/python bench/bench_loop_parts.py --before {trees[0]['commit'][:7]} "
               f"--after {trees[1]['commit'][:7]} --rounds {args.rounds}")
    command += f" --steps {args.steps}" if args.steps != oct_bench.STEPS else ""
    command += f" --section {args.section} --heading '{args.heading}'" if args.section != "loop-parts" else ""
    (OUT / "results.json").write_text(json.dumps(
        {"command": command, "trees": [{k: str(v) for k, v in t.items()} for t in trees], "runs": runs}, indent=1))
    text = markdown(runs, trees, args.rounds, command, args.steps, args.heading)
    print(text)
    if not args.no_write:
        write_section(args.section, text)
    return 0


def measure(trees: list[dict], baseline_py: Path, rounds: int, steps: int) -> list[dict]:
    """All rounds' runs, each with its steady state, in the order they ran."""
    by_name = {t["name"]: t for t in trees}
    for tree in trees:
        tree["stage_loop"] = imported_from(tree["tree"])
        if not tree["stage_loop"].startswith(str(tree["tree"])):
            raise SystemExit(f"{tree['name']}: imports {tree['stage_loop']}, not the tree's")
    (OUT / "runs.jsonl").unlink(missing_ok=True)
    runs = []
    for index in range(rounds):
        for name in round_order(index):
            work = OUT / f"{len(runs) + 1}-{name}"
            shutil.rmtree(work, ignore_errors=True)   # this bench's own earlier output
            work.mkdir(parents=True)
            if name == OPEN_CLIP:
                result = run_open_clip(baseline_py, trees[0]["tree"], work, steps)
            else:
                result = run_crate_clip(by_name[name], work, steps)
            result.update(oct_bench.steady_state(result.pop("points"), result.pop("cpu_series"),
                                                 result["launch_time"], result["exit_time"]))
            result["round"] = index
            print(json.dumps(result), flush=True)
            with open(OUT / "runs.jsonl", "a") as kept:   # each run as it ends: a stopped bench keeps its runs
                kept.write(json.dumps(result) + "\n")
            runs.append(result)
    return runs


if __name__ == "__main__":
    sys.exit(main())
