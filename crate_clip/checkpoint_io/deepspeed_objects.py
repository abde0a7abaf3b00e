"""The four DeepSpeed objects a checkpoint file may hold, rebuilt from validated plain fields.

torch's weights_only reader builds an allow-listed class by `cls.__new__(cls)` and then `__setstate__(state)`,
or `__dict__.update(state)` without one; for an enum it calls the class and may then update the member it
returned. A crafted file could so set any attribute on the object (a method shadowed by another allowed
callable, a half-initialised scaler) or on a process-wide enum member (`ZeroStageEnum.disabled._value_ = 3`
would change what every later checkpoint records). Here each allow-listed dotted name resolves to a stand-in:

- the loss scalers and fragment_address: a subclass whose `__setstate__` takes exactly the attributes
  DeepSpeed 0.19 writes, each of its type, and then turns the object into the real class (so it is the
  DeepSpeed object, and re-saves under DeepSpeed's name); anything else is refused;
- ZeroStageEnum: a function that returns the existing member for a value 0-3 and refuses any other; the
  member is not an allow-listed type, so a BUILD on it (any state) is refused by torch.

A refusal raises pickle.UnpicklingError (torch adds its "Weights only load failed" text) with REFUSED_OBJECT in it,
which safe_unpickling turns into its one-line UntrustedCheckpointError.
"""
from __future__ import annotations

import math
import pickle

import torch

REFUSED_OBJECT = "crate-clip refused a DeepSpeed object"
_INT, _BOOL, _NUMBER = "int", "bool", "number"
_SCALER_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
# dotted name -> the attributes DeepSpeed 0.19.8 gives it and their kinds (read from its __init__)
FIELDS = {
    "deepspeed.runtime.fp16.loss_scaler.LossScaler": {"cur_scale": _NUMBER, "dynamic": _BOOL},
    "deepspeed.runtime.fp16.loss_scaler.DynamicLossScaler": {
        "cur_scale": _NUMBER, "dynamic": _BOOL, "cur_iter": _INT, "last_overflow_iter": _INT,
        "scale_factor": _NUMBER, "scale_window": _NUMBER, "min_scale": _NUMBER, "delayed_shift": _INT,
        "cur_hysteresis": _INT, "consecutive_hysteresis": _BOOL, "raise_error_at_min_scale": _BOOL,
        "dtype": "dtype"},
    "deepspeed.utils.tensor_fragment.fragment_address": {"numel": _INT, "start": _INT},
}
ZERO_STAGE_ENUM = "deepspeed.runtime.zero.config.ZeroStageEnum"
# attributes whose value is fixed by the class (a static scaler that says it is dynamic is not one)
_FIXED = {"deepspeed.runtime.fp16.loss_scaler.LossScaler": {"dynamic": False},
          "deepspeed.runtime.fp16.loss_scaler.DynamicLossScaler": {"dynamic": True}}


def refuse(name: str, why: str) -> pickle.UnpicklingError:
    """The error of a crafted or foreign object: names the class and what is wrong with it."""
    return pickle.UnpicklingError(f"{REFUSED_OBJECT} {name}: {why}")


def _kind_ok(value, kind: str) -> bool:
    if kind == _BOOL:
        return type(value) is bool
    if kind == _INT:
        return type(value) is int
    if kind == _NUMBER:
        return type(value) in (int, float) and math.isfinite(value)
    return value in _SCALER_DTYPES   # "dtype"


def validated_fields(name: str, state) -> dict:
    """`state` when it holds exactly the attributes of `name`, each of its kind; raises refuse(...) otherwise."""
    expected = FIELDS[name]
    if isinstance(state, tuple) and len(state) == 2 and state[1] is None:   # pickle's (dict, slots) form
        state = state[0]
    if type(state) is not dict:
        raise refuse(name, f"its state is a {type(state).__name__}, not a dict of its attributes")
    if set(state) != set(expected):
        extra, missing = sorted(set(state) - set(expected), key=str), sorted(set(expected) - set(state))
        raise refuse(name, f"attributes {extra} are not DeepSpeed's" if extra else f"attributes {missing} missing")
    for key, kind in expected.items():
        if not _kind_ok(state[key], kind):
            raise refuse(name, f"attribute {key} is {type(state[key]).__name__} {state[key]!r}, not a {kind}")
    for key, value in _FIXED.get(name, {}).items():
        if state[key] != value:
            raise refuse(name, f"attribute {key} is {state[key]!r}; this class has {value!r}")
    return state


def _standin(name: str, real: type) -> type:
    """A subclass of `real` whose unpickled state is validated, then the object becomes a `real` instance."""

    def __setstate__(self, state):
        for key, value in validated_fields(name, state).items():
            object.__setattr__(self, key, value)   # also for a frozen dataclass
        self.__class__ = real

    def __new__(cls, *args, **kwargs):   # DeepSpeed's files build it as cls.__new__(cls), then set its state
        if args or kwargs:
            raise refuse(name, "built with arguments, not as DeepSpeed pickles it")
        return object.__new__(cls)

    def __init__(self, *args, **kwargs):   # a call of the class (REDUCE) is not how DeepSpeed pickles it
        raise refuse(name, "built by a call of the class, not as DeepSpeed pickles it")

    def __getattr__(self, attr):   # only for an object whose file gave it no state at all
        raise AttributeError(f"{real.__name__} object from a checkpoint file has no state ({attr}): the file was "
                             "crafted or damaged")

    return type(f"Validated{real.__name__}", (real,), {"__new__": __new__, "__init__": __init__,
                                                        "__setstate__": __setstate__, "__getattr__": __getattr__,
                                                        "__module__": __name__})


def _zero_stage_factory(enum: type):
    def zero_stage(value=None, *rest):
        if rest or type(value) is not int or value not in {member.value for member in enum}:
            raise refuse(ZERO_STAGE_ENUM, f"value {value!r} is not a ZeRO stage (0-3)")
        return enum(value)
    return zero_stage


def standins(classes: dict[str, type]) -> list[tuple[object, str]]:
    """(stand-in, dotted name) pairs for torch.serialization.safe_globals, for the importable classes given."""
    pairs = []
    for name, cls in classes.items():
        if name == ZERO_STAGE_ENUM:
            pairs.append((_cached(name, lambda: _zero_stage_factory(cls)), name))
        elif name in FIELDS:
            pairs.append((_cached(name, lambda: _standin(name, cls)), name))
    return pairs


_CACHE: dict[str, object] = {}


def _cached(name: str, make):
    """One stand-in per name for the process (torch compares the built class against the allowed ones)."""
    if name not in _CACHE:
        _CACHE[name] = make()
    return _CACHE[name]
