"""Rank bookkeeping for evaluation under torch.distributed: splits, lock-step batches, reductions.

Every rank must make the same number of forward calls (ZeRO-3 gathers parameters collectively), so
batch iteration is kept in lock-step: a rank that has run out of data keeps stepping with a dummy
batch until all ranks are done.
"""
from typing import Iterable, Iterator

import torch
import torch.distributed as dist


def rank_and_world() -> tuple[int, int]:
    """(rank, world size) of the initialised process group, (0, 1) otherwise."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def _comm_device() -> torch.device:
    # NCCL reduces CUDA tensors only; gloo (CPU runs) reduces CPU tensors.
    if dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def all_reduce_sum(tensor: torch.Tensor) -> torch.Tensor:
    """Sum a tensor over ranks (returned on the tensor's own device; no-op in one process)."""
    if rank_and_world()[1] == 1:
        return tensor
    work = tensor.to(_comm_device())
    dist.all_reduce(work, op=dist.ReduceOp.SUM)
    return work.to(tensor.device)


def all_ranks_agree(flag: bool) -> bool:
    """True only when `flag` is true on every rank."""
    if rank_and_world()[1] == 1:
        return flag
    work = torch.tensor([1 if flag else 0], dtype=torch.int64, device=_comm_device())
    dist.all_reduce(work, op=dist.ReduceOp.MIN)
    return bool(work.item())


def gather_objects(obj) -> list:
    """Every rank's `obj`, in rank order (a one-element list in one process)."""
    if rank_and_world()[1] == 1:
        return [obj]
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


class OtherRankError(ValueError):
    """Another rank stopped with an error (bad .cls, missing member, ...); the message is that rank's."""


def lockstep(batches: Iterable) -> Iterator:
    """Yield this rank's batches, then None while any other rank still has batches.

    An error while reading a batch on any rank stops every rank (in the same step) with its message,
    instead of leaving the others waiting at the next collective until the process-group timeout."""
    it = iter(batches)
    while True:
        try:
            batch, error = next(it, None), None
        except Exception as exn:   # re-raised below, on this rank and (by message) on every other one
            batch, error = None, exn
        done, failed = _agree_on_step(batch is None, error is not None)
        if failed:
            raise_agreed_error(error)
        if done:
            return
        yield batch


def _agree_on_step(done: bool, failed: bool) -> tuple[bool, bool]:
    """(every rank done, some rank failed), in one reduction."""
    if rank_and_world()[1] == 1:
        return done, failed
    work = torch.tensor([0 if done else 1, 1 if failed else 0], dtype=torch.int64, device=_comm_device())
    dist.all_reduce(work, op=dist.ReduceOp.MAX)
    return work[0].item() == 0, work[1].item() == 1


def raise_agreed_error(error: BaseException | None) -> None:
    """Called on every rank once some rank failed: re-raise this rank's error, else the first failed rank's."""
    messages = gather_objects(None if error is None else f"{error}")
    if error is not None:
        raise error
    rank = next(r for r, m in enumerate(messages) if m is not None)
    raise OtherRankError(f"rank {rank} stopped: {messages[rank]}")


def rank_slice(n: int, rank: int, world: int) -> range:
    """Indices of n items that this rank evaluates (interleaved so class-sorted data stays balanced)."""
    return range(rank, n, world)
