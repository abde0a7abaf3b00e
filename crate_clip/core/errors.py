"""One way for every `crate-clip` command to report a user error: its message, its exit code, a traceback only
with --debug; and, under a launcher that replaces the process's exit code with its own, that code as the last
line (docs/exit_codes.md). The bottom layer of the errors: it imports nothing of crate_clip but user_text (how
text from a user's files is printed), every package may raise these."""
from __future__ import annotations

import os
import sys

from crate_clip.core.user_text import cut, printable

EXIT_USAGE = EXIT_CONFIG = 2     # a bad command line, config, file or data set
EXIT_NONFINITE = 3               # training stopped on non-finite losses (the last good state is saved)
EXIT_RESUME = 4                  # the checkpoint named by --resume cannot be continued by this job
EXIT_LOCKED = 5                  # the run folder is in use by another training run
EXIT_NO_SPACE = 6                # the disk filled up while a run wrote (the last complete checkpoint is kept)
EXIT_SOURCE_UNAVAILABLE = 7      # a remote data source stayed unreachable past data.remote_retry_total_s (saved)
EXIT_PREEMPTED = 8               # stopped by a preemption signal after saving (--save-on-signal)
EXIT_RANK_LOST = 9               # another rank of the job was lost (its node crashed): nothing saved since the last
                                 # checkpoint, which is kept
# What each exit code of a crate-clip process means; docs/exit_codes.md says the same for users.
EXIT_MEANINGS = {1: "unexpected error, see the traceback above",
                 EXIT_USAGE: "configuration or input error, see the message above",
                 EXIT_NONFINITE: "training stopped after too many non-finite losses in a row",
                 EXIT_RESUME: "the checkpoint cannot be resumed by this job",
                 EXIT_LOCKED: "the run folder is in use by another training run",
                 EXIT_NO_SPACE: "no space left on the device the run writes to",
                 EXIT_SOURCE_UNAVAILABLE: "a data source stayed unreachable; --resume latest continues once it is back",
                 EXIT_PREEMPTED: "stopped by a preemption signal after saving; --resume latest continues",
                 EXIT_RANK_LOST: "another rank of the job was lost; --resume latest continues from the last checkpoint"}
# Set in the processes torchrun, the DeepSpeed launcher and `accelerate launch` start.
LAUNCHER_ENV = ("LOCAL_RANK", "RANK", "TORCHELASTIC_RUN_ID", "ACCELERATE_MIXED_PRECISION")
# read as the process starts: a one-process `crate-clip train` sets RANK and LOCAL_RANK itself later
STARTED_BY_LAUNCHER = any(k in os.environ for k in LAUNCHER_ENV)
DEBUG_ENV = "CRATE_CLIP_DEBUG"   # set by `crate-clip --debug ...`; inherited by the ranks a launcher starts


class UserError(Exception):
    """Something the user can fix (the message names the key or file and the fix): reported, not a traceback."""
    exit_code = EXIT_USAGE


class OneLineDataError(UserError, RuntimeError):
    """A data error with its one line, also when a DataLoader worker raised it: PyTorch re-raises a worker's exception
    in the trainer as exc_type("Caught ... in DataLoader worker ... Original Traceback ... <Name>: <line>"), and the
    line is cut back out of that. `checkpoint_before_exit`: the trainer saves the last completed step first."""

    checkpoint_before_exit = True

    def __init__(self, message: str):
        marker = f"{type(self).__name__}: "
        self.line = message.rsplit(marker, 1)[-1].strip().splitlines()[0] if marker in message else message
        super().__init__(self.line)

    def __str__(self) -> str:
        return self.line   # a reader may append to args (webdataset adds " @ <file>"): the line stays ours


class ConfigError(UserError, ValueError):
    """A run config that cannot be used; the message lists every bad key with its fix."""


# Errors that are about the user's input (files, config, data): reported in one line, not as a traceback.
USER_ERRORS = (UserError, ValueError, FileNotFoundError, NotADirectoryError)


def pop_debug_flag(argv: list[str]) -> list[str]:
    """argv without `--debug`; its presence turns on tracebacks for this process and its children."""
    if "--debug" in argv:
        os.environ[DEBUG_ENV] = "1"
    return [a for a in argv if a != "--debug"]


def debug_enabled() -> bool:
    """Whether `--debug` was given (or CRATE_CLIP_DEBUG=1 is set)."""
    return os.environ.get(DEBUG_ENV) == "1"


def report_error(prog: str, exc: BaseException, *, once_per_job: bool = False) -> int:
    """Print the error on stderr and return its exit code; with --debug re-raise it (traceback).

    A ConfigError keeps its lines (one per bad key); any other message is put on one line. Our own errors
    are sentences naming the key or file and the fix; another library's are marked `error:`. `once_per_job` (or
    the error's own `once_per_job` attribute): every rank of a launched job finds the same error, rank 0 prints it."""
    if debug_enabled():
        raise exc
    text = str(exc).strip() or type(exc).__name__
    text = text if isinstance(exc, ConfigError) else " ".join(text.split())
    text = bounded_message(text)   # text from the user's files: escapes kept off the terminal, sizes bounded
    if not isinstance(exc, UserError):
        text = f"error: {text} (--debug shows the traceback)"
    once_per_job = once_per_job or getattr(exc, "once_per_job", False)
    if not once_per_job or os.environ.get("RANK", "0") == "0":
        print(f"{prog}: {text}", file=sys.stderr)
    return getattr(exc, "exit_code", EXIT_USAGE)


MAX_MESSAGE_LINES = 40   # a config with thousands of bad values: the first problems, then how many more


def bounded_message(text: str) -> str:
    """`text` as printed: control characters escaped (crate_clip.core.user_text), each line cut to MAX_LINE_CHARS,
    at most MAX_MESSAGE_LINES lines."""
    lines = [cut(printable(line)) for line in text.split("\n")]
    if len(lines) > MAX_MESSAGE_LINES:
        lines = lines[:MAX_MESSAGE_LINES] + [f"  ... and {len(lines) - MAX_MESSAGE_LINES:,} more lines"]
    return "\n".join(lines)


def show_exit_code(code: int) -> int:
    """Under a launcher, print `crate-clip: exit code N (meaning)` as rank 0's last line (torchrun and `accelerate
    launch` exit 1 for any failing process); returns `code`."""
    if code and STARTED_BY_LAUNCHER and os.environ.get("RANK", "0") == "0":
        meaning = EXIT_MEANINGS.get(code, "see docs/exit_codes.md")
        print(f"crate-clip: exit code {code} ({meaning}); the launcher may report its own code (torchrun and "
              f"accelerate launch: 1)", file=sys.stderr, flush=True)
    return code
