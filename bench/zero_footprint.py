"""What one rank really holds under DeepSpeed ZeRO: bytes of parameters, gradients and optimizer state,
read from the engine's own tensors (not computed from a formula), for the partition tests and the bench
(a measuring tool, not library code: moved here from crate_clip/train)."""
from __future__ import annotations

import torch


def _unique_bytes(tensors) -> int:
    """Bytes of distinct storages among `tensors` (views of one flat buffer are counted once)."""
    seen, total = set(), 0
    for t in tensors:
        if t is None or not torch.is_tensor(t) or t.numel() == 0:
            continue
        key = (t.untyped_storage().data_ptr(), t.untyped_storage().nbytes())
        if key not in seen:
            seen.add(key)
            total += t.untyped_storage().nbytes()
    return total


def _flat(obj):
    if torch.is_tensor(obj):
        yield obj
    elif isinstance(obj, dict):
        for v in obj.values():
            yield from _flat(v)
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            yield from _flat(v)


def param_bytes(engine) -> int:
    """Bytes of the model parameters this rank stores (ZeRO-3: its partitions only)."""
    params = list(engine.module.parameters())
    if engine.zero_optimization_stage() == 3:
        return _unique_bytes(p.ds_tensor for p in params)
    return _unique_bytes(p.data for p in params)


def buffer_bytes(engine) -> int:
    """Bytes of the module's buffers on this rank (a locked text tower lives there: never partitioned)."""
    return _unique_bytes(b for b in engine.module.buffers())


def param_numel(engine) -> tuple[int, int]:
    """(elements this rank stores, elements of the whole model)."""
    params = list(engine.module.parameters())
    if engine.zero_optimization_stage() == 3:
        return sum(p.ds_tensor.numel() for p in params), sum(p.ds_numel for p in params)
    n = sum(p.numel() for p in params)
    return n, n


def master_tensors(engine) -> list:
    """The fp32 master weights the optimizer updates (this rank's partitions under ZeRO 1-3)."""
    opt = engine.optimizer
    for attr in ("single_partition_of_fp32_groups", "fp32_partitioned_groups_flat", "fp32_groups_flat_partition",
                 "fp32_groups_flat", "fp32_groups"):
        if hasattr(opt, attr):
            return list(_flat(getattr(opt, attr)))  # lists of flat partitions, or lists of lists of tensors
    return []


def optimizer_state_tensors(engine) -> list:
    """The optimizer's moment buffers (Adam's exp_avg, exp_avg_sq) held by this rank."""
    opt = engine.optimizer
    inner = getattr(opt, "optimizer", opt)
    return [t for t in _flat(list(inner.state.values())) if t.ndim > 0]


def optimizer_state_numel(engine) -> int:
    """Elements of this rank's Adam moments (2 x the parameters it updates)."""
    return sum(t.numel() for t in optimizer_state_tensors(engine))


def _view_bytes(tensors) -> int:
    """Bytes covered by the tensors' own extents (a partition that views a larger bucket counts its own
    size; overlapping views, e.g. per-parameter views of one flat partition, count once)."""
    spans = sorted((t.data_ptr(), t.data_ptr() + t.numel() * t.element_size()) for t in tensors
                   if t is not None and torch.is_tensor(t) and t.numel() > 0)
    total, end = 0, -1
    for lo, hi in spans:
        if hi > end:
            total += hi - max(lo, end)
            end = hi
    return total


def gradient_bytes(engine) -> int:
    """Bytes of the gradients this rank keeps for its update (call after backward, before step): whole
    `.grad`s without ZeRO, this rank's reduced partitions under ZeRO 1-3 (DeepSpeed's communication
    buckets, sized by reduce_bucket_size, come on top)."""
    opt = engine.optimizer
    tensors = [p.grad for p in engine.module.parameters()]
    for attr in ("grads_in_partition", "grad_partitions_flat_buffer", "fp32_groups_gradients_flat",
                 "averaged_gradients"):
        tensors += list(_flat(getattr(opt, attr, None)))
    tensors += [getattr(t, "grad", None) for t in master_tensors(engine)]
    return _view_bytes(tensors)


def footprint(engine, grads_bytes: int | None = None) -> dict:
    """Per-rank bytes of parameters, gradients (if measured), fp32 master weights and Adam state."""
    local, total = param_numel(engine)
    return {"zero_stage": engine.zero_optimization_stage(), "param_bytes": param_bytes(engine),
            "param_numel_local": local, "param_numel_total": total, "grad_bytes": grads_bytes,
            "master_bytes": _unique_bytes(master_tensors(engine)),
            "master_numel": sum(t.numel() for t in master_tensors(engine)),
            "optimizer_state_bytes": _unique_bytes(optimizer_state_tensors(engine)),
            "optimizer_state_numel": optimizer_state_numel(engine)}
