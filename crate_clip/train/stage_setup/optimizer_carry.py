"""`stages.N.optimizer_state: carry`: a stage starts with AdamW's moments and step count from the stage before it,
instead of a fresh optimizer (`fresh`, the default).

Under ZeRO 1/2 each rank holds a slice of one flat fp32 partition per parameter group, and its AdamW state (exp_avg,
exp_avg_sq, step) lives on those slices; the next stage's model may have parameters of other shapes (a resized patch
kernel, a grown position embedding), so the flat layout changes. The state is therefore carried per named parameter,
as whole tensors: gathered from every rank's slice at the end of the stage (DeepSpeed's safe_get_full_optimizer_state)
and written into the new stage's slices (safe_set_full_optimizer_state). A parameter whose shape changed at the
boundary starts from zero moments: its old moments belong to another tensor. The step count is carried for every
parameter (one per group in ZeRO's flat partitions), so the zero moments of a reshaped parameter get no bias
correction: its first updates are ~0.45x a warm one's and grow to full size within ~1/(1 - beta2) steps.
"""
import dataclasses
from typing import Optional

import torch

from crate_clip.core.errors import ConfigError
from crate_clip.train.stage_setup.engine import zero_stage_of

MOMENTS = ("exp_avg", "exp_avg_sq")
CARRY, FRESH = "carry", "fresh"


@dataclasses.dataclass
class CarriedState:
    """AdamW's state at the end of a stage: the step count and each trained parameter's moments (CPU, full)."""
    step: float
    moments: dict          # parameter name -> {"exp_avg": tensor, "exp_avg_sq": tensor}


@dataclasses.dataclass
class CarryReport:
    carried: list          # names whose moments were carried
    reset: list            # names that start from zero moments (another shape, or none saved)

    def line(self, stage_name: str, step: float) -> str:
        reset = f"; zero moments for {', '.join(self.reset)} (another shape)" if self.reset else ""
        return (f"[optimizer] stage {stage_name}: AdamW state carried from the previous stage (step {int(step)}, "
                f"{len(self.carried)} parameters){reset}")


def check_carry(cfg) -> None:
    """Refuse, before anything trains, a run whose stages carry AdamW state under a ZeRO stage without flat fp32
    partitions to write it into (0, 3): ConfigError, one line (exit code 2)."""
    problem = carry_problem(cfg, zero_stage_of(cfg))
    if problem:
        raise ConfigError(f"invalid run config:\n  {problem}")


def carry_problem(cfg, zero_stage: int) -> Optional[str]:
    """The line check_carry refuses with; None when the run can carry (or carries nothing)."""
    carrying = [i for i, s in enumerate(cfg.stages) if s.optimizer_state == CARRY]
    if carrying and zero_stage not in (1, 2):
        return (f"stages.{carrying[0]}.optimizer_state: carry works under ZeRO stage 1 or 2, this run uses "
                f"{zero_stage}; fix: deepspeed.zero_stage 1 or 2, or optimizer_state fresh")
    return None


def _zero_optimizer(engine):
    """DeepSpeed's ZeRO 1/2 optimizer of `engine` (carry is refused for the other ZeRO stages by the run config)."""
    opt = engine.optimizer
    if not hasattr(opt, "single_partition_of_fp32_groups"):
        raise RuntimeError("optimizer_state carry needs DeepSpeed's ZeRO stage 1 or 2 optimizer")
    return opt


def collect_state(engine) -> CarriedState:
    """Every rank (the gathers are collectives): the optimizer step and the whole moments of every trained
    parameter, from this engine's ZeRO partitions."""
    from deepspeed.utils import safe_get_full_optimizer_state   # lazy: DeepSpeed's import is slow

    opt = _zero_optimizer(engine)
    state = opt.optimizer.state
    if not state:   # the stage trained no step: nothing to carry
        return CarriedState(0.0, {})
    # each parameter's slice views the state only from the first step (and a checkpoint load replaces the
    # state's tensors): (re)make the views now
    opt._hp_optimizer_states_linked = False
    opt._lazy_init_hp_params_optimizer_state()
    step = float(next(iter(state.values()))["step"])
    moments = {}
    for name, param in engine.module.named_parameters():
        if param.requires_grad:
            moments[name] = {k: safe_get_full_optimizer_state(param, k).detach().to("cpu", copy=True)
                             for k in MOMENTS}
    return CarriedState(step, moments)


def apply_state(engine, carried: CarriedState) -> CarryReport:
    """Put `carried` into a fresh engine's optimizer (every rank): the step on every flat partition, each
    parameter's moments where its shape is unchanged, zero moments elsewhere."""
    from deepspeed.utils import safe_set_full_optimizer_state

    opt = _zero_optimizer(engine)
    inner = opt.optimizer
    for group in inner.param_groups:   # AdamW makes its state at the first step; make it now, to write into
        for flat in group["params"]:
            inner.state[flat] = {"step": torch.tensor(carried.step, dtype=torch.float32),
                                 "exp_avg": torch.zeros_like(flat), "exp_avg_sq": torch.zeros_like(flat)}
    opt._hp_optimizer_states_linked = False
    opt._lazy_init_hp_params_optimizer_state()   # each parameter's slice now views the state above
    report = CarryReport([], [])
    for name, param in engine.module.named_parameters():
        if not param.requires_grad:
            continue
        saved: Optional[dict] = carried.moments.get(name)
        if saved is None or saved["exp_avg"].shape != param.shape:
            report.reset.append(name)
            continue
        for k in MOMENTS:
            safe_set_full_optimizer_state(param, saved[k].to(param.device), k)
        report.carried.append(name)
    return report
