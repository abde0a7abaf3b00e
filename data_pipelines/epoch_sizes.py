"""Real shard sizes for epoch mode: the usable samples counted while reading replace the claimed sizes.

img2dataset's `_stats.json` counts downloads ("successes"), bad images included, so an epoch sized from it
is longer than the data: streams run out of their shards and continue into the next epoch's (seen twice).
At the end of each epoch every rank reports the usable samples of the shards its canonical streams read in
full; all ranks take the union, so the next epoch is dealt and sized from the real counts (the same on every
rank, and for any world size: the streams' reads do not depend on which rank holds them).
"""
from __future__ import annotations

import logging

from .shard_plan import ShardPlan

log = logging.getLogger(__name__)


def gather_across_ranks(obj, world_size: int) -> list:
    """Every rank's `obj` when a process group of `world_size` ranks is running, else [obj]."""
    import torch.distributed as dist

    if world_size > 1 and dist.is_available() and dist.is_initialized() and dist.get_world_size() == world_size:
        out = [None] * world_size
        dist.all_gather_object(out, obj)
        return out
    return [obj]


def adopt_real_sizes(plan: ShardPlan, stream_reads: list[dict], rank: int, world_size: int) -> dict[str, int]:
    """Put the measured sizes of every rank's fully read shards into the plan; returns those that changed."""
    local: dict[str, int] = {}
    for read in stream_reads:
        local.update(read)
    measured: dict[str, int] = {}
    for rank_read in gather_across_ranks(local, world_size):   # all ranks call it at the same batch
        measured.update(rank_read)
    changed = {url: int(n) for url, n in measured.items() if plan.sizes.get(url) != n}
    if changed and rank == 0:
        claimed = sum(plan.sizes.get(url, 0) for url in measured)
        log.warning("epoch %d: the stats of the %d shards read in full claimed %d samples, %d were usable; "
                    "epoch %d is dealt and sized with the usable counts", plan.epoch, len(measured), claimed,
                    sum(measured.values()), plan.epoch + 1)
    plan.update_sizes(changed)
    return changed
