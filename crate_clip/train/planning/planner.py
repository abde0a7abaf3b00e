"""Will a run config fit, and how long will it take? Per stage, from counted FLOPs and measured activations.

`stage` is a ResolvedStage (stage_model.py): every model here is the one its build_model() makes.
    parameters        trainable / frozen, from the stage's model
    FLOPs per sample  `stage.counts`: torch.utils.flop_counter on a meta-device forward + loss + backward of the
                      stage's model (count_per_sample; deep towers cut to 1 and 2 blocks and extrapolated
                      linearly in depth), the numbers the throughput meter reports too; the time
                      adds the forward that runs again (checkpoint recompute, the accumulation's grad pass),
                      which is the part of the forward autograd records: a locked tower's no-grad forward
                      runs once per sample whatever k and checkpointing
    state bytes       weights / grads / AdamW state per rank under the ZeRO stage and precision; with train.ema,
                      rank 0's fp32 average of the trained parameters (the rank the plan's peak is of)
    activations       bytes per sample of a CPU training step (live tensors traced through dispatch, batch 2
                      and 4, slope = per sample), with and without gradient checkpointing, scaled to the dtype;
                      towers traced cut to 1 and 2 blocks and extrapolated linearly in depth; the step runs on
                      fake CPU tensors (FakeTensorMode), so it takes seconds: the CPU's kernels and sizes,
                      no values
    micro-batch       the largest divisor of global_batch / world that fits, and k accumulation steps
    time              at an assumed efficiency (plan_inputs.Efficiency): by default HFU, on the executed FLOPs
                      (model FLOPs + the forward run again): executed FLOPs / (GPUs x peak bf16 x HFU); or
                      MFU, on the model FLOPs alone (what the training meter and bench/bench_gpu.py call MFU):
                      model FLOPs / (GPUs x peak bf16 x MFU). The other one is derived and printed; GPU-hours

The activation trace counts every tensor an op creates while it is alive (views share their storage),
which is what a caching allocator must hold at the peak, less fragmentation (the 10% reserve).
"""
from __future__ import annotations

import contextlib
import gc
import math
import weakref
from dataclasses import asdict, dataclass, field, replace
from typing import Callable, Optional

import torch
import torch.nn.functional as F
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import FlopCounterMode, flop_registry

from crate_clip.core.errors import ConfigError
from crate_clip.train.planning.plan_inputs import (DEFAULT_EFFICIENCY, GPU_TABLE, HFU_WORDS,  # noqa: F401 (API)
                                                   MFU_WORDS, Efficiency, parse_bytes)
from crate_clip.train.planning.plan_inputs import COMPILE_S_PER_STAGE

MEMORY_RESERVE = 0.10       # the caching allocator's fragmentation, NCCL's buffers (the CUDA context: below)
# Of the usable memory (the GPU's less MEMORY_RESERVE and the CUDA context: what a step may hold), a fit leaves this
# share free (issue 53): for what the plan does not see, and so that a GPU reporting a little less than its nominal
# size plans the same (an H100 80GB shows CUDA 79.2 GiB; a config fitted to the last GiB at 80 GiB fell to
# micro-batch 256 and k = 2 at 78 GiB). The plan prints what each stage leaves free.
HEADROOM = 0.05
# What a fit adds to the step's planned peak (state, activations, logits, input batch: the part that scales with the
# model and the batch, and all a GPU holds besides the CUDA context) for what the plan is measured to miss (issue
# 53): bench/bench_plan_memory.py's larger config (63 px, batch 256) held 612 MiB above the CPU runtime (its measured
# peak, 1622 MiB, less the 1009 MiB the demo's run holds besides its planned step) where the plan says 494: 0.81 of
# it (BENCHMARKS.md, "Issue 53: the plan's step against the measured run"). Printed with each stage's headroom.
STEP_MARGIN = 0.24
ZERO_STAGES = (1, 2, 3)   # tried by the tune, lowest first: the least communication wins a tie
# Training-stream images/s per loader core at the stage size, measured on DataComp-like JPEGs (max side 512):
# decode: cpu = header + crop draw + PIL decode/resize + tokenize, BENCHMARKS.md `data` section
# (bench/bench_data.py, 1 worker, "ours" column, 2026-11-29). decode: device = the worker's share alone
# (header + crop draw + tokenize; the device decodes): its ratio to decode: cpu measured in one run of
# bench/bench_gpu.py decode_rates (16.3x at 224 px, 3.2x at 84 px; BENCHMARKS.md `scaling`, 2026-12-01)
# times the rate above.
CPU_DECODE_RATE = {84: 547.0, 112: 290.0, 224: 71.0}
DEVICE_PATH_WORKER_RATE = {84: 1740.0, 224: 1160.0}
# One raw DataComp-1B sample as a shuffle buffer holds it (JPEG at max side 512 + caption + json): ~50 TB of
# shards over ~1.4B pairs (the img2dataset download, /work/shared/SPEC-clipa-training.md)
RAW_SAMPLE_BYTES = 36_000
# img2dataset's default shard size (number_sample_per_shard=10000), DataComp's download: a stream's buffer never
# holds more than its group's samples (data.shards_per_group x this), since it is drained at every group's end
SAMPLES_PER_SHARD = 10_000
# Python objects one raw sample holds in a shuffle buffer besides its members' bytes (the dict, its keys, the
# bytes headers): 510 bytes a sample by tracemalloc over the 1,000 samples of a shard (bench/bench_plan_memory.py)
SAMPLE_OBJECT_BYTES = 510

# What a process holds besides its step (process memory = this runtime + the step's peak):
# - GPU: the CUDA context a process creates on its device before its first tensor: 781 MB in nvidia-smi after the
#   first CUDA call (pytorch/pytorch#34323); NCCL's buffers and the allocator's fragmentation are MEMORY_RESERVE;
# - CPU: the trainer's resident memory apart from its stage (interpreter, torch, DeepSpeed, open_clip, the run's
#   modules, the process group, the tokenizer; the first step's lazily loaded kernels): measured on the demo config
#   by bench/bench_plan_memory.py (its measured peak minus this planner's step peak) and checked there on two
#   other configs with this same number (BENCHMARKS.md, "Issue 40: the plan against a measured CPU run"). Refitted
#   in issue 53 (1091 MiB measured less an 82 MiB step; was 910 MiB, before the trainer's modules grew: its
#   resident memory at the model build went from 807 to 922 MiB), BENCHMARKS.md "Issue 53: the plan's step against
#   the measured run".
CUDA_CONTEXT_BYTES = 781 * 10 ** 6
CPU_RUNTIME_BYTES = 1009 * 2 ** 20
# The DataLoader workers' memory apart from their streams' buffers and the items they build, measured on the real CPU
# trainer by bench/bench_plan_memory.py (the pages the workers map and the trainer does not): each worker's own
# pages (what it writes of the pages it inherited: reference counts; its decoder and tokenizer state; from its
# private memory with 2 workers) and, once a rank, the trainer's pages of before the fork that the trainer has since
# rewritten and only its workers still hold (shared by all of them). Fitted on two configs of the quiet pagemap run
# (the demo's one worker: 85 MiB, the mid config's two: 110 MiB, each less its buffers and items) and checked on the
# third (BENCHMARKS.md, "Issue 40: the plan against a measured CPU run")
CPU_WORKER_BASE_BYTES = 25 * 2 ** 20
CPU_FORK_RETAINED_BYTES = 60 * 2 ** 20
# DeepSpeed's ZeRO-1/2 gradients pass through a reduce bucket of reduce_bucket_size elements in the weights' dtype
# (stage_1_and_2.py setup_buckets, `ipg_buckets`): configs/deepspeed/zero1.json and zero2.json set 5e7
REDUCE_BUCKET_ELEMENTS = 50_000_000
# The definitions `crate-clip plan` and bench/bench_plan_memory.py print
MEMORY_TERMS = {
    "process memory (a rank)": "the most one training process holds while it trains a stage, on the device it "
    "trains on: its runtime (GPU: the CUDA context; CPU: interpreter, libraries, the run's modules), weights, "
    "gradients, optimizer state and DeepSpeed's buffers, the step's activations and logits, its input batch",
    "host memory (a node's loaders)": "what the data loaders of a node's ranks hold besides the ranks' processes: "
    "every DataLoader worker's private memory (a base, its streams' shuffle buffers, the item it builds) and the "
    "batches in flight from the workers to the ranks (shared or pinned memory)",
}


def loader_rate(table: dict, image_size: int) -> float:
    """Images/s per core at `image_size`: the measured size nearest to it."""
    return table[min(table, key=lambda s: abs(s - image_size))]


def gpu_peak_tflops(name: Optional[str]) -> Optional[float]:
    """Dense bf16 peak of a GPU from GPU_TABLE by name (case-insensitive substring), None if unknown."""
    if not name:
        return None
    key = name.lower().replace("nvidia", "").replace(" ", "-").replace("_", "-")
    for gpu in sorted(GPU_TABLE, key=len, reverse=True):
        if gpu in key:
            return GPU_TABLE[gpu][0]
    return None




# ---------------------------------------------------------------- live-tensor trace
class LiveTensorPeak(TorchDispatchMode):
    """Peak bytes of tensors created by ops inside the mode that are alive at the same time."""

    def __init__(self):
        super().__init__()
        self.live: dict[int, list] = {}  # storage address -> [nbytes, tensors alive]
        self.now = self.peak = 0

    def _release(self, key: int) -> None:
        entry = self.live.get(key)
        if entry is None:
            return
        entry[1] -= 1
        if entry[1] == 0:
            self.now -= entry[0]
            del self.live[key]

    def _track(self, t: torch.Tensor) -> None:
        storage = t.untyped_storage()
        key = storage._cdata   # the storage's own address: a fake tensor has no data pointer
        entry = self.live.get(key)
        if entry is None:
            entry = self.live[key] = [storage.nbytes(), 0]
            self.now += entry[0]
            self.peak = max(self.peak, self.now)
        entry[1] += 1
        weakref.finalize(t, self._release, key)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in (out if isinstance(out, (tuple, list)) else (out,)):
            if isinstance(t, torch.Tensor):
                self._track(t)
        return out


def _contrastive_step(model, images, tokens, after_forward=None) -> None:
    """Forward, the contrastive loss (both directions) and backward: one training step's model work."""
    image_f, text_f, scale = model(image=images, text=tokens)[:3]
    # a locked text tower computes in the run's precision: its features meet the image's in fp32
    logits = scale * image_f @ text_f.t().to(image_f.dtype)
    labels = torch.arange(len(images), device=logits.device)
    loss = (F.cross_entropy(logits, labels) + F.cross_entropy(logits.t(), labels)) / 2
    if after_forward is not None:
        after_forward()
    loss.backward()


@contextlib.contextmanager
def older_objects_frozen():
    """The objects that exist now left out of every cycle collection until the block ends (gc.freeze): a full
    collection of a process that imported torch, DeepSpeed and open_clip scans ~10^6 objects (~0.25 s here), and a
    plan collects before each of its ~36 traced passes. A pass's own garbage is younger, so it is still collected."""
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()


def _peak_bytes(model, images, tokens, fake: Optional[FakeTensorMode], track_memory: bool) -> int:
    """Peak live bytes of one training step (0 without `track_memory`: a warm-up pass); in `fake` when the
    model and inputs are fake tensors."""
    model.zero_grad(set_to_none=True)
    tracer = LiveTensorPeak() if track_memory else None
    # the trace sees a tensor die with its Python object: the cycle collector running at random moments
    # (checkpointing's saved-tensor hooks make cycles) would move the measured peak from run to run
    gc.collect()
    gc_was_on = gc.isenabled()
    gc.disable()
    try:
        with fake or contextlib.nullcontext(), tracer or contextlib.nullcontext():
            _contrastive_step(model, images, tokens)
    finally:
        if gc_was_on:
            gc.enable()
    model.zero_grad(set_to_none=True)
    return tracer.peak if tracer else 0


# ---------------------------------------------------------------- FLOPs and tokens per sample
@dataclass(frozen=True)
class SampleCounts:
    """Per-sample work of one training step of a model: FLOPs counted by torch.utils.flop_counter, and the
    tokens each tower runs on, read at its first block."""
    flops: float                   # forward + contrastive loss + backward (a locked tower's backward does not run)
    forward_flops: float
    grad_forward_flops: float      # the part of the forward autograd records: what runs again in a checkpoint
                                   # recompute or the accumulation's grad pass (not a locked tower's no-grad forward)
    image_tokens: Optional[int]    # class token + the patches the token mask keeps (None: tower not recognised)
    text_tokens: Optional[int]

    @property
    def tokens(self) -> Optional[int]:
        """Image plus text tokens."""
        return None if self.image_tokens is None or self.text_tokens is None else self.image_tokens + self.text_tokens


def tower_blocks(model) -> Optional[tuple]:
    """((owner, attribute) of the image tower's block list, (owner, attribute) of the text tower's), or None:
    the repeated blocks a depth cut shortens and whose first one sees each tower's tokens."""
    visual = getattr(model, "visual", None)
    trunk = getattr(visual, "trunk", None)
    image = (trunk, "blocks") if hasattr(trunk, "blocks") else \
        (visual.transformer, "resblocks") if hasattr(getattr(visual, "transformer", None), "resblocks") else None
    text_tower = getattr(model, "text", model)   # CustomTextCLIP holds its text tower as .text
    text = (text_tower.transformer, "resblocks") if hasattr(getattr(text_tower, "transformer", None), "resblocks") \
        else None
    return (image, text) if image and text else None


class NoGradFlops(TorchDispatchMode):
    """FLOPs (torch.utils.flop_counter's formulas) of the ops that run with autograd off. Entered outside a
    FlopCounterMode, it sees the ops that counter counts, after its decompositions."""

    def __init__(self):
        super().__init__()
        self.flops = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        formula = flop_registry.get(func._overloadpacket)
        if formula is not None and not torch.is_grad_enabled():
            self.flops += formula(*args, **kwargs, out_val=out)
        return out


def count_per_sample(model, image_size: int, context_length: int, batch: int = 2) -> SampleCounts:
    """SampleCounts of one training step of `model` (any device, meta included: the counter reads shapes)."""
    device = next(model.parameters()).device
    images = torch.zeros(batch, 3, image_size, image_size, device=device)
    tokens = torch.ones(batch, context_length, dtype=torch.long, device=device)
    seen, hooks = [None, None], []

    def recorder(tower: int):
        return lambda module, args: seen.__setitem__(tower, int(args[0].shape[1]))   # (batch, tokens, width)

    for i, (owner, attr) in enumerate(tower_blocks(model) or ()):
        hooks.append(getattr(owner, attr)[0].register_forward_pre_hook(recorder(i)))
    model.train()
    forward = []
    try:
        # attention counted as its matmuls (the math kernel): the counter has no formula for fused CPU kernels;
        # the backward also runs with autograd off, so the no-grad share is read where the forward ends
        with sdpa_kernel(SDPBackend.MATH), NoGradFlops() as no_grad, FlopCounterMode(display=False) as counter:
            _contrastive_step(model, images, tokens,
                              lambda: forward.extend((counter.get_total_flops(), no_grad.flops)))
    finally:
        for hook in hooks:
            hook.remove()
    return SampleCounts(counter.get_total_flops() / batch, forward[0] / batch, (forward[0] - forward[1]) / batch,
                        *seen)


CUT_ABOVE_BLOCKS = 4   # towers this deep or shallower are traced and counted whole (cheaper than three cut ones)


def extrapolated_in_depth(measure: Callable[[tuple], dict], depths: tuple) -> dict:
    """What `measure(depths)` gives for the whole towers, from measures of towers cut to 1 and 2 blocks: the
    blocks of a tower are identical, so each adds the same amount, and the numbers are linear in each tower's
    depth. One measure at (1, 1), one more per tower deeper than 1 block."""
    base = measure((1,) * len(depths))
    whole = dict(base)
    for tower, depth in enumerate(depths):
        if depth < 2:
            continue
        more = measure(tuple(2 if i == tower else 1 for i in range(len(depths))))
        for key in whole:
            whole[key] += (more[key] - base[key]) * (depth - 1)
    return whole


def count_cut_per_sample(model, image_size: int, context_length: int) -> SampleCounts:
    """count_per_sample of `model`, counted on its towers cut to 1 and 2 blocks when one is deeper than
    CUT_ABOVE_BLOCKS: the blocks of a tower are identical, so each adds the same FLOPs and the counts are linear in
    each tower's depth, exactly (tests/test_train_stage_model.py checks it against the whole count). Three counts
    of three blocks instead of one of all: an H/14 stage's count takes 0.2 s instead of 1.4 s. The model's block
    lists are put back afterwards."""
    lists = tower_blocks(model)
    blocks = [getattr(owner, attr) for owner, attr in lists] if lists else []
    if not blocks or max(len(b) for b in blocks) <= CUT_ABOVE_BLOCKS:
        return count_per_sample(model, image_size, context_length)

    tokens = {}   # each tower's tokens, read at its first block: the same at any depth

    def flops_at(depths: tuple) -> dict:
        for (owner, attr), whole, depth in zip(lists, blocks, depths):
            setattr(owner, attr, whole[:depth])
        counts = asdict(count_per_sample(model, image_size, context_length))
        tokens.update(image_tokens=counts.pop("image_tokens"), text_tokens=counts.pop("text_tokens"))
        return counts

    try:
        flops = extrapolated_in_depth(flops_at, tuple(len(b) for b in blocks))
    finally:
        for (owner, attr), whole in zip(lists, blocks):
            setattr(owner, attr, whole)
    return SampleCounts(**flops, **tokens)


# ---------------------------------------------------------------- per-stage measurement
@dataclass
class StageMeasure:
    """What the planner measured for one stage's model (per sample, a CPU step in fp32)."""
    trainable_params: int
    frozen_params: int
    flops_per_sample: float          # forward + backward
    forward_flops_per_sample: float
    grad_forward_flops_per_sample: float   # the forward a recompute or the accumulation's grad pass repeats
    activation_bytes_per_sample: float
    activation_bytes_fixed: float
    activation_bytes_per_sample_ckpt: float
    locked_params: int = 0           # a locked tower's weights, held as fp32 buffers (text_lock)


def _cut(model, depths: tuple) -> torch.nn.Module:
    """The (meta-device) model with each tower cut to `depths` blocks."""
    for (owner, attr), depth in zip(tower_blocks(model), depths):
        setattr(owner, attr, getattr(owner, attr)[:depth])
    return model


def _trace(meta_model, stage, batches) -> dict:
    """Peak live bytes at each batch, gradient checkpointing off and on. The model runs on fake CPU tensors
    (torch's FakeTensorMode): every op is dispatched as on the CPU (its autocast, its fused attention kernel)
    and gives tensors of the CPU's sizes, but no values are computed. A trace measures sizes only."""
    fake = FakeTensorMode(allow_non_fake_inputs=True)
    with fake:
        model = meta_model.to_empty(device="cpu")
    model.train()
    out = {}

    def inputs(b):
        with fake:
            return (torch.empty(b, 3, stage.image_size, stage.image_size),
                    torch.ones(b, stage.context_length, dtype=torch.long))

    with older_objects_frozen():
        for ckpt in (False, True):
            model.set_grad_checkpointing(ckpt)
            # one untraced pass first in each mode: lazily built state (workspaces, cached masks) is not per-sample
            _peak_bytes(model, *inputs(1), fake, track_memory=False)
            for b in batches:
                out[f"{'ckpt' if ckpt else 'peak'}{b}"] = _peak_bytes(model, *inputs(b), fake, track_memory=True)
    return out


def measure_stage(stage, batches=(2, 4), full_depth: Optional[bool] = None, memory: bool = True) -> StageMeasure:
    """Parameters, the stage's FLOP counts, and activations traced at two batch sizes (a CPU step in fp32, on fake
    tensors); batches of 2 and 4 rather than 1 and 2, so that activations, not the parameter gradients, decide where
    the peak is.
    `memory=False`: no trace (the activations are NaN), for FLOPs and time alone.

    With full_depth False (None: when a tower is deeper than CUT_ABOVE_BLOCKS), the towers are traced cut
    to 1 and 2 blocks and the activations are extrapolated linearly in each tower's depth: the blocks of a
    tower are identical, so each adds the same saved activations (tests/test_train_planner.py checks it
    against the full trace): three small models to trace instead of the whole one."""
    def build(device):
        return stage.build_model(read_files=False, device=device, train=False)

    meta = build("meta")
    trainable = sum(p.numel() for p in meta.parameters() if p.requires_grad)
    frozen = sum(p.numel() for p in meta.parameters() if not p.requires_grad)
    locked = locked_buffer_params(meta)
    lists = tower_blocks(meta)
    depths = tuple(len(getattr(owner, attr)) for owner, attr in lists) if lists else None
    if full_depth is None:
        full_depth = depths is None or max(depths) <= CUT_ABOVE_BLOCKS
    if not memory:
        v = dict.fromkeys([f"{kind}{b}" for kind in ("peak", "ckpt") for b in batches], math.nan)
    elif full_depth or depths is None:
        v = _trace(meta, stage, batches)
    else:
        models = [meta]   # a trace turns its model into fake tensors: the first cut on this one, the others on new ones

        def trace_cut(cut: tuple) -> dict:
            return _trace(_cut(models.pop() if models else build("meta"), cut), stage, batches)

        v = extrapolated_in_depth(trace_cut, depths)
    b1, b2 = batches
    per = (v[f"peak{b2}"] - v[f"peak{b1}"]) / (b2 - b1)
    per_ckpt = (v[f"ckpt{b2}"] - v[f"ckpt{b1}"]) / (b2 - b1)
    # the trace also holds the fp32 parameter gradients: counted apart, in the per-rank state
    fixed = max(0.0, v[f"peak{b1}"] - per * b1 - 4.0 * trainable)
    counts = stage.counts
    return StageMeasure(trainable, frozen, counts.flops, counts.forward_flops, counts.grad_forward_flops, per, fixed,
                        per_ckpt, locked)


def locked_buffer_params(model) -> int:
    """Elements of the persistent floating-point buffers: the weights text_lock turned into buffers (open_clip's
    and our towers keep no other persistent float buffers)."""
    params = {name for name, _ in model.named_parameters()}
    return sum(t.numel() for name, t in model.state_dict(keep_vars=True).items()
               if name not in params and t.is_floating_point())


# ---------------------------------------------------------------- memory model
def state_bytes_per_rank(trainable: int, frozen: int, precision: str, zero_stage: int, world: int,
                         locked: int = 0, ema: bool = False) -> dict:
    """Weights / gradients / optimizer bytes one rank holds (DeepSpeed mixed precision: bf16 working
    weights and gradients, fp32 master weights + AdamW m and v in the optimizer). `locked` weights are fp32
    buffers, which ZeRO does not partition: every rank holds them whole.
    ZeRO-1/2 as deepspeed/runtime/zero/stage_1_and_2.py holds them: the fp32 master partition is a clone even when the
    weights are fp32, and the gradients also fill a reduce bucket (REDUCE_BUCKET_ELEMENTS in the weights' dtype; on
    a CPU only its written pages count: at most the trainable parameters, which is what is counted here).
    `ema` (train.ema): rank 0 also holds an fp32 copy of the trainable parameters, whole whatever the ZeRO stage
    (train/loop/parts/ema_weights.py), counted under "ema"; the plan is of rank 0, the rank holding the most."""
    half = precision in ("bf16", "fp16")
    w_b = 2 if half else 4
    weights = (trainable + frozen) * w_b
    grads = trainable * w_b
    optim = trainable * ((4 if half or zero_stage >= 1 else 0) + 8)
    if zero_stage >= 1:
        optim /= world
    if zero_stage >= 2:
        grads /= world
    if zero_stage in (1, 2):
        grads += min(trainable, REDUCE_BUCKET_ELEMENTS) * w_b
    if zero_stage >= 3:
        weights /= world
    weights += 4 * locked
    return {"weights": weights, "grads": grads, "optimizer": optim, **({"ema": 4 * trainable} if ema else {})}


@dataclass
class StagePlan:
    """The planner's answer for one stage."""
    name: str
    image_size: int
    context_length: int
    global_batch: int
    per_rank_batch: int
    trainable_params: int
    frozen_params: int
    flops_per_sample: float
    state_bytes: dict
    activation_bytes_per_sample: float
    activation_bytes_per_sample_ckpt: float
    micro_batch: Optional[int]
    accumulation_steps: Optional[int]
    grad_checkpointing: bool
    peak_bytes_per_rank: float
    steps: int
    total_flops: float
    wall_hours: Optional[float]
    gpu_hours: Optional[float]
    cpu_cores_per_gpu: Optional[dict]   # loader cores one GPU needs: {"cpu": decode: cpu, "device": decode: device}
    decode: str = "cpu"
    notes: list = field(default_factory=list)
    repeated_flops_per_sample: float = 0.0   # forward run again: checkpoint recompute, the accumulation's grad pass
    loader_streams: int = 1                  # canonical streams one rank reads, each with its shuffle buffer
    shuffle_buffer: int = 0                  # raw samples per stream
    shuffle_buffer_bytes: float = 0.0        # host memory per rank: streams x buffered samples x bytes a raw sample
    checkpoint_blocks: Optional[int] = None  # image-tower blocks recomputed (None: all or none, grad_checkpointing)
    image_depth: int = 1
    zero_stage: int = 1
    ranks_per_host: int = 1
    host_bytes: dict = field(default_factory=dict)   # host memory a node: shuffle buffers, workers, batches
    peak_at_one: float = math.nan            # process memory a rank (CUDA context included) at micro-batch 1, every
                                             # block recomputed
    state_by_zero: dict = field(default_factory=dict)   # ZeRO stage -> weights + grads + optimizer bytes a rank
    usable_bytes: float = math.nan           # the GPU's memory less MEMORY_RESERVE and the CUDA context
    step_margin_bytes: float = math.nan      # STEP_MARGIN of the peak: what a fit holds besides it
    model_flops: float = 0.0                 # steps x global batch x flops_per_sample: what MFU is of (total_flops
                                             # is executed: the forward run again included)
    efficiency_assumed: str = "hfu"          # which of hfu / mfu the time assumes (the other is derived)
    hfu: Optional[float] = None              # of the peak on the executed FLOPs (total_flops)
    mfu: Optional[float] = None              # of the peak on the model FLOPs (model_flops), as the training meter
    compile_s: float = 0.0                   # model.compile: the towers' compile before the first step, in the time

    @property
    def host_bytes_total(self) -> float:
        """Host memory one node needs for this stage's loaders."""
        return float(sum(self.host_bytes.values()))


def usable_bytes(gpu_memory: float) -> float:
    """What a step may hold on a GPU of `gpu_memory` bytes: less MEMORY_RESERVE and the CUDA context."""
    return gpu_memory * (1 - MEMORY_RESERVE) - CUDA_CONTEXT_BYTES


def fit_budget(gpu_memory: float) -> float:
    """The most a fitted step's peak with its STEP_MARGIN may be: the usable memory less HEADROOM of it."""
    return usable_bytes(gpu_memory) * (1 - HEADROOM)


def _divisors_desc(n: int) -> list[int]:
    return sorted({d for i in range(1, math.isqrt(n) + 1) if n % i == 0 for d in (i, n // i)}, reverse=True)


def logits_bytes(micro: int, global_batch: int) -> float:
    """Local-loss logits (micro x global, fp32, image and text side, with softmax grads): about 4 copies."""
    return 4 * 4.0 * micro * global_batch


def input_sample_bytes(stage, raw_sample_bytes: float = RAW_SAMPLE_BYTES) -> float:
    """Bytes of one sample of a batch as the stream yields it: a float32 image (decode: device: the JPEG) and int64
    tokens."""
    image = raw_sample_bytes if stage.decode == "device" else 4 * 3 * stage.image_size ** 2
    return image + 8 * stage.context_length


def buffered_samples(stage, samples_per_shard: int = SAMPLES_PER_SHARD) -> int:
    """Raw samples one stream's shuffle buffer holds at most: its size, or the samples of one shard group (the buffer
    is drained at the end of every group)."""
    st = stage.stream
    return min(st.shuffle_buffer, st.shards_per_group * samples_per_shard)


def host_bytes_per_node(stage, raw_sample_bytes: float = RAW_SAMPLE_BYTES,
                        samples_per_shard: int = SAMPLES_PER_SHARD) -> dict:
    """Host memory one node's loaders hold for `stage` (MEMORY_TERMS): the DataLoader workers (each its own pages and
    the item it builds: its share of a rank batch, decoded then collated; a rank's workers together, the trainer's
    pages they keep), the shuffle buffers of the canonical streams the node's ranks read (a raw sample: its members'
    bytes and SAMPLE_OBJECT_BYTES), and the batches in flight. A
    rank asks its K workers for prefetch_factor x K items each (train_stream: the DataLoader's prefetch_factor is
    data.prefetch_factor x K, and torch keeps prefetch_factor x workers items outstanding), one rank batch being K
    items: prefetch_factor x K rank batches outstanding, one of them being built (counted with the workers). With
    no workers the trainer reads its streams itself: the buffers only."""
    st = stage.stream
    if st is None:
        return {}
    sample = input_sample_bytes(stage, raw_sample_bytes)
    buffers = st.per_host * buffered_samples(stage, samples_per_shard) * (raw_sample_bytes + SAMPLE_OBJECT_BYTES)
    if not st.workers:
        return {"decode workers": 0.0, "shuffle buffers": float(buffers), "batches in flight": 0.0}
    decoded = 3 * stage.image_size ** 2 if stage.decode != "device" else 0   # uint8 pixels before the collate
    building = stage.per_rank_batch / st.workers * (sample + decoded)
    workers = CPU_FORK_RETAINED_BYTES + st.workers * (CPU_WORKER_BASE_BYTES + building)
    return {"decode workers": float(st.ranks_per_host * workers),
            "shuffle buffers": float(buffers),
            "batches in flight": float(st.ranks_per_host * (st.prefetch_factor * st.workers - 1)
                                       * stage.per_rank_batch * sample)}


def process_bytes(plan: "StagePlan", device: str = "cuda") -> dict:
    """Process memory of one rank (MEMORY_TERMS) on `device` ('cuda' or 'cpu'): its runtime and the step's peak."""
    return {"runtime": float(CUDA_CONTEXT_BYTES if device.startswith("cuda") else CPU_RUNTIME_BYTES),
            "step": float(plan.peak_bytes_per_rank)}


@dataclass(frozen=True)
class StepChoice:
    """How a rank runs its batch: micro-batch, and the image-tower blocks recomputed (None: all/none per ckpt)."""
    micro: int
    ckpt: bool
    blocks: Optional[int] = None


def _step_options(stage, per_rank: int, tune: bool) -> list:
    """The (micro-batch, checkpointing) choices, in the order the first that fits is taken: as configured (the
    largest micro-batch, checkpointing only if it must); tuned: every split of the rank batch with every number of
    image-tower blocks recomputed (a text tower that trains is recomputed all or none: its share is not traced
    apart)."""
    recomputed, depth = stage.image_blocks_recomputed
    if not tune:
        if stage.checkpoint_blocks is not None:
            return [StepChoice(m, recomputed > 0, recomputed) for m in _divisors_desc(per_rank)]
        ckpt_on = bool(stage.model.grad_checkpointing)
        return [StepChoice(m, c) for c in [ckpt_on] + ([True] if not ckpt_on else []) for m in _divisors_desc(per_rank)]
    blocks = range(depth + 1) if stage.model.lock_text and stage.partial_checkpointing else (0, depth)
    return [StepChoice(m, n > 0, n) for m in _divisors_desc(per_rank) for n in blocks]


def as_efficiency(efficiency) -> Efficiency:
    """An Efficiency; a bare number is an HFU (the planner always timed executed FLOPs at it)."""
    return efficiency if isinstance(efficiency, Efficiency) else Efficiency("hfu", float(efficiency))


def plan_stage(stage, measure: StageMeasure, gpu_memory: int, peak_tflops: Optional[float], efficiency,
               tune: bool = False) -> StagePlan:
    """Fit the stage on its world size of GPUs with `gpu_memory` bytes each; time at `efficiency` (an Efficiency,
    or a number: an HFU) of `peak_tflops`.
    `tune`: the fastest micro-batch and recomputed blocks that fit, instead of the configured checkpointing."""
    efficiency = as_efficiency(efficiency)
    gpus, per_rank = stage.world_size, stage.per_rank_batch
    dtype_scale = 0.5 if stage.precision in ("bf16", "fp16") else 1.0  # activations measured in fp32
    ema = stage.ema
    state = state_bytes_per_rank(measure.trainable_params, measure.frozen_params, stage.precision, stage.zero_stage,
                                 gpus, measure.locked_params, ema)
    fixed = sum(state.values()) + measure.activation_bytes_fixed * dtype_scale
    budget = fit_budget(gpu_memory)
    sample_in = input_sample_bytes(stage)
    depth = stage.image_blocks_recomputed[1]
    notes = []

    def share(c: StepChoice) -> float:   # of the checkpointable activations and grad forward recomputed
        return c.blocks / depth if c.blocks is not None else float(c.ckpt)

    def peak(c: StepChoice) -> float:
        saved = measure.activation_bytes_per_sample - measure.activation_bytes_per_sample_ckpt
        per = measure.activation_bytes_per_sample - share(c) * saved
        return fixed + (per * dtype_scale + sample_in) * c.micro + logits_bytes(c.micro, stage.global_batch)

    def extra(c: StepChoice) -> float:
        # k > 1: the grad pass repeats what the no-grad caching pass ran (a locked tower's features are reused);
        # checkpointing recomputes the forward in backward (a no-grad tower saved nothing to recompute)
        return measure.grad_forward_flops_per_sample * ((1 if per_rank // c.micro > 1 else 0) + share(c))

    options = _step_options(stage, per_rank, tune)
    if math.isnan(measure.activation_bytes_per_sample):   # memory not measured: the configured micro-batch
        blocks = stage.checkpoint_blocks
        choice = StepChoice(stage.micro_batch, bool(stage.image_blocks_recomputed[0]), blocks)
        notes.append("memory not measured (--no-memory): the run config's micro-batch, not checked to fit")
    else:
        fits = [c for c in options if peak(c) * (1 + STEP_MARGIN) <= budget]
        # tuned: the least compute, then the larger micro-batch; configured: the first that fits
        choice = min(fits, key=lambda c: (extra(c), -c.micro)) if tune and fits else (fits[0] if fits else None)
    if choice and not tune and choice.ckpt and not stage.image_blocks_recomputed[0]:
        notes.append("fits only with model.grad_checkpointing: true")
    if choice is None:
        notes.append("does not fit even at micro-batch 1 with gradient checkpointing: raise the ZeRO stage or GPUs")
    micro = choice.micro if choice else None
    k = per_rank // micro if micro else None
    repeated = extra(choice) if choice else 0.0
    total = (measure.flops_per_sample + repeated) * stage.steps * stage.global_batch
    model_total = measure.flops_per_sample * stage.steps * stage.global_batch
    hfu = efficiency.on_executed(model_total, total)
    wall = gpu_h = cores = None
    compile_s = COMPILE_S_PER_STAGE if stage.model.compile else 0.0
    if peak_tflops:
        seconds = total / (gpus * peak_tflops * 1e12 * hfu) + compile_s   # = model FLOPs / (GPUs x peak x MFU)
        wall, gpu_h = seconds / 3600, seconds * gpus / 3600
        per_gpu_rate = peak_tflops * 1e12 * hfu / (measure.flops_per_sample + repeated)
        cores = {"cpu": per_gpu_rate / loader_rate(CPU_DECODE_RATE, stage.image_size),
                 "device": per_gpu_rate / loader_rate(DEVICE_PATH_WORKER_RATE, stage.image_size)}
    planned_peak = peak(choice) if choice and not math.isnan(measure.activation_bytes_per_sample) else math.nan
    return StagePlan(stage.name, stage.image_size, stage.context_length, stage.global_batch, per_rank,
                     measure.trainable_params, measure.frozen_params + measure.locked_params,
                     measure.flops_per_sample, state,
                     measure.activation_bytes_per_sample * dtype_scale,
                     measure.activation_bytes_per_sample_ckpt * dtype_scale, micro, k, bool(choice and choice.ckpt),
                     planned_peak,
                     stage.steps, total, wall, gpu_h, cores,
                     stage.decode, notes, repeated_flops_per_sample=repeated, loader_streams=stage.loader_streams,
                     shuffle_buffer=stage.shuffle_buffer,
                     shuffle_buffer_bytes=float(stage.loader_streams * buffered_samples(stage)
                                                * (RAW_SAMPLE_BYTES + SAMPLE_OBJECT_BYTES)) if stage.stream else 0.0,
                     checkpoint_blocks=choice.blocks if choice else None, image_depth=depth,
                     zero_stage=stage.zero_stage, ranks_per_host=stage.stream.ranks_per_host if stage.stream else 1,
                     host_bytes=host_bytes_per_node(stage), peak_at_one=peak(StepChoice(1, True)) + CUDA_CONTEXT_BYTES,
                     state_by_zero={z: sum(state_bytes_per_rank(measure.trainable_params, measure.frozen_params,
                                                                stage.precision, z, gpus, measure.locked_params,
                                                                ema).values()) for z in ZERO_STAGES},
                     usable_bytes=usable_bytes(gpu_memory), step_margin_bytes=STEP_MARGIN * planned_peak,
                     model_flops=model_total, efficiency_assumed=efficiency.kind, hfu=hfu,
                     mfu=efficiency.on_model(model_total, total), compile_s=compile_s)


def plan_run(stages: list, gpu_memory: int, gpu: Optional[str] = None, efficiency=DEFAULT_EFFICIENCY,
             memory: bool = True) -> list[StagePlan]:
    """Plan every stage (ResolvedStages of one run, resolved for its number of GPUs) on GPUs of `gpu_memory` bytes
    (`memory=False`: without the activation trace, at the configured micro-batch), timed at `efficiency`."""
    return [plan_stage(s, measure_stage(s, memory=memory), gpu_memory, gpu_peak_tflops(gpu), efficiency)
            for s in stages]



def fit_micro_batch(stage, gpu_memory: int) -> int:
    """micro_batch auto: the largest per-rank micro-batch whose step fits `gpu_memory` bytes (resolve_stage on a
    GPU; dropped by mistake with the tune's commit, c804870, while stage_model.py still calls it)."""
    plan = plan_stage(stage, measure_stage(stage), gpu_memory, None, DEFAULT_EFFICIENCY)
    if plan.micro_batch is None:
        raise ConfigError(f"stages.{stage.index}.micro_batch: auto: even 1 sample per rank does not fit in "
                          f"{gpu_memory / 2 ** 30:.0f} GiB; fix: raise deepspeed.zero_stage or enable "
                          "model.grad_checkpointing")
    return plan.micro_batch


def tune_run(stages: list, gpu_memory: int, gpu: Optional[str] = None,
             efficiency=DEFAULT_EFFICIENCY) -> tuple[list[StagePlan], list[StagePlan]]:
    """(the fastest plan that fits: per stage the micro-batch and recomputed image blocks of least compute, and the
    ZeRO stage of the least total compute, the run config's plan): both from one measure of each stage.
    An assumed MFU is taken as measured at the run config's settings: each tuned stage runs at the HFU it gives
    there (the GPU's rate on executed FLOPs), so what the tune stops recomputing shows as time saved."""
    measures, peak = [measure_stage(s) for s in stages], gpu_peak_tflops(gpu)
    configured = [plan_stage(s, m, gpu_memory, peak, efficiency) for s, m in zip(stages, measures)]
    rates = [Efficiency("hfu", c.hfu) for c in configured]
    best = None
    for zero in ZERO_STAGES:
        plans = [plan_stage(_with_zero(s, zero), m, gpu_memory, peak, rate, tune=True)
                 for s, m, rate in zip(stages, measures, rates)]
        if all(p.micro_batch for p in plans) and (best is None or _flops(plans) < _flops(best)):
            best = plans
    return best or configured, configured


def _with_zero(stage, zero: int):
    """The ResolvedStage under another ZeRO stage, keeping what was counted of its model."""
    other = replace(stage, zero_stage=zero)
    other.__dict__.update({k: v for k, v in stage.__dict__.items() if k in ("counts", "_image_tower")})
    return other


def _flops(plans: list[StagePlan]) -> float:
    return sum(p.total_flops for p in plans)


def unfit_line(plans: list[StagePlan], gpu_memory: int, host_memory: Optional[int]) -> Optional[str]:
    """The one line that refuses a plan (None when it fits): the stage, the memory short, a setting that fits."""
    for p in plans:
        if p.micro_batch is None:
            need = p.peak_at_one
            fix = next((f"deepspeed.zero_stage: {z}" for z in ZERO_STAGES if z > p.zero_stage
                        and _fits_at_one(p, z, gpu_memory)), None) or \
                f"at least {_fmt_bytes(gpu_memory_for(need))} a GPU (--gpu-memory), or more GPUs to shard over"
            return (f"stage {p.name}: does not fit {_fmt_bytes(gpu_memory)} a GPU even at micro-batch 1 with every "
                    f"block recomputed: {_fmt_bytes(_with_margin(need) - fit_budget(gpu_memory))} short (with the "
                    f"{MEMORY_RESERVE:.0%} reserve, the {STEP_MARGIN:.0%} margin and {HEADROOM:.0%} headroom); "
                    f"fix: {fix}")
        if host_memory is not None and p.host_bytes_total > host_memory:
            short = p.host_bytes_total - host_memory
            room = p.host_bytes["shuffle buffers"] - short
            per_sample = RAW_SAMPLE_BYTES + SAMPLE_OBJECT_BYTES
            fix = (f"data.host_shuffle_buffer: {int(room // per_sample):,} (raw samples a node)" if room > 0 else
                   "fewer data.num_workers or ranks a node (--gpus-per-node)")
            return (f"stage {p.name}: host memory {_fmt_bytes(p.host_bytes_total)} a node ("
                    + ", ".join(f"{k} {_fmt_bytes(v)}" for k, v in p.host_bytes.items())
                    + f") exceeds --host-memory {_fmt_bytes(host_memory)} by {_fmt_bytes(short)}; fix: {fix}")
    return None


def _fits_at_one(p: StagePlan, zero: int, gpu_memory: int) -> bool:
    """Whether micro-batch 1 with every block recomputed fits under ZeRO `zero` (the state is what changes)."""
    return _with_margin(p.peak_at_one - p.state_by_zero[p.zero_stage] + p.state_by_zero[zero]) <= fit_budget(gpu_memory)


def _with_margin(process: float) -> float:
    """A process's step (its memory less the CUDA context) with STEP_MARGIN, as a fit holds it."""
    return (process - CUDA_CONTEXT_BYTES) * (1 + STEP_MARGIN)


def gpu_memory_for(process: float) -> float:
    """The GPU memory at which a process of `process` planned bytes (its CUDA context included) fits, with the
    margin, the reserve and the headroom: fit_budget's inverse."""
    return (_with_margin(process) / (1 - HEADROOM) + CUDA_CONTEXT_BYTES) / (1 - MEMORY_RESERVE)


# ---------------------------------------------------------------- printing
def _fmt_bytes(n: float) -> str:
    if math.isnan(n):
        return "not measured"
    return f"{n / 2 ** 30:.2f} GiB" if n >= 2 ** 30 else f"{n / 2 ** 20:.1f} MiB"


def _repeat_reason(p: StagePlan) -> str:
    """Why part of the forward runs twice: checkpoint recompute and/or the accumulation's grad pass."""
    return " and ".join(r for r, on in (("grad checkpointing", p.grad_checkpointing),
                                        ("accumulation", (p.accumulation_steps or 1) > 1)) if on)


def _fmt_flops(n: float) -> str:
    """FLOPs in the largest unit that leaves a number >= 1 (GFLOP for a paper-size sample, MFLOP for a tiny one)."""
    for unit, size in (("EFLOP", 1e18), ("PFLOP", 1e15), ("TFLOP", 1e12), ("GFLOP", 1e9), ("MFLOP", 1e6)):
        if abs(n) >= size:
            return f"{n / size:.1f} {unit}"
    return f"{n:.0f} FLOP"


def _ckpt_words(p: StagePlan) -> str:
    if p.checkpoint_blocks is not None and 0 < p.checkpoint_blocks < p.image_depth:
        return f" (grad checkpointing: {p.checkpoint_blocks} of {p.image_depth} image blocks)"
    return " (grad checkpointing)" if p.grad_checkpointing else ""


def _headroom_line(p: StagePlan) -> str:
    """What the stage's peak and its STEP_MARGIN leave free of the usable memory (HEADROOM)."""
    margin = p.step_margin_bytes
    free = p.usable_bytes - p.peak_bytes_per_rank - margin
    return (f"  headroom          {_fmt_bytes(free)} free ({free / p.usable_bytes:.1%} of the "
            f"{_fmt_bytes(p.usable_bytes)} a step may use: the GPU's memory less the {MEMORY_RESERVE:.0%} reserve and "
            f"the CUDA context) after the peak and its {STEP_MARGIN:.0%} margin, {_fmt_bytes(margin)} (what a "
            f"measured run held above the planned step); a fit keeps at least {HEADROOM:.0%}")


def format_tune(tuned: list[StagePlan], configured: list[StagePlan]) -> str:
    """What the tune chose, stage by stage, and what that saves against the run config's plan."""
    lines = [f"tuned: ZeRO-{tuned[0].zero_stage} (run config: ZeRO-{configured[0].zero_stage})"]
    for t, c in zip(tuned, configured):
        lines.append(f"  stage {t.name}: micro-batch {t.micro_batch}, k = {t.accumulation_steps}, recompute "
                     f"{t.checkpoint_blocks} of {t.image_depth} image blocks, peak {_fmt_bytes(t.peak_bytes_per_rank)}"
                     f" (run config: micro-batch {c.micro_batch}{_ckpt_words(c) or ', no checkpointing'}); "
                     f"{_fmt_flops(c.repeated_flops_per_sample - t.repeated_flops_per_sample)} a sample less")
    if tuned[0].gpu_hours is not None:
        before, after = sum(p.gpu_hours for p in configured), sum(p.gpu_hours for p in tuned)
        lines.append(f"  saves {before - after:,.0f} GPU-hours ({before:,.0f} -> {after:,.0f})")
    else:
        lines.append(f"  saves {_fmt_flops(_flops(configured) - _flops(tuned))}")
    return "\n".join(lines)


def run_utilisation(plans: list[StagePlan]) -> tuple[float, float]:
    """(HFU, MFU) of the whole run: its executed and its model FLOPs over the GPU time the stages take (each stage's
    time is its executed FLOPs at its HFU)."""
    time = sum(p.total_flops / p.hfu for p in plans)
    return sum(p.total_flops for p in plans) / time, sum(p.model_flops for p in plans) / time


def _efficiency_words(plans: list[StagePlan], efficiency) -> str:
    """'HFU 40% (assumed: ...) -> MFU 38.0% (...)', or from an assumed MFU the HFU it needs."""
    efficiency = as_efficiency(efficiency)
    hfu, mfu = run_utilisation(plans)
    if efficiency.kind == "hfu":
        return f"HFU {efficiency.value:.0%} (assumed: {HFU_WORDS}) -> MFU {mfu:.1%} ({MFU_WORDS})"
    tuned = f"; MFU {mfu:.1%} with these settings" if abs(mfu - efficiency.value) > 5e-4 else ""
    return f"MFU {efficiency.value:.0%} (assumed: {MFU_WORDS}) -> HFU {hfu:.1%} ({HFU_WORDS}{tuned})"


def _utilisation_words(p: StagePlan) -> str:
    """The stage's total line's tail: its HFU and MFU, the assumed one first; the compile the time includes."""
    pair = [f"HFU {p.hfu:.1%}", f"MFU {p.mfu:.1%}"]
    compiling = (f"; the time includes {p.compile_s:.0f} s of compiling (model.compile; assumed: the CPU's measured "
                 "largest, bench/bench_compile.py)" if p.compile_s and p.wall_hours is not None else "")
    return "; " + " -> ".join(pair if p.efficiency_assumed == "hfu" else pair[::-1]) + compiling


def format_plan(plans: list[StagePlan], gpus: int, gpu_memory: int, gpu: Optional[str], efficiency,
                zero_stage: int, precision: str) -> str:
    """The human-readable plan (what `crate-clip plan` prints), timed at `efficiency` (an Efficiency, or a number:
    an HFU)."""
    peak = gpu_peak_tflops(gpu)
    head = (f"plan: {gpus} x {gpu or 'GPU'} ({_fmt_bytes(gpu_memory)}"
            f"{f', {peak:.0f} TFLOP/s bf16 peak' if peak else ''}), ZeRO-{zero_stage}, {precision}, "
            + _efficiency_words(plans, efficiency))
    lines = [head]
    for p in plans:
        lines += [
            f"stage {p.name}: {p.image_size}px, {p.context_length} tokens, global batch {p.global_batch:,} "
            f"({p.per_rank_batch} per rank), {p.steps:,} steps",
            f"  parameters        {p.trainable_params / 1e6:.1f} M trainable, {p.frozen_params / 1e6:.1f} M frozen",
            f"  FLOPs per sample  {p.flops_per_sample / 1e9:.1f} GFLOP (forward + backward, counted)"
            + (f" + {p.repeated_flops_per_sample / 1e9:.1f} GFLOP forward run again ({_repeat_reason(p)})"
               if p.repeated_flops_per_sample else ""),
            f"  per-rank state    weights {_fmt_bytes(p.state_bytes['weights'])}, grads "
            f"{_fmt_bytes(p.state_bytes['grads'])}, optimizer {_fmt_bytes(p.state_bytes['optimizer'])}"
            + (f", EMA {_fmt_bytes(p.state_bytes['ema'])} (rank 0, train.ema)" if "ema" in p.state_bytes else ""),
            f"  activations       {_fmt_bytes(p.activation_bytes_per_sample)}/sample "
            f"({_fmt_bytes(p.activation_bytes_per_sample_ckpt)} with grad checkpointing)"
            if not math.isnan(p.activation_bytes_per_sample) else "  activations       not measured",
            (f"  micro-batch       {p.micro_batch} per rank, k = {p.accumulation_steps}{_ckpt_words(p)}, "
             f"peak {_fmt_bytes(p.peak_bytes_per_rank)}"
             if p.micro_batch else "  micro-batch       none fits"),
        ] + ([_headroom_line(p)] if p.micro_batch and not math.isnan(p.peak_bytes_per_rank) else []) + [
            f"  total             {p.total_flops / 1e18:.1f} EFLOP"
            + (f" executed ({p.model_flops / 1e18:.1f} EFLOP model)" if p.total_flops != p.model_flops else "")
            + (f", {p.wall_hours:.1f} h wall, {p.gpu_hours:,.0f} GPU-hours" if p.wall_hours is not None else
               " (give --gpu for time)") + _utilisation_words(p),
        ] + ([f"  loader CPU cores  {p.cpu_cores_per_gpu['cpu']:.1f} per GPU with decode: cpu, "
              f"{p.cpu_cores_per_gpu['device']:.1f} with decode: device (this stage: {p.decode})"]
             if p.cpu_cores_per_gpu else []) + [
            f"  shuffle buffers   {p.loader_streams * p.ranks_per_host} stream(s) a node ({p.loader_streams} a rank) x "
            f"{p.shuffle_buffer:,} samples = {_fmt_bytes(p.shuffle_buffer_bytes * p.ranks_per_host)} host memory a "
            f"node ({(RAW_SAMPLE_BYTES + SAMPLE_OBJECT_BYTES) / 1000:.1f} KB per raw DataComp sample, its Python "
            f"objects included)",
            f"  memory a node     process memory {_fmt_bytes(sum(process_bytes(p).values()))} a rank (CUDA context "
            f"{_fmt_bytes(CUDA_CONTEXT_BYTES)} + step peak) x {p.ranks_per_host}; host memory "
            f"{_fmt_bytes(p.host_bytes_total)} (" + ", ".join(f"{k} {_fmt_bytes(v)}" for k, v in p.host_bytes.items())
            + ")"] + [f"  note: {n}" for n in p.notes]
    lines += [f"{term}: {meaning}" for term, meaning in MEMORY_TERMS.items()]
    if plans and plans[0].gpu_hours is not None:
        total = sum(p.gpu_hours for p in plans)
        lines.append(f"all stages: {sum(p.wall_hours for p in plans):.1f} h wall, {total:,.0f} GPU-hours")
    return "\n".join(lines)


def plans_as_dicts(plans: list[StagePlan]) -> list[dict]:
    """JSON-ready form."""
    return [asdict(p) for p in plans]
