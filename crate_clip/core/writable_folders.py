"""A folder a command will write into, checked before the work starts: a read-only file system (EROFS) or a folder
this process may not write (EACCES, EPERM) is one line naming the folder and the fix (exit code 2), not a traceback
after minutes of work. Part of the bottom layer: it imports nothing of crate_clip but the errors."""
from __future__ import annotations

import errno
import os
import tempfile
from pathlib import Path
from typing import Optional

from crate_clip.core.errors import UserError

UNWRITABLE_ERRNOS = (errno.EROFS, errno.EACCES, errno.EPERM)


class UnwritableFolderError(UserError, OSError):
    """A folder that cannot be written (read-only file system, no permission); the message names it and the fix."""


def _message(folder: Path, what: str, exc: OSError) -> str:
    name = errno.errorcode.get(exc.errno, str(exc.errno))
    where = f" ({exc.filename})" if exc.filename and Path(str(exc.filename)) != folder else ""
    return (f"{what} {folder}: cannot write there{where}: {exc.strerror or exc} ({name}); fix: choose a folder on a "
            f"writable file system, or make this one writable")


def unwritable_error(exc: BaseException, folder, what: str = "output folder",
                     errnos: tuple = UNWRITABLE_ERRNOS) -> Optional[UnwritableFolderError]:
    """The one-line error for `exc` (or an error it was raised from) when it says a folder cannot be written
    (one of `errnos`); None for any other error."""
    while exc is not None:
        if isinstance(exc, UnwritableFolderError):
            return exc
        if isinstance(exc, OSError) and exc.errno in errnos:
            return UnwritableFolderError(_message(Path(folder), what, exc))
        exc = exc.__cause__ or exc.__context__
    return None


def check_writable(folder, what: str = "output folder") -> None:
    """UnwritableFolderError unless a file can be created in `folder`, or, when it does not exist yet, in its
    nearest existing parent (where it will be created). A real probe file, not os.access: the file system
    (read-only mount, NFS squashing root, quotas) decides, not the permission bits."""
    folder = Path(folder).absolute()
    existing = folder
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    if not existing.is_dir():
        return   # a file where a folder is expected: the command's own check names it
    try:
        fd, probe = tempfile.mkstemp(prefix=".crate-clip-write-probe-", dir=existing)
    except OSError as exc:
        error = unwritable_error(exc, folder, what)
        if error is None:
            raise
        raise error from exc
    os.close(fd)
    os.unlink(probe)
