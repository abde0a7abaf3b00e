"""EMA of the trained weights (train.ema): an fp32 exponential moving average of the model's trained parameters,
kept by rank 0 beside the weights the optimizer trains, saved in each checkpoint, evaluated beside the live weights
at the stage's end and exportable (`crate-clip export --weights ema`).

In each stage the average starts at step train.ema.start_step as a copy of the weights (0: the stage's starting
weights), then every train.ema.every_steps steps takes them in: ema = decay x ema + (1 - decay) x weights. It restarts
in each stage, as the engine does: a stage may change the weights' shapes (patch size, position embeddings). It
averages the module's weights as the forward uses them (bf16 under bf16 precision: the rounding is averaged out;
exact under fp32), keyed by the module's parameter names, which are the consolidated checkpoint's keys; parameters
that are not trained (a locked text tower) are the live ones (checkpoint_io/ema_state.with_ema).

Under ZeRO-3 every rank holds a slice of each parameter: each update gathers them a group at a time
(deepspeed.zero.GatheredParameters, every rank taking part) and rank 0 takes them in; under ZeRO 0-2 rank 0 holds
them whole and the other ranks do nothing. Its state is job-wide (rank 0's alone), so a resume at another world size
takes it from the saved rank 0's file. It records the last step it took in: a checkpoint saved before this part saw
its step is caught up at the resume from the loaded weights, which are that step's, so a resume ends with the same
average, tensor for tensor, whatever the parts' order.
"""
from __future__ import annotations

from typing import Iterator, Optional

import torch

from crate_clip.checkpoint_io.ema_state import EMA_PART
from crate_clip.train.loop.parts.stage_part import LoopState, StagePart
from crate_clip.train.loop.stage_evals import rank0s
from crate_clip.train.run.run_config import EmaSection

GATHER_ELEMENTS = 1 << 26   # ZeRO-3: parameters gathered together per update (256 MiB in fp32 at most)


class EmaWeights(StagePart):
    """train.ema's average of one stage's trained parameters (rank 0 holds it; every rank runs its hooks)."""

    name = EMA_PART
    job_wide = True

    def __init__(self, settings: EmaSection, is_main: bool):
        self.decay, self.every, self.start = settings.decay, settings.every_steps, settings.start_step
        self.is_main = is_main
        self.seen: Optional[int] = None            # the last stage step taken in (None: not started)
        self.averages: Optional[dict[str, torch.Tensor]] = None   # rank 0: parameter name -> fp32 average

    @classmethod
    def for_stage(cls, cfg, stage, dist) -> Optional["EmaWeights"]:
        """The stage's EMA part, None when train.ema is off (`stage` unused: each stage starts its own)."""
        return cls(cfg.train.ema, dist.is_main) if cfg.train.ema.on else None

    # ------------------------------------------------------------ the hooks
    def on_stage_start(self, loop: LoopState) -> None:
        """Fresh, or resumed without a saved average (train.ema turned on at the resume): start at start_step, or
        now if the stage is past it. Resumed from a checkpoint saved before this part saw its step: take it in."""
        self.seen = rank0s(self.seen, loop.dist)   # rank 0 holds the saved state: every rank decides alike
        if self.averages is not None:
            self._check_fits(loop.engine)
            self.averages = {k: v.to(loop.dist.device) for k, v in self.averages.items()}
        if self.seen is None and loop.progress.step > self.start:
            loop.log.print(f"[note] train.ema starts at stage step {loop.progress.step} (resumed without a saved "
                           f"average; train.ema.start_step is {self.start})")
        self._take(loop.engine, loop.progress.step, catch_up=True)

    def on_step_end(self, loop: LoopState) -> None:
        self._take(loop.engine, loop.progress.step)

    def state_dict(self) -> Optional[dict]:
        """Rank 0: the last step taken in and the average (CPU copies); None on the other ranks."""
        if not self.is_main:
            return None
        weights = None if self.averages is None else {k: v.detach().to("cpu", copy=True)
                                                       for k, v in self.averages.items()}
        return {"seen": self.seen, "weights": weights}

    def load_state_dict(self, state: Optional[dict]) -> None:
        if state is None:
            return
        self.seen, self.averages = state.get("seen"), state.get("weights")

    def weights(self) -> Optional[dict]:
        """Rank 0: the average (parameter name -> fp32 CPU tensor) for the stage-end evaluation and the export; None
        before it started and on the other ranks."""
        if self.averages is None:
            return None
        return {k: v.detach().to("cpu", copy=True) for k, v in self.averages.items()}

    # ------------------------------------------------------------ the arithmetic
    def due(self, step: int) -> bool:
        """Whether the average takes in the weights after stage step `step` (the start copies them)."""
        return step >= self.start and (step - self.start) % self.every == 0

    def _take(self, engine, step: int, catch_up: bool = False) -> None:
        """Take in the weights of `step` if due (started: copied at start_step or at the first step after it
        with no average); every rank, in the same steps (ZeRO-3 gathers)."""
        if step < self.start or (self.seen is not None and step <= self.seen):
            return
        start = self.seen is None
        if start or self.due(step):
            for name, live in _trained_parameters(engine):
                if self.is_main:
                    self._update(name, live, start)
        elif catch_up:
            return   # a resumed step that was not due: nothing to redo, seen moves on with the next step
        self.seen = step

    def _update(self, name: str, live: torch.Tensor, start: bool) -> None:
        if start:
            if self.averages is None:
                self.averages = {}
            self.averages[name] = live.detach().to(torch.float32, copy=True)
            return
        average = self.averages[name]
        average.mul_(self.decay).add_(live.detach().to(average.device, torch.float32), alpha=1 - self.decay)

    def _check_fits(self, engine) -> None:
        """The saved average must be of this stage's parameters (names and shapes)."""
        shapes = {name: tuple(_full_shape(p)) for name, p in engine.module.named_parameters() if p.requires_grad}
        for name, tensor in self.averages.items():
            if shapes.get(name) != tuple(tensor.shape):
                raise ValueError(f"the checkpoint's EMA weights do not fit this stage's model: {name} "
                                 f"{tuple(tensor.shape)} vs {shapes.get(name, 'no such parameter')}")


def _full_shape(param) -> torch.Size:
    """A parameter's shape (ZeRO-3: the whole one, not its slice)."""
    return getattr(param, "ds_shape", None) or param.shape


def _trained_parameters(engine) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, whole tensor) of each trained parameter; ZeRO-3's slices gathered a group at a time, on every rank."""
    params = [(name, p) for name, p in engine.module.named_parameters() if p.requires_grad]
    if not any(hasattr(p, "ds_id") for _, p in params):
        yield from params
        return
    import deepspeed

    group, size = [], 0
    for item in params + [None]:
        if item is not None and (not group or size + item[1].ds_numel <= GATHER_ELEMENTS):
            group.append(item)
            size += item[1].ds_numel
            continue
        with deepspeed.zero.GatheredParameters([p for _, p in group], modifier_rank=None):
            yield from group
        group, size = ([item], item[1].ds_numel) if item is not None else ([], 0)
