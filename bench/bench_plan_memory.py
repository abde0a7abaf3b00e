"""The plan held against measurement: `crate-clip plan`'s process memory a rank and host memory a node vs a real
CPU training run (issue 40 item 5).

What is compared (the definitions `crate-clip plan` prints, planner.MEMORY_TERMS):
- process memory (a rank): the most one training process holds while it trains a stage, on the device it trains
  on: its runtime (CPU: interpreter, torch, DeepSpeed and the run's modules; GPU: the CUDA context), the state
  (weights, gradients, optimizer state, DeepSpeed's buffers), the step's activations and logits, and the rank
  batch it holds. Measured: the trainer's resident memory, sampled every millisecond from its first step to its
  final checkpoint; also shown above the trainer's resident memory when it builds the stage's model (what the
  planner's state, activations and the runtime's later part must predict);
- host memory (a node's loaders): what the data loaders hold besides the ranks' processes: every DataLoader
  worker's memory (a base, its streams' shuffle buffers, the item it builds) and the batches in flight to the
  ranks. Measured every 0.2 s (plus the time a sample takes), peak of the sum: the physical pages the workers map
  and the trainer does not (/proc/PID/pagemap: a worker's own pages, and the trainer's pages of before the fork
  that only workers still hold, each counted once however many workers share it; the workers' USS would miss pages
  two workers share, and PSS splits the libraries' pages with every process of the machine), plus the
  shared-memory batches the workers have sent and the trainer not yet taken (the /dev/shm files they hold open).

Each config is one real `crate-clip train` run (one stage, one rank, CPU, fp32, DeepSpeed ZeRO-2 as the demo
trains; evaluations and diagnostics off) in a fresh process, observed from inside (crate_clip.train.cli.main with
the trainer's functions wrapped to mark the phases; nothing replaced), long enough that every shuffle buffer
fills. glibc returns its large blocks on free (MALLOC_MMAP_THRESHOLD_=65536, as a GPU's caching allocator reuses
its blocks): with glibc's default dynamic threshold the freed activations of a step stay in the heap and the
peak grows with them (--malloc default measures that). The planned side is the planner's own numbers for the
same config, with the raw sample size of these shards (RAW_SAMPLE_BYTES is DataComp's).
Shards: Fashion-MNIST pictures as 256 px JPEGs (q90) with captions, 1,000 a shard, 8 shards a group (a group holds
more samples than a buffer: the buffers fill).

    .venv/bin/python bench/bench_plan_memory.py                 # the table: three real training runs
    .venv/bin/python bench/bench_plan_memory.py --case larger   # one config
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tarfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "bench" / "out" / "plan_memory"
DEMO = ROOT / "configs" / "demo" / "fashion_mnist.yaml"
MiB = 2 ** 20
# (stage keys, data keys, steps): steps enough that the buffers fill (a stream's buffer fills at 2 raw samples a
# yielded one) and the workers run their prefetch ahead
CASES = {
    "demo": ({}, {}, 34),
    "larger": ({"image_size": 63, "patch_size": 9, "global_batch": 256}, {"num_workers": 2, "shuffle_buffer": 1500},
               14),
    "mid": ({"image_size": 42, "patch_size": 7, "global_batch": 128}, {"num_workers": 2, "shuffle_buffer": 1000}, 18),
}


def make_shards(n: int = 4000, per_shard: int = 1000) -> str:
    """Fashion-MNIST as 256 px JPEG shards; returns the brace pattern."""
    from PIL import Image

    from crate_clip.data.shard_writer import write_shards
    from crate_clip.data.sources.fashion_mnist import fashion_mnist_samples

    def samples():
        for s in fashion_mnist_samples("train", limit=n):
            yield {**s, "image": s["image"].convert("RGB").resize((256, 256), Image.BICUBIC)}

    return write_shards(samples(), OUT / "shards", per_shard, max_side=256, quality=90, progress=False)["pattern"]


def raw_sample_bytes(pattern_dir: Path) -> float:
    """Mean bytes of one sample's tar members (what a shuffle buffer holds)."""
    sizes, keys = 0, set()
    for tar in sorted(pattern_dir.glob("*.tar")):
        with tarfile.open(tar) as t:
            for m in t.getmembers():
                sizes += m.size
                keys.add(m.name.split(".")[0])
    return sizes / len(keys)


def sample_object_bytes(shard: Path) -> float:
    """Bytes a raw sample holds in Python besides its members' bytes (the dict, keys, bytes headers): tracemalloc
    over the samples of one shard held at once, as a shuffle buffer holds them (planner.SAMPLE_OBJECT_BYTES)."""
    import gc
    import tracemalloc
    from collections import Counter

    from crate_clip.data.shard_reader import iter_shard_samples

    tracemalloc.start()
    gc.collect()
    before = tracemalloc.get_traced_memory()[0]
    held = list(iter_shard_samples(str(shard), Counter()))
    gc.collect()
    traced = tracemalloc.get_traced_memory()[0] - before
    tracemalloc.stop()
    members = sum(len(v) for sample in held for v in sample.values() if isinstance(v, bytes))
    return (traced - members) / len(held)


def write_config(name: str, pattern: str) -> Path:
    """The demo config reduced to its first stage with the case's keys, evaluations off."""
    import yaml

    stage_keys, data_keys, steps = CASES[name]
    cfg = yaml.safe_load(DEMO.read_text())
    stage = {**cfg["stages"][0], **stage_keys}
    stage.update(samples=steps * stage["global_batch"], warmup_steps=2)
    cfg["stages"] = [stage]
    cfg["data"].update(data_keys, sources=[pattern], shards_per_group=8)
    cfg["eval"]["evals"] = []
    cfg["logging"]["diagnostics_every"] = 0
    cfg["checkpoint"]["every_steps"] = 100000
    cfg["deepspeed"]["config"] = str(ROOT / "configs" / "deepspeed" / "zero2.json")
    cfg["run"]["output_dir"] = str(OUT / f"run_{name}")
    path = OUT / f"{name}.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


# ---------------------------------------------------------------- the child: one observed training run
def resident() -> int:
    return int(open("/proc/self/statm").read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def shm_in_flight(pids: list) -> int:
    """Bytes of the shared-memory batches the workers hold open to send (torch's file_descriptor sharing keeps each
    sent storage's fd in the sender until the receiver takes it): /dev/shm files, each counted once."""
    seen = {}
    for pid in pids:
        try:
            fds = os.listdir(f"/proc/{pid}/fd")
        except OSError:
            continue
        for fd in fds:
            try:
                if os.readlink(f"/proc/{pid}/fd/{fd}").startswith("/dev/shm/"):
                    st = os.stat(f"/proc/{pid}/fd/{fd}")
                    seen[st.st_ino] = st.st_size
            except OSError:
                pass
    return sum(seen.values())


def present_frames(pid: int):
    """The physical page frames `pid` maps (/proc/PID/pagemap, readable with CAP_SYS_ADMIN), as a sorted array."""
    import numpy as np

    page, frames = os.sysconf("SC_PAGE_SIZE"), []
    with open(f"/proc/{pid}/maps") as maps, open(f"/proc/{pid}/pagemap", "rb") as pagemap:
        for line in maps:
            start, end = (int(x, 16) for x in line.split()[0].split("-"))
            try:
                pagemap.seek(start // page * 8)
                entries = np.frombuffer(pagemap.read((end - start) // page * 8), dtype=np.uint64)
            except (OSError, ValueError):   # [vsyscall] and the like
                continue
            present = entries[(entries >> np.uint64(63)) == 1]
            frames.append(present & np.uint64((1 << 55) - 1))
    return np.unique(np.concatenate(frames)) if frames else np.zeros(0, np.uint64)


def loader_pages(trainer: int, workers: list) -> int:
    """Bytes of the pages the workers map and the trainer does not: a worker's own pages and the trainer's pages of
    before the fork that only workers still hold, each page once however many workers share it."""
    import numpy as np

    held = np.unique(np.concatenate([present_frames(w) for w in workers]))
    return int(np.setdiff1d(held, present_frames(trainer), assume_unique=True).size) * os.sysconf("SC_PAGE_SIZE")


def child_run(config: str) -> dict:
    """Train `config` in this process and observe its memory (the trainer's functions wrapped, not replaced)."""
    import psutil

    from crate_clip.train import cli
    from crate_clip.train.loop import stage_loop
    from crate_clip.train.stage_setup import stage_model

    marks, obs = {}, {"window": False, "peak": 0, "host": [], "steps": 0}
    wrapped = {}

    def wrap(owner, name, before):
        original = getattr(owner, name)
        wrapped[(owner, name)] = original

        def call(*args, **kwargs):
            before(*args, **kwargs)
            return original(*args, **kwargs)
        setattr(owner, name, call)

    def on_build(*args, **kwargs):
        if kwargs.get("train", True):
            marks.setdefault("model_build", resident())

    def on_train_stage(*args, **kwargs):
        marks["steps_start"] = resident()
        obs["window"] = True

    def on_save(*args, **kwargs):
        obs["window"] = False
        marks["final_save"] = resident()

    def on_step(*args, **kwargs):
        obs["steps"] += 1

    wrap(stage_model.ResolvedStage, "build_model", on_build)
    wrap(stage_loop, "train_stage", on_train_stage)
    wrap(stage_loop, "_save", on_save)
    wrap(stage_loop, "train_step", on_step)
    me, running = psutil.Process(), True

    def sample_trainer():
        while running:
            if obs["window"]:
                obs["peak"] = max(obs["peak"], resident())
            time.sleep(0.001)

    def sample_loaders():
        while running:
            workers = me.children()
            if workers and obs["window"]:
                try:
                    uss = sum(w.memory_full_info().uss for w in workers)
                    held = loader_pages(me.pid, [w.pid for w in workers])
                    obs["host"].append((held, shm_in_flight([w.pid for w in workers]), len(workers), uss))
                except (psutil.Error, OSError):   # a worker that just exited
                    pass
            time.sleep(0.2)

    threads = [threading.Thread(target=f, daemon=True) for f in (sample_trainer, sample_loaders)]
    for t in threads:
        t.start()
    with open(os.devnull, "w") as quiet:
        stdout, sys.stdout = sys.stdout, quiet
        try:
            rc = cli.main([config, "--overwrite"])
        finally:
            sys.stdout = stdout
    running = False
    for t in threads:
        t.join()
    best = max(obs["host"], key=lambda r: r[0] + r[1], default=(0, 0, 0, 0))
    return {"rc": rc, "marks": marks, "peak": obs["peak"], "steps": obs["steps"],
            "host": {"workers": best[0], "in_flight": best[1], "processes": best[2], "workers_uss": best[3]},
            "host_first": obs["host"][0] if obs["host"] else None}


# ---------------------------------------------------------------- the planned side
def planned(config: Path, sample_bytes: float) -> dict:
    """The planner's process memory (CPU) and host memory a node for the config's stage, 1 rank."""
    from crate_clip.train.planning import planner
    from crate_clip.train.run.run_config import load_run_config
    from crate_clip.train.stage_setup.stage_model import resolve_stage

    cfg = load_run_config(config, [], check_paths=False)
    stage = resolve_stage(cfg, 0, ranks_per_host=1)
    plan = planner.plan_stage(stage, planner.measure_stage(stage), 2 ** 40, None, 0.4)
    return {"process": planner.process_bytes(plan, "cpu"),
            "host": planner.host_bytes_per_node(stage, raw_sample_bytes=sample_bytes, samples_per_shard=1000)}


def run_child(config: Path, malloc: str) -> dict:
    env = {**os.environ, "OMP_NUM_THREADS": "2", "PYTHONPATH": str(ROOT)}
    if malloc == "returned":
        env["MALLOC_MMAP_THRESHOLD_"] = "65536"
    out = subprocess.run([sys.executable, __file__, "--child", str(config)], capture_output=True, text=True, cwd=ROOT,
                         env=env)
    if out.returncode:
        raise SystemExit(f"{config.name}: training child failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def row(name: str, plan: dict, run: dict) -> str:
    p, h = plan["process"], plan["host"]
    proc_plan, proc_meas = sum(p.values()), run["peak"]
    base = run["marks"]["model_build"]   # the part the runtime constant need not predict: measured in this run
    host_plan, host_meas = sum(h.values()), run["host"]["workers"] + run["host"]["in_flight"]
    return (f"| {name} | {proc_plan / MiB:.0f} MiB | {proc_meas / MiB:.0f} MiB | {proc_plan / proc_meas:.2f} "
            f"| {(proc_plan - base) / MiB:.0f} / {(proc_meas - base) / MiB:.0f} MiB = "
            f"{(proc_plan - base) / (proc_meas - base):.2f} "
            f"| {p['step'] / MiB:.0f} / {(proc_meas - p['runtime']) / MiB:.0f} MiB = "
            f"{p['step'] / (proc_meas - p['runtime']):.2f} "
            f"| {host_plan / MiB:.0f} MiB ({', '.join(f'{v / MiB:.0f}' for v in h.values())}) "
            f"| {host_meas / MiB:.0f} MiB ({run['host']['workers'] / MiB:.0f}, {run['host']['in_flight'] / MiB:.0f}) "
            f"| {host_plan / host_meas:.2f} |")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--child", help=argparse.SUPPRESS)
    p.add_argument("--case", action="append", choices=sorted(CASES), help="configs to run (default: all)")
    p.add_argument("--malloc", choices=("returned", "default"), default="returned",
                   help="glibc's large blocks returned on free (MALLOC_MMAP_THRESHOLD_=65536), or its default")
    p.add_argument("--reuse", action="store_true",
                   help="the runs' measurements saved in bench/out/plan_memory/ (the plan computed anew)")
    args = p.parse_args(argv)
    sys.path.insert(0, str(ROOT))
    if args.child:
        print(json.dumps(child_run(args.child)))
        return 0
    from crate_clip.train.planning.planner import MEMORY_TERMS, STEP_MARGIN

    OUT.mkdir(parents=True, exist_ok=True)
    pattern = make_shards() if not (OUT / "shards").is_dir() else str(OUT / "shards" / "{00000000..00000003}.tar")
    sample_bytes = raw_sample_bytes(OUT / "shards")
    lines = ["| config | process memory planned | measured | planned / measured | above the trainer at its model "
             "build: planned / measured "
             "| the step (state, activations, logits, batch: what a GPU holds besides its CUDA context): planned / "
             "measured less the CPU runtime "
             "| host memory planned (decode workers, shuffle buffers, batches in flight) | measured (workers, in "
             "flight) | planned / measured |", "|---|---|---|---|---|---|---|---|---|"]
    for name in args.case or list(CASES):
        config, saved = write_config(name, pattern), OUT / f"measured_{name}_{args.malloc}.json"
        if args.reuse and saved.is_file():
            run = json.loads(saved.read_text())
        else:
            run = run_child(config, args.malloc)
            saved.write_text(json.dumps(run))
        plan = planned(config, sample_bytes)
        print(name, json.dumps({"planned": plan, "measured": run}), flush=True)
        lines.append(row(name, plan, run))
    print("\n".join(lines))
    print(f"the plan's fits add STEP_MARGIN = {STEP_MARGIN:.0%} to the step (what the larger config measured above it)")
    objects = sample_object_bytes(OUT / "shards" / "00000000.tar")
    print(f"raw sample bytes of these shards: {sample_bytes:.0f}, and {objects:.0f} of Python objects a buffered "
          f"sample; malloc: {args.malloc}")
    print("\n".join(f"{k}: {v}" for k, v in MEMORY_TERMS.items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
