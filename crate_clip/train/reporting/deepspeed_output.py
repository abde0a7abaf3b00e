"""DeepSpeed's start-up and checkpoint chatter goes to the run's log file, logs/deepspeed-rank<R>.log, not the
console: its logger's records below ERROR ("Setting accelerator to CPU", engine settings), what its checkpoint
tools print on every rank ("Processing zero checkpoint ...", "Loading checkpoint shards" bars) and, on ranks other
than 0, Python's warnings (rank 0 says them once for the job).

The logger is diverted by a filter on DeepSpeed's logger ("DeepSpeed"), which holds whatever DeepSpeed adds to it
later (its own handler is created at its import, which may come before or after this); records logged before the
run folder exists are kept and written once it does.
"""
from __future__ import annotations

import contextlib
import io
import logging
import warnings
from pathlib import Path
from typing import Iterator, Optional, TextIO

from crate_clip.checkpoint_io.run_layout import LOG_DIR

DEEPSPEED_LOGGER = "DeepSpeed"
_FORMAT = logging.Formatter("[%(asctime)s] [%(levelname)s] [%(filename)s:%(lineno)d] %(message)s")


def deepspeed_log_path(run_dir: Path, rank: int) -> Path:
    """This rank's DeepSpeed log in the run folder."""
    return Path(run_dir) / LOG_DIR / f"deepspeed-rank{rank}.log"


class _Divert(logging.Filter):
    """Takes DeepSpeed's records below ERROR off the console into the log file (held until it is open)."""

    def __init__(self):
        super().__init__()
        self.held: list[str] = []
        self.file: Optional[TextIO] = None

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno >= logging.ERROR:   # an error still reaches the console
            return True
        self.write(_FORMAT.format(record) + "\n")
        return False

    def write(self, text: str) -> None:
        if self.file is None:
            self.held.append(text)
        else:
            self.file.write(text)
            self.file.flush()

    def flush(self) -> None:   # a stream for redirect_stdout (deepspeed_prints)
        if self.file is not None:
            self.file.flush()


_DIVERT = _Divert()


def divert_deepspeed_logs() -> None:
    """From now on DeepSpeed's logger writes to the run's log file (held in memory until log_to opens it)."""
    logger = logging.getLogger(DEEPSPEED_LOGGER)
    if _DIVERT not in logger.filters:
        logger.addFilter(_DIVERT)


def deepspeed_logs_diverted() -> bool:
    """Whether DeepSpeed's logger writes to a run's log (divert_deepspeed_logs) now."""
    return _DIVERT in logging.getLogger(DEEPSPEED_LOGGER).filters


def stop_diverting_deepspeed_logs() -> None:
    """DeepSpeed's logger as before divert_deepspeed_logs, nothing held (a run in a notebook's process has ended)."""
    close_log()
    logging.getLogger(DEEPSPEED_LOGGER).removeFilter(_DIVERT)
    _DIVERT.held = []


def log_to(path: Path) -> None:
    """Open (append) the log file and write what was held."""
    close_log()
    path.parent.mkdir(parents=True, exist_ok=True)
    _DIVERT.file = open(path, "a", encoding="utf-8")
    held, _DIVERT.held = _DIVERT.held, []
    for text in held:
        _DIVERT.write(text)


def close_log() -> None:
    """Close the file (records are held again until the next log_to) and give Python's warnings back."""
    if _SHOWWARNING:
        warnings.showwarning = _SHOWWARNING.pop()
    if _DIVERT.file is not None:
        _DIVERT.file.close()
        _DIVERT.file = None


_SHOWWARNING: list = []


def warnings_to_log() -> None:
    """Python's warnings of this process (a rank other than 0: the same deprecation notices of the collectives
    DeepSpeed calls, once per rank) go to its log file, not the console, until close_log."""
    if not _SHOWWARNING:
        _SHOWWARNING.append(warnings.showwarning)
    warnings.showwarning = lambda message, category, filename, lineno, file=None, line=None: _DIVERT.write(
        warnings.formatwarning(message, category, filename, lineno, line))


@contextlib.contextmanager
def deepspeed_prints() -> Iterator[None]:
    """What DeepSpeed's checkpoint tools print (stdout and stderr, its tqdm bars) goes to the log file (or nowhere,
    before it is open): they print on every rank, and none of it is the user's business unless something fails,
    which they raise."""
    sink = _DIVERT if _DIVERT.file is not None else io.StringIO()
    with contextlib.redirect_stdout(sink), contextlib.redirect_stderr(sink):
        yield
