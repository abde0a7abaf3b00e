"""Mid-stage evaluations as a part (eval.every_samples / every_steps): a mark crossed makes an evaluation pending;
it runs once the budget (eval.max_time_share of this stage's training time) allows it, rank 0 deciding for all."""
from __future__ import annotations

import time

from crate_clip.train.loop.parts.stage_part import StagePart, rng_untouched
from crate_clip.train.loop.stage_evals import EvalBudget, agreed, evaluate_mid_stage, mid_stage_due


class MidStageEvals(StagePart):
    def __init__(self, share: float):
        self.budget, self.pending, self.t0 = EvalBudget(share), None, None

    def on_stage_start(self, loop) -> None:
        self.t0 = time.perf_counter()

    def on_step_end(self, loop) -> None:
        cfg, progress = loop.cfg, loop.progress
        if mid_stage_due(cfg, progress, loop.stage.global_batch, loop.last):
            self.pending = self.pending or progress.samples_seen
        if self.pending is None or loop.last:
            return
        train_s = time.perf_counter() - self.t0 - self.budget.eval_s
        if not agreed(self.budget.allows(train_s), loop.dist):
            line = self.budget.deferral(train_s, self.pending)
            if line:
                loop.log.print(line)
            return
        started = time.perf_counter()
        with rng_untouched(loop.dist):   # the stage's token masks and data order stay those of a run without it
            evaluate_mid_stage(cfg, loop.stage, loop.engine, progress, loop.log, loop.dist)
        seconds = time.perf_counter() - started
        loop.log.pause(seconds)
        loop.log.print(self.budget.spent(seconds, train_s))
        self.pending = None
