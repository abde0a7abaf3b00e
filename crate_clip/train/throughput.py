"""Throughput while training: samples/s, image + text tokens/s, achieved TFLOP/s and MFU, peak memory per
rank, and how long each step waited for the data loader.

Model FLOPs per sample are counted once per stage on the meta device (planner.count_flops_per_sample);
MFU = achieved model FLOP/s per GPU / the GPU's dense bf16 peak (planner.GPU_TABLE), so the extra forward
of gradient checkpointing or of the accumulation's feature cache lowers it, as is the convention.
On CPU, MFU is None (no peak to compare with). Step times are wall clock: train_step ends with one host
sync, so a step's time includes its device work.
"""
from __future__ import annotations

import resource
import time
from typing import Optional

import torch
import torch.distributed as tdist

DATA_WAIT_WARN = 0.10  # warn when the loader holds up more than this fraction of step time


def device_peak_tflops(device: str) -> Optional[float]:
    """The bf16 peak of this process's GPU from the planner's table; None on CPU or an unknown GPU."""
    if not device.startswith("cuda"):
        return None
    from crate_clip.train.planner import gpu_peak_tflops
    return gpu_peak_tflops(torch.cuda.get_device_name(torch.device(device)))


def tokens_per_sample(model_name: str, stage) -> int:
    """Image tokens the tower runs on (class + kept patches) plus the text context length."""
    import open_clip

    from crate_clip.models.token_masks import num_kept_tokens
    vision = open_clip.get_model_config(model_name)["vision_cfg"]
    patch = vision.get("patch_size", 16)
    grid = (stage.image_size // patch,) * 2
    kept = grid[0] * grid[1] if stage.image_mask == "none" else num_kept_tokens(stage.image_mask, grid,
                                                                              stage.image_mask_ratio)
    return 1 + kept + stage.context_length


class StepMeter:
    """Times the data wait and the step of each iteration; `fields()` averages them since the last call."""

    def __init__(self, cfg, stage, dist):
        self.dist, self.samples_per_step = dist, stage.global_batch
        self.peak = device_peak_tflops(dist.device)
        try:
            from crate_clip.train.planner import count_flops_per_sample
            self.flops_per_sample = count_flops_per_sample(cfg, stage)[0]
        except Exception:  # an op the meta device cannot run: report throughput without FLOPs
            self.flops_per_sample = None
        try:
            self.tokens = tokens_per_sample(cfg.model.name, stage)
        except Exception:
            self.tokens = None
        self._reset()
        self._t = time.perf_counter()
        if dist.device.startswith("cuda"):
            torch.cuda.reset_peak_memory_stats(torch.device(dist.device))

    def _reset(self) -> None:
        self.steps, self.wait, self.total = 0, 0.0, 0.0

    def begin(self) -> None:
        """Before fetching the batch."""
        self._t = time.perf_counter()

    def data_ready(self) -> None:
        """The batch is here: the time since begin() was data wait."""
        self._ready = time.perf_counter()
        self.wait += self._ready - self._t

    def step_done(self) -> None:
        """The optimizer step finished (train_step synced with the device)."""
        self.total += time.perf_counter() - self._t
        self.steps += 1

    def peak_memory_bytes(self) -> int:
        """This rank's peak: CUDA max allocated, or the process's peak resident memory on CPU."""
        if self.dist.device.startswith("cuda"):
            return int(torch.cuda.max_memory_allocated(torch.device(self.dist.device)))
        return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024

    def fields(self) -> dict:
        """Averages since the last call (a collective: every rank calls it at the same steps)."""
        steps = max(self.steps, 1)
        step_s, wait_s = self.total / steps, self.wait / steps
        samples_s = self.samples_per_step / step_s if step_s > 0 else 0.0
        mem = torch.tensor([float(self.peak_memory_bytes())])
        if tdist.is_initialized():
            mem = mem.to(self.dist.device)
            tdist.all_reduce(mem, op=tdist.ReduceOp.MAX)
        out = {"step_time_s": step_s, "data_wait_s": wait_s,
               "data_wait_frac": wait_s / step_s if step_s > 0 else 0.0,
               "samples_per_s_window": samples_s,
               "tokens_per_s": samples_s * self.tokens if self.tokens else None,
               "tflops": None, "tflops_per_gpu": None, "mfu": None,
               "peak_memory_gib_max_rank": float(mem.item()) / 2 ** 30}
        if self.flops_per_sample:
            total = samples_s * self.flops_per_sample / 1e12
            per_gpu = total / self.dist.world_size
            out.update(tflops=total, tflops_per_gpu=per_gpu, mfu=per_gpu / self.peak if self.peak else None)
        self._reset()
        return out

    @staticmethod
    def data_wait_warning(fields: dict) -> Optional[str]:
        """A warning line when the loader held up more than DATA_WAIT_WARN of the step time."""
        if fields["data_wait_frac"] <= DATA_WAIT_WARN:
            return None
        return (f"[warn] the data loader held up {fields['data_wait_frac']:.0%} of the step time "
                f"({fields['data_wait_s'] * 1e3:.0f} ms of {fields['step_time_s'] * 1e3:.0f} ms): raise "
                "data.num_workers (`crate-clip plan` shows the CPU cores per GPU a stage needs)")
