"""A checkpoint save whose writes fail (a full disk, a quota) on some ranks: recorded instead of raised, so every
rank finishes DeepSpeed's save in lock-step (it holds barriers) and then all stop together with the same message.

torch.save given a path writes through its own C++ file layer, which reports a full disk as
"unexpected pos ..." without the errno. Given a Python file object it writes through Python's I/O, where a full
disk is an OSError with errno ENOSPC (EDQUOT for a quota), at about the same speed (BENCHMARKS.md, checkpoint
checksums).
So `recorded_writes` gives DeepSpeed's engine a checkpoint engine whose `save` opens the file itself
(atomic_files.torch_save_to_file, which crate-clip's own files are written with too). Even so torch's zip writer
may report the full disk on close as `RuntimeError: unexpected pos ...` with the OSError only as its __context__:
every exception of a write is recorded, and `is_no_space` walks the cause / context chain. What is shared with the
other ranks is a `Failure` of plain fields (an exception loses its context when it is pickled).
"""
from __future__ import annotations

import contextlib
import errno
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator, Optional

from crate_clip.checkpoint_io.atomic_files import torch_save_to_file

NO_SPACE_ERRNOS = (errno.ENOSPC, errno.EDQUOT)


def is_no_space(exc: BaseException) -> bool:
    """True for a full disk or an exhausted quota (the error itself or one it was raised from)."""
    while exc is not None:
        if isinstance(exc, OSError) and exc.errno in NO_SPACE_ERRNOS:
            return True
        exc = exc.__cause__ or exc.__context__
    return False


@dataclass(frozen=True)
class Failure:
    """One failed write, as the ranks exchange it: the file, the error in words, and whether the disk was full."""
    path: str
    error: str
    no_space: bool

    @classmethod
    def of(cls, path: str | Path, exc: BaseException) -> "Failure":
        return cls(str(path), f"{type(exc).__name__}: {exc}", is_no_space(exc))


@dataclass
class WriteFailures:
    """The first write that failed on this rank during one save: `first` = (file, error), None while every write
    succeeded."""
    first: Optional[tuple] = None

    def run(self, path: str | Path, write: Callable[[], None]) -> None:
        """Call `write()` (which writes `path`), recording any exception instead of raising it (torch's writer
        raises RuntimeError for a full disk); after a first failure the save is lost anyway: nothing more is
        written."""
        if self.first:
            return
        try:
            write()
        except Exception as exc:
            self.first = (Path(path), exc)

    def failure(self) -> Optional[Failure]:
        """The first failure in the plain form the ranks exchange, None when every write succeeded."""
        return Failure.of(*self.first) if self.first else None


class _RecordingCheckpointEngine:
    """DeepSpeed's TorchCheckpointEngine with `save` writing through a Python file object and recording (not
    raising) a failed write; everything else is the wrapped engine's."""

    def __init__(self, inner, record: WriteFailures):
        self._inner, self._record = inner, record

    def __getattr__(self, name):
        return getattr(self._inner, name)

    def save(self, state_dict, path: str) -> None:
        """Write one DeepSpeed file; a failure is recorded and its partial file removed."""
        serialization = getattr(self._inner, "zipfile_serialization", True)
        self._record.run(path, lambda: torch_save_to_file(state_dict, path,
                                                          _use_new_zipfile_serialization=serialization))
        if self._record.first:
            with contextlib.suppress(OSError):
                Path(path).unlink(missing_ok=True)


@contextlib.contextmanager
def recorded_writes(engine) -> Iterator[WriteFailures]:
    """For the body, DeepSpeed's file writes of `engine` record their failures in the WriteFailures yielded (use
    its `run` for other writes). Other checkpoint engines (decoupled, fast-writer) are left as they are: their
    failures raise."""
    record = WriteFailures()
    inner = getattr(engine, "checkpoint_engine", None)
    wrap = type(inner).__name__ == "TorchCheckpointEngine"
    if wrap:
        engine.checkpoint_engine = _RecordingCheckpointEngine(inner, record)
    try:
        yield record
    finally:
        if wrap:
            engine.checkpoint_engine = inner
