"""What a part of the stage loop is, and what the loop shows its parts (stage_loop.train_stage).

The loop is a plain loop over steps; everything else a stage does (metrics, the white-box probe, mid-stage
evaluations, checkpoint cadence, stop agreement, the non-finite guard, EMA weights) is a part: a small object whose
hooks the loop calls in the order of its list. A part that holds state names it (`name`) and gives it as a
state_dict; a checkpoint saves {name: state} of every such part in each rank's file, as torchtitan's checkpointer
saves its components' states, and a resume hands each part its entry back.
"""
from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any, Callable, Optional

import torch


class StagePart:
    """One part of a stage's loop. Every hook is optional; the loop calls them on every rank, in the list's order:

    on_stage_start(loop)   once, after a resume's states were loaded, before the first step
    on_step_start(loop)    before each step's batch is fetched
    on_batch_ready(loop)   once the step's batch is there, before the step
    on_step_end(loop)      after each optimizer step (loop.result, loop.progress already moved on)
    on_stage_end(loop)     once, after the stage's final checkpoint (loop.saved names it)
    """

    name: Optional[str] = None      # key of its state in a checkpoint's rank file; None: it holds no state
    # Its state is the same on every rank and kept by rank 0 alone: a resume at another world size takes it from
    # the saved rank 0's file (a per-rank state, as the stream's position, is rebuilt by elastic_resume instead).
    job_wide: bool = False

    def on_stage_start(self, loop: "LoopState") -> None:
        pass

    def on_step_start(self, loop: "LoopState") -> None:
        pass

    def on_batch_ready(self, loop: "LoopState") -> None:
        pass

    def on_step_end(self, loop: "LoopState") -> None:
        pass

    def on_stage_end(self, loop: "LoopState") -> None:
        pass

    def state_dict(self) -> Any:
        return None

    def load_state_dict(self, state: Any) -> None:
        pass


@dataclasses.dataclass
class LoopState:
    """What the loop shows its parts: the stage's run, engine and stream, where it is, and what the step did."""

    run: Any                     # stage_loop.RunContext: cfg, dist, ckpts, log
    stage: Any                   # stage_setup.stage_model.ResolvedStage
    engine: Any                  # the DeepSpeed engine
    stream: Any                  # the stage's batches (data_pipelines' train stream)
    progress: Any                # checkpoint_record.Progress, moved on by the loop after each step
    first_step: int = 0          # the step the stage (re)started at: a stop saves only if a step was trained since
    images: Any = None           # the step's image batch (rank 0's share is what the metrics part logs once)
    lr: float = 0.0              # the learning rate the step used
    result: Any = None           # train_step.StepResult of the step
    measured: dict = dataclasses.field(default_factory=dict)   # extra columns of the step's metrics row
    probed_step: Optional[int] = None   # the last step the white-box probe measured (on every rank: its row is due)
    parts: list = dataclasses.field(default_factory=list)   # the stage's StageParts, in hook order
    saved: Optional[Path] = None  # the checkpoint saved after this step, if any (the cadence's, a guard's)
    saver: Optional[Callable] = None   # stage_loop's save of every part's state: saver(loop, stream_state) -> Path

    def save(self, stream_state: Optional[dict] = None) -> Path:
        """Every rank: a checkpoint of the step just trained, with every part's state (`stream_state`: the data
        position to record instead of the stream's now); loop.saved names it."""
        self.saved = self.saver(self, stream_state)
        return self.saved

    @property
    def cfg(self):
        return self.run.cfg

    @property
    def dist(self):
        return self.run.dist

    @property
    def log(self):
        return self.run.log

    @property
    def last(self) -> bool:
        """Whether the step just done is the stage's last."""
        return self.progress.step == self.stage.steps


def rng_untouched(dist):
    """Measurements (FLOP count, white-box probe, mid-stage evaluations) run models whose token masks draw from the
    global generators: they must not move them, or a resumed stage would draw other masks than the uninterrupted
    one."""
    return torch.random.fork_rng(devices=[torch.device(dist.device)] if dist.device.startswith("cuda") else [])


def part_states(parts: list) -> dict:
    """What a checkpoint saves in this rank's file: {name: state} of every part that holds one."""
    return {part.name: part.state_dict() for part in parts if part.name}


def load_part_states(parts: list, states: dict) -> None:
    """A resume hands each part its saved state (None where the checkpoint holds none: one written before the part
    existed, or a per-rank state at another world size)."""
    for part in parts:
        if part.name:
            part.load_state_dict(states.get(part.name))


def job_wide_names(parts: list) -> tuple:
    """The parts whose state rank 0 keeps for the whole job (a resume at another world size reads them from it)."""
    return tuple(part.name for part in parts if part.name and part.job_wide)
