"""A full disk while a run writes: one line that names the folder, what was being saved, the last complete
checkpoint and how much to free; never a raw ENOSPC. A save that runs out of space is removed (its `.saving`
folder held the space) and the last complete checkpoint stays the one a resume continues from; a resume checks
first that the next checkpoint fits, so it does not train for nothing."""
from __future__ import annotations

import shutil
from pathlib import Path
from typing import Optional

from crate_clip.checkpoint_io.checkpoint_manifest import checkpoint_files
from crate_clip.checkpoint_io.deepspeed_checkpoints import latest_complete_tag
from crate_clip.checkpoint_io.run_layout import checkpoints_dir
from crate_clip.core.errors import EXIT_NO_SPACE, UserError


class NoSpaceError(UserError, RuntimeError):
    """The disk the run writes to is full (or its quota used up); the message says what to free."""
    exit_code = EXIT_NO_SPACE


def size_text(n: float) -> str:
    """A byte count for people: MiB below 1 GiB, else GiB with one decimal."""
    return f"{n / 2 ** 30:.1f} GiB" if n >= 2 ** 30 else f"{max(n / 2 ** 20, 0.1):.1f} MiB"


def checkpoint_bytes(tag_dir: Optional[Path]) -> int:
    """The bytes of a checkpoint's files (0 for None or a folder that is gone)."""
    if tag_dir is None or not Path(tag_dir).is_dir():
        return 0
    return sum(checkpoint_files(tag_dir).values())


def free_bytes(folder: Path) -> int:
    """Bytes a process may still write into `folder`'s file system (its nearest existing parent's)."""
    folder = Path(folder).absolute()
    while not folder.exists():
        folder = folder.parent
    return shutil.disk_usage(folder).free


def to_free(needed: int, folder: Path) -> str:
    """'free N GiB': what to free in `folder`'s file system for `needed` more bytes (plus 5%)."""
    missing = int(needed * 1.05) - free_bytes(folder)
    return f"free at least {size_text(missing)}" if missing > 0 else "free some space"


def no_space_in_save(root: Path, tag: str, last_complete: Optional[str], needed: int) -> NoSpaceError:
    """The error of a checkpoint save that ran out of space (its partial files already removed)."""
    last = (f"the last complete checkpoint is {last_complete}" if last_complete else
            "there is no complete checkpoint yet")
    return NoSpaceError(f"no space left on {root} while saving {tag}; {last}; {to_free(needed, root)} there and "
                        f"resume (--resume latest)")


def no_space_while_writing(exc: BaseException, run_dir: Path) -> NoSpaceError:
    """The error of any other write of a run (metrics, run_config.yaml, the lock, the export) that ran out of space."""
    filename = getattr(exc, "filename", None)
    root = checkpoints_dir(run_dir)
    last = latest_complete_tag(root)
    last_text = f"the last complete checkpoint is {last}" if last else "there is no complete checkpoint yet"
    return NoSpaceError(f"no space left on {run_dir}{f' (writing {filename})' if filename else ''}; {last_text}; "
                        f"{to_free(checkpoint_bytes(root / last if last else None), run_dir)} there and resume "
                        "(--resume latest)")


def check_space_for_next_save(root: Path, tag_dir: Optional[Path]) -> None:
    """NoSpaceError when the checkpoints' file system has less free space than the checkpoint `tag_dir` takes
    (the next save writes as much, beside it)."""
    needed = checkpoint_bytes(tag_dir)
    free = free_bytes(root)
    if needed > free:
        raise NoSpaceError(f"no space left on {root} for the next checkpoint: it takes about {size_text(needed)} "
                           f"(the size of {tag_dir.name}), {size_text(free)} are free; {to_free(needed, root)} there "
                           "and resume (--resume latest)")
