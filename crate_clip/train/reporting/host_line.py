"""One line a host, at the start of each stage: what this node's loaders hold, as the planner counts it.

Only global rank 0 prints the run's progress; but a node's host memory is its own (the shuffle buffers of the
canonical streams its ranks read, their DataLoader workers), and a node that runs out of it is the one to look at.
So in a job of several hosts the first process of each (LOCAL_RANK 0) says, once per stage, how many streams its
ranks read, the buffer each holds (data.host_shuffle_buffer is split over exactly these), the decode workers, and
the host memory that `crate-clip plan` counts for them (planner.host_bytes_per_node).
"""
from __future__ import annotations

import os
import socket
from typing import Optional

from crate_clip.train.planning.planner import host_bytes_per_node


def host_line(stage) -> Optional[str]:
    """This host's line for `stage` (a ResolvedStage: its stream settings, as the launch settled them), or None on any
    process of the host but the first, and on a job of one host (the plan says it all there)."""
    st = stage.stream
    one_host = st is None or st.ranks_per_host >= stage.world_size
    if one_host or int(os.environ.get("LOCAL_RANK", "0")) != 0:
        return None
    split = (f" (data.host_shuffle_buffer {st.host_shuffle_buffer:,} split over a host's streams at the run's "
             "first launch)" if st.host_shuffle_buffer is not None else "")
    parts = host_bytes_per_node(stage)
    memory = ", ".join(f"{k} {v / 2 ** 20:,.0f} MiB" for k, v in parts.items())
    return (f"[host {socket.gethostname()}] stage {stage.index} ({stage.name}): {st.ranks_per_host} rank(s) reading "
            f"{st.per_host} of {st.streams} canonical streams, shuffle buffer {st.shuffle_buffer:,} samples a "
            f"stream{split}, {st.workers} decode worker(s) a rank; loader memory as planned: {memory}")
