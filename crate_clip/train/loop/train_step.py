"""One optimizer step on all ranks: forward, contrastive loss, backward, DeepSpeed step.

A rank's batch (global_batch / world) is split into k = batch / micro_batch micro-batches when the engine
was built with gradient accumulation (DeepSpeed's gradient_accumulation_steps). Plain accumulation would
change the contrastive loss (each micro-batch would only see its own negatives), so the step uses the
feature-cache scheme (GradCache):

    1. forward all k micro-batches without grad, caching the normalised features (RNG state saved before each)
    2. the loss of the full batch on the cached features -> d loss / d features and d loss / d logit_scale
    3. per micro-batch: restore its RNG state (same image token mask and drop-path draws as in 1),
       forward with grad, backward of <features, d loss / d features> (+ the logit scale's term once,
       in the first micro-batch only), DeepSpeed step (an optimizer step only at the k-th)

The surrogate's gradient is the exact gradient of the full-batch loss, so DeepSpeed must not divide it by
k again: backward runs with scale_wrt_gas=False. Ranks average as in k = 1 (DeepSpeed divides by world).

Host syncs: one per step (the .tolist() of [loss, non-finite flag, logit scale, grad norm]). The gradient norm
is the global L2 norm of the rank-averaged gradients before clipping, under every ZeRO stage:
- ZeRO 1-3, and ZeRO 0 in bf16/fp16: DeepSpeed's optimizer wrapper measures it, all-reduced, and its overflow
  check skips the step on every rank when it is NaN / infinite (norm reported as inf, as DeepSpeed does).
- ZeRO 0 in fp32 (the demo's): DeepSpeed steps the torch AdamW as it is, which measures no norm and applies a
  NaN gradient. There the engine is built without DeepSpeed's clipping (stage_setup/engine.py:
  clips_in_train_step) and step_measured measures the norm itself (one fused norm; the gradients are already
  all-reduced after the last backward, so every rank gets the same number with no collective), clips by it,
  and drops the gradients of a non-finite step so that the optimizer finds none. Its one sync comes before
  the optimizer step (whether to step depends on it), as DeepSpeed's own overflow checks' do.
Either way a skipped step is reported as skipped and the schedule moves on.
"""
from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as tdist
from torch.nn.attention import SDPBackend, sdpa_kernel

MAX_LOGIT_SCALE = 100.0  # CLIP's cap on exp(logit_scale)


@dataclass
class StepResult:
    """What one step did: mean loss over ranks (None when skipped), logit scale, gradient norm, why skipped."""
    loss: Optional[float]
    logit_scale: float
    grad_norm: Optional[float] = None
    skipped: Optional[str] = None  # None | "nonfinite_loss" | "nonfinite_grad" | "loss_scale_overflow"


def attention_kernel(name: str, device: str):
    """Context choosing scaled_dot_product_attention's kernel for the forward (the backward follows it)."""
    if name == "auto":
        name = "math" if device == "cpu" else "default"
    if name == "default":
        return contextlib.nullcontext()
    backend = {"math": SDPBackend.MATH, "flash": SDPBackend.FLASH_ATTENTION,
               "efficient": SDPBackend.EFFICIENT_ATTENTION}[name]
    return sdpa_kernel(backend)


def forward_features(engine, images: torch.Tensor, tokens: Optional[torch.Tensor]):
    """(image features, text features or None, clamped logit scale), features in fp32. The clamp acts out
    of place on what the fp32 master weights produce (an in-place clamp of the parameter would not reach them)."""
    out = engine(image=images, text=tokens)
    if isinstance(out, dict):
        image_f, text_f, scale = out["image_features"], out["text_features"], out["logit_scale"]
    else:
        image_f, text_f, scale = out[:3]
    scale = scale.float().clamp(max=MAX_LOGIT_SCALE).reshape(())
    return image_f.float(), (text_f.float() if text_f is not None else None), scale


def forward_loss(engine, loss_fn, images: torch.Tensor, tokens: torch.Tensor):
    """Contrastive loss of one batch and the (detached) logit scale."""
    image_f, text_f, scale = forward_features(engine, images, tokens)
    return loss_fn(image_f, text_f, scale), scale.detach()


def accumulation_steps(engine) -> int:
    """k: DeepSpeed's gradient_accumulation_steps of this engine (1 without accumulation)."""
    return int(engine.gradient_accumulation_steps()) if hasattr(engine, "gradient_accumulation_steps") else 1


def text_tower_trains(engine) -> bool:
    """Whether any text-tower parameter is trained (a locked text tower's features can be reused)."""
    module = getattr(engine, "module", engine)
    return any(p.requires_grad for n, p in module.named_parameters()
               if not n.startswith("visual.") and n not in ("logit_scale", "logit_bias"))


# ---------------------------------------------------------------- RNG per micro-batch
def _rng_snapshot(device: torch.device):
    return torch.get_rng_state(), (torch.cuda.get_rng_state(device) if device.type == "cuda" else None)


def _rng_restore(snapshot, device: torch.device) -> None:
    cpu, cuda = snapshot
    torch.set_rng_state(cpu)
    if cuda is not None:
        torch.cuda.set_rng_state(cuda, device)


# ---------------------------------------------------------------- the two backward paths
def backward_direct(engine, loss_fn, images, tokens):
    """k = 1: one forward with grad over the rank's batch and one backward (no optimizer step here)."""
    loss, scale = forward_loss(engine, loss_fn, images, tokens)
    engine.backward(loss)
    return loss.detach(), scale


def backward_accumulated(engine, loss_fn, images, tokens, k: int, device: torch.device):
    """k > 1: the feature-cache scheme (module docstring). All micro-steps but the last are stepped here;
    the caller's engine.step() is the accumulation boundary."""
    micro = images.shape[0] // k
    chunks = [(images[i * micro:(i + 1) * micro], tokens[i * micro:(i + 1) * micro]) for i in range(k)]
    snapshots, image_parts, text_parts = [], [], []
    with torch.no_grad():
        for im, tok in chunks:
            snapshots.append(_rng_snapshot(device))
            image_f, text_f, scale = forward_features(engine, im, tok)
            image_parts.append(image_f)
            text_parts.append(text_f)
    after = _rng_snapshot(device)
    image_all = torch.cat(image_parts).requires_grad_(True)
    text_all = torch.cat(text_parts)
    train_text = text_tower_trains(engine)
    text_all.requires_grad_(train_text)
    scale_leaf = scale.detach().clone().requires_grad_(True)
    loss = loss_fn(image_all, text_all, scale_leaf)
    leaves = [image_all, scale_leaf] + ([text_all] if train_text else [])
    grads = torch.autograd.grad(loss, leaves)
    g_image, g_scale = grads[0], grads[1]
    g_text = grads[2] if train_text else None
    for j, (im, tok) in enumerate(chunks):
        _rng_restore(snapshots[j], device)
        # a locked text tower: its cached features are final, the re-forward runs the image tower only
        image_f, text_f, scale_j = forward_features(engine, im, tok if train_text else None)
        rows = slice(j * micro, (j + 1) * micro)
        surrogate = (image_f * g_image[rows]).sum()
        if train_text:
            surrogate = surrogate + (text_f * g_text[rows]).sum()
        # the logit scale's gradient once per step; * 0 keeps the parameter in every micro-step's graph
        surrogate = surrogate + scale_j * (g_scale if j == 0 else torch.zeros_like(g_scale))
        engine.backward(surrogate, scale_wrt_gas=False)
        if j < k - 1:
            engine.step()  # not a boundary: DeepSpeed only counts the micro-step
    _rng_restore(after, device)
    return loss.detach(), scale.detach()


# ---------------------------------------------------------------- one step
def train_step(engine, loss_fn, images, tokens, dist, dtype, attention: str = "auto",
               before_step=None) -> StepResult:
    """One optimizer step on all ranks (k micro-batches when the engine accumulates); skipped on every rank
    when some rank's loss or the global gradient norm is NaN / infinite. `before_step(engine)` runs after
    the last backward, before the optimizer step (the full gradients are readable there)."""
    device = torch.device(dist.device)
    images = images.to(device, dtype=dtype, non_blocking=True)
    tokens = tokens.to(device, non_blocking=True)
    k = accumulation_steps(engine)
    if images.shape[0] % k:
        raise ValueError(f"rank batch {images.shape[0]} is not divisible into {k} micro-batches "
                         f"(stages.N.micro_batch must divide global_batch / world_size)")
    with attention_kernel(attention, device.type):
        if k == 1:
            loss, scale = backward_direct(engine, loss_fn, images, tokens)
        else:
            loss, scale = backward_accumulated(engine, loss_fn, images, tokens, k, device)
    finite = torch.isfinite(loss)
    stats = torch.stack([torch.where(finite, loss.float(), torch.zeros_like(loss, dtype=torch.float32)),
                         (~finite).float(), scale.float()])
    tdist.all_reduce(stats)  # queued on the device; read below together with the norm
    if before_step is not None:
        before_step(engine)
    if getattr(engine, "grad_clip_in_step", None) is not None:
        return step_measured(engine, stats, dist, engine.grad_clip_in_step)
    engine.step()
    applied = engine.was_step_applied() if hasattr(engine, "was_step_applied") else True
    norm = engine.get_global_grad_norm() if hasattr(engine, "get_global_grad_norm") else None
    norm_t = torch.as_tensor(float("nan") if norm is None else norm, dtype=torch.float32).to(stats.device)
    loss_sum, bad_losses, scale_sum, grad_norm = torch.cat([stats, norm_t.reshape(1)]).tolist()  # the one sync
    scale_value = scale_sum / dist.world_size
    grad_norm = None if norm is None else grad_norm
    if bad_losses > 0 or not applied:
        # DeepSpeed's overflow check discarded the gradients on every rank (the norm is global) and did not
        # move the schedule: move it, so the stage still ends after its planned samples
        engine.lr_scheduler.step()
        reason = ("nonfinite_loss" if bad_losses > 0 else
                  "loss_scale_overflow" if dtype == torch.float16 else "nonfinite_grad")
        if applied:  # a non-finite loss whose gradients were finite: cannot happen through softmax, but say so
            raise RuntimeError("a non-finite loss produced an applied optimizer step; the weights are suspect")
        return StepResult(None, scale_value, grad_norm, reason)
    return StepResult(loss_sum / dist.world_size, scale_value, grad_norm, None)


def step_measured(engine, stats: torch.Tensor, dist, grad_clip: float) -> StepResult:
    """The optimizer step of an engine whose optimizer measures no gradient norm (ZeRO 0 in fp32, built without
    DeepSpeed's clipping): the norm of the all-reduced gradients, read with the step's stats in its one sync;
    clipped by it as DeepSpeed would (max_norm / (norm + 1e-6), at most 1); a non-finite step's gradients dropped,
    so that DeepSpeed's step moves its counters and the schedule while the optimizer, finding no gradient, moves
    nothing (no weight, no moment, no step count)."""
    params = [p for p in engine.module.parameters() if p.grad is not None]
    norm = torch.nn.utils.get_total_norm([p.grad for p in params])   # every rank holds the same (averaged) grads
    loss_sum, bad_losses, scale_sum, grad_norm = torch.cat([stats, norm.float().reshape(1).to(stats.device)]).tolist()
    scale_value = scale_sum / dist.world_size
    if bad_losses > 0 or not math.isfinite(grad_norm):
        for p in params:
            p.grad = None
        engine.step()
        return StepResult(None, scale_value, float("inf"), "nonfinite_loss" if bad_losses > 0 else "nonfinite_grad")
    if grad_clip > 0:
        torch.nn.utils.clip_grads_with_norm_(params, grad_clip, norm)
    engine.step()
    return StepResult(loss_sum / dist.world_size, scale_value, grad_norm, None)
