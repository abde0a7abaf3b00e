"""The error our checkpoint loaders raise, and how they list key names in it."""
from typing import Iterable

from crate_clip.core.errors import UserError


class CheckpointMismatchError(UserError, RuntimeError):
    """A checkpoint whose keys or shapes do not match the model; the message names them."""


def key_list(keys: Iterable[str], limit: int = 20) -> str:
    """Sorted key names, comma-separated, the first `limit` of them and a count of the rest."""
    keys = sorted(keys)
    more = f" ... and {len(keys) - limit} more" if len(keys) > limit else ""
    return ", ".join(keys[:limit]) + more
