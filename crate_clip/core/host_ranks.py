"""How many processes of the job share this host: what a host's memory is split by (data.host_shuffle_buffer,
the planner's host memory, the loader advice).

Each launcher says it in its own variable: torchrun, `accelerate launch` and configs/slurm/train.sbatch set
LOCAL_WORLD_SIZE; DeepSpeed's launcher (launch.py, under `deepspeed --hostfile`) sets LOCAL_SIZE only. Without
either, a job is taken to be one host.
"""
from __future__ import annotations

import os


def ranks_on_this_host(world_size: int) -> int:
    """This host's processes of a job of `world_size` (LOCAL_WORLD_SIZE, else LOCAL_SIZE, else all of them)."""
    for name in ("LOCAL_WORLD_SIZE", "LOCAL_SIZE"):
        value = os.environ.get(name, "")
        if value.isdigit() and int(value) > 0:
            return int(value)
    return world_size
