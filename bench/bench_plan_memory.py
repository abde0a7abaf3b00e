"""The plan held against measurement: `crate-clip plan`'s per-rank peak and host memory a node vs a CPU run.

Two configs: the demo (configs/demo/fashion_mnist.yaml, stage 0: 21 px, batch 64, 1 worker, 2,000-sample buffer)
and a larger one (the same file with 63 px (7x7 patches of 9 px), batch 256, 2 workers, 1,500 samples a stream). Each is measured in a
fresh process (its own baseline), on this CPU, 1 rank:
- process memory of a training step: the stage's model, AdamW and 3 steps of forward + contrastive loss + backward
  at the rank batch; measured: peak resident memory (sampled every 0.5 ms) minus the resident memory before the
  model was built; planned: the planner's peak a rank (weights, gradients, optimizer state, activations, logits;
  fp32 as the demo trains);
- host memory of the loaders: the real training stream (build_train_stream, its DataLoader workers) read until
  every shuffle buffer is full; measured: the workers' private memory (USS: what a forked worker does not share
  with the trainer) plus the trainer's growth while it holds the batches; planned: planner.host_bytes_per_node
  with the raw sample size of these shards (the planner's RAW_SAMPLE_BYTES is DataComp's 36 KB).
Shards: Fashion-MNIST pictures as 256 px JPEGs (q90) with captions, 1,000 a shard, 4 shards a group (so a group
holds more samples than a buffer: the buffer fills).

    .venv/bin/python bench/bench_plan_memory.py          # prints the table; --write puts it into BENCHMARKS.md
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
COMMON = ["run.output_dir=bench/out/plan_memory/run", "data.shards_per_group=4", "stages.0.samples=2560000"]
CASES = {
    "demo": [],
    "larger": ["stages.0.image_size=63", "stages.0.patch_size=9", "stages.0.global_batch=256",
               "data.num_workers=2", "data.shuffle_buffer=1500"],
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


class Peak:
    """Samples a quantity every 0.5 ms in a thread; .peak is its largest value."""

    def __init__(self, read):
        self.read, self.peak, self.running = read, read(), True
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self):
        while self.running:
            try:
                self.peak = max(self.peak, self.read())
            except Exception:   # a worker that just exited
                pass
            time.sleep(0.0005)

    def stop(self) -> float:
        self.running = False
        self.thread.join()
        return self.peak


def rss() -> int:
    import resource
    return int(open("/proc/self/statm").read().split()[1]) * resource.getpagesize()


def child_step(overrides: list) -> dict:
    """Planned and measured process memory of the stage's training step."""
    import torch

    from crate_clip.train.planning.planner import measure_stage, plan_stage
    from crate_clip.train.run.run_config import load_run_config
    from crate_clip.train.stage_setup.stage_model import resolve_stage

    cfg = load_run_config(DEMO, overrides, check_paths=False)
    stage = resolve_stage(cfg, 0, ranks_per_host=1)
    planned = plan_stage(stage, measure_stage(stage), 2 ** 40, None, 0.4)
    batch = stage.per_rank_batch
    torch.manual_seed(0)
    images = torch.randn(batch, 3, stage.image_size, stage.image_size)
    tokens = torch.randint(1, 1000, (batch, stage.context_length))
    base = rss()
    peak = Peak(rss)
    model = stage.build_model(read_files=False).train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    for _ in range(3):
        image_f, text_f, scale = model(image=images, text=tokens)[:3]
        logits = scale * image_f @ text_f.t()
        labels = torch.arange(batch)
        loss = (torch.nn.functional.cross_entropy(logits, labels)
                + torch.nn.functional.cross_entropy(logits.t(), labels)) / 2
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        del image_f, text_f, scale, logits, loss
    return {"planned": planned.peak_bytes_per_rank, "measured": peak.stop() - base, "micro": planned.micro_batch}


def child_host(overrides: list, pattern: str, sample_bytes: float) -> dict:
    """Planned and measured host memory of the stage's loaders, read until every shuffle buffer is full."""
    import psutil

    from crate_clip.data.train_stream import build_train_stream
    from crate_clip.train.planning import planner
    from crate_clip.train.run.run_config import load_run_config
    from crate_clip.train.stage_setup.stage_model import resolve_stage

    cfg = load_run_config(DEMO, overrides + [f"data.sources=[{json.dumps(pattern)}]"], check_paths=False)
    stage = resolve_stage(cfg, 0, ranks_per_host=1)
    planner.RAW_SAMPLE_BYTES = sample_bytes   # these shards' samples, not DataComp's
    planned = planner.host_bytes_per_node(stage)
    me = psutil.Process()

    def workers_uss() -> int:
        return sum(c.memory_full_info().uss for c in me.children(recursive=True))

    base = rss()
    stream = build_train_stream(cfg.data, image_size=stage.image_size, context_length=stage.context_length,
                                text_mask="truncate", batch_size=stage.per_rank_batch)
    per_worker = stage.shuffle_buffer * stage.loader_streams // max(1, stage.stream.workers)
    steps = 2 * stage.shuffle_buffer // (stage.per_rank_batch // stage.loader_streams) + 8   # buffers fill at 2 a draw
    held, peak_workers, peak_main = [], 0, 0
    for i, batch in enumerate(stream):
        held = [batch]   # the batch the trainer holds
        if i % 4 == 0 or i == steps:
            peak_workers = max(peak_workers, workers_uss())
            peak_main = max(peak_main, rss() - base)
        if i >= steps:
            break
    del held
    return {"planned": planned, "measured": {"workers": peak_workers, "trainer": peak_main},
            "buffer_samples_per_worker": per_worker, "steps": steps}


def run_child(kind: str, *args: str) -> dict:
    out = subprocess.run([sys.executable, __file__, "--child", kind, *args], capture_output=True, text=True,
                         cwd=ROOT, env={**os.environ, "OMP_NUM_THREADS": "2"})
    if out.returncode:
        raise SystemExit(f"{kind} child failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def gib(n: float) -> str:
    return f"{n / 2 ** 20:.0f} MiB"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--child", nargs="+", help=argparse.SUPPRESS)
    p.add_argument("--write", action="store_true", help="write the table into BENCHMARKS.md")
    args = p.parse_args(argv)
    sys.path.insert(0, str(ROOT))
    if args.child:
        kind, rest = args.child[0], args.child[1:]
        overrides = json.loads(rest[0])
        result = child_step(overrides) if kind == "step" else child_host(overrides, rest[1], float(rest[2]))
        print(json.dumps(result))
        return 0
    pattern = make_shards() if not (OUT / "shards").is_dir() else \
        str(OUT / "shards" / "{00000000..00000003}.tar")
    sample_bytes = raw_sample_bytes(OUT / "shards")
    rows = []
    for name, extra in CASES.items():
        overrides = COMMON + extra
        step = run_child("step", json.dumps(overrides))
        host = run_child("host", json.dumps(overrides), pattern, str(sample_bytes))
        planned_host = sum(host["planned"].values())
        measured_host = sum(host["measured"].values())
        rows.append((name, step, host, planned_host, measured_host))
        print(name, json.dumps({"step": step, "host": host}), flush=True)
    table = ["| config | process memory planned | measured | planned / measured | host memory planned (buffers, "
             "workers, batches) | measured (workers' USS, trainer) | planned / measured |", "|---|---|---|---|---|---|---|"]
    for name, step, host, ph, mh in rows:
        hp, hm = host["planned"], host["measured"]
        table.append(f"| {name} | {gib(step['planned'])} | {gib(step['measured'])} | {step['planned'] / step['measured']:.2f} "
                     f"| {gib(ph)} ({gib(hp['shuffle buffers'])}, {gib(hp['decode workers'])}, {gib(hp['batches'])}) "
                     f"| {gib(mh)} ({gib(hm['workers'])}, {gib(hm['trainer'])}) | {ph / mh:.2f} |")
    text = "\n".join(table)
    print(text)
    print(f"raw sample bytes of these shards: {sample_bytes:.0f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
