"""The step's metrics as a part: the progress display, the first batch's images, the step meter (where the time
goes) and a metrics.jsonl / tracker row every logging.every_steps steps."""
from __future__ import annotations

import time

import torch.distributed as tdist

from crate_clip.train.loop.parts.stage_part import StagePart, rng_untouched
from crate_clip.train.reporting.throughput import StepMeter


class StepMetrics(StagePart):
    """A row on the steps logging.every_steps names, on the stage's last, on a skipped one and on one the white-box
    probe measured (its columns: loop.measured)."""

    def __init__(self, every_steps: int):
        self.every_steps, self.meter = every_steps, None

    def on_stage_start(self, loop) -> None:
        with rng_untouched(loop.dist):   # the meter counts the step's FLOPs with a forward
            self.meter = StepMeter(loop.stage, loop.dist, loop.cfg.data.num_workers)

    def on_step_start(self, loop) -> None:
        self.meter.begin()

    def on_batch_ready(self, loop) -> None:
        self.meter.data_ready()

    def on_step_end(self, loop) -> None:
        self.meter.step_done()
        progress, stage, log, result = loop.progress, loop.stage, loop.log, loop.result
        log.advance(result.loss, loop.lr, progress.step)
        if progress.step == 1:   # the stage's first batch, as the model sees it (rank 0's share)
            log.log_images(f"train_samples/stage{stage.index}_{stage.name}", loop.images, progress.samples_seen,
                           stage.mean, stage.std)
        probed = loop.probed_step == progress.step   # not loop.measured: {} on ranks other than 0
        if progress.step % self.every_steps and not loop.last and result.loss is not None and not probed:
            return
        perf = self.meter.record()
        warning = self.meter.data_wait_warning(perf)
        if warning:
            log.print(warning)
        log.show_throughput(perf)
        log.log_step(self._row(loop), perf)

    @staticmethod
    def _row(loop) -> dict:
        progress, stage, result = loop.progress, loop.stage, loop.result
        return {"stage_index": progress.stage_index, "stage_name": stage.name, "step": progress.step,
                "global_step": progress.global_step, "samples_seen": progress.samples_seen,
                "image_size": stage.image_size, "loss": result.loss, "lr": loop.lr, "logit_scale": result.logit_scale,
                "grad_norm": result.grad_norm, "skipped": result.skipped,
                "samples_per_s": loop.log.samples_per_second(progress.step),
                "nonfinite_skipped": progress.nonfinite_skipped,
                "data_skips": summed_counters(loop.stream, loop.dist), "time": time.time(), **loop.measured,
                **({"data_decode": summed_counters(loop.stream, loop.dist, "decode_counts")}
                   if stage.decode == "device" else {})}


def summed_counters(stream, dist, counters: str = "skip_counts") -> dict:
    """The data stream's bad-sample counters (or its `decode_counts`), summed over ranks."""
    local = getattr(stream, counters)() if hasattr(stream, counters) else {}
    gathered = [None] * dist.world_size
    tdist.all_gather_object(gathered, dict(local))
    total: dict = {}
    for d in gathered:
        for k, v in (d or {}).items():
            total[k] = total.get(k, 0) + int(v)
    return total
