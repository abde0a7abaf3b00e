"""The white-box probe as a part (logging.diagnostics_every): coding rate and sparsity per layer on a fixed probe
batch, as extra columns of the step's metrics row."""
from __future__ import annotations

from crate_clip.train.loop.parts.stage_part import StagePart, rng_untouched
from crate_clip.train.reporting.whitebox_log import WhiteboxProbe


class WhiteboxDiagnostics(StagePart):
    """Placed before StepMetrics: its measurement is a column of the same step's row."""

    def __init__(self):
        self.probe = None

    def on_stage_start(self, loop) -> None:
        with rng_untouched(loop.dist):
            self.probe = WhiteboxProbe.for_stage(loop.cfg, loop.stage, loop.engine, loop.dist, loop.log)

    def on_step_end(self, loop) -> None:
        if self.probe and self.probe.due(loop.progress.step, loop.last):
            with rng_untouched(loop.dist):
                loop.measured.update(self.probe.measure())   # {} on ranks other than 0
            loop.probed_step = loop.progress.step   # every rank logs the row: it gathers the skip counters
