"""What a weights file holds, from its header checked against the file's size, before anything is allocated from it.

A safetensors file is an 8-byte length, a JSON header naming each tensor's dtype, shape and byte range, then the
data; a torch file (`torch.save`, DeepSpeed's states files) is a zip archive of uncompressed records. Both headers
are claims: a 1 KB safetensors file may claim 2e9 values, a zip record gigabytes. `stored_values` reads the header
alone and holds every claim to the file's size (a tensor's values fill exactly its byte range, every range and record
lies inside the file), so a model can be held to the values its weights file really has before it is built, and a
torch read never allocates a record the file does not hold. A file that is neither (a legacy torch pickle) is
bounded by its size alone: a value takes at least one byte.
"""
from __future__ import annotations

import json
import math
import stat
import struct
import zipfile
from pathlib import Path

from crate_clip.core.errors import UserError
from crate_clip.core.file_kinds import file_kind

MAX_SAFETENSORS_HEADER = 100 << 20   # the safetensors library's own bound on the JSON header
# bytes per value of the safetensors dtypes torch reads (safetensors.torch)
SAFETENSORS_DTYPES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U8": 1,
                      "BOOL": 1, "F8_E4M3": 1, "F8_E4M3FNUZ": 1, "F8_E5M2": 1, "F8_E5M2FNUZ": 1, "C64": 8, "U64": 8,
                      "U32": 4, "U16": 2}


class WeightsHeaderError(UserError, ValueError):
    """A weights file whose header claims what the file cannot hold; the message names the file and the claim."""


def stored_values(path: str | Path) -> int:
    """How many values weights file `path` holds at most, from its header alone (module doc); WeightsHeaderError
    naming the file when the header is malformed or claims more than the file holds."""
    path = Path(path)
    mode, size = path.stat().st_mode, path.stat().st_size   # FileNotFoundError as torch.load gives it
    if not stat.S_ISREG(mode):   # opening a FIFO to read its header would block
        raise WeightsHeaderError(f"{path}: {file_kind(mode)}, not a weights file")
    if path.suffix == ".safetensors":
        return _safetensors_values(path, size)
    if zipfile.is_zipfile(path):
        return _zip_values(path, size)
    return size


def _safetensors_values(path: Path, size: int) -> int:
    """The values of a safetensors file whose every tensor's byte range matches its dtype and shape and lies in it."""
    with open(path, "rb") as f:
        head = f.read(8)
        length = struct.unpack("<Q", head)[0] if len(head) == 8 else -1
        if not 0 < length <= min(MAX_SAFETENSORS_HEADER, size - 8):
            raise WeightsHeaderError(f"{path}: not a safetensors file (its header length is {length:,} in a file of "
                                     f"{size:,} bytes)")
        try:
            header = json.loads(f.read(length))
            tensors = {name: entry for name, entry in header.items() if name != "__metadata__"}
        except (ValueError, AttributeError, RecursionError) as exc:
            raise WeightsHeaderError(f"{path}: not a safetensors file ({type(exc).__name__} in its header)") from None
    data_bytes, values = size - 8 - length, 0
    for name, entry in tensors.items():
        count, (begin, end) = _tensor_claim(path, name, entry)
        if end > data_bytes:
            raise WeightsHeaderError(f"{path}: its header claims tensor {name[:80]!r} of {count:,} values at bytes "
                                     f"{begin:,}-{end:,}, past the {data_bytes:,} bytes of data the file holds "
                                     "(truncated, or not the file its header describes); copy or download it again")
        values += count
    return values


def _tensor_claim(path: Path, name: str, entry) -> tuple[int, tuple[int, int]]:
    """(values, byte range) one header entry claims, its range the size its dtype and shape make."""
    try:
        itemsize = SAFETENSORS_DTYPES[entry["dtype"]]
        shape, (begin, end) = entry["shape"], entry["data_offsets"]
        if not all(type(n) is int and n >= 0 for n in (*shape, begin, end)):
            raise ValueError
    except (KeyError, TypeError, ValueError):
        raise WeightsHeaderError(f"{path}: not a safetensors file (its header entry {name[:80]!r} is not a dtype, "
                                 "shape and data_offsets)") from None
    count = math.prod(shape)
    if end - begin != count * itemsize:
        raise WeightsHeaderError(f"{path}: its header claims tensor {name[:80]!r} of {count:,} values in "
                                 f"{max(0, end - begin):,} bytes")
    return count, (begin, end)


def _zip_values(path: Path, size: int) -> int:
    """The bytes of a torch zip file's records (a value takes at least one), each stored uncompressed in the file; a
    directory that does not read is the file's size (torch's own reader then refuses the file)."""
    try:
        with zipfile.ZipFile(path) as archive:
            records = archive.infolist()
    except (zipfile.BadZipFile, OSError, ValueError, OverflowError):
        return size   # a damaged archive: torch's reader refuses it, and its caller names the file so
    total = 0
    for record in records:
        if record.compress_type != zipfile.ZIP_STORED or record.header_offset + record.file_size > size:
            raise WeightsHeaderError(f"{path}: its zip record {record.filename[:80]!r} claims {record.file_size:,} "
                                     f"bytes{' compressed' if record.compress_type != zipfile.ZIP_STORED else ''}, "
                                     f"which a torch file of {size:,} bytes does not hold")
        total += record.file_size
    if total > size:
        raise WeightsHeaderError(f"{path}: its zip records claim {total:,} bytes, more than the file's {size:,}")
    return total
