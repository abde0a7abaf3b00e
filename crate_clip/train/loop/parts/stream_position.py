"""The data stream's position as a part: saved by every rank, so that a resume reads on from the next sample."""
from __future__ import annotations

from typing import Optional

from crate_clip.train.loop.parts.stage_part import StagePart


class StreamPosition(StagePart):
    """This rank's place in its shards (data_pipelines' stream state); at another world size elastic_resume rebuilds
    each new rank's from the saved table, and the loop hands that in instead."""

    name = "stream"

    def __init__(self, stream):
        self.stream = stream

    def state_dict(self) -> Optional[dict]:
        return stream_state(self.stream)

    def load_state_dict(self, state: Optional[dict]) -> None:
        if state is not None:
            self.stream.load_state_dict(state)


def stream_state(stream) -> Optional[dict]:
    """A stream's position (None for a stream without one: a test's list of batches)."""
    return stream.state_dict() if hasattr(stream, "state_dict") else None
