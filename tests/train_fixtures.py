"""Shared pieces of the training tests: a small real Fashion-MNIST data set, run configs, launching torchrun."""
from __future__ import annotations

import gc
import json
import os
import subprocess
import sys
import traceback
import warnings
from pathlib import Path

import yaml

import warm_python

REPO_ROOT = Path(__file__).resolve().parents[1]
WORKERS = Path(__file__).resolve().parent / "train_workers.py"
FORK_RANKS = Path(__file__).resolve().parent / "fork_ranks.py"


# The tiny runs' evaluation set: the first 50 test images hold all 10 classes (3 to 7 each). Each run evaluates
# them 4 times (16 px, then 28 px grown and PI-resized, then the 28 px stage), and a bf16 evaluation is ~20x
# slower than fp32 on a CPU without bf16 instructions: 200 images cost a 2-rank bf16 run ~30 s of CPU.
TINY_EVAL_IMAGES = 50


def write_tiny_fmnist(root: Path, fashion_mnist_dir: Path) -> Path:
    """1,200 real Fashion-MNIST training pairs in 3 shards (root/train) and TINY_EVAL_IMAGES test images as an
    ImageFolder (root/test); returns root."""
    from crate_clip.data.sources.fashion_mnist import write_fashion_mnist_eval_folder, write_fashion_mnist_shards

    write_fashion_mnist_shards(root / "train", split="train", samples_per_shard=400, limit=1200,
                               source_dir=fashion_mnist_dir)
    write_fashion_mnist_eval_folder(root / "test", split="test", limit=TINY_EVAL_IMAGES,
                                    source_dir=fashion_mnist_dir)
    return root


def default_stages() -> list[dict]:
    """The tiny run's two stages: 10 steps at 16 px, then 4 at 28 px (batch 16)."""
    return [
        {"name": "low", "image_size": 16, "context_length": 16, "samples": 160, "global_batch": 16, "lr": 2e-3,
         "warmup_steps": 2},
        {"name": "full", "image_size": 28, "context_length": 16, "samples": 64, "global_batch": 16, "lr": 2e-4,
         "warmup_steps": 1},
    ]


def tiny_config(run_dir: Path, data: Path, *, zero_stage: int = 2, precision: str = "fp32",
                stages: list[dict] | None = None, every_steps: int = 0, evals: bool = True, **sections) -> dict:
    """A two-stage run config of the tiny model on the small data set (16 px, then 28 px)."""
    stages = stages or default_stages()
    cfg = {
        "run": {"name": "test", "output_dir": str(run_dir), "seed": 3},
        "model": {"name": "CRATE-alpha-CLIPA-tiny"},
        "data": {"sources": [str(data / "train")], "num_workers": 1, "shuffle_buffer": 100},
        "stages": stages,
        "precision": precision,
        "deepspeed": {"zero_stage": zero_stage},
        "checkpoint": {"every_steps": every_steps, "keep_last": 3},
        "eval": {"full_image_size": 28, "evals": [
            {"name": "fmnist", "type": "zeroshot", "dataset": "fashion_mnist", "data": str(data / "test"),
             "templates": "simple", "batch_size": 100}] if evals else []},
        "logging": {"every_steps": 1, "progress": False, "tensorboard": True},
    }
    for key, value in sections.items():
        if isinstance(value, dict):
            cfg.setdefault(key, {}).update(value)
        else:
            cfg[key] = value
    return cfg


BOTH_CRATE = "CRATE-alpha-CLIPA-tiny-crate-text"
BOTH_CRATE_STAGES = [   # 6 steps at 16 px, 8 tokens, random text mask; then 3 at 28 px, 16 tokens, k = 2 per rank
    {"name": "low", "image_size": 16, "context_length": 8, "text_mask": "random", "samples": 96, "global_batch": 16,
     "lr": 2e-3, "warmup_steps": 1},
    {"name": "full", "image_size": 28, "context_length": 16, "text_mask": "block", "samples": 48, "global_batch": 16,
     "micro_batch": 4, "lr": 2e-4, "warmup_steps": 1},
]


def both_crate_config(run_dir: Path, data: Path) -> dict:
    """The tiny both-CRATE CLIP (CRATE-alpha image and text towers) in two ZeRO-3 fp32 stages with text token
    reduction, a context-length change, accumulation, gradient checkpointing, a checkpoint every 2 steps and
    white-box diagnostics every 2 steps on 8 probe images / captions."""
    return tiny_config(run_dir, data, zero_stage=3, precision="fp32", stages=BOTH_CRATE_STAGES, every_steps=2,
                       model={"name": BOTH_CRATE, "grad_checkpointing": True},
                       logging={"every_steps": 1, "progress": False, "tensorboard": True, "diagnostics_every": 2,
                                "diagnostics_images": 8})


def train_both_crate(root: Path, data: Path) -> tuple[Path, Path]:
    """both_crate_config trained uninterrupted by 2 processes into root/run: (run folder, config file). The
    session's run is conftest.py's `both_crate_run`."""
    config = write_config(both_crate_config(root / "run", data), root / "run.yaml")
    proc = run_job(ranks_cmd(2, "--config", str(config), module="crate_clip.train.cli"), timeout=400)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    return root / "run", config


def write_config(cfg: dict, path: Path) -> Path:
    """The config as a YAML file."""
    path.write_text(yaml.safe_dump(cfg, sort_keys=False))
    return path


def torchrun_cmd(nproc: int, *args: str, module: str | None = None) -> list[str]:
    """`python -m torch.distributed.run --nproc_per_node N (-m module | tests/train_workers.py) args`: for the tests
    of what torchrun does (its restarts, a killed launcher, its exit code and output); the others use ranks_cmd."""
    from crate_clip.train.stage_setup.engine import _free_port

    target = ["-m", module] if module else [str(WORKERS)]
    return [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc),
            "--master_addr", "127.0.0.1", "--master_port", str(_free_port()), *target, *args]


def ranks_cmd(nproc: int, *args: str, module: str | None = None, script: Path = WORKERS) -> list[str]:
    """The same N ranks (torchrun's environment: RANK, WORLD_SIZE, MASTER_ADDR, ...) forked from one interpreter
    that imported the training code (fork_ranks.py), each running `-m module` or `script` (tests/train_workers.py
    unless given): a 2-rank job costs ~6 s less CPU than under torchrun here."""
    target = ["-m", module] if module else [str(script)]
    return [sys.executable, str(FORK_RANKS), str(nproc), *target, *args]


def run_env() -> dict:
    """Environment of a launched job: one thread per process (2 cores), repo importable."""
    # faulthandler: a worker that dies of a signal prints every thread's Python stack, so a crash says where
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO_ROOT), PYTHONFAULTHANDLER="1")
    env.pop("RANK", None)
    env.pop("WORLD_SIZE", None)
    return env


def warm_subprocess(monkeypatch, module, request=None) -> None:
    """`module`'s subprocess calls (a launcher it starts) forked by the warm interpreter (warm_python has
    subprocess.run's interface), in the environment of the suite's jobs (run_env: one thread per process), so the
    command can run warm. What that launcher starts in turn (torchrun's workers) stays fresh, unless the test's
    `request` is given: then they are stand-ins for warm commands too (warm_python.stand_in_env; ~7 s less CPU a
    worker), their CPU added to the test's at its teardown."""
    for key, value in (run_env() if request is None else stand_in_run_env(request)).items():
        monkeypatch.setenv(key, value)
    monkeypatch.setattr(module, "subprocess", warm_python)


def stand_in_run_env(request) -> dict:
    """run_env() for a launcher (torchrun, `crate-clip train --nproc`) whose workers are to be stand-ins for warm
    commands (warm_python.stand_in_env): their CPU is added to the test's (its `request`) at its teardown."""
    env = warm_python.stand_in_env(run_env())
    request.addfinalizer(lambda: warm_python.count_stand_in_cpu(env))
    return env


def run_job(cmd: list[str], timeout: int = 240, env: dict | None = None) -> subprocess.CompletedProcess:
    """Run a launched job to completion (output captured; shown on failure by the caller), forked by the warm
    interpreter where it can be (warm_python.py). A job whose worker
    aborted (SIGABRT from C++ destructors at interpreter exit: "terminate called without an active exception",
    seen in ~1 of 20 runs of two train_workers probes, which skip that teardown) runs once more, with a
    warning in pytest's summary that carries the crash. `env`: the job's environment if not run_env()
    (stand_in_run_env)."""
    env = env or run_env()
    proc = warm_python.run(cmd, env=env, cwd=REPO_ROOT, capture_output=True, text=True, timeout=timeout)
    if proc.returncode != 0 and "SIGABRT" in proc.stderr:
        warnings.warn(f"a worker of {' '.join(cmd[-3:])} aborted; ran the job again. Its stderr:\n"
                      f"{proc.stderr[-4000:]}")
        proc = warm_python.run(cmd, env=env, cwd=REPO_ROOT, capture_output=True, text=True, timeout=timeout)
    return proc


def run_jobs(cmds: list[list[str]], parallel: int = 2, timeout: int = 600) -> list[subprocess.CompletedProcess]:
    """run_job of each command, `parallel` at a time: one-process jobs use one core each (one thread), so two of
    them side by side take the wall time of one on a 2-core machine, for the same CPU time. A job whose worker
    aborted runs once more, alone (as in run_job)."""
    done: list[subprocess.CompletedProcess] = []
    for at in range(0, len(cmds), parallel):
        batch = [warm_python.Popen(cmd, env=run_env(), cwd=REPO_ROOT, stdout=subprocess.PIPE,
                                   stderr=subprocess.PIPE, text=True) for cmd in cmds[at:at + parallel]]
        for proc in batch:
            out, err = proc.communicate(timeout=timeout)
            done.append(subprocess.CompletedProcess(proc.args, proc.returncode, out, err))
    for i, proc in enumerate(done):
        if proc.returncode != 0 and "SIGABRT" in proc.stderr:
            done[i] = run_job(list(proc.args), timeout=timeout)
    return done


def train_in_process(config, overrides: list[str] | tuple = (), *, resume: str | None = None, stream_factory=None,
                     allow_changes: tuple = (), overwrite: bool = False) -> dict:
    """The trainer (stage_loop.run_training) in this pytest process, as plain `crate-clip train` runs it: a world of
    one on gloo, made by the trainer's own init_distributed; for what needs no second rank and no process of its own
    (a stage's loop, its logs, evaluations, checkpoints and export). `config`: a dict (tiny_config), a YAML path or a
    RunConfig; `overrides`: `--set` assignments ("stages.0.lr=1e-3") on a YAML path, read as the command reads them;
    `stream_factory` as run_training's (a stream that injects a fault). One torch thread, as each launched
    job's process (run_env). Returns run_training's summary; what it raises propagates.

    Afterwards the process is as it was for the tests after it in this pytest worker: the Python API's
    process_state_kept gives back the environment variables a world of one sets, the random generators, the warning
    filters and DeepSpeed's logger, and the process group is destroyed with DeepSpeed's cached references to it (a
    next run would otherwise broadcast over a group that is gone)."""
    import torch

    from crate_clip.train.loop.stage_loop import run_training
    from crate_clip.train.python_api import _destroy_process_group, process_state_kept
    from crate_clip.train.run.run_config import RunConfig, config_from_dict, load_run_config

    if isinstance(config, dict):
        config = config_from_dict(config, base_dir=Path("."), check_paths=False)
    elif not isinstance(config, RunConfig):
        config = load_run_config(config, list(overrides), check_paths=False)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with process_state_kept():
            try:
                return run_training(config, resume=resume, stream_factory=stream_factory, overwrite=overwrite,
                                    allow_changes=tuple(allow_changes))
            except BaseException as exc:
                # the traceback's frames hold the stream's DataLoader iterator, whose workers would live on with the
                # test's exception (torch's SIGCHLD handler then fails a later run of this process when one dies)
                traceback.clear_frames(exc.__traceback__)
                raise
            finally:
                import torch.distributed as tdist
                if tdist.is_available() and tdist.is_initialized():
                    _destroy_process_group()
                gc.collect()   # an iterator left in a reference cycle: its workers shut down now, not at some later test
    finally:
        torch.set_num_threads(threads)


def read_jsonl(path: Path) -> list[dict]:
    """Records of a JSONL file."""
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]


def tiny_text_params(context_length: int) -> int:
    """CRATE-alpha-CLIPA-tiny's text tower in closed form: open_clip blocks of 12 w^2 + 13 w, final LayerNorm,
    projection (the part a text lock turns into buffers)."""
    w, vocab, layers, embed = 64, 49408, 2, 128
    return vocab * w + context_length * w + layers * (12 * w * w + 13 * w) + 2 * w + w * embed


def tiny_clip_params(image_size: int, context_length: int) -> int:
    """CRATE-alpha-CLIPA-tiny's parameter count in closed form (its model_configs JSON; 3,953,921 at 16 px, 16 tokens)."""
    d, depth, p, embed = 128, 4, 4, 128   # CRATE-alpha blocks of 10 d^2 + 4 d; patch conv without bias; linear proj
    image = depth * (10 * d * d + 4 * d) + 3 * p * p * d + d + ((image_size // p) ** 2 + 1) * d + 2 * d + d * embed
    return image + tiny_text_params(context_length) + 1   # + logit_scale
