"""What every typed config section shares (pydantic v2): unknown keys rejected, strict booleans, numbers
that YAML 1.1 reads as text (`1e-3`) accepted, every number finite and within 64 bits, cross-key checks that name
the key they are about, and error lines that echo a value shortened and a key with its control characters escaped.

Each schema lives with the code that uses it (the stream's in crate_clip.data.train_stream, an evaluation's
in its eval/ task module, the run's in crate_clip.train.run.run_config); this module is the bottom layer they
all may import.
"""
from __future__ import annotations

import difflib
from types import UnionType
from typing import Annotated, Any, Union, get_args, get_origin

from pydantic import (AfterValidator, AllowInfNan, BaseModel, BeforeValidator, ConfigDict, StrictBool, ValidationError,
                      model_validator)
from pydantic.fields import FieldInfo
from pydantic_core import PydanticCustomError

from crate_clip.core.user_text import printable, short_repr

KEY_CHECK = "key_check"


def _number(value: Any, kind: str = "float") -> Any:
    """Booleans are not numbers; numeric text (`1e-3`, which YAML 1.1 reads as a string) is."""
    if isinstance(value, bool):
        raise PydanticCustomError(f"{kind}_type", "expected a number, got {value!r}", {"value": value})
    if isinstance(value, str):
        try:
            return float(value) if any(c in value for c in ".eE") else int(value)
        except ValueError:
            return value  # pydantic reports it with the key
    return value


def _int64(value: int) -> int:
    """Integers fit the 64 bits torch and numpy take (a validator, not a ge/le bound: those are the key's own)."""
    if not -2 ** 63 <= value < 2 ** 63:
        raise PydanticCustomError("int_out_of_range", "out of range", {"value": value})
    return value


# Every number of a config is finite and fits the 64-bit integers torch and numpy take (a key may bound it further):
# `lr: .inf` or `seed: 1e26` is refused where it is read, naming the key, not where training uses it.
Int = Annotated[int, BeforeValidator(lambda value: _number(value, "int")), AfterValidator(_int64)]
Float = Annotated[float, BeforeValidator(_number), AllowInfNan(False)]
Bool = StrictBool


class Section(BaseModel):
    """A config section: unknown keys are errors; a number where text is expected is taken as text.

    Checks that involve more than one key go in `checks()`, which returns every problem as
    (key, "value; fix: ...") so that all of them are reported at once, each under its own dotted key."""

    model_config = ConfigDict(extra="forbid", coerce_numbers_to_str=True)

    def checks(self) -> list[tuple[str, str]]:
        """Cross-key problems of this section as (key, message with the fix); none by default."""
        return []

    @model_validator(mode="after")
    def _run_checks(self):
        problems = self.checks()
        if problems:
            text = "; ".join(f"{type(self).__name__}.{key}: {fix}" for key, fix in problems)
            raise PydanticCustomError(KEY_CHECK, "{text}", {"text": text, "problems": problems})
        return self


# ------------------------------------------------------------------ error messages: key named, fix given
def _unwrap(tp: Any) -> tuple[Any, str | None]:
    """The type inside Optional[...] / Annotated[...], and the description found on the way."""
    description = None
    while True:
        if get_origin(tp) is Annotated:
            tp, *meta = get_args(tp)
            description = next((m.description for m in meta if isinstance(m, FieldInfo) and m.description),
                               description)
        elif get_origin(tp) in (Union, UnionType) and type(None) in get_args(tp):
            members = [a for a in get_args(tp) if a is not type(None)]
            if len(members) != 1:
                return Union[tuple(members)], description
            tp = members[0]
        else:
            return tp, description


def _tagged_member(tp: Any, tag: Any) -> Any:
    """The member of a union of sections whose `type` default is `tag` (pydantic puts the tag in the path)."""
    for member in get_args(tp):
        member, _ = _unwrap(member)
        field = getattr(member, "model_fields", {}).get("type")
        if field is not None and field.default == tag:
            return member
    return None


def _walk(root: Any, loc: tuple) -> tuple[list[str], Any, Any, FieldInfo | None]:
    """Follow an error location through the schema: dotted parts (union tags dropped), the last section
    passed, the type at the end and its field info."""
    parts, tp, section, info = [], root, None, None
    for item in loc:
        tp, _ = _unwrap(tp)
        if get_origin(tp) in (Union, UnionType) and _tagged_member(tp, item) is not None:
            tp = _tagged_member(tp, item)
            continue
        parts.append(str(item))
        if isinstance(tp, type) and issubclass(tp, BaseModel):
            section, info = tp, tp.model_fields.get(item) if isinstance(item, str) else None
            tp = info.annotation if info is not None else None
        elif get_origin(tp) in (list, tuple, dict):
            args = get_args(tp)
            tp = (args[-1] if get_origin(tp) is dict else
                  args[item] if get_origin(tp) is tuple and isinstance(item, int) and item < len(args) else args[0]
                  ) if args else None
        else:
            tp = None
    return parts, section, tp, info


def _keys(section: Any) -> list[str]:
    return list(getattr(section, "model_fields", {}))


_RANGES = {"greater_than": ">", "greater_than_equal": ">=", "less_than": "<", "less_than_equal": "<="}
_KINDS = {"int": "an integer", "float": "a number", "number": "a number", "bool": "true or false",
          "string": "a string", "list": "a list ([a, b, ...])", "tuple": "a list ([a, b, ...])",
          "dict": "a mapping (key: value)", "model": "a mapping (key: value)"}


def _message(err: dict, root: Any) -> list[str]:
    """One pydantic error as `dotted.key: what is wrong; fix: ...` lines."""
    kind, loc, value, ctx = err["type"], err["loc"], err.get("input"), err.get("ctx") or {}
    parts, section, tp, info = _walk(root, loc)
    key = printable(".".join(parts)) or "(top level)"   # a key from the file may hold escape sequences
    shown = short_repr(value)   # the value, shortened: it may be a list of millions
    fix = f"; fix: {info.description}" if info is not None and info.description else ""
    if kind == KEY_CHECK:
        return [printable(".".join(parts + [k])) + f": {text}" for k, text in ctx["problems"]]
    if kind == "extra_forbidden":
        parent = _walk(root, loc[:-1])[2]
        names = _keys(_unwrap(parent)[0])
        close = difflib.get_close_matches(str(loc[-1]), names, n=1)
        hint = f"did you mean '{close[0]}'?" if close else f"valid keys here: {', '.join(names)}"
        return [f"{key}: unknown key; fix: remove it or rename it ({hint})"]
    if kind == "missing":
        return [f"{key}: missing; fix: add it" + (f" ({info.description})" if fix else "")]
    if kind == "literal_error":
        return [f"{key}: {shown} is not one of {get_args(_unwrap(tp)[0])}; fix: use one of them"]
    if kind in ("union_tag_invalid", "union_tag_not_found"):
        tags = tuple(_unwrap(m)[0].model_fields["type"].default for m in get_args(_unwrap(tp)[0]))
        return [f"{key}.type: {short_repr(ctx.get('tag', value))} is not one of {tags}; fix: use one of them"]
    if kind in _RANGES:
        bound = next(iter(ctx.values()))
        return [f"{key}: must be {_RANGES[kind]} {bound}, got {shown}{fix}"]
    if kind == "finite_number":
        return [f"{key}: {shown} is not a finite number{fix}"]
    if kind in ("int_parsing_size", "int_out_of_range"):
        return [f"{key}: {shown} is out of range (a 64-bit integer is expected){fix}"]
    expected = next((text for prefix, text in _KINDS.items() if kind.startswith(prefix + "_")), None)
    if expected:
        names = _keys(_unwrap(tp)[0])
        expected = f"a mapping of {', '.join(names)}" if names and kind.startswith(("dict", "model")) else expected
        return [f"{key}: expected {expected}, got {shown}{fix or f'; fix: write {expected}'}"]
    return [f"{key}: {err['msg']}, got {shown}{fix or '; fix: correct the value'}"]


def error_lines(err: ValidationError, root: Any) -> list[str]:
    """Every error of a validation against `root` (a section class or type), one line each."""
    return [line for e in err.errors(include_url=False) for line in _message(e, root)]
