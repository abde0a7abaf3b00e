"""The EMA weights a checkpoint holds (train.ema: train/loop/parts/ema_weights.py keeps them), read without the
trainer: by the stage-end evaluation of a resumed run and by `crate-clip export --weights ema`.

The EMA part's state is job-wide, kept by rank 0 alone: it is in rank 0's rank-state file under the part's name,
{"seen": the last stage step it took in, "weights": {parameter name: fp32 tensor} or None before it started}. The
names are the model's (engine.module's), which are the consolidated checkpoint's keys; only trained parameters are
averaged, so the EMA weights are the consolidated weights with these in place (with_ema).
"""
from __future__ import annotations

from pathlib import Path
from typing import Optional

from crate_clip.core.errors import UserError
from crate_clip.checkpoint_io.run_layout import rank_state_file
from crate_clip.checkpoint_io.safe_unpickling import load_torch_file

EMA_PART = "ema"   # the part's name: its key in a rank-state file


class NoEmaError(UserError, ValueError):
    """A checkpoint that holds no EMA weights (train.ema was off, or had not started in its stage)."""


def ema_state_of_checkpoint(tag_dir: Path) -> Optional[dict]:
    """The EMA weights (parameter name -> fp32 tensor) saved in checkpoint `tag_dir`, from its rank 0 file (read
    with weights_only and no allow-list: the file holds tensors, numbers and containers only); None when it holds
    none."""
    path = rank_state_file(tag_dir, 0)
    if not path.is_file():
        return None
    state = load_torch_file(path, allow=())
    part = state.get(EMA_PART) if isinstance(state, dict) else None
    weights = part.get("weights") if isinstance(part, dict) else None
    if not weights:
        return None
    return {name: tensor.float() for name, tensor in weights.items()}


def with_ema(live: dict, ema: dict) -> dict:
    """The state dict `live` (a consolidated checkpoint's) with the EMA's parameters in place of its own; ValueError
    naming the first EMA key that is not one of `live`'s or has another shape."""
    for name, tensor in ema.items():
        if name not in live or tuple(live[name].shape) != tuple(tensor.shape):
            found = f"shape {tuple(live[name].shape)}" if name in live else "no such key"
            raise ValueError(f"the EMA weights do not fit the checkpoint's: {name} {tuple(tensor.shape)} ({found})")
    return {**live, **{name: tensor.to(live[name].dtype) for name, tensor in ema.items()}}


def ema_weights_of_checkpoint(tag_dir: Path, live: dict) -> dict:
    """The checkpoint's weights `live` with its EMA parameters in place (NoEmaError, one line, when it holds no
    EMA)."""
    return with_ema(live, required_ema_state(tag_dir))


def required_ema_state(tag_dir: Path) -> dict:
    """ema_state_of_checkpoint, NoEmaError (one line with the fix) when the checkpoint holds none."""
    ema = ema_state_of_checkpoint(tag_dir)
    if ema is None:
        raise NoEmaError(f"{tag_dir}: the checkpoint holds no EMA weights (train.ema was off in its run, or its "
                         "stage ended before train.ema.start_step); fix: export its weights without --weights ema, "
                         "or train with train.ema.decay set (docs/training.md, \"EMA of the weights\")")
    return ema


