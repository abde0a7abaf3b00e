"""Batches fetched in agreement: a data error on one rank stops every rank with its message, not a hang.

Without it, a rank whose stream raises leaves the others waiting in the step's collectives until the
process-group timeout (30 min by default). One tiny all-reduce per step tells every rank that some
rank failed; that rank's message is then gathered so that every rank stops with it."""
from __future__ import annotations

from typing import Iterable, Iterator

import torch
import torch.distributed as tdist

from crate_clip.train.loop.stop_requests import stops_with_checkpoint


class OtherRankDataError(RuntimeError):
    """Another rank's data stream raised; the message is that rank's error. When that error asks for a checkpoint
    before the run exits (stop_requests.stops_with_checkpoint), so does this one, with its message and exit code:
    every rank then saves the same step."""

    def __init__(self, message: str, exit_code: int | None = None):
        super().__init__(message)
        if exit_code is not None:
            self.checkpoint_before_exit, self.exit_code = True, exit_code


def agreed_batches(stream: Iterable, device: str = "cpu") -> Iterator:
    """The stream's batches; ends when this rank's stream ends; raises on every rank if any rank's raised."""
    it = iter(stream)
    while True:
        try:
            batch, error = next(it), None
        except StopIteration:
            return   # epoch ends come at the same batch count on every rank (the stream caps them)
        except Exception as exn:
            batch, error = None, exn
        _raise_if_any_failed(error, device)
        yield batch


def _raise_if_any_failed(error: BaseException | None, device: str) -> None:
    if not (tdist.is_available() and tdist.is_initialized()) or tdist.get_world_size() == 1:
        if error is not None:
            raise error
        return
    flag = torch.tensor([0 if error is None else 1], dtype=torch.int64,
                        device=device if tdist.get_backend() == "nccl" else "cpu")
    tdist.all_reduce(flag, op=tdist.ReduceOp.MAX)
    if flag.item() == 0:
        return
    messages = [None] * tdist.get_world_size()
    tdist.all_gather_object(messages, None if error is None else _described(error))
    if error is not None:
        raise error
    rank = next(r for r, m in enumerate(messages) if m is not None)
    text, exit_code = messages[rank]
    if exit_code is not None:   # that rank's own one-line message (it names the source): every rank says the same
        raise OtherRankDataError(text, exit_code)
    raise OtherRankDataError(f"rank {rank}'s data stream failed: {text}")


def _described(error: BaseException) -> tuple[str, int | None]:
    """(the error as another rank reports it, its exit code when it asks for a checkpoint before the exit)."""
    if stops_with_checkpoint(error):
        return str(error), error.exit_code
    return f"{type(error).__name__}: {error}", None
