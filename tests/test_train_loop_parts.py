"""The stage loop's parts in one process, without a run: what a checkpoint saves of them and hands back, the progress
counters, the RNG part's exact round trip, and the cadence's and the guard's decisions (the loop itself runs in every
training test)."""
from types import SimpleNamespace

import pytest
import torch

from crate_clip.checkpoint_io.checkpoint_record import Progress
from crate_clip.train.loop.parts.checkpoint_cadence import CheckpointCadence
from crate_clip.train.loop.parts.nonfinite_guard import NonFiniteLossError, NonfiniteGuard
from crate_clip.train.loop.parts.progress_record import ProgressRecord, advance
from crate_clip.train.loop.parts.rng_states import RngStates
from crate_clip.train.loop.parts.stage_part import (LoopState, StagePart, job_wide_names, load_part_states,
                                                    part_states)
from crate_clip.train.loop.train_step import StepResult


class _Counter(StagePart):
    """A part with state, as a feature would add one."""
    name = "counter"

    def __init__(self):
        self.n, self.loaded = 0, "never"

    def on_step_end(self, loop):
        self.n += 1

    def state_dict(self):
        return {"n": self.n}

    def load_state_dict(self, state):
        self.loaded = state
        self.n = state["n"] if state else 0


class _JobWide(_Counter):
    name, job_wide = "shared_counter", True


def test_a_checkpoint_holds_each_named_parts_state_and_a_resume_hands_it_back():
    parts = [_Counter(), StagePart(), _JobWide()]
    parts[0].n, parts[2].n = 3, 7
    states = part_states(parts)
    assert states == {"counter": {"n": 3}, "shared_counter": {"n": 7}}   # a part without a name saves nothing
    assert job_wide_names(parts) == ("shared_counter",)
    fresh = [_Counter(), StagePart(), _JobWide()]
    load_part_states(fresh, {"counter": {"n": 3}})   # a checkpoint written before the job-wide part existed
    assert (fresh[0].n, fresh[0].loaded, fresh[2].n, fresh[2].loaded) == (3, {"n": 3}, 0, None)


def test_progress_counts_steps_samples_and_non_finite_runs():
    progress = Progress()
    advance(progress, StepResult(loss=1.0, logit_scale=1.0), 64)
    advance(progress, StepResult(loss=None, logit_scale=1.0, skipped="nonfinite_loss"), 64)
    advance(progress, StepResult(loss=None, logit_scale=1.0, skipped="loss_scale_overflow"), 64)
    assert (progress.step, progress.global_step, progress.samples_seen) == (3, 3, 192)
    # an fp16 loss-scale overflow is skipped and counted, but does not make a run of non-finite steps longer
    assert (progress.nonfinite_skipped, progress.nonfinite_in_a_row) == (2, 1)
    advance(progress, StepResult(loss=0.5, logit_scale=1.0), 64)
    assert progress.nonfinite_in_a_row == 0
    assert ProgressRecord(progress).state_dict()["samples_seen"] == 256


def test_the_rng_part_restores_the_draws_exactly_and_seeds_by_place_without_a_state():
    progress = Progress(global_step=5)
    part = RngStates(seed=3, stage_index=1, progress=progress, rank=0)
    saved = part.state_dict()
    draws = torch.rand(4)
    part.load_state_dict(saved)
    assert torch.equal(torch.rand(4), draws)
    part.load_state_dict(None)   # another world size: seeded from where the run is, the same on every try
    first = torch.rand(4)
    part.load_state_dict(None)
    assert torch.equal(torch.rand(4), first) and not torch.equal(first, draws)


def _loop(step: int, steps: int, loss, saves: list, skipped=None) -> LoopState:
    log = SimpleNamespace(print=lambda line: None, end_stage=lambda: None)
    run = SimpleNamespace(log=log)
    loop = LoopState(run, SimpleNamespace(steps=steps, name="s"), None, None,
                     Progress(step=step, nonfinite_in_a_row=3 if loss is None else 0),
                     result=StepResult(loss=loss, logit_scale=1.0, skipped=skipped),
                     saver=lambda loop, stream_state: saves.append(loop.progress.step) or f"tag{loop.progress.step}")
    return loop


def test_the_cadence_saves_every_n_steps_but_not_the_stages_last():
    saves = []
    cadence = CheckpointCadence(every_steps=2)
    for step in range(1, 7):
        cadence.on_step_end(_loop(step, 6, 1.0, saves))
    assert saves == [2, 4]   # step 6 is the stage's last: the loop saves it as the final checkpoint
    CheckpointCadence(every_steps=0).on_step_end(_loop(4, 6, 1.0, saves))
    assert saves == [2, 4]


def test_the_guard_saves_the_last_good_state_and_stops_at_its_limit():
    saves = []
    NonfiniteGuard(max_in_a_row=4).on_step_end(_loop(5, 9, None, saves, "nonfinite_loss"))   # 3 in a row
    assert saves == []
    with pytest.raises(NonFiniteLossError, match=r"3 non-finite losses in a row .* saved in tag5"):
        NonfiniteGuard(max_in_a_row=3).on_step_end(_loop(5, 9, None, saves, "nonfinite_loss"))
    assert saves == [5]
