"""Throughput while training: samples/s, image + text tokens/s, achieved TFLOP/s and MFU, peak memory per
rank, and how long each step waited for the data loader.

FLOPs and tokens per sample are the stage's own (ResolvedStage.counts, counted on a copy of the model that
trains; the planner reports the same numbers). MFU = achieved model FLOP/s per GPU / the GPU's dense bf16 peak
(planner.GPU_TABLE), so the extra forward of gradient checkpointing or of the accumulation's feature cache
lowers it, as is the convention. On CPU, MFU is None (no peak to compare with). Step times are wall clock:
train_step ends with one host sync, so a step's time includes its device work.
"""
from __future__ import annotations

import os
import resource
import time
from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as tdist

from crate_clip.core.host_ranks import ranks_on_this_host
from crate_clip.train.planning.planner import gpu_peak_tflops

DATA_WAIT_WARN = 0.10  # warn when the loader holds up more than this fraction of step time


@dataclass(frozen=True)
class ThroughputRecord:
    """Throughput averaged over the steps since the last record: fields of a metrics.jsonl row, and the
    `throughput/*` scalars of TensorBoard (the logger takes the names from here)."""
    step_time_s: float
    data_wait_s: float
    data_wait_frac: float
    samples_per_s_window: float
    tokens_per_sample: Optional[int]     # image tokens kept + text tokens
    tokens_per_s: Optional[float]
    flops_per_sample: Optional[float]    # model FLOPs of one sample's forward + backward
    tflops: Optional[float]
    tflops_per_gpu: Optional[float]
    mfu: Optional[float]
    peak_memory_gib_max_rank: float


def device_peak_tflops(device: str) -> Optional[float]:
    """The bf16 peak of this process's GPU from the planner's table; None on CPU or an unknown GPU."""
    if not device.startswith("cuda"):
        return None
    return gpu_peak_tflops(torch.cuda.get_device_name(torch.device(device)))


def loader_advice(workers: int, ranks_here: int, cores: int, decode: str, device: str) -> str:
    """What can make the data loader keep up on this machine: another worker per rank where a core is free for
    it, else (on a GPU) decoding there; never advice that cannot apply."""
    if cores - ranks_here * (1 + workers) >= ranks_here:   # each rank runs its training process + its workers
        return ("raise data.num_workers (`crate-clip plan` shows the CPU cores per GPU a stage needs)")
    advice = (f"every CPU core is busy ({cores} cores for {ranks_here} training processes with {workers} loader "
              "worker(s) each), so more workers would not help")
    if decode == "cpu" and device.startswith("cuda"):
        advice += "; data.decode: device moves the JPEG decoding to the GPU"
    return advice


class StepMeter:
    """Times the data wait and the step of each iteration of one stage; `record()` averages them since the
    last call."""

    def __init__(self, stage, dist, loader_workers: int = 0):
        self.dist, self.samples_per_step = dist, stage.global_batch
        self.peak = device_peak_tflops(dist.device)
        self.counts = stage.counts
        self.warned = False
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
        ranks_here = ranks_on_this_host(dist.world_size)
        self.advice = loader_advice(loader_workers, ranks_here, cores, stage.decode, dist.device)
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

    def record(self) -> ThroughputRecord:
        """Averages since the last call (a collective: every rank calls it at the same steps)."""
        steps = max(self.steps, 1)
        step_s, wait_s = self.total / steps, self.wait / steps
        samples_s = self.samples_per_step / step_s if step_s > 0 else 0.0
        mem = torch.tensor([float(self.peak_memory_bytes())])
        if tdist.is_initialized():
            mem = mem.to(self.dist.device)
            tdist.all_reduce(mem, op=tdist.ReduceOp.MAX)
        tokens, flops = self.counts.tokens, self.counts.flops
        total = samples_s * flops / 1e12
        per_gpu = total / self.dist.world_size
        self._reset()
        return ThroughputRecord(step_time_s=step_s, data_wait_s=wait_s,
                                data_wait_frac=wait_s / step_s if step_s > 0 else 0.0,
                                samples_per_s_window=samples_s, tokens_per_sample=tokens,
                                tokens_per_s=samples_s * tokens if tokens else None, flops_per_sample=flops,
                                tflops=total, tflops_per_gpu=per_gpu, mfu=per_gpu / self.peak if self.peak else None,
                                peak_memory_gib_max_rank=float(mem.item()) / 2 ** 30)

    def data_wait_warning(self, perf: ThroughputRecord) -> Optional[str]:
        """A warning line the first time in the stage the loader held up more than DATA_WAIT_WARN of the step
        time, with the advice that applies on this machine; None otherwise."""
        if self.warned or perf.data_wait_frac <= DATA_WAIT_WARN:
            return None
        self.warned = True
        return (f"[warn] the data loader held up {perf.data_wait_frac:.0%} of the step time "
                f"({perf.data_wait_s * 1e3:.0f} ms of {perf.step_time_s * 1e3:.0f} ms): {self.advice} "
                "(said once per stage)")
