"""Checkpoint cadence as a part: a checkpoint every checkpoint.every_steps steps (the stage's last step is saved by
the loop itself, as the stage's final checkpoint)."""
from __future__ import annotations

from crate_clip.train.loop.parts.stage_part import StagePart


class CheckpointCadence(StagePart):
    def __init__(self, every_steps: int):
        self.every_steps = every_steps   # 0: only at the stage's end

    def on_step_end(self, loop) -> None:
        if self.every_steps and loop.progress.step % self.every_steps == 0 and not loop.last:
            loop.save()
