"""Reading torch files from checkpoint folders, exports and weights files without running code.

A `.pt` file is a pickle, and unpickling runs whatever callable it names (a `__reduce__` payload can start a
shell command). Every read here is `torch.load(weights_only=True)`: tensors, numbers, strings and
containers, plus an explicit allow-list of the classes DeepSpeed 0.19 writes into its model- and
optimizer-states files (found by saving checkpoints of ZeRO 0-3 in fp32 and bf16 with the trainer and listing
what weights_only refuses; fp16's dynamic loss scaler from DeepSpeed's optimizer `state_dict()`s). A file
that needs anything else is refused in one line naming the file, the class and the fix. The allow-listed
objects are rebuilt from validated fields only (deepspeed_objects.py): a crafted one is refused the same way, it
cannot set other attributes or change a process-wide enum member.

DeepSpeed's own readers (`engine.load_checkpoint`, zero_to_fp32) call `torch.load(weights_only=False)`:
`deepspeed_reads` scans the folder's files first and forces weights_only for the duration of the call.
`trusted_checkpoints` (the `--trust-checkpoint` flag) is the explicit opt-in to plain unpickling, e.g. for
one's own checkpoints written by an earlier version.
"""
from __future__ import annotations

import contextlib
import importlib
import os
import pickle
import re
import zipfile
from contextvars import ContextVar
from pathlib import Path
from typing import Iterable, Iterator, Optional

import torch

from crate_clip.checkpoint_io.deepspeed_notices import deepspeed_notices_off
from crate_clip.checkpoint_io.deepspeed_objects import REFUSED_OBJECT, standins
from crate_clip.checkpoint_io.trust_flag import TRUST_FLAG, TRUST_HELP, TRUST_WARNING  # noqa: F401 (the CLIs')
from crate_clip.checkpoint_io.weights_headers import stored_values

# dotted name -> what DeepSpeed stores it for
DEEPSPEED_CLASSES = {
    "deepspeed.runtime.fp16.loss_scaler.LossScaler": "the ZeRO optimizer's static loss scale (fp32, bf16)",
    "deepspeed.runtime.fp16.loss_scaler.DynamicLossScaler": "the ZeRO optimizer's dynamic loss scale (fp16)",
    "deepspeed.runtime.zero.config.ZeroStageEnum": "the ZeRO stage in an optimizer-states file",
    "deepspeed.utils.tensor_fragment.fragment_address": "ZeRO-1/2 parameter slice mappings",
}
# the files DeepSpeed reads from a tag folder: model / optimizer states (any ZeRO stage), universal-checkpoint parts
DEEPSPEED_FILES = ("*states.pt", "zero/**/*.pt")
_WEIGHTS_ONLY_FAILED = "Weights only load failed"
_REFUSED_GLOBAL = re.compile(r"GLOBAL ([\w.]+)")   # torch names the refused class so in its message
_FORCE, _FORCE_NOT = "TORCH_FORCE_WEIGHTS_ONLY_LOAD", "TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD"

_trusted: ContextVar[bool] = ContextVar("crate_clip_trusted_checkpoints", default=False)


class UntrustedCheckpointError(ValueError):
    """A torch file that needs a class outside the allow-list; the message names the file, the class and the fix."""

    def __init__(self, path, classes: list[str], note: str = "", crafted: str | None = None):
        self.path, self.classes = Path(path), list(classes)
        what = ", ".join(self.classes) or "an object that is not a tensor, number, string or container"
        reason = (f"{crafted.replace(REFUSED_OBJECT, 'it holds the DeepSpeed object')} (an allow-listed object is "
                  "rebuilt only from the fields DeepSpeed writes)" if crafted else
                  f"it pickles {what}, which torch.load(weights_only=True) does not build and which is not one of "
                  f"the classes DeepSpeed writes into checkpoints; unpickling it could run code{note}")
        super().__init__(
            f"{path}: refused: {reason}. Fix: re-save it with a trusted tool (an export, safetensors + JSON, is the "
            f"format to share), or pass {TRUST_FLAG} if you trust where it came from (docs/safety.md)")


@contextlib.contextmanager
def trusted_checkpoints(enabled: bool = True) -> Iterator[None]:
    """Within this block (this thread / task), torch files are unpickled without the allow-list."""
    token = _trusted.set(bool(enabled))
    try:
        yield
    finally:
        _trusted.reset(token)


def checkpoints_trusted() -> bool:
    """Whether reads are unrestricted here (inside `trusted_checkpoints()`)."""
    return _trusted.get()


def allowed_classes(names: Iterable[str] = DEEPSPEED_CLASSES) -> dict[str, type]:
    """The allow-listed classes that can be imported here, by dotted name (without DeepSpeed there is nothing of
    it to allow)."""
    found = {}
    for name in names:
        module, _, attr = name.rpartition(".")
        try:
            with deepspeed_notices_off():   # the first of them imports DeepSpeed, which announces its accelerator
                found[name] = getattr(importlib.import_module(module), attr)
        except (ImportError, AttributeError):
            continue
    return found


def allowed_globals(names: Iterable[str] = DEEPSPEED_CLASSES) -> list[tuple[object, str]]:
    """What torch.serialization.safe_globals gets for the allow-listed names: each name resolves to its validating
    stand-in (deepspeed_objects.py), never to the class itself."""
    return standins(allowed_classes(names))


_BUILD_REFUSED = re.compile(r"Can only build .* but got <(?:enum|class) '([\w.]+)'>")


def _crafted_object(exn: Exception) -> str | None:
    """The reason a stand-in refused an allow-listed object (or torch refused to give an allowed enum member a
    state), when that is why the read failed."""
    text = str(exn)
    if REFUSED_OBJECT in text:
        return text[text.index(REFUSED_OBJECT):].split("\n")[0]
    built = _BUILD_REFUSED.search(text)
    return f"{REFUSED_OBJECT} {built.group(1)}: given a state, which DeepSpeed never writes" if built else None


def load_torch_file(path: str | Path, *, allow: Iterable[str] = DEEPSPEED_CLASSES, map_location="cpu",
                    mmap: bool = False):
    """The object in a torch file, read with weights_only=True and the classes `allow` names; a file needing
    another class raises UntrustedCheckpointError, one whose zip records claim more than the file holds
    WeightsHeaderError (weights_headers.py, before torch allocates them). Corrupt files raise torch's own errors."""
    stored_values(path)
    if checkpoints_trusted():
        return torch.load(path, map_location=map_location, weights_only=False, mmap=mmap)
    allow = list(allow)
    with torch.serialization.safe_globals(allowed_globals(allow)):
        try:
            return torch.load(path, map_location=map_location, weights_only=True, mmap=mmap)
        except pickle.UnpicklingError as exn:
            if _crafted_object(exn):
                raise UntrustedCheckpointError(path, [], crafted=_crafted_object(exn)) from None
            named = sorted(set(_REFUSED_GLOBAL.findall(str(exn))))
            if _WEIGHTS_ONLY_FAILED not in str(exn) or not (named or _is_intact_zip(path)):
                raise   # not a refusal: a damaged file
            raise UntrustedCheckpointError(path, unsafe_classes(path, allow) or named) from None


def unsafe_classes(path: str | Path, allow: Iterable[str] = DEEPSPEED_CLASSES) -> Optional[list[str]]:
    """The classes and functions a torch file names beyond data and `allow`, read from its pickle opcodes
    without building anything; None when the file cannot be scanned (not a torch zip file, damaged)."""
    with torch.serialization.safe_globals(allowed_globals(allow)):
        try:
            return sorted(torch.serialization.get_unsafe_globals_in_checkpoint(str(path)))
        except Exception:   # a legacy-format or damaged file: the weights_only read itself decides
            return None


def _is_intact_zip(path: str | Path) -> bool:
    """Whether a torch file is a complete zip archive (its records all read back)."""
    try:
        with zipfile.ZipFile(path) as archive:
            return archive.testzip() is None
    except (zipfile.BadZipFile, OSError):
        return False


def check_checkpoint_folder(folder: str | Path, patterns: Iterable[str] = ("**/*.pt",),
                            allow: Iterable[str] = DEEPSPEED_CLASSES) -> None:
    """Raise UntrustedCheckpointError for the first torch file under `folder` matching `patterns` that needs a
    class outside `allow`, WeightsHeaderError for one whose zip records claim more than the file holds (nothing is
    unpickled; every rank scans every file, so all ranks refuse alike)."""
    for path in sorted({p for pattern in patterns for p in Path(folder).glob(pattern)}):
        stored_values(path)   # trusted or not: a header's claims are about memory, not code
        if checkpoints_trusted():
            continue
        classes = unsafe_classes(path, allow)
        if classes:
            raise UntrustedCheckpointError(path, classes)


def _refusal_in(folder: str | Path) -> UntrustedCheckpointError | None:
    """After DeepSpeed's read of `folder` was refused: the refusal naming the file (each read again, on this error
    path only)."""
    for path in sorted({p for pattern in DEEPSPEED_FILES for p in Path(folder).glob(pattern)}):
        try:
            load_torch_file(path)
        except UntrustedCheckpointError as exc:
            return exc
        except Exception:
            continue
    return None


@contextlib.contextmanager
def deepspeed_reads(folder: str | Path) -> Iterator[None]:
    """DeepSpeed's own readers of checkpoint folder `folder` (engine.load_checkpoint, zero_to_fp32) held to
    the allow-list: the folder is scanned, then torch.load is forced to weights_only=True (TORCH_FORCE_
    WEIGHTS_ONLY_LOAD) with the allow-listed classes until the block ends, and both are restored after."""
    check_checkpoint_folder(folder, DEEPSPEED_FILES)   # the headers always, the classes unless trusted
    if checkpoints_trusted():
        yield
        return
    saved = {name: os.environ.pop(name, None) for name in (_FORCE, _FORCE_NOT)}
    os.environ[_FORCE] = "1"
    try:
        with torch.serialization.safe_globals(allowed_globals()):
            yield
    except pickle.UnpicklingError as exn:
        if _WEIGHTS_ONLY_FAILED not in str(exn):
            raise
        if _crafted_object(exn):
            raise _refusal_in(folder) or UntrustedCheckpointError(folder, [], crafted=_crafted_object(exn)) from None
        raise UntrustedCheckpointError(folder, sorted(set(_REFUSED_GLOBAL.findall(str(exn))))) from None
    finally:
        for name, value in saved.items():
            os.environ.pop(name, None)
            if value is not None:
                os.environ[name] = value
