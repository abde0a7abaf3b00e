"""Runs of the embedded demo for the benchmarks (`python -m crate_clip.train.demo` in a subprocess, its console
in `<run-dir>.log`) and what their own metrics.jsonl says about their time: each stage's training seconds and
the seconds the white-box probe took inside them (all probed towers)."""
import json
import subprocess
import sys
import time
from pathlib import Path

import yaml

from crate_clip.train.reporting.whitebox_log import TOWER_KEYS

ROOT = Path(__file__).resolve().parents[1]
DEMO_CONFIG = ROOT / "configs" / "demo" / "fashion_mnist.yaml"


def demo_stages(config: Path = DEMO_CONFIG) -> list[dict]:
    """The demo config's stages (samples, global_batch, ... as written in the YAML)."""
    return yaml.safe_load(Path(config).read_text())["stages"]


def absolute_deepspeed(section: dict) -> dict:
    """A deepspeed section read from the demo config, with the DeepSpeed file it names (if any) made absolute, so
    that a run config written elsewhere still finds it."""
    section = dict(section)
    if section.get("config"):
        section["config"] = str((DEMO_CONFIG.parent / section["config"]).resolve())
    return section


def demo_deepspeed() -> dict:
    """The demo config's deepspeed section, its file path made absolute."""
    return absolute_deepspeed(yaml.safe_load(DEMO_CONFIG.read_text())["deepspeed"])


def run_demo(run_dir: Path, overrides: list[str], *, config: Path = DEMO_CONFIG, data_dir: Path | None = None,
             probe_train_images: int | None = None, nproc: int = 2, reuse: bool = False) -> float:
    """One demo run into `run_dir` (an earlier one there is moved aside by the trainer); returns its wall seconds
    (also kept in `<run-dir>.wall`). `reuse`: a finished run there with the same command is kept instead.
    Raises with the console's tail when the demo fails."""
    cmd = [sys.executable, "-m", "crate_clip.train.demo", "--config", str(config), "--nproc", str(nproc),
           "--run-dir", str(run_dir), "--data-dir", str(data_dir or ROOT / "data" / "fashion_mnist")]
    if probe_train_images is not None:
        cmd += ["--probe-train-images", str(probe_train_images)]
    for o in overrides:
        cmd += ["--set", o]
    log, done = Path(f"{run_dir}.log"), Path(f"{run_dir}.wall")
    if reuse and done.is_file() and (Path(run_dir) / "export").is_dir():
        kept = json.loads(done.read_text())
        if kept["command"] == cmd[1:]:
            print(f"[bench] reusing the finished run {run_dir}", flush=True)
            return kept["wall_seconds"]
    log.parent.mkdir(parents=True, exist_ok=True)
    print(f"[bench] {' '.join(cmd[1:])}  (console: {log})", flush=True)
    t0 = time.perf_counter()
    with log.open("w") as f:
        rc = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, cwd=ROOT).returncode
    wall = time.perf_counter() - t0
    if rc:
        raise RuntimeError(f"the demo run {run_dir} failed (exit {rc}):\n{log.read_text()[-4000:]}")
    done.write_text(json.dumps({"command": cmd[1:], "wall_seconds": wall}))
    return wall


def stage_times(run_dir: Path) -> dict:
    """Training seconds of the run's stages and the white-box probe's seconds within them, from metrics.jsonl
    (a record's samples_per_s counts from the stage start with the probe included, so a stage's last record
    gives its elapsed time: step * batch / samples_per_s)."""
    records = [json.loads(line) for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()
               if line.strip()]
    per_stage: dict = {}
    for r in records:
        per_stage.setdefault(r["stage_index"], []).append(r)
    train = probe = 0.0
    for recs in per_stage.values():
        first, last = recs[0], recs[-1]
        batch = (last["samples_seen"] - first["samples_seen"]) / max(last["step"] - first["step"], 1)
        train += last["step"] * batch / last["samples_per_s"]
        for key in TOWER_KEYS:   # each probed tower keeps its own running total
            measured = [r[key] for r in recs if r.get(key)]
            probe += measured[-1]["seconds_total"] if measured else 0.0
    return {"training_seconds": train, "probe_seconds": probe,
            "probe_share": probe / train if train else None,
            "measurements": sum(1 for r in records if any(r.get(key) for key in TOWER_KEYS)),
            "samples": records[-1]["samples_seen"] if records else 0}
