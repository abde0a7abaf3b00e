"""What a command prints where its console is a Slurm log, a pipe or a file: a long step's progress as plain lines
with its total, at a bounded rate, one line as it ends, never a bar's carriage returns (a bar only on a terminal,
crate_clip/core/progress_lines.py); and no DeepSpeed notice from a command that only reads checkpoints
(crate_clip/checkpoint_io/deepspeed_notices.py). The commands' own lines are checked where they run: eval
(test_eval_cli.py, test_eval_linear_probe.py), shards (test_data_shards.py)."""
from __future__ import annotations

import fcntl
import logging
import os
import select
import struct
import subprocess
import sys
import termios

import pytest

from crate_clip.core.progress_lines import StepProgress, progress
from train_fixtures import REPO_ROOT, run_env


class Clock:
    """The seconds a StepProgress reads, set by the test (no sleeping, no timed assertion)."""

    def __init__(self):
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_plain_lines_give_the_total_at_a_bounded_rate_and_one_line_at_the_end(capsys):
    clock = Clock()
    shown = StepProgress("zero-shot images", total=4, bar=False, every_s=10, clock=clock)
    for at in (3, 11, 15, 25):   # lines at most every 10 s: after 11 s (1 done of 2) and 25 s (10 s after it)
        clock.now = 100 + at
        shown.update()
    clock.now = 130
    shown.close()
    assert capsys.readouterr().err.splitlines() == [
        "[progress] zero-shot images: 2/4 batches (50%), 0.182 batches/s, ETA 0:00:11",
        "[progress] zero-shot images: 4/4 batches (100%), 0.16 batches/s, ETA 0:00:00",
        "[progress] zero-shot images: done, 4/4 batches in 30.0 s"]

    clock.now = 0.0   # a shard set: no total known before its end, the count so far
    with StepProgress("retrieval", bar=False, every_s=10, clock=clock) as shown:
        clock.now = 12
        shown.update(3)
    assert capsys.readouterr().err.splitlines() == ["[progress] retrieval: 3 batches so far, 0.25 batches/s",
                                                    "[progress] retrieval: done, 3 batches in 12.0 s"]

    with pytest.raises(ValueError), StepProgress("fits", unit="fit", bar=False, clock=clock) as shown:
        shown.update()
        raise ValueError("cut short: the error is the command's line, no end line")
    for item in progress(range(3), "rank 1", enabled=False):   # another rank, or --no-progress
        pass
    assert [line for line in progress([7], "one", unit="fit", every_s=0)] == [7]   # every update, then the end
    err = capsys.readouterr().err
    assert err.splitlines()[0].startswith("[progress] one: 1/1 fit (100%), ")
    assert err.splitlines()[1].startswith("[progress] one: done, 1/1 fit in ") and len(err.splitlines()) == 2


def test_a_bar_only_where_stderr_is_a_terminal(monkeypatch):
    primary, secondary = os.openpty()
    fcntl.ioctl(secondary, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 100, 0, 0))   # a terminal's 100 columns
    terminal = os.fdopen(secondary, "w")
    monkeypatch.setattr(sys, "stderr", terminal)
    try:
        for _ in progress(range(3), "text classifier"):
            pass
        terminal.flush()
        drawn = b""
        while select.select([primary], [], [], 0)[0]:   # all the written bytes wait in the terminal already
            drawn += os.read(primary, 65536)
        drawn = drawn.decode()
    finally:
        terminal.close()
        os.close(primary)
    assert "\r" in drawn and "text classifier: 100%|" in drawn and "[progress]" not in drawn, drawn


def test_deepspeed_notices_stay_off_a_checkpoint_readers_console():
    """DeepSpeed's import says "Setting accelerator to CPU" through its logger on a machine without a GPU; reading a
    checkpoint imports it (the allow-listed classes): a fresh process, as `crate-clip export` and `eval` are, says
    nothing. Inside deepspeed_notices_off its records below ERROR are dropped, an error still passes; after it,
    the logger is as it was."""
    from crate_clip.checkpoint_io.deepspeed_notices import DEEPSPEED_LOGGER, deepspeed_notices_off

    code = ("from crate_clip.checkpoint_io.safe_unpickling import allowed_classes\n"
            "import sys\nprint(len(allowed_classes()), 'deepspeed' in sys.modules)")
    done = subprocess.run([sys.executable, "-c", code], env=run_env(), cwd=REPO_ROOT, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0 and done.stdout == "4 True\n" and done.stderr == "", done.stdout + done.stderr

    seen: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: seen.append(f"{record.levelname} {record.getMessage()}")
    logger = logging.getLogger(DEEPSPEED_LOGGER)
    logger.addHandler(handler)
    earlier = list(logger.filters)   # an in-process `crate-clip train` earlier in this process diverts it to its log
    logger.filters = []
    try:
        with deepspeed_notices_off(), deepspeed_notices_off():   # nested: the outer block keeps it on
            logger.warning("Setting accelerator to CPU")
            logger.error("a checkpoint DeepSpeed cannot read")
        assert logger.filters == []
        logger.warning("outside the block")
    finally:
        logger.removeHandler(handler)
        logger.filters = earlier
    assert seen == ["ERROR a checkpoint DeepSpeed cannot read", "WARNING outside the block"]
