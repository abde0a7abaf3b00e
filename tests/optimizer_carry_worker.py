"""Multi-process body of test_train_optimizer_carry.py (not collected by pytest): `crate_clip.train.cli ARGS` with
the carry checked in the ranks themselves. Right after a stage's optimizer took the previous stage's AdamW state,
the state is gathered back from the ZeRO partitions and compared with what was carried; rank 0 writes the result
to $CARRY_CHECK_OUT (JSON). Imported, it only defines the check (checked_apply).

    python tests/fork_ranks.py 2 tests/optimizer_carry_worker.py --config C.yaml
"""
from __future__ import annotations

import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch.distributed as tdist  # noqa: E402

import crate_clip.train.loop.stage_loop as stage_loop  # noqa: E402
from crate_clip.train.stage_setup import optimizer_carry  # noqa: E402
from crate_clip.train.cli import main  # noqa: E402

_apply = stage_loop.apply_state


def checked_apply(engine, carried):
    """stage_loop.apply_state, then the carried state gathered back and compared (rank 0 writes $CARRY_CHECK_OUT);
    test_train_optimizer_carry.py also puts it in place in its own process for a run there."""
    report = _apply(engine, carried)
    back = optimizer_carry.collect_state(engine)   # a collective: every rank
    check = {
        "carried_step": carried.step, "step_after": back.step, "carried": report.carried, "reset": report.reset,
        "max_diff": max(float((back.moments[n][k] - carried.moments[n][k]).abs().max())
                        for n in report.carried for k in optimizer_carry.MOMENTS),
        "carried_nonzero": sum(bool(carried.moments[n]["exp_avg_sq"].any()) for n in report.carried),
        "reset_max": max([float(back.moments[n][k].abs().max()) for n in report.reset
                          for k in optimizer_carry.MOMENTS] or [0.0]),
    }
    if tdist.get_rank() == 0:
        Path(os.environ["CARRY_CHECK_OUT"]).write_text(json.dumps(check))
    return report


if __name__ == "__main__":
    stage_loop.apply_state = checked_apply
    sys.exit(main())
