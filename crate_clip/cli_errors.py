"""One way for every `crate-clip` command to report a user error: one line, exit code 2, traceback with --debug."""
from __future__ import annotations

import os
import sys

from crate_clip.models.checkpoint_errors import CheckpointMismatchError

EXIT_USAGE = 2
DEBUG_ENV = "CRATE_CLIP_DEBUG"   # set by `crate-clip --debug ...`; inherited by the ranks a launcher starts
# Errors that are about the user's input (files, config, data): reported in one line, not as a traceback.
USER_ERRORS = (ValueError, FileNotFoundError, NotADirectoryError, CheckpointMismatchError)


def pop_debug_flag(argv: list[str]) -> list[str]:
    """argv without `--debug`; its presence turns on tracebacks for this process and its children."""
    if "--debug" in argv:
        os.environ[DEBUG_ENV] = "1"
    return [a for a in argv if a != "--debug"]


def debug_enabled() -> bool:
    """Whether `--debug` was given (or CRATE_CLIP_DEBUG=1 is set)."""
    return os.environ.get(DEBUG_ENV) == "1"


def report_error(prog: str, exc: BaseException, code: int = EXIT_USAGE) -> int:
    """Print `prog: error: <message>` on one line and return `code`; with --debug re-raise (traceback)."""
    if debug_enabled():
        raise exc
    message = " ".join(str(exc).split()) or type(exc).__name__
    print(f"{prog}: error: {message} (--debug shows the traceback)", file=sys.stderr)
    return code
