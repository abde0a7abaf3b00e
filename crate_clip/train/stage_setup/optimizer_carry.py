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

Under ZeRO 0 in fp32 (the demo's setting) DeepSpeed steps torch's own AdamW on the parameters themselves, whose
state is already whole and per parameter: it is read and written there directly, with the same rules. ZeRO 3, and
ZeRO 0 in bf16 / fp16 (DeepSpeed's mixed-precision wrappers), are refused when the run starts.
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
    """Refuse, before anything trains, a run whose stages carry AdamW state where this module cannot write it (ZeRO
    3; ZeRO 0 outside fp32): ConfigError, one line (exit code 2)."""
    problem = carry_problem(cfg, zero_stage_of(cfg))
    if problem:
        raise ConfigError(f"invalid run config:\n  {problem}")


def carry_problem(cfg, zero_stage: int) -> Optional[str]:
    """The line check_carry refuses with; None when the run can carry (or carries nothing)."""
    carrying = [i for i, s in enumerate(cfg.stages) if s.optimizer_state == CARRY]
    if not carrying or zero_stage in (1, 2) or (zero_stage == 0 and cfg.precision == "fp32"):
        return None
    return (f"stages.{carrying[0]}.optimizer_state: carry works under ZeRO stage 1 or 2, or 0 in fp32; this run "
            f"uses ZeRO {zero_stage} in {cfg.precision}; fix: deepspeed.zero_stage 1 or 2, or optimizer_state fresh")


def _zero_optimizer(engine):
    """DeepSpeed's ZeRO 1/2 optimizer of `engine`, or None under ZeRO 0 in fp32 (torch's own optimizer, per
    parameter); the run config refuses carry elsewhere."""
    opt = engine.optimizer
    if hasattr(opt, "single_partition_of_fp32_groups"):
        return opt
    if isinstance(opt, torch.optim.Optimizer):   # DeepSpeed's wrappers are not torch optimizers
        return None
    raise RuntimeError("optimizer_state carry needs DeepSpeed's ZeRO stage 1 or 2 optimizer, or torch's own (ZeRO 0, "
                       f"fp32), not {type(opt).__name__}")


def _trained(engine) -> list:
    return [(name, p) for name, p in engine.module.named_parameters() if p.requires_grad]


def collect_state(engine) -> CarriedState:
    """Every rank (the ZeRO gathers are collectives): the optimizer step and the whole moments of every trained
    parameter."""
    from deepspeed.utils import safe_get_full_optimizer_state   # lazy: DeepSpeed's import is slow

    opt = _zero_optimizer(engine)
    if opt is None:
        return _collect_per_parameter(engine)
    state = opt.optimizer.state
    if not state:   # the stage trained no step: nothing to carry
        return CarriedState(0.0, {})
    # each parameter's slice views the state only from the first step (and a checkpoint load replaces the
    # state's tensors): (re)make the views now
    opt._hp_optimizer_states_linked = False
    opt._lazy_init_hp_params_optimizer_state()
    step = float(next(iter(state.values()))["step"])
    moments = {name: {k: safe_get_full_optimizer_state(param, k).detach().to("cpu", copy=True) for k in MOMENTS}
               for name, param in _trained(engine)}
    return CarriedState(step, moments)


def _collect_per_parameter(engine) -> CarriedState:
    """collect_state under ZeRO 0 in fp32: AdamW's own state of each parameter (whole on every rank)."""
    state = engine.optimizer.state
    kept = [(name, state[p]) for name, p in _trained(engine) if p in state]
    if not kept:   # the stage trained no step
        return CarriedState(0.0, {})
    return CarriedState(float(kept[0][1]["step"]),
                        {name: {k: s[k].detach().to("cpu", copy=True) for k in MOMENTS} for name, s in kept})


def apply_state(engine, carried: CarriedState) -> CarryReport:
    """Put `carried` into a fresh engine's optimizer (every rank): the step on every flat partition, each
    parameter's moments where its shape is unchanged, zero moments elsewhere."""
    from deepspeed.utils import safe_set_full_optimizer_state

    opt = _zero_optimizer(engine)
    if opt is None:
        return _apply_per_parameter(engine, carried)
    inner = opt.optimizer
    for group in inner.param_groups:   # AdamW makes its state at the first step; make it now, to write into
        for flat in group["params"]:
            inner.state[flat] = {"step": torch.tensor(carried.step, dtype=torch.float32),
                                 "exp_avg": torch.zeros_like(flat), "exp_avg_sq": torch.zeros_like(flat)}
    opt._hp_optimizer_states_linked = False
    opt._lazy_init_hp_params_optimizer_state()   # each parameter's slice now views the state above
    report = CarryReport([], [])
    for name, param in _trained(engine):
        saved = _saved_moments(carried, name, param, report)
        for k in MOMENTS if saved else ():
            safe_set_full_optimizer_state(param, saved[k].to(param.device), k)
    return report


def _apply_per_parameter(engine, carried: CarriedState) -> CarryReport:
    """apply_state under ZeRO 0 in fp32: each parameter's AdamW state made as torch's AdamW makes it at its first
    step (the step a tensor on the parameter's device for the fused kernel, else on the CPU), then filled."""
    opt = engine.optimizer
    for group in opt.param_groups:
        on_device = group.get("fused") or group.get("capturable")
        for p in group["params"]:
            opt.state[p] = {"step": torch.tensor(carried.step, dtype=torch.float32,
                                                 device=p.device if on_device else "cpu"),
                            "exp_avg": torch.zeros_like(p, memory_format=torch.preserve_format),
                            "exp_avg_sq": torch.zeros_like(p, memory_format=torch.preserve_format)}
    report = CarryReport([], [])
    for name, param in _trained(engine):
        saved = _saved_moments(carried, name, param, report)
        for k in MOMENTS if saved else ():
            opt.state[param][k].copy_(saved[k])
    return report


def _saved_moments(carried: CarriedState, name: str, param, report: CarryReport) -> Optional[dict]:
    """The moments carried for `name` when their shape is the parameter's (recorded as carried), else None
    (recorded as reset: zero moments)."""
    saved: Optional[dict] = carried.moments.get(name)
    if saved is None or saved["exp_avg"].shape != param.shape:
        report.reset.append(name)
        return None
    report.carried.append(name)
    return saved
