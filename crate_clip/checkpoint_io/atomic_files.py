"""Write-then-rename: a reader (or a run resumed after SIGKILL or a power loss) sees the old or the new
content, never half of it. Data is fsynced before the rename and the folder after it, so the rename
cannot reach the disk before the bytes it points to."""
from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Callable

import torch


def fsync_dir(path: Path) -> None:
    """Make the names in folder `path` (created, renamed, removed) durable."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_file(path: Path) -> None:
    """Make the bytes of file `path` durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_tree(root: Path) -> None:
    """fsync every file and folder under `root`, and `root` itself. Several processes may write there at once
    (each rank fsyncs after its own writes, so each file is synced by its writer at least): a file that is
    renamed away meanwhile (another rank's temporary file) is skipped."""
    for folder, _, files in os.walk(root):
        for name in files:
            try:
                fsync_file(Path(folder) / name)
            except FileNotFoundError:
                continue
        fsync_dir(Path(folder))


def _temporary_name(path: Path) -> Path:
    return path.with_name(f".{path.name}.tmp{os.getpid()}")


def atomic_write(path: Path, write: Callable[[Path], None]) -> None:
    """Call `write(tmp)` on a temporary file beside `path`, fsync it, rename it to `path`, fsync the folder."""
    path = Path(path)
    tmp = _temporary_name(path)
    try:
        write(tmp)
        fsync_file(tmp)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fsync_dir(path.parent)


def atomic_write_text(path: Path, text: str) -> None:
    """Write a text file atomically and durably."""
    atomic_write(path, lambda tmp: tmp.write_text(text))


def torch_save_to_file(obj, path: str | Path, **kwargs) -> None:
    """torch.save through a Python file object: given a path, torch writes through its own C++ layer, which
    reports a full disk as "unexpected pos ..."; through Python's I/O it is OSError(ENOSPC)."""
    with open(path, "wb") as f:
        torch.save(obj, f, **kwargs)


def atomic_torch_save(obj, path: Path) -> None:
    """torch.save atomically and durably."""
    atomic_write(path, lambda tmp: torch_save_to_file(obj, tmp))


def replaced_name(path: Path) -> Path:
    """Where replace_dir keeps the previous folder until the new one is in place."""
    return path.with_name(f".{path.name}.replaced")


def replace_dir(new: Path, path: Path) -> None:
    """Put the complete folder `new` at `path`. An existing `path` is renamed aside first and deleted only once
    `new` holds its name, so some complete version always exists (restore_replaced undoes a cut-short swap)."""
    new, path = Path(new), Path(path)
    old = replaced_name(path)
    if old.exists():
        shutil.rmtree(old)
    if path.exists():
        os.rename(path, old)
    os.rename(new, path)
    fsync_dir(path.parent)
    shutil.rmtree(old, ignore_errors=True)


def restore_replaced(path: Path) -> bool:
    """After a swap cut short between its two renames, put the previous folder back; True if it did."""
    old = replaced_name(Path(path))
    if old.is_dir() and not Path(path).exists():
        os.rename(old, path)
        fsync_dir(Path(path).parent)
        return True
    return False
