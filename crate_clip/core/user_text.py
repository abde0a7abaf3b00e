"""Text from a user's files (config keys and values, paths) echoed in a message: control characters escaped, so a
key holding an escape sequence cannot recolour, move or clear the terminal, and long values cut, so a huge value (a
YAML alias chain, a 10 MB caption) cannot turn a one-line error into megabytes. Part of the bottom layer: it
imports nothing of crate_clip."""
from __future__ import annotations

import reprlib

MAX_VALUE_CHARS = 100     # a value echoed in an error: enough to recognise it
MAX_LINE_CHARS = 1000     # one line of a message, the fix included (the longest fixes are ~450 characters)


def printable(text: str, keep_newlines: bool = False) -> str:
    """`text` with characters Python calls unprintable (controls: C0, DEL, C1; formats: bidi overrides; line and
    paragraph separators) written as escapes (`\\x1b`, `\\u202e`);
    newlines kept when `keep_newlines` (a message of several lines)."""
    if text.isprintable():
        return text
    return "".join(c if c.isprintable() or (keep_newlines and c == "\n")
                   else c.encode("unicode_escape").decode("ascii") for c in text)


def cut(text: str, limit: int = MAX_LINE_CHARS) -> str:
    """`text` cut to `limit` characters, saying how many were left out."""
    if len(text) <= limit:
        return text
    return f"{text[:limit]}... ({len(text) - limit:,} more characters)"


_REPR = reprlib.Repr()
_REPR.maxlevel, _REPR.maxlist, _REPR.maxtuple, _REPR.maxdict, _REPR.maxset = 3, 6, 6, 6, 6
_REPR.maxstring, _REPR.maxother, _REPR.maxlong = MAX_VALUE_CHARS, MAX_VALUE_CHARS, 40


def short_repr(value) -> str:
    """repr(value) for a message: nested containers and long strings shortened (reprlib, which never builds the
    whole repr of a large value), cut to MAX_VALUE_CHARS, control characters escaped."""
    text = _REPR.repr(value)
    return printable(text if len(text) <= MAX_VALUE_CHARS else text[:MAX_VALUE_CHARS] + "...")
