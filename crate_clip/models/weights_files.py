"""Reading weights files (.safetensors, .pt, .pth, DeepSpeed model states) with one clear error for a bad file.

torch and safetensors report a truncated or corrupt file as SafetensorError, UnpicklingError, a zip
"failed finding central directory", or the advice to retry with weights_only=False (unsafe, and no help
for a broken file). Every read goes through `read_weights_file`, which names the file and the fix instead.
"""
from __future__ import annotations

import pickle
import zipfile
from pathlib import Path

from crate_clip.models.checkpoint_errors import CheckpointMismatchError


class CorruptWeightsError(ValueError):
    """A weights or checkpoint file that cannot be read; the message names the file and the fix."""


def corrupt_file_message(path, exn: BaseException) -> str:
    """One line: the file, why it could not be read, and what to do."""
    reason = str(exn).strip().splitlines()[0] if str(exn).strip() else type(exn).__name__
    return (f"{path}: corrupt or truncated weights file ({type(exn).__name__}: {reason[:160]}); copy or "
            f"download it again, or point to another checkpoint (an interrupted save leaves such files)")


def read_weights_file(path: str | Path, *, trusted_pickle: bool = False):
    """The object stored in a .safetensors / torch file; a corrupt or truncated file raises CorruptWeightsError.

    `trusted_pickle` is for DeepSpeed's own model-states files, which pickle its config objects."""
    import torch

    path = Path(path)
    try:
        if path.suffix == ".safetensors":
            from safetensors.torch import load_file
            return load_file(str(path), device="cpu")
        return torch.load(path, map_location="cpu", weights_only=not trusted_pickle)
    except (FileNotFoundError, IsADirectoryError, PermissionError):
        raise
    except pickle.UnpicklingError as exn:
        if not trusted_pickle and _is_intact_zip(path):
            # a complete file that pickles code: not corrupt, but not loaded without trusting it
            raise CheckpointMismatchError(f"{path}: holds pickled objects other than tensors; torch.load with "
                                      f"weights_only=True refuses them. Re-save its state_dict() with "
                                      f"torch.save or safetensors") from exn
        raise CorruptWeightsError(corrupt_file_message(path, exn)) from exn
    except (RuntimeError, EOFError, OSError, ValueError, KeyError, zipfile.BadZipFile) as exn:
        raise CorruptWeightsError(corrupt_file_message(path, exn)) from exn
    except Exception as exn:  # safetensors' SafetensorError and other readers' own error types
        if type(exn).__name__ == "SafetensorError":
            raise CorruptWeightsError(corrupt_file_message(path, exn)) from exn
        raise


def _is_intact_zip(path: Path) -> bool:
    """Whether a torch file is a complete zip archive (its records all read back)."""
    try:
        with zipfile.ZipFile(path) as archive:
            return archive.testzip() is None
    except (zipfile.BadZipFile, OSError):
        return False
