"""How much a test job's launcher costs: the same 2-rank tiny training run under torchrun (N fresh interpreters plus
its agent) and under tests/fork_ranks.py (the ranks forked from one interpreter that imported the training code),
alternated in this process, CPU from getrusage(RUSAGE_CHILDREN). Prints each run and the median ratios.

    python bench/bench_test_launch.py [--rounds 2]
"""
from __future__ import annotations

import argparse
import re
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
from train_fixtures import ranks_cmd, run_env, tiny_config, torchrun_cmd, write_config, write_tiny_fmnist  # noqa: E402

FASHION_MNIST = Path("/usr/share/datasets/fashion-mnist")


def _children_cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


def _run(launcher: str, root: Path, data: Path) -> tuple[float, float, str]:
    """(wall s, CPU s, the last evaluation line) of one 2-rank run."""
    config = write_config(tiny_config(root / launcher, data), root / f"{launcher}.yaml")
    make = torchrun_cmd if launcher == "torchrun" else ranks_cmd
    cmd = make(2, "--config", str(config), "--overwrite", module="crate_clip.train.cli")
    cpu0, t0 = _children_cpu(), time.perf_counter()
    proc = subprocess.run(cmd, env=run_env(), cwd=ROOT, capture_output=True, text=True)
    wall, cpu = time.perf_counter() - t0, _children_cpu() - cpu0
    if proc.returncode:
        raise RuntimeError(f"{launcher}: exit {proc.returncode}\n{proc.stderr[-3000:]}")
    evals = re.findall(r"\[eval\].*", proc.stdout)
    return wall, cpu, evals[-1] if evals else ""


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=2)
    args = p.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        data = write_tiny_fmnist(root / "data", FASHION_MNIST)
        runs = {"torchrun": [], "fork": []}
        for _ in range(args.rounds):
            for launcher in runs:
                wall, cpu, line = _run(launcher, root, data)
                runs[launcher].append((wall, cpu))
                print(f"{launcher:8s} {wall:6.1f} s wall {cpu:6.1f} s CPU  {line}", flush=True)
    med = {k: (statistics.median(w for w, _ in v), statistics.median(c for _, c in v)) for k, v in runs.items()}
    wall, cpu = med["fork"][0] / med["torchrun"][0], med["fork"][1] / med["torchrun"][1]
    print(f"fork / torchrun: wall {wall:.2f}x, CPU {cpu:.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
