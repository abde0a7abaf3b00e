"""The random generators as a part: the image token masks and drop-path draws of a resumed stage are those of the
uninterrupted one."""
from __future__ import annotations

import random
from typing import Optional

import numpy as np
import torch

from crate_clip.train.checkpointing.checkpoints import rng_state, set_rng_state
from crate_clip.train.checkpointing.elastic_resume import resume_seed
from crate_clip.train.loop.parts.stage_part import StagePart


class RngStates(StagePart):
    """Python's, numpy's and torch's generators of this rank. A resume at another world size has none that fit (the
    saved ones belong to ranks this job does not have): each rank is seeded from where the run is instead."""

    name = "rng"

    def __init__(self, seed: int, stage_index: int, progress, rank: int):
        self.seed, self.stage_index, self.progress, self.rank = seed, stage_index, progress, rank

    def state_dict(self) -> dict:
        return rng_state()

    def load_state_dict(self, state: Optional[dict]) -> None:
        if state is not None:
            set_rng_state(state)
        else:
            seed_everything(resume_seed(self.seed, self.stage_index, self.progress.global_step, self.rank))


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2 ** 32)
    torch.manual_seed(seed)
