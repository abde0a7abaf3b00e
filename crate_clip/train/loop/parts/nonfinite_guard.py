"""The non-finite guard as a part: a skipped step is said, and too many in a row stop the run with the weights of
the last good step saved."""
from __future__ import annotations

from crate_clip.core.errors import EXIT_NONFINITE, UserError
from crate_clip.train.loop.parts.stage_part import StagePart


class NonFiniteLossError(UserError, RuntimeError):
    """Too many non-finite losses in a row; the message names the step and the checkpoint to go back to."""
    exit_code = EXIT_NONFINITE


# why train_step skipped a step, as the warning says it
_SKIPPED = {"nonfinite_grad": "finite loss but non-finite gradient norm",
            "loss_scale_overflow": "fp16 loss-scale overflow"}


class NonfiniteGuard(StagePart):
    """Says each skipped step (the progress counts them: progress_record.advance) and stops at
    run.max_nonfinite_in_a_row. Placed after StepMetrics, so that the skipped step's row is logged before a stop."""

    def __init__(self, max_in_a_row: int):
        self.max_in_a_row = max_in_a_row

    def on_step_end(self, loop) -> None:
        progress, result = loop.progress, loop.result
        if result.loss is not None:
            return
        loop.log.print(f"[warn] stage {progress.stage_index} step {progress.step}: "
                       f"{_SKIPPED.get(result.skipped, 'non-finite loss')}, step skipped "
                       f"({progress.nonfinite_in_a_row} in a row, {progress.nonfinite_skipped} in total)")
        if progress.nonfinite_in_a_row >= self.max_in_a_row:
            self._stop(loop)

    def _stop(self, loop) -> None:
        progress, stage = loop.progress, loop.stage
        # the skipped steps left the weights untouched: this checkpoint holds the last good state
        tag_dir = loop.save()
        loop.log.end_stage()
        raise NonFiniteLossError(
            f"stopped: {progress.nonfinite_in_a_row} non-finite losses in a row (run.max_nonfinite_in_a_row="
            f"{self.max_in_a_row}) at stage {progress.stage_index} ({stage.name}) step "
            f"{progress.step}, {progress.samples_seen} samples seen. The weights of the last good step are "
            f"saved in {tag_dir}. Fix: lower stages.{progress.stage_index}.lr or raise its warmup_steps, use "
            f"precision: bf16/fp32 instead of fp16, or check the data; then resume with --resume latest.")
