"""What a user's files are, to check that a refused or failed command left them as they were."""
from __future__ import annotations

import hashlib
import os
import stat
from pathlib import Path

KINDS = {stat.S_IFREG: "file", stat.S_IFDIR: "folder", stat.S_IFLNK: "link", stat.S_IFIFO: "fifo",
         stat.S_IFSOCK: "socket", stat.S_IFCHR: "char device", stat.S_IFBLK: "block device"}


def snapshot(root: Path) -> dict[str, tuple]:
    """`root` and, when it is a folder, everything under it, links not followed: relative path ('.' for `root`) ->
    (kind, where a link points, size, modification time in ns, sha256 of a file's bytes). A folder is its kind
    only: its own size and time change with any entry made and removed again (a lock taken and released), while
    an entry added, removed or changed shows as that entry."""
    root = Path(root)
    found = {".": _state(root)}
    if found["."][0] == "folder":
        for folder, subfolders, files in os.walk(root):   # os.walk lists a link to a folder but does not enter it
            for name in subfolders + files:
                path = Path(folder, name)
                found[str(path.relative_to(root))] = _state(path)
    return dict(sorted(found.items()))


def _state(path: Path) -> tuple:
    st = os.lstat(path)
    kind = KINDS[stat.S_IFMT(st.st_mode)]
    if kind == "folder":
        return (kind,)
    target = os.readlink(path) if kind == "link" else None
    digest = hashlib.sha256(path.read_bytes()).hexdigest() if kind == "file" else None   # a fifo is never read
    return kind, target, st.st_size, st.st_mtime_ns, digest
