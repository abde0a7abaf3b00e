"""One-process training runs cut short at a precise point by an injected fault (not collected by pytest).

    run_dir_workers.py kill_between_evals CONFIG          killed as the full-size eval of stage 0 starts
    run_dir_workers.py kill_in_save CONFIG TAG RESUME     resumed from RESUME, killed once DeepSpeed has
                                                          written the files of checkpoint TAG (before the
                                                          checkpoint is complete)
    run_dir_workers.py no_space TAG ARGS...               `crate-clip train ARGS` on a disk that is full for
                                                          checkpoint TAG's DeepSpeed files and for the plot
    run_dir_workers.py train_twice ARGS1 -- ARGS2         `crate-clip train` twice in one process; prints the two
                                                          exit codes as JSON
"""
from __future__ import annotations

import os
import signal
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import crate_clip  # noqa: E402,F401
from crate_clip.train.run.run_config import load_run_config  # noqa: E402
from crate_clip.train.loop.stage_loop import run_training  # noqa: E402


def _die() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


def kill_between_evals(config: Path) -> None:
    """Stage 0 trains at low resolution: its own-size eval is recorded, then the kill comes at full size."""
    # where the trainer calls crate_clip.eval.stage_hook.evaluate_stage
    import crate_clip.train.loop.stage_evals as stage_evals

    cfg = load_run_config(config)
    real = stage_evals.evaluate_stage

    def evaluate_stage(model, *, image_size, **kwargs):
        if image_size == cfg.full_image_size and image_size != cfg.stages[0].image_size:
            _die()
        return real(model, image_size=image_size, **kwargs)

    stage_evals.evaluate_stage = evaluate_stage
    run_training(cfg)


def kill_in_save(config: Path, tag: str, resume: str) -> None:
    """DeepSpeed's files of `tag` are written; the kill comes before anything marks the checkpoint complete."""
    from deepspeed.runtime.engine import DeepSpeedEngine

    real = DeepSpeedEngine.save_checkpoint

    def save_checkpoint(self, save_dir, tag=None, **kwargs):
        out = real(self, save_dir, tag=tag, **kwargs)
        if tag is not None and target in str(tag):
            _die()
        return out

    target = tag
    DeepSpeedEngine.save_checkpoint = save_checkpoint
    run_training(load_run_config(config), resume=resume)


def no_space(tag: str, *args: str) -> None:
    """Checkpoint TAG's DeepSpeed files and the plot are /dev/full, where the kernel answers every write with
    ENOSPC, whichever layer writes them (torch's C++ writer or Python's): the disk is full for them."""
    import builtins

    from crate_clip.train.cli import main

    def full(path: str) -> None:
        if not os.path.lexists(path):
            os.symlink("/dev/full", path)

    real_makedirs, real_open = os.makedirs, builtins.open

    def makedirs(name, *rest, **kwargs):   # DeepSpeed makes the staging folder before writing into it
        real_makedirs(name, *rest, **kwargs)
        if str(name).endswith(f".{tag}.saving"):
            for file in ("mp_rank_00_model_states.pt", "zero_pp_rank_0_mp_rank_00_optim_states.pt"):
                full(os.path.join(name, file))

    def open_on_a_full_disk(file, mode="r", *rest, **kwargs):   # matplotlib writes the plot through Python
        if any(c in mode for c in "wax") and "training_curve.png" in os.path.basename(str(file)):
            full(str(file))
        return real_open(file, mode, *rest, **kwargs)

    os.makedirs, builtins.open = makedirs, open_on_a_full_disk
    sys.exit(main(list(args)))


def train_twice(*args: str) -> None:
    """Two `crate-clip train` commands in one process (one start-up for two refusals)."""
    import json

    from crate_clip.train.cli import main

    cut = args.index("--")
    codes = []
    for argv in (args[:cut], args[cut + 1:]):
        codes.append(main(list(argv)))
        for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_PORT"):
            os.environ.pop(key, None)   # the one-process world of the first command
    print(json.dumps(codes), flush=True)


if __name__ == "__main__":
    mode, args = sys.argv[1], sys.argv[2:]
    {"kill_between_evals": kill_between_evals, "kill_in_save": kill_in_save, "no_space": no_space,
     "train_twice": train_twice}[mode](*args)
    sys.exit(0)
