"""Two-rank (gloo) bodies of the reliability tests, launched with torchrun (not collected by pytest).

    reliability_workers.py epoch-sizes DATA OUT   epoch mode over shards whose _stats.json over-claim
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
    from data_pipelines.train_stream import StreamConfig, build_train_stream

    rank, world = dist.get_rank(), dist.get_world_size()
    cfg = StreamConfig([data], mode="epoch", num_workers=0, shuffle_buffer=1, shards_per_group=1)
    stream = build_train_stream(cfg, image_size=16, context_length=8, text_mask="truncate", batch_size=2,
                                rank=rank, world_size=world)
    first = _captions(list(stream))
    claimed_next = stream.batches_per_epoch
    second = _captions(list(stream))
    Path(f"{out}.{rank}.json").write_text(json.dumps({"first": first, "second": second,
                                                      "batches_per_epoch": claimed_next}))


if __name__ == "__main__":
    dist.init_process_group("gloo")
    try:
        {"epoch-sizes": epoch_sizes}[sys.argv[1]](*sys.argv[2:])
    finally:
        dist.destroy_process_group()
    os._exit(0)
