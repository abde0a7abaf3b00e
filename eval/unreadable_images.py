"""When too many evaluation images cannot be read, the evaluation refuses its result instead of reporting it.

An evaluation counts unreadable images (corrupt files, broken tars) rather than stopping at the first one;
a number computed from a few of the images would describe another data set, so above
`max_unreadable_fraction` of them (and always when none was read) it raises UnreadableDataError.
"""
from __future__ import annotations

DEFAULT_MAX_UNREADABLE_FRACTION = 0.01


class UnreadableDataError(ValueError):
    """Too many images of an evaluation set could not be read; the message names the set, counts and examples."""


def check_unreadable(what: str, n_read: int, n_unreadable: int, max_fraction: float,
                     examples: list[str] = ()) -> None:
    """Raise UnreadableDataError when nothing was read or more than `max_fraction` of the images were unreadable."""
    total = n_read + n_unreadable
    shown = f" (e.g. {', '.join(examples[:3])})" if examples else ""
    if n_read == 0:
        found = f"none of its {total} images could be read{shown}" if total else "it holds no images"
        raise UnreadableDataError(f"{what}: {found}; no result (fix or replace the files)")
    if n_unreadable > max_fraction * total:
        raise UnreadableDataError(
            f"{what}: {n_unreadable} of {total} images ({n_unreadable / total:.1%}) could not be read{shown}, "
            f"more than max_unreadable_fraction {max_fraction:g}; the result is refused (fix the files, or raise "
            f"--max-unreadable-fraction / the eval's max_unreadable_fraction to accept it)")


def data_name(dataset) -> str:
    """The folder or first shard an evaluation set was read from, for messages."""
    root = getattr(dataset, "root", None)
    if root is not None:
        return str(root)
    urls = getattr(dataset, "urls", None)
    if urls:
        return urls[0] + (f" (+{len(urls) - 1} more shards)" if len(urls) > 1 else "")
    return type(dataset).__name__
