"""Tests only: a training run whose data source is given up on mid-stage (not collected by pytest).

    python tests/fork_ranks.py 2 tests/stop_workers.py CONFIG.yaml source|signal RANK AT_BATCH

source: RANK's stream raises, at its AT_BATCH-th batch, an error that asks for a checkpoint before the exit (the
attribute protocol of stop_requests.stops_with_checkpoint, as data_pipelines' ShardSourceUnavailable has it).
signal: RANK sends its own process SIGTERM as its checkpoint save of step AT_BATCH starts (the other rank gets
none; the run config saves every AT_BATCH steps).
stuck: RANK's stream, at its AT_BATCH-th batch, reads a remote shard from a port nobody listens on, retried for 10
minutes (data_pipelines/remote_retry.py, the real retry loop); the other rank sends its own process SIGTERM a second
after it fetched its AT_BATCH-th batch, while it waits for RANK in the step's collective.
The process exits with the code crate-clip train would, after the trainer's one line on rank 0.
"""
from __future__ import annotations

import os
import signal
import socket
import sys
import threading
from pathlib import Path
from typing import Optional

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from crate_clip.core.errors import UserError, report_error  # noqa: E402
from crate_clip.data.remote_retry import RetryPolicy, open_remote_shard  # noqa: E402
from crate_clip.train.checkpointing.checkpoints import CheckpointManager  # noqa: E402
from crate_clip.train.run.run_config import load_run_config  # noqa: E402
from crate_clip.train.loop.stage_loop import default_stream_factory, run_training  # noqa: E402
from crate_clip.train.loop.stop_requests import (DEFAULT_SIGNALS, StopRequested, parse_signals,  # noqa: E402
                                                 stop_signals_handled)

SOURCE_EXIT = 7


class SourceGone(UserError, RuntimeError):
    """A data source given up on: the trainer saves the last completed step, then exits with `exit_code`."""
    checkpoint_before_exit = True
    exit_code = SOURCE_EXIT


class FailingStream:
    """The real training stream, raising SourceGone at one batch on one rank."""

    def __init__(self, stream, mode: Optional[str], at_batch: int):
        self.stream, self.mode, self.at_batch = stream, mode, at_batch

    def __iter__(self):
        for n, batch in enumerate(self.stream, start=1):
            if self.mode == "source" and n == self.at_batch:
                raise SourceGone(f"data.sources http://shards.invalid/{{0..2}}.tar: unreachable for 1800 s "
                                 "(connection refused); fix: bring it back, then --resume latest")
            if self.mode == "stuck" and n == self.at_batch:
                with socket.socket() as s:   # a port nobody listens on: every attempt is refused
                    s.bind(("127.0.0.1", 0))
                    port = s.getsockname()[1]
                policy = RetryPolicy(total_s=600, backoff_base_s=0.5, backoff_max_s=1.0)
                open_remote_shard(f"http://127.0.0.1:{port}/00000000.tar", policy).read()
            if self.mode == "signal_later" and n == self.at_batch:
                threading.Timer(1.0, os.kill, (os.getpid(), signal.SIGTERM)).start()
            yield batch

    def __getattr__(self, name):   # state_dict, load_state_dict, skip_counts: the real stream's
        return getattr(self.stream, name)


def _signal_as_save_starts(step: int) -> None:
    """SIGTERM to this process when the checkpoint save of `step` starts (the save must finish all the same)."""
    save = CheckpointManager.save

    def signalled_save(self, engine, tag, *args, **kwargs):
        if tag.endswith(f"step{step:08d}"):
            os.kill(os.getpid(), signal.SIGTERM)
        return save(self, engine, tag, *args, **kwargs)

    CheckpointManager.save = signalled_save


def main(config: str, mode: str, rank: int, at_batch: int) -> int:
    def factory(cfg, stage, dist):
        if mode == "signal" and dist.rank == rank:
            _signal_as_save_starts(at_batch)
        other = "signal_later" if mode == "stuck" else None
        return FailingStream(default_stream_factory(cfg, stage, dist), mode if dist.rank == rank else other, at_batch)

    try:
        with stop_signals_handled(parse_signals(DEFAULT_SIGNALS)):   # as crate-clip train's default
            run_training(load_run_config(config), stream_factory=factory)
    except StopRequested as exc:
        return report_error("crate-clip train", exc)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])))
