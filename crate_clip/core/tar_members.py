"""Tar members read within bounds: every member's size is known from its header before a byte of it is read.

webdataset's tar iterator (tarfile "r|*") decompresses gzip/bz2/xz shards on the fly and reads each member whole:
a 2 MB gzip shard holding one 2 GiB member took 5 GB to inspect. Here a shard is an uncompressed tar
(webdataset's and img2dataset's .tar): a compressed one is recognised from its first bytes and refused before
anything is decompressed; a member above its cap is passed over unread (seeked past, or read through in 1 MiB
pieces from a pipe); pax and GNU long-name records, which only carry a path or a size, are bounded too.
A size field no file can hold (the base-256 encoding allows 2^95; a pax size of any length) is a malformed header,
refused before any seek. The same walk, reading no data at all, counts the complete samples of a local tar
(crate_clip.data's shard_census.py); tar_samples.py groups the members into samples, for training and evaluation.
"""
from __future__ import annotations

import re
import tarfile
from dataclasses import dataclass
from typing import BinaryIO, Callable, Iterator

BLOCK = tarfile.BLOCKSIZE
# First bytes of the compressed streams tarfile would open transparently ("r:*"), and zstd's.
COMPRESSED_MAGIC = {b"\x1f\x8b": "gzip", b"BZh": "bzip2", b"\xfd7zXZ\x00": "xz", b"\x28\xb5\x2f\xfd": "zstd"}
MAX_RECORD_BYTES = 1 << 20     # a pax or GNU long-name record holds a path and a few numbers
# A member size above this is no member of a real file (8 EiB: the largest offset a seek takes); 2^80 from a
# base-256 size field made the seek raise "cannot fit 'int' into an offset-sized integer", naming no shard.
MAX_SIZE_FIELD = (1 << 63) - 1
SKIP_CHUNK = 1 << 20           # passing over a member of a pipe: read and dropped in pieces of this size
_META = re.compile(r"__[^/]*__($|/)")   # webdataset's skip_meta: __key__-style names are not members of a sample


class CompressedTarError(tarfile.ReadError):
    """A compressed shard: refused before any of it is decompressed."""

    def __init__(self, kind: str):
        super().__init__(f"{kind}-compressed tar: crate-clip reads uncompressed .tar shards only")
        self.kind = kind


class TruncatedTarError(EOFError):
    """A tar that ends before its end-of-archive blocks (cut in a header, in a member, or between members)."""


@dataclass
class Member:
    """One regular-file member: its name, size, where its data ends, and its bytes (None: above its cap, unread)."""

    name: str
    size: int
    end: int            # offset just past the member's data (before padding), from the start of the tar
    data: bytes | None


def compression_of(head: bytes) -> str | None:
    """'gzip', 'bzip2', 'xz' or 'zstd' when a stream starts like one, else None."""
    return next((kind for magic, kind in COMPRESSED_MAGIC.items() if head.startswith(magic)), None)


class _Reader:
    """A byte stream read in exact amounts, keeping its offset; passes over data by seeking where it can."""

    def __init__(self, stream: BinaryIO):
        self.stream, self.offset = stream, 0
        try:
            self.seekable = bool(stream.seekable())
        except Exception:   # a pipe or socket wrapper without seekable()
            self.seekable = False

    def read(self, n: int) -> bytes:
        """Up to n bytes; fewer only at the end of the stream."""
        parts, left = [], n
        while left > 0:
            piece = self.stream.read(left)
            if not piece:
                break
            parts.append(piece)
            left -= len(piece)
        data = b"".join(parts)
        self.offset += len(data)
        return data

    def skip(self, n: int) -> None:
        """Pass over n bytes without keeping them (a seek past the end is found at the next header)."""
        if n <= 0:
            return
        if self.seekable:
            self.stream.seek(n, 1)
            self.offset += n
            return
        while n > 0:
            got = len(self.read(min(n, SKIP_CHUNK)))
            if got == 0:
                raise TruncatedTarError("unexpected end of data")
            n -= got


def _pax_fields(record: bytes) -> dict[str, str]:
    """The 'LENGTH key=value\\n' fields of a pax extended header."""
    fields, pos = {}, 0
    while pos < len(record):
        space = record.find(b" ", pos)
        if space < 0 or not record[pos:space].isdigit():
            raise tarfile.ReadError("malformed pax header")
        length = int(record[pos:space])
        entry = record[space + 1:pos + length]
        if length <= space - pos or not entry.endswith(b"\n") or b"=" not in entry:
            raise tarfile.ReadError("malformed pax header")
        key, value = entry[:-1].split(b"=", 1)
        fields[key.decode("utf-8", "replace")] = value.decode("utf-8", "surrogateescape")
        pos += length
    return fields


def _header(reader: _Reader, started: bool) -> tarfile.TarInfo | None:
    """The next header block, or None at the end-of-archive block."""
    block = reader.read(BLOCK)
    if not started and compression_of(block):   # before anything else: a small gzip file is shorter than a block
        raise CompressedTarError(compression_of(block))
    if len(block) < BLOCK:
        if not block and not started:
            raise tarfile.ReadError("empty file")
        raise TruncatedTarError("unexpected end of data")
    if block.count(0) == BLOCK:
        return None
    try:
        info = tarfile.TarInfo.frombuf(block, "utf-8", "surrogateescape")
    except tarfile.HeaderError as exn:
        raise tarfile.ReadError(f"invalid tar header at byte {reader.offset - BLOCK}: {exn}") from None
    _check_size(info.size, reader.offset - BLOCK)
    return info


def _check_size(size: int, at: int) -> None:
    """tarfile.ReadError for a member size no file holds (negative, or beyond any offset)."""
    if not 0 <= size <= MAX_SIZE_FIELD:
        raise tarfile.ReadError(f"invalid tar header at byte {at}: a member size of {size:.3g} bytes")


def iter_members(stream: BinaryIO, cap: Callable[[str], int]) -> Iterator[Member]:
    """The regular-file members of an uncompressed tar stream, in order; a member larger than cap(name) comes
    with data None, unread. Raises CompressedTarError at the first block of a compressed stream, TruncatedTarError
    where the tar is cut, tarfile.ReadError where it is not a tar."""
    reader, started, name, size = _Reader(stream), False, None, None
    while True:
        info = _header(reader, started)
        if info is None:
            return
        started = True
        member_size = info.size if size is None else size
        if info.type in (tarfile.XHDTYPE, tarfile.SOLARIS_XHDTYPE, tarfile.GNUTYPE_LONGNAME):
            record = _record(reader, info.size)
            if info.type == tarfile.GNUTYPE_LONGNAME:
                name = record.split(b"\0", 1)[0].decode("utf-8", "surrogateescape")
            else:
                fields = _pax_fields(record)
                name = fields.get("path", name)
                size = _pax_size(fields.get("size"), reader.offset) if "size" in fields else size
            continue
        member_name = name if name is not None else info.name
        name = size = None
        if info.type not in tarfile.REGULAR_TYPES or info.type == tarfile.GNUTYPE_SPARSE or _META.match(member_name):
            reader.skip(_padded(member_size))
            continue
        if member_size > cap(member_name):
            reader.skip(member_size)
            yield Member(member_name, member_size, reader.offset, None)
        else:
            data = reader.read(member_size)
            if len(data) < member_size:
                raise TruncatedTarError("unexpected end of data")
            yield Member(member_name, member_size, reader.offset, data)
        reader.skip(_padded(member_size) - member_size)


def _pax_size(value: str, at: int) -> int:
    """The size a pax record gives (decimal digits), bounded before it is converted."""
    if not (value.isascii() and value.isdigit()) or len(value) > len(str(MAX_SIZE_FIELD)):
        raise tarfile.ReadError(f"invalid pax size {value[:24]!r} before byte {at}")
    size = int(value)
    _check_size(size, at)
    return size


def _padded(size: int) -> int:
    """A member's size rounded up to whole blocks."""
    return -(-size // BLOCK) * BLOCK


def _record(reader: _Reader, size: int) -> bytes:
    """A pax or GNU long-name record (bounded: it holds a path and a few numbers)."""
    if size > MAX_RECORD_BYTES:
        raise tarfile.ReadError(f"a {size:,}-byte tar header record (more than {MAX_RECORD_BYTES:,})")
    data = reader.read(_padded(size))
    if len(data) < _padded(size):
        raise TruncatedTarError("unexpected end of data")
    return data[:size]
