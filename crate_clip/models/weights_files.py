"""Reading weights files (.safetensors, .pt, .pth, DeepSpeed model states) with one clear error for a bad file.

torch and safetensors report a truncated or corrupt file as SafetensorError, UnpicklingError, a zip
"failed finding central directory", or the advice to retry with weights_only=False (unsafe, and no help
for a broken file). Every read goes through `read_weights_file`, which names the file and the fix instead.
"""
from __future__ import annotations

import pickle
import struct
import zipfile
from pathlib import Path

from crate_clip.checkpoint_io.safe_unpickling import UntrustedCheckpointError, load_torch_file
from crate_clip.checkpoint_io.weights_headers import WeightsHeaderError, stored_values
from crate_clip.core.errors import UserError
from crate_clip.core.file_kinds import special_file


class CorruptWeightsError(UserError, ValueError):
    """A weights or checkpoint file that cannot be read; the message names the file and the fix."""


def corrupt_file_message(path, exn: BaseException) -> str:
    """One line: the file, why it could not be read, and what to do."""
    reason = str(exn).strip().splitlines()[0] if str(exn).strip() else type(exn).__name__
    return (f"{path}: corrupt or truncated weights file ({type(exn).__name__}: {reason[:160]}); copy or "
            f"download it again, or point to another checkpoint (an interrupted save leaves such files)")


def refuse_special_file(path: str | Path) -> None:
    """CorruptWeightsError saying what `path` is when it is a FIFO, a device or a socket (links followed): a FIFO
    blocks the read, a device (a link to /dev/zero) never ends it, and "not found" would be wrong for both."""
    kind = special_file(path)
    if kind:
        raise CorruptWeightsError(f"{path}: {kind}, not a weights file; fix: point to the weights file itself")


def read_weights_file(path: str | Path):
    """The object stored in a .safetensors / torch file; a corrupt or truncated file (its header claiming more than
    the file holds included: crate_clip.checkpoint_io.weights_headers) raises CorruptWeightsError, one that pickles a
    class outside the allow-list UntrustedCheckpointError."""
    path = Path(path)
    refuse_special_file(path)
    try:
        if path.suffix == ".safetensors":
            from safetensors.torch import load_file
            stored_values(path)   # its header held to the file's size before any tensor exists
            return load_file(str(path), device="cpu")
        return load_torch_file(path)   # weights_only=True, DeepSpeed's classes allowed (its model-states files)
    except (FileNotFoundError, IsADirectoryError, PermissionError, UntrustedCheckpointError):
        raise
    except WeightsHeaderError as exn:   # the header claims more than the file holds: truncated, or not such a file
        said = str(exn).removeprefix(f"{path}: ")
        raise CorruptWeightsError(f"{path}: corrupt or truncated weights file: {said}") from None
    except (pickle.UnpicklingError, RuntimeError, EOFError, OSError, ValueError, LookupError, TypeError,
            AttributeError, OverflowError, MemoryError, zipfile.BadZipFile, struct.error) as exn:
        # a text file or random bytes read as a legacy pickle stop anywhere in the unpickler: an IndexError (pop
        # from an empty stack), a KeyError (an unknown memo), a TypeError, ... each means "not a weights file"
        raise CorruptWeightsError(corrupt_file_message(path, exn)) from exn
    except Exception as exn:  # safetensors' SafetensorError and other readers' own error types
        if type(exn).__name__ == "SafetensorError":
            raise CorruptWeightsError(corrupt_file_message(path, exn)) from exn
        raise

