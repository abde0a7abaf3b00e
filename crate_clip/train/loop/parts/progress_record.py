"""Where the run is, as a part: each rank's file keeps the progress it saved at (crate_clip.json's copy is the one
a resume reads)."""
from __future__ import annotations

import dataclasses

from crate_clip.train.loop.parts.stage_part import StagePart


class ProgressRecord(StagePart):
    name = "progress"

    def __init__(self, progress):
        self.progress = progress

    def state_dict(self) -> dict:
        return dataclasses.asdict(self.progress)

    def load_state_dict(self, state) -> None:
        pass   # the resume point's progress (crate_clip.json) is already the loop's: find_resume_point read it


def advance(progress, result, global_batch: int) -> None:
    """The progress after one step (skipped ones included: the schedule moves on) with its non-finite counters."""
    progress.step += 1
    progress.global_step += 1
    progress.samples_seen += global_batch
    if result.loss is None:
        progress.nonfinite_skipped += 1
        # fp16's dynamic loss scale overflows now and then by design: not a sign of divergence
        progress.nonfinite_in_a_row += result.skipped != "loss_scale_overflow"
    else:
        progress.nonfinite_in_a_row = 0
