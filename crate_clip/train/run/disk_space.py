"""A full disk while a run writes: one line that names the folder, what was being saved, the last complete
checkpoint and how much to free; never a raw ENOSPC. A save that runs out of space is removed (its `.saving`
folder held the space) and the last complete checkpoint stays the one a resume continues from; a resume checks
first that the next checkpoint fits, so it does not train for nothing: it first removes what interrupted writes
left (a `.<tag>.saving` folder, a `.universal.converting` folder of a killed conversion; the run's lock is held,
so no other job writes there), counts each file once however many hard links it has (a universal folder links
its model-states file), and names what else could be freed (converted `universal/` copies)."""
from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Iterable, Optional

from crate_clip.checkpoint_io.checkpoint_record import latest_complete_tag
from crate_clip.checkpoint_io.deepspeed_checkpoints import UNIVERSAL_DIR
from crate_clip.checkpoint_io.run_layout import checkpoints_dir, is_own_staging, tag_position
from crate_clip.core.errors import EXIT_NO_SPACE, UserError


class NoSpaceError(UserError, RuntimeError):
    """The disk the run writes to is full (or its quota used up); the message says what to free."""
    exit_code = EXIT_NO_SPACE


def size_text(n: float) -> str:
    """A byte count for people: MiB below 1 GiB, else GiB with one decimal."""
    return f"{n / 2 ** 30:.1f} GiB" if n >= 2 ** 30 else f"{max(n / 2 ** 20, 0.1):.1f} MiB"


CONVERTING_DIR = f".{UNIVERSAL_DIR}.converting"


def tree_bytes(folder: Optional[Path], skip: Iterable[str] = ()) -> int:
    """The bytes the files under `folder` take, each file once however many hard links name it (by inode), links
    not followed, the top-level entries named in `skip` left out; 0 for None or a folder that is gone."""
    if folder is None or not Path(folder).is_dir():
        return 0
    seen, total, skip = set(), 0, set(skip)
    for top, dirs, files in os.walk(folder):
        if Path(top) == Path(folder):
            dirs[:] = [d for d in dirs if d not in skip]
            files = [f for f in files if f not in skip]
        for name in files:
            try:
                st = os.lstat(os.path.join(top, name))
            except FileNotFoundError:
                continue
            if (st.st_dev, st.st_ino) not in seen:
                seen.add((st.st_dev, st.st_ino))
                total += st.st_size
    return total


def checkpoint_bytes(tag_dir: Optional[Path]) -> int:
    """The bytes a checkpoint's files take on disk (a converted universal/ folder included, its hard-linked files
    once; leftovers of a conversion not); 0 for None or a folder that is gone."""
    return tree_bytes(tag_dir, skip=(CONVERTING_DIR,))


def save_bytes(tag_dir: Optional[Path]) -> int:
    """What the next save writes, judged by checkpoint `tag_dir`: its own files, not its universal/ copy."""
    return tree_bytes(tag_dir, skip=(CONVERTING_DIR, UNIVERSAL_DIR))


def leftovers(root: Path) -> list[Path]:
    """What interrupted writes left in checkpoints folder `root`: `.<tag>.saving` folders and the
    `.universal.converting` folders of killed conversions in checkpoint folders, by the trainer's own names only (a
    user's folders stay; a `.<tag>.replaced` folder is a checkpoint's previous copy, put back by the checkpoint
    manager: not a leftover)."""
    if not Path(root).is_dir():
        return []
    found = sorted(p for p in Path(root).iterdir() if is_own_staging(p))   # only the trainer's own names
    return found + sorted(p for p in Path(root).glob(f"*/{CONVERTING_DIR}") if p.is_dir() and
                          tag_position(p.parent.name) is not None and not p.parent.is_symlink())


def remove_leftovers(root: Path) -> list[str]:
    """Remove leftovers(root) (the caller holds the run's lock); returns what was removed, with sizes, for a note."""
    removed = []
    for path in leftovers(root):
        size = tree_bytes(path)
        shutil.rmtree(path, ignore_errors=True)
        removed.append(f"{path.relative_to(root)} ({size_text(size)})")
    return removed


def removable(root: Path, keep: Optional[Path]) -> list[str]:
    """Converted universal/ copies of the run's checkpoints other than `keep`'s (a resume converts again when it
    needs one), with sizes; a user's folders are not named."""
    found = []
    for folder in sorted(Path(root).glob(f"*/{UNIVERSAL_DIR}")) if Path(root).is_dir() else ():
        if tag_position(folder.parent.name) is None or folder.parent.is_symlink():
            continue
        if keep is None or folder.parent != Path(keep):
            found.append(f"{folder.relative_to(root)} ({size_text(tree_bytes(folder))}, a converted copy)")
    return found


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
    (the next save writes as much, beside it; its universal/ copy is not written again); the message names the
    converted copies that could be removed. Leftovers are removed before (remove_leftovers, rank 0)."""
    needed = save_bytes(tag_dir)
    free = free_bytes(root)
    if needed > free:
        others = removable(root, tag_dir)
        hint = f" (removable: {', '.join(others)})" if others else ""
        raise NoSpaceError(f"no space left on {root} for the next checkpoint: it takes about {size_text(needed)} "
                           f"(the size of {tag_dir.name}), {size_text(free)} are free; {to_free(needed, root)} there"
                           f"{hint} and resume (--resume latest)")
