"""Two-rank (gloo) bodies of the reliability tests, launched by tests/fork_ranks.py (not collected by pytest).

    reliability_workers.py epoch-sizes DATA OUT   epoch mode over shards whose _stats.json over-claim
    reliability_workers.py agreement OUT          rank 1's data raises mid-loop (eval lockstep, training fetch)
"""
from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def _captions(batches) -> list[list[int]]:
    return [row for _, tokens in batches for row in tokens.tolist()]


def epoch_sizes(data: str, out: str) -> None:
    """Two passes of an epoch-mode stream on each rank; rank r writes OUT.r.json with what it yielded."""
    from crate_clip.data.train_stream import StreamConfig, build_train_stream

    rank, world = dist.get_rank(), dist.get_world_size()
    cfg = StreamConfig(sources=[data], mode="epoch", num_workers=0, shuffle_buffer=1, shards_per_group=1)
    stream = build_train_stream(cfg, image_size=16, context_length=8, text_mask="truncate", batch_size=2,
                                rank=rank, world_size=world)
    first = _captions(list(stream))
    claimed_next = stream.batches_per_epoch
    second = _captions(list(stream))
    Path(f"{out}.{rank}.json").write_text(json.dumps({"first": first, "second": second,
                                                      "batches_per_epoch": claimed_next}))


def _failing_on_rank_1(n: int = 5):
    """Batches 0..n-1; on rank 1 the third raises as a bad .cls member would."""
    for i in range(n):
        if i == 2 and dist.get_rank() == 1:
            raise ValueError("shard sample /data/00000003.tar:000000000042 has no .cls member")
        yield i


def _steps(batches) -> str:
    """Run lock-step steps (one collective each, as a forward would); the error that stopped them."""
    import torch
    try:
        for _ in batches:
            dist.all_reduce(torch.ones(1))
    except Exception as exn:
        return f"{type(exn).__name__}: {exn}"
    return "finished"


def agreement(out: str) -> None:
    """Rank r writes OUT.r.json: how the eval loop and the training fetch stopped."""
    from crate_clip.train.loop.batch_agreement import agreed_batches
    from crate_clip.eval.distributed_batches import lockstep

    result = {"eval": _steps(lockstep(_failing_on_rank_1())), "train": _steps(agreed_batches(_failing_on_rank_1()))}
    Path(f"{out}.{dist.get_rank()}.json").write_text(json.dumps(result))


if __name__ == "__main__":
    from datetime import timedelta

    dist.init_process_group("gloo", timeout=timedelta(seconds=60))   # a hang fails the test in a minute
    try:
        {"epoch-sizes": epoch_sizes, "agreement": agreement}[sys.argv[1]](*sys.argv[2:])
    finally:
        dist.destroy_process_group()
    os._exit(0)
