"""crate-clip beside open_clip_train (issue 40): the same model, shards, global batch, precision, steps, lr schedule
and loader workers, trained by `python -m open_clip_train.main` (the open_clip_torch wheel's trainer; torchrun,
DDP) and by `crate-clip train --nproc 2` (its own launcher; DeepSpeed at the demo's ZeRO stage), two CPU processes
each. Writes the `open-clip-train` section of BENCHMARKS.md.

    .venv/bin/python bench/bench_open_clip_train.py          # ~4-5 min on 2 cores (shards and baseline venv: once)
    .venv/bin/python bench/bench_open_clip_train.py --wide   # the wider tower (~12 min; section open-clip-train-wide)

- Model: `CRATE-alpha-CLIPA-tiny`, the demo's, as registered with open_clip after `import crate_clip`, at its
  config's geometry (28 px, patch 4: 49 tokens), context 16, fp32. The demo's 21 px / patch-7 stage is not
  comparable: open_clip_train cannot change a tower's patch size (crate-clip PI-resizes the kernel at stage start).
  `--wide`: `CRATE-alpha-CLIP-B-16` (the CRATE-alpha B/16 image tower, width 768, 12 blocks, and open_clip's
  12-layer text tower of width 512) at 64 px / patch 16 (16 tokens), global batch 32, lr 5e-4; open_clip_train
  then saves its final checkpoint, as crate-clip does (at this size the save is most of the exit).
- Data: Fashion-MNIST's 60,000 training images as DataComp-layout shards (`crate-clip shards fashion-mnist`, 10
  shards), read in resampled mode by both, 1 DataLoader worker a rank, no crop (scale 1.0), ImageNet/OpenAI
  normalisation as each trainer does it.
- open_clip_train runs in bench/out/venv-wds0286 (the main venv's packages plus webdataset 0.2.86 and pandas): its
  data code fails with webdataset >= 1.0 and imports pandas (bench/bench_data.py says why); the launcher
  bench/open_clip_train_entry.py imports crate_clip first and lets its CPU DDP accept `device_ids=[cpu]`.
- Throughput and step time: wall clock over the steady-state window, from the first log point at or after step
  WARM_STEPS to the last step, from each trainer's own log points (open_clip_train's "Train Epoch" lines, time-
  stamped as they arrive; crate-clip's metrics.jsonl `time`). Wall: launch to exit (crate-clip's also saves its
  final checkpoint, the open_clip export and the plot; open_clip_train is told to save nothing).
- Memory: every process of the job is sampled every 0.2 s (psutil RSS); "ranks" is the sum of each training
  process's peak, "job" the peak of the whole tree's sum at one instant (launcher and loader workers included;
  RSS counts pages shared by forked workers once per process).
- Load: the arms alternate A B B A (the machine is shared); each run records the CPU the rest of the machine used
  meanwhile (/proc/stat busy time minus the job's own CPU time).
"""
from __future__ import annotations

import argparse
import json
import os
import re
import resource
import shutil
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "bench" / "out" / "open_clip_train"
SHARDS = ROOT / "bench" / "out" / "fashion_mnist_shards"
SHARD_PATTERN = str(SHARDS / "{00000000..00000009}.tar")
sys.path.insert(0, str(ROOT / "bench"))
from demo_runs import demo_deepspeed  # noqa: E402

MODEL = "CRATE-alpha-CLIPA-tiny"
IMAGE_SIZE, PATCH, CONTEXT = 28, 4, 16
GLOBAL_BATCH, NPROC, WORKERS = 64, 2, 1
STEPS, WARM_STEPS, LOG_EVERY = 60, 10, 10
LR, WARMUP, WD = 2e-3, 10, 0.1
SAVES = False   # open_clip_train saves its final checkpoint (at the wide tower the save is most of the exit)
# --wide rebinds these module settings before anything runs (the arms and the section read them)
WIDE = dict(MODEL="CRATE-alpha-CLIP-B-16", IMAGE_SIZE=64, PATCH=16, GLOBAL_BATCH=32, LR=5e-4, SAVES=True)
WIDE_STEPS = 30
SAMPLE_EVERY_S = 0.2
OPEN_CLIP_LINE = re.compile(r"Train Epoch: \d+ \[\s*(\d+)/\s*\d+")


# ------------------------------------------------------------------------------------------------- the two arms
def make_shards() -> None:
    """Fashion-MNIST's training set as 10 DataComp-layout shards of 6,000 (once)."""
    if (SHARDS / "00000009.tar").exists():
        return
    subprocess.run([str(ROOT / ".venv" / "bin" / "crate-clip"), "shards", "fashion-mnist", "--out", str(SHARDS),
                    "--samples-per-shard", "6000", "--no-progress"], check=True, stdout=subprocess.DEVNULL)


def open_clip_command(py: Path, steps: int, compiled: bool = False, saves: bool = False) -> list[str]:
    """torchrun + open_clip_train.main with the shared settings (no evaluation; no checkpoint unless `saves`: its
    final one, --save-frequency 1); `compiled`: its --torchcompile (torch.compile of the whole model)."""
    return [str(py), "-m", "torch.distributed.run", "--nproc_per_node", str(NPROC),
            str(ROOT / "bench" / "open_clip_train_entry.py"),
            "--model", MODEL, "--train-data", SHARD_PATTERN, "--dataset-type", "webdataset", "--dataset-resampled",
            "--train-num-samples", str(steps * GLOBAL_BATCH), "--epochs", "1",
            "--batch-size", str(GLOBAL_BATCH // NPROC), "--workers", str(WORKERS), "--precision", "fp32",
            "--lr", str(LR), "--warmup", str(WARMUP), "--wd", str(WD), "--beta1", "0.9", "--beta2", "0.95",
            "--eps", "1e-6", "--grad-clip-norm", "1.0", "--force-image-size", str(IMAGE_SIZE),
            "--force-context-length", str(CONTEXT), "--aug-cfg", "scale=(1.0,1.0)",
            "--save-frequency", "1" if saves else "0", "--zeroshot-frequency", "0",
            "--log-every-n-steps", str(LOG_EVERY), "--seed", "0",
            "--dist-backend", "gloo", "--device", "cpu", "--name", "run"] + (["--torchcompile"] if compiled else [])


def crate_clip_config(run_dir: Path, steps: int, compiled: bool = False) -> dict:
    """The same run as a crate-clip config: one stage, the demo's DeepSpeed settings, no evaluation, no
    diagnostics."""
    return {
        "run": {"name": "bench-open-clip-train", "output_dir": str(run_dir), "seed": 0},
        "model": {"name": MODEL, "compile": compiled},
        "data": {"sources": [SHARD_PATTERN], "mode": "resampled", "num_workers": WORKERS, "crop_scale": [1.0, 1.0]},
        "stages": [{"name": "s0", "image_size": IMAGE_SIZE, "context_length": CONTEXT, "global_batch": GLOBAL_BATCH,
                    "samples": steps * GLOBAL_BATCH, "lr": LR, "warmup_steps": WARMUP, "weight_decay": WD}],
        "optimizer": {"betas": [0.9, 0.95], "eps": 1e-6, "grad_clip": 1.0},
        "precision": "fp32",
        "deepspeed": demo_deepspeed(),
        "eval": {"evals": []},
        "logging": {"every_steps": LOG_EVERY, "diagnostics_every": 0},
    }


def crate_clip_command(config: Path) -> list[str]:
    return [str(ROOT / ".venv" / "bin" / "crate-clip"), "train", "--nproc", str(NPROC), "--config", str(config)]


# ------------------------------------------------------------------------------------------------- measuring
class TreeMemory:
    """Samples the RSS of a process and all its descendants until stopped; per-process peaks and the tree's peak."""

    def __init__(self, pid: int):
        self.root = psutil.Process(pid)
        self.peaks: dict[int, int] = {}
        self.roles: dict[int, str] = {}
        self.tree_peak = 0
        self.cpu_series: list[tuple[float, float]] = []   # (wall time, CPU seconds of the live tree)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _role(self, proc: psutil.Process) -> str:
        """'rank': a training process (RANK set, its parent's not), 'helper': its loader workers and the like,
        'launcher': the rest."""
        try:
            if "RANK" not in proc.environ():
                return "launcher"
            return "helper" if "RANK" in proc.parent().environ() else "rank"
        except (psutil.Error, AttributeError):
            return "helper"

    def _run(self) -> None:
        while not self._stop.is_set():
            total, cpu = 0, 0.0
            try:
                procs = [self.root, *self.root.children(recursive=True)]
            except psutil.Error:
                procs = []
            for proc in procs:
                try:
                    rss, times = proc.memory_info().rss, proc.cpu_times()
                except psutil.Error:
                    continue
                total += rss
                cpu += times.user + times.system
                self.peaks[proc.pid] = max(self.peaks.get(proc.pid, 0), rss)
                if proc.pid not in self.roles:
                    self.roles[proc.pid] = self._role(proc)
            self.tree_peak = max(self.tree_peak, total)
            self.cpu_series.append((time.time(), cpu))
            self._stop.wait(SAMPLE_EVERY_S)

    def stop(self) -> dict:
        self._stop.set()
        self._thread.join()
        ranks = [peak for pid, peak in self.peaks.items() if self.roles.get(pid) == "rank"]
        return {"ranks": len(ranks), "ranks_peak_sum_gib": sum(ranks) / 2 ** 30,
                "job_peak_gib": self.tree_peak / 2 ** 30,
                "cpu_series": self.cpu_series}


def _busy_cpu_s() -> float:
    """Seconds of CPU the whole machine has spent busy since boot (/proc/stat)."""
    fields = [int(v) for v in Path("/proc/stat").read_text().splitlines()[0].split()[1:]]
    user, nice, system, _idle, _iowait, irq, softirq, steal = fields[:8]
    return (user + nice + system + irq + softirq + steal) / os.sysconf("SC_CLK_TCK")


def _children_cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def run_arm(name: str, command: list[str], env: dict, cwd: Path, log_file: Path) -> dict:
    """Run one training job to the end: its log points (samples, wall time), memory, CPU and wall time."""
    busy0, cpu0, t0 = _busy_cpu_s(), _children_cpu_s(), time.time()
    proc = subprocess.Popen(command, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            bufsize=1)
    memory = TreeMemory(proc.pid)
    points = []
    with open(log_file, "w") as log:
        for line in proc.stdout:
            log.write(line)
            found = OPEN_CLIP_LINE.search(line)
            if found:
                points.append((int(found.group(1)), time.time()))
    code = proc.wait()
    wall = time.time() - t0
    mem = memory.stop()
    own_cpu = _children_cpu_s() - cpu0
    others = max(0.0, _busy_cpu_s() - busy0 - own_cpu) / wall
    if code != 0:
        raise SystemExit(f"{name} exited {code}; its output: {log_file}")
    return {"arm": name, "points": points, "wall_s": wall, "cpu_s": own_cpu, "others_cores": others,
            "launch_time": t0, "exit_time": t0 + wall, **mem}


def crate_clip_points(run_dir: Path) -> list[tuple[int, float]]:
    """(samples seen, wall time) of each metrics.jsonl step row."""
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return [(r["samples_seen"], r["time"]) for r in rows if "samples_seen" in r and "time" in r]


def _cpu_at(series: list[tuple[float, float]], t: float) -> float:
    """The job's CPU seconds at wall time t (the last sample at or before it)."""
    return max((cpu for when, cpu in series if when <= t), default=0.0)


def steady_state(points: list[tuple[int, float]], cpu_series: list[tuple[float, float]], launch_time: float,
                 exit_time: float) -> dict:
    """Samples/s, step time and the job's CPU time a step, from the first log point at or after WARM_STEPS to the
    last one. CPU a step barely moves with the machine's load, wall time does. The ends: launch to the end of the
    first step (the window's first log point less its steps after the first at the steady step time: both trainers
    alike, though only open_clip_train logs its first step) and the last step's log point to exit."""
    window = [p for p in points if p[0] >= WARM_STEPS * GLOBAL_BATCH]
    (s0, t0), (s1, t1) = window[0], window[-1]
    steps = (s1 - s0) / GLOBAL_BATCH
    step_s = (t1 - t0) / steps
    cpu = _cpu_at(cpu_series, t1) - _cpu_at(cpu_series, t0)
    return {"samples_per_s": (s1 - s0) / (t1 - t0), "step_ms": 1000 * step_s, "window_steps": steps,
            "cpu_ms_per_step": 1000 * cpu / steps,
            "first_step_s": t0 - launch_time - (s0 / GLOBAL_BATCH - 1) * step_s, "exit_after_s": exit_time - t1}


# ------------------------------------------------------------------------------------------------- report
def _ratio_rows(runs: list[dict]) -> list[list[str]]:
    """Per A/B pair: crate-clip / open_clip_train for throughput, step time and memory."""
    rows = []
    for pair in range(len(runs) // 2):
        a, b = runs[2 * pair], runs[2 * pair + 1]
        cc, oc = (a, b) if a["arm"] == "crate-clip" else (b, a)
        rows.append([f"{pair + 1} ({a['arm']} first)", f"{cc['samples_per_s'] / oc['samples_per_s']:.2f}",
                     f"{cc['step_ms'] / oc['step_ms']:.2f}", f"{cc['cpu_ms_per_step'] / oc['cpu_ms_per_step']:.2f}",
                     f"{cc['cpu_s'] / oc['cpu_s']:.2f}",
                     f"{cc['ranks_peak_sum_gib'] / oc['ranks_peak_sum_gib']:.2f}",
                     f"{cc['job_peak_gib'] / oc['job_peak_gib']:.2f}", f"{cc['wall_s'] / oc['wall_s']:.2f}"])
    return rows


def markdown(runs: list[dict], command: str, steps: int, compiled: bool = False) -> str:
    from report import cpu_model, machine_line, markdown_table
    per_run = markdown_table(
        ["run", "trainer", "samples/s", "step (ms)", "CPU a step (ms)", "window (steps)", "CPU (s)",
         "ranks' peak RSS (GiB)", "job peak RSS (GiB)", "wall (s)", "launch to 1st step (s)", "last step to exit (s)",
         "rest of machine (cores busy)"],
        [[str(i + 1), r["arm"], f"{r['samples_per_s']:.1f}", f"{r['step_ms']:.0f}", f"{r['cpu_ms_per_step']:.0f}",
          f"{r['window_steps']:.0f}", f"{r['cpu_s']:.1f}", f"{r['ranks_peak_sum_gib']:.2f}", f"{r['job_peak_gib']:.2f}",
          f"{r['wall_s']:.1f}", f"{r['first_step_s']:.1f}", f"{r['exit_after_s']:.1f}", f"{r['others_cores']:.2f}"]
         for i, r in enumerate(runs)])
    ratios = _ratio_rows(runs)
    ratio_table = markdown_table(
        ["pair", "samples/s", "step time", "CPU a step", "CPU (whole run)", "ranks' peak RSS", "job peak RSS", "wall"],
        ratios)
    speed, cpu, mem = ([float(r[i]) for r in ratios] for i in (1, 3, 5))
    busiest = max(r["others_cores"] for r in runs)
    load = ("The rest of the machine was idle in every run (at most "
            f"{busiest:.2f} cores busy), so the wall-clock ratios are the trainers' own." if busiest < 0.25 else
            "On a machine this busy the wall-clock ratios move with the other jobs' load; CPU a step does not.")
    heading = ("Issue 55: crate-clip beside open_clip_train, both compiled" if compiled else
               "Issue 40: crate-clip beside open_clip_train")
    if MODEL != "CRATE-alpha-CLIPA-tiny":
        heading = f"Issue 55: crate-clip beside open_clip_train, a wider tower ({MODEL} at {IMAGE_SIZE} px)" + (
            ", both compiled" if compiled else "")
    both = (" Both compiled: open_clip_train with its `--torchcompile` (torch.compile of the whole model), crate-clip "
            "with `model.compile: true` (both towers); the window from step 10 leaves the compile out, launch to "
            "exit holds it." if compiled else "")
    saves = "; open_clip_train saves its final checkpoint too (--save-frequency 1)" if SAVES else ""
    return f"""## {heading} (`bench/bench_open_clip_train.py`)

`{command}`; {machine_line()}, {cpu_model()}, {os.cpu_count()} cores shared with other jobs (last column); each rank and
loader worker runs 1 torch thread (OMP_NUM_THREADS=1, what torchrun sets by default).
Both train `{MODEL}` ({"the demo's model" if MODEL == "CRATE-alpha-CLIPA-tiny" else "a wider tower"}, from \
crate-clip's open_clip config) at {IMAGE_SIZE} px / patch {PATCH} and
context {CONTEXT}, fp32, global batch {GLOBAL_BATCH} ({NPROC} processes x {GLOBAL_BATCH // NPROC}), {steps} steps,
AdamW (lr {LR:g}, {WARMUP} warm-up steps, cosine, wd {WD}, betas 0.9/0.95, clip 1.0), {WORKERS} loader worker a
rank, resampled reading of the same 10 Fashion-MNIST DataComp-layout shards, no crop. open_clip_train: torchrun +
DDP (gloo) in a venv with webdataset 0.2.86 (its data code fails with >= 1.0); crate-clip: `crate-clip train
--nproc 2`, DeepSpeed ZeRO-{demo_deepspeed()["zero_stage"]} with fused AdamW (the demo's settings), TensorBoard and
metrics.jsonl on, evaluations and white-box diagnostics off. Samples/s and step time: wall clock from step
{WARM_STEPS} to step {steps} on each trainer's own log points; CPU a step: the whole job's CPU time (ranks and
loader workers) over the same window, which the load of the rest of the machine barely moves; CPU and wall: launch
to exit (crate-clip's include its final checkpoint, export and plot{saves}).{both}

{per_run}

crate-clip / open_clip_train, per back-to-back pair (samples/s: above 1 is crate-clip faster; the rest: below 1
is crate-clip smaller or shorter):

{ratio_table}

Throughput ratio {_span(speed)} (goal >= 1.0), CPU a step {_span(cpu)}, at a ranks' peak RSS ratio of
{_span(mem)}. {load}"""


def _span(values: list[float]) -> str:
    """'a-b (geometric mean g)' of ratios."""
    mean = statistics.geometric_mean(values)
    return f"{min(values):.2f}-{max(values):.2f} (geometric mean {mean:.2f})"


# ------------------------------------------------------------------------------------------------- main
def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=None, help=f"steps a run (default: {STEPS}; --wide {WIDE_STEPS})")
    parser.add_argument("--wide", action="store_true", help="the wider tower (section open-clip-train-wide)")
    parser.add_argument("--pairs", type=int, default=2, help="back-to-back A/B pairs, order alternating")
    parser.add_argument("--no-write", action="store_true", help="print the section, leave BENCHMARKS.md alone")
    parser.add_argument("--compile", action="store_true", help="both compiled: open_clip_train --torchcompile, "
                                                               "crate-clip model.compile: true (section "
                                                               "open-clip-train-compiled)")
    args = parser.parse_args()
    if args.wide:
        globals().update(WIDE)
    args.steps = args.steps or (WIDE_STEPS if args.wide else STEPS)
    if args.steps < WARM_STEPS + 2 * LOG_EVERY:
        parser.error(f"--steps {args.steps}: at least {WARM_STEPS + 2 * LOG_EVERY} (the window starts at step "
                     f"{WARM_STEPS} and needs two log points)")
    from bench_data import throwaway_venv
    from report import write_section

    OUT.mkdir(parents=True, exist_ok=True)
    make_shards()
    baseline_py = throwaway_venv("venv-wds0286", ["pandas", "webdataset==0.2.86"])
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1",
           "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    runs = []
    for pair in range(args.pairs):
        order = ("open_clip_train", "crate-clip") if pair % 2 == 0 else ("crate-clip", "open_clip_train")
        for arm in order:
            work = OUT / f"{len(runs) + 1}-{arm}"
            shutil.rmtree(work, ignore_errors=True)   # this bench's own earlier output
            work.mkdir(parents=True)
            if arm == "open_clip_train":
                # cwd = work: open_clip_train writes ./logs/run there (torchrun's parser takes --logs for its own)
                result = run_arm(arm, open_clip_command(baseline_py, args.steps, args.compile, SAVES), env, work,
                                 work / "output.log")
            else:
                config = work / "config.yaml"   # JSON is YAML
                config.write_text(json.dumps(crate_clip_config(work / "run", args.steps, args.compile)))
                result = run_arm(arm, crate_clip_command(config), env, ROOT, work / "output.log")
                result["points"] = crate_clip_points(work / "run")
            result.update(steady_state(result.pop("points"), result.pop("cpu_series"), result["launch_time"],
                                       result["exit_time"]))
            print(json.dumps(result), flush=True)
            runs.append(result)
    command = ".venv/bin/python bench/bench_open_clip_train.py"
    command += (" --wide" if args.wide else "") + (f" --steps {args.steps}" if args.steps != (
        WIDE_STEPS if args.wide else STEPS) else "") + (" --compile" if args.compile else "")
    text = markdown(runs, command, args.steps, args.compile)
    print(text)
    if not args.no_write:
        write_section("open-clip-train" + ("-wide" if args.wide else "") + ("-compiled" if args.compile else ""), text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
