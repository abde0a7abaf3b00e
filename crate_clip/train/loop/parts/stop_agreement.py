"""Stop agreement as a part: a preemption signal (or a data source given up on) on any rank stops every rank after
the same step, with that step saved (stop_requests.py, stop_sharing.py)."""
from __future__ import annotations

from pathlib import Path
from typing import NoReturn, Optional

from crate_clip.checkpoint_io.run_layout import checkpoint_tag
from crate_clip.data.remote_retry import RESUME_LATEST
from crate_clip.train.loop.parts.stage_part import StagePart
from crate_clip.train.loop.stop_requests import StopRequested, agreed_stop


class StopAgreement(StagePart):
    """Placed last: the step's other parts (a cadence save among them) are done when it stops. A stop agreed on the
    stage's last step waits for the stage's final checkpoint (on_stage_end); its evaluations run on resume."""

    def __init__(self):
        self.stop: Optional[tuple[str, int]] = None

    def on_step_end(self, loop) -> None:
        self.stop = agreed_stop(loop.dist)
        if self.stop is not None and not loop.last:
            stop_stage(loop, self.stop, saved=loop.saved)

    def on_stage_end(self, loop) -> None:
        if self.stop is not None:
            stop_stage(loop, self.stop, saved=loop.saved)


def stop_stage(loop, stop: tuple[str, int], saved: Optional[Path] = None,
               stream_state: Optional[dict] = None) -> NoReturn:
    """Every rank: save the last completed step (unless `saved` holds it, or no step was trained since the checkpoint
    this stage started from), end the stage's display and raise StopRequested with the stop's reason and exit code
    (the run folder's lock is released on the way out; stop_requests.py)."""
    reason, code = stop
    progress, tag_dir = loop.progress, saved
    if tag_dir is None and progress.step > loop.first_step:
        tag_dir = loop.save(stream_state)
    elif tag_dir is None and progress.step > 0:   # the checkpoint this stage resumed from holds this step
        tag_dir = loop.run.ckpts.root / checkpoint_tag(progress.stage_index, progress.step)
    loop.log.end_stage()
    where = (f"stage {progress.stage_index} ({loop.stage.name}) step {progress.step}, "
             f"{progress.samples_seen} samples seen")
    if tag_dir is None and progress.global_step == 0:   # no checkpoint at all: --resume latest would find none
        reason = reason.replace(RESUME_LATEST, "start it again with --resume auto")
        kept, resume = "no step trained yet, so nothing is saved", "" if "--resume" in reason else \
            "; start it again with --resume auto"
    else:
        kept = f"saved in {tag_dir}" if tag_dir else "no step of this stage trained yet: the last checkpoint is kept"
        resume = "" if "--resume" in reason else f"; {RESUME_LATEST} (or --resume auto)"
    raise StopRequested(f"{reason.rstrip('.')}; at {where}, {kept}{resume}", code)
