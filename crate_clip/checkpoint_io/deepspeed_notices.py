"""DeepSpeed's notices kept off the console of a command that only reads checkpoints (export, eval, inspect): its
import says "Setting accelerator to CPU ..." on every machine without a GPU, through its logger ("DeepSpeed"),
whose console handler DeepSpeed creates itself. Records below ERROR logged inside `deepspeed_notices_off()` are
dropped; an error still reaches the console. A training process diverts the same logger to its run's log file
first (train/reporting/deepspeed_output.py): that filter comes before this one and keeps the records there.
"""
from __future__ import annotations

import contextlib
import logging
from typing import Iterator

DEEPSPEED_LOGGER = "DeepSpeed"


def _below_error(record: logging.LogRecord) -> bool:
    return record.levelno >= logging.ERROR


@contextlib.contextmanager
def deepspeed_notices_off() -> Iterator[None]:
    """Within the block, DeepSpeed's log records below ERROR are dropped (its import's accelerator notice)."""
    logger = logging.getLogger(DEEPSPEED_LOGGER)
    outermost = _below_error not in logger.filters   # nested blocks: the outermost one removes it
    logger.addFilter(_below_error)
    try:
        yield
    finally:
        if outermost:
            logger.removeFilter(_below_error)
