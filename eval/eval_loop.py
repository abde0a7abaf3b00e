"""The evaluation loop every task shares: the model in eval mode for the pass (its mode restored after, also on an
error), this rank's share of the data set in lock-step with the other ranks, its progress on rank 0 (a bar on a
terminal, plain lines elsewhere: crate_clip/core/progress_lines.py), and the unreadable images of the share
counted."""
from __future__ import annotations

import contextlib
from typing import Callable, Iterator, Optional

from crate_clip.core.progress_lines import progress as shown_progress
from crate_clip.eval.distributed_batches import lockstep, rank_and_world
from crate_clip.eval.eval_datasets import loader_length, make_loader


@contextlib.contextmanager
def evaluation_mode(model) -> Iterator[None]:
    """`model` in eval mode inside the block, in the mode it had before after it."""
    was_training = model.training
    model.eval()
    try:
        yield
    finally:
        model.train(was_training)


class EvalPass:
    """One pass over this rank's share of `dataset`: iterating yields the batches that hold readable images, with
    the model in eval mode; `idle()` runs at every step without one (a rank out of data, or a batch of unreadable
    files), for the forward calls the other ranks' collectives wait for (ZeRO-3 gathers). `unreadable`: the files
    of the share that could not be read."""

    def __init__(self, model, dataset, *, batch_size: int, num_workers: int = 0, max_images: Optional[int] = None,
                 desc: str, progress: bool = True, idle: Optional[Callable] = None):
        self.model, self.dataset, self.idle = model, dataset, idle
        self.rank, self.world = rank_and_world()
        self.loader = make_loader(dataset, batch_size=batch_size, num_workers=num_workers, rank=self.rank,
                                  world=self.world, max_images=max_images)
        total = loader_length(dataset, max_images, self.world, batch_size)   # None for shards: counted as read
        self._shown = dict(desc=desc, total=total, unit="batch", enabled=progress and self.rank == 0)
        self.unreadable: list[str] = []

    def __iter__(self):
        with evaluation_mode(self.model):
            for batch in shown_progress(lockstep(self.loader), **self._shown):
                if batch is not None:
                    self.unreadable += batch.unreadable
                if batch is None or batch.images is None:
                    if self.idle is not None:
                        self.idle()
                    continue
                yield batch
