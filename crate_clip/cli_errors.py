"""One way for every `crate-clip` command to report a user error: one line, exit code 2, traceback with --debug;
and, under a launcher that replaces the process's exit code with its own, that code as the last line
(docs/exit_codes.md)."""
from __future__ import annotations

import os
import sys

from crate_clip.models.checkpoint_errors import CheckpointMismatchError

EXIT_USAGE = 2
# What each exit code of a crate-clip process means (crate_clip/train/cli.py: EXIT_CONFIG, EXIT_NONFINITE,
# EXIT_RESUME); docs/exit_codes.md says the same for users.
EXIT_MEANINGS = {1: "unexpected error, see the traceback above", 2: "configuration or input error, see the message above",
                 3: "training stopped after too many non-finite losses in a row",
                 4: "the checkpoint cannot be resumed by this job"}
# Set in the processes torchrun, the DeepSpeed launcher and `accelerate launch` start.
LAUNCHER_ENV = ("LOCAL_RANK", "RANK", "TORCHELASTIC_RUN_ID", "ACCELERATE_MIXED_PRECISION")
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


def show_exit_code(code: int) -> int:
    """Under a launcher, print `crate-clip: exit code N (meaning)` as rank 0's last line (torchrun and `accelerate
    launch` exit 1 for any failing process); returns `code`."""
    if code and any(k in os.environ for k in LAUNCHER_ENV) and os.environ.get("RANK", "0") == "0":
        meaning = EXIT_MEANINGS.get(code, "see docs/exit_codes.md")
        print(f"crate-clip: exit code {code} ({meaning}); the launcher may report its own code (torchrun and "
              f"accelerate launch: 1)", file=sys.stderr, flush=True)
    return code
