"""Which class each folder of an ImageFolder-layout evaluation set holds: by name, or by an index in the folder
name, never by sort order alone (a test split named `Ankle_boot/` where the training split says `9_ankle_boot/`
sorts differently, and sort order would silently swap the labels).

A folder matches a class when their names agree ignoring case and punctuation (`T-shirt_top` is class
`T-shirt/top`), either whole or without a leading index (`03_coat`, `3-coat`). When no folder matches a name,
folders named by their 0-based class index (`3`, `03_anything`) are taken by that index. Anything else is an
error that names the folders.
"""
from __future__ import annotations

import re
from pathlib import Path

INDEX_PREFIX = re.compile(r"^(\d+)(?:[ _.\-]+(.*))?$")   # "3", "03_coat", "3-ankle boot"


def name_key(name: str) -> str:
    """The name compared: lower-case letters and digits only."""
    return re.sub(r"[^0-9a-z]", "", name.lower())


def _keys(name: str) -> set[str]:
    """The name whole and, when it starts with an index, without it."""
    keys = {name_key(name)}
    match = INDEX_PREFIX.match(name.strip())
    if match and match.group(2):
        keys.add(name_key(match.group(2)))
    return keys - {""}


def _by_name(folder: str, classnames: list[str]) -> int | None:
    """The one class whose name the folder carries (whole names first), None when none or several."""
    whole = [i for i, c in enumerate(classnames) if name_key(c) == name_key(folder)]
    if len(whole) == 1:
        return whole[0]
    keys = _keys(folder)
    found = [i for i, c in enumerate(classnames) if keys & _keys(c)]
    return found[0] if len(found) == 1 else None


def _by_index(folders: list[str], num_classes: int) -> dict[str, int] | None:
    """Folder -> the class index its name starts with, when every folder has a distinct one in range."""
    matches = {f: INDEX_PREFIX.match(f.strip()) for f in folders}
    if not all(matches.values()):
        return None
    indices = {f: int(m.group(1)) for f, m in matches.items()}
    if len(set(indices.values())) != len(indices) or not all(0 <= i < num_classes for i in indices.values()):
        return None
    return indices


def map_class_folders(root: str | Path, folders: list[str], classnames: list[str]) -> dict[str, int]:
    """Folder name -> class index, matched by name or by a leading 0-based index; ValueError naming the folders
    that match no class (or the same class as another folder)."""
    by_name = {f: _by_name(f, classnames) for f in folders}
    if not any(i is not None for i in by_name.values()):
        by_index = _by_index(folders, len(classnames))
        if by_index is not None:
            return by_index
    unmatched = [f for f, i in by_name.items() if i is None]
    taken: dict[int, str] = {}
    doubles = []
    for folder, index in sorted((f, i) for f, i in by_name.items() if i is not None):
        if index in taken:
            doubles.append(f"{taken[index]!r} and {folder!r} both match class {classnames[index]!r}")
        taken.setdefault(index, folder)
    if unmatched or doubles:
        what = ([f"folders {_shown(unmatched)} match no class name" if unmatched else ""] + doubles)
        raise ValueError(f"{root}: {'; '.join(w for w in what if w)} (class names: {_shown(classnames)}); fix: "
                         f"name each folder after its class (e.g. 'ankle_boot' or '9_ankle_boot') or by its "
                         f"0-based class index, or give the class-names file of these folders")
    return by_name


def _shown(names: list[str], limit: int = 6) -> str:
    more = f" ... ({len(names)} in all)" if len(names) > limit else ""
    return ", ".join(repr(n) for n in names[:limit]) + more
