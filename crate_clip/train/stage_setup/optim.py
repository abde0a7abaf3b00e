"""Optimizer parameter groups and the per-stage learning-rate schedule (linear warm-up, cosine decay)."""
from __future__ import annotations

import math

import torch

# Parameter names (last component, or any component for containers) that are never decayed: embeddings,
# the CRATE-alpha sparse-coding dictionaries D and D1 (the published recipe decays only matrix kernels),
# and the temperature.
NO_DECAY_NAMES = {"token_embedding", "positional_embedding", "pos_embed", "cls_token", "class_embedding",
                  "D", "D1", "logit_scale", "logit_bias", "reg_token"}


def is_no_decay(name: str, param: torch.Tensor, extra: set[str] = frozenset()) -> bool:
    """True for norms, biases, embeddings, the dictionaries D/D1 and the logit scale."""
    parts = name.split(".")
    if name in extra or param.ndim < 2:        # biases, norm weights, logit_scale ([] or [1])
        return True
    return any(p in NO_DECAY_NAMES for p in parts) or parts[-1] == "bias"


def _tower_no_weight_decay(model: torch.nn.Module) -> set[str]:
    """Names the timm image tower itself declares as not decayed (timm's no_weight_decay()), fully prefixed."""
    names = set()
    for prefix, module in model.named_modules():
        fn = getattr(module, "no_weight_decay", None)
        if callable(fn) and prefix:
            try:
                names |= {f"{prefix}.{n}" for n in fn()}
            except TypeError:
                pass
    return names


def param_groups(model: torch.nn.Module, weight_decay: float) -> list[dict]:
    """Two AdamW groups: decayed matrix kernels and non-decayed everything else (named in each group)."""
    extra = _tower_no_weight_decay(model)
    decay, no_decay, decay_names, no_decay_names = [], [], [], []
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        if is_no_decay(name, p, extra):
            no_decay.append(p)
            no_decay_names.append(name)
        else:
            decay.append(p)
            decay_names.append(name)
    groups = [{"params": decay, "weight_decay": weight_decay, "names": decay_names},
              {"params": no_decay, "weight_decay": 0.0, "names": no_decay_names}]
    return [g for g in groups if g["params"]]


def warmup_cosine(step: int, *, total_steps: int, warmup_steps: int, min_ratio: float = 0.0) -> float:
    """LR multiplier at `step` (0-based): linear warm-up to 1, then cosine down to `min_ratio` at the end."""
    if warmup_steps > 0 and step < warmup_steps:
        return (step + 1) / warmup_steps
    span = max(1, total_steps - warmup_steps)
    progress = min(1.0, (step - warmup_steps) / span)
    return min_ratio + (1.0 - min_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))


# Devices with torch's fused AdamW kernel (torch >= 2.4 on the CPU); elsewhere the default implementation.
FUSED_DEVICES = ("cpu", "cuda")


def build_optimizer(model: torch.nn.Module, *, lr: float, weight_decay: float, betas, eps: float):
    """torch AdamW over the weight-decay groups (DeepSpeed wraps a torch optimizer; no C++ op build), fused where
    torch has the kernel for every parameter: one multi-tensor update instead of a loop over ~100 tensors, which
    took 12.6% of the demo's CPU step (BENCHMARKS.md, "Issue 42: the demo's step, ZeRO stage x AdamW")."""
    groups = param_groups(model, weight_decay)
    for g in groups:
        g.pop("names")
    fused = all(p.is_floating_point() and p.device.type in FUSED_DEVICES for g in groups for p in g["params"])
    return torch.optim.AdamW(groups, lr=lr, betas=tuple(betas), eps=eps, fused=fused or None)


def build_schedule(optimizer, *, total_steps: int, warmup_steps: int, lr: float, min_lr: float):
    """A LambdaLR stepping once per optimizer step of the stage (state saved in DeepSpeed checkpoints)."""
    min_ratio = min_lr / lr if lr > 0 else 0.0

    def multiplier(step: int) -> float:
        return warmup_cosine(step, total_steps=total_steps, warmup_steps=warmup_steps, min_ratio=min_ratio)

    return torch.optim.lr_scheduler.LambdaLR(optimizer, multiplier)


# what a stage's run config sets in each optimizer group; a checkpoint load puts the saved values back over them
GROUP_SETTINGS = ("weight_decay", "betas", "eps")


def schedule_settings(scheduler) -> dict:
    """The peak learning rates and group settings a freshly built engine has from the run config (taken before a
    checkpoint is loaded over them)."""
    groups = scheduler.optimizer.param_groups
    return {"base_lrs": list(scheduler.base_lrs),
            "groups": [{key: group[key] for key in GROUP_SETTINGS if key in group} for group in groups]}


def restore_schedule_settings(scheduler, settings: dict) -> None:
    """After a checkpoint load (step count, moments and schedule position kept): the run config's settings
    again, so that the next step's learning rate is the config's schedule at the step reached,
    lr x warmup_cosine(step) (the same value when nothing changed; docs/training.md, "Changing the config of a
    run")."""
    scheduler.base_lrs = list(settings["base_lrs"])
    for group, fresh, base, multiplier in zip(scheduler.optimizer.param_groups, settings["groups"],
                                              scheduler.base_lrs, scheduler.lr_lambdas):
        group.update(fresh)
        group["initial_lr"] = base
        group["lr"] = base * multiplier(scheduler.last_epoch)   # LambdaLR's own expression: bit-equal
    scheduler._last_lr = [group["lr"] for group in scheduler.optimizer.param_groups]
