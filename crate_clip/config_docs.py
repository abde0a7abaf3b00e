"""docs/config.md, the reference of every run-config key, rendered from the pydantic schemas (names, types,
defaults and Field descriptions), so the page cannot drift from the code.

    python -m crate_clip.config_docs            # rewrite docs/config.md
    python -m crate_clip.config_docs --check    # exit 1 when docs/config.md is not what the schemas give
"""
from __future__ import annotations

import argparse
import inspect
import sys
from pathlib import Path
from types import UnionType
from typing import Annotated, Any, Literal, Union, get_args, get_origin

from pydantic import BaseModel
from pydantic.fields import FieldInfo

from crate_clip.train.run.run_config import RunConfig

DOC_PATH = Path(__file__).resolve().parents[1] / "docs" / "config.md"
REGENERATE = "python -m crate_clip.config_docs"
_BOUNDS = (("ge", ">="), ("gt", ">"), ("le", "<="), ("lt", "<"))


def _bounds(metadata) -> str:
    """', >= 1'-style text of the numeric bounds in a field's metadata."""
    parts = [f"{sign} {getattr(m, key)}" for m in metadata for key, sign in _BOUNDS
             if getattr(m, key, None) is not None]
    return " " + ", ".join(parts) if parts else ""


def _value(value: Any) -> str:
    """A value as YAML writes it."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_value(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k}: {_value(v)}" for k, v in value.items()) + "}"
    return str(value) if value != "" else '""'


def _sections(tp: Any) -> list[type[BaseModel]]:
    """The schema classes inside a field type (through Optional, list, Annotated, unions)."""
    if isinstance(tp, type) and issubclass(tp, BaseModel):
        return [tp]
    return [s for arg in get_args(tp) for s in _sections(arg)]


def type_name(tp: Any, titles: dict) -> str:
    """A field type in words: `int >= 1`, `'a' | 'b'`, `list of text`, a section's title."""
    origin, args = get_origin(tp), get_args(tp)
    if origin is Annotated:
        return type_name(args[0], titles) + _bounds(c for info in args[1:] if isinstance(info, FieldInfo)
                                                    for c in info.metadata)
    if origin in (Union, UnionType):
        members = [a for a in args if a is not type(None)]
        text = " or ".join(type_name(a, titles) for a in members)
        return text + (" or null" if len(members) < len(args) else "")
    if origin is Literal:
        return " | ".join(f"'{a}'" for a in args)
    if origin is list:
        return f"list of {type_name(args[0], titles)}" if args else "list"
    if origin is tuple:
        return "[" + ", ".join(type_name(a, titles) for a in args) + "]"
    if origin is dict:
        return "mapping"
    if isinstance(tp, type) and issubclass(tp, BaseModel):
        return titles.get(tp, tp.__name__)
    return {int: "int", float: "float", str: "text", bool: "bool", Any: "any"}.get(tp, getattr(tp, "__name__", str(tp)))


def _default(field: FieldInfo) -> str:
    if field.is_required():
        return "required"
    value = field.get_default(call_default_factory=True)
    single = get_origin(field.annotation) is not list and _sections(field.annotation)
    return "(section)" if isinstance(value, BaseModel) or single else _value(value)


def _slug(title: str) -> str:
    """The anchor GitHub gives a heading."""
    return "".join(c for c in title.lower() if c.isalnum() or c in " -_").replace(" ", "-")


def _link(title: str) -> str:
    """A link to a section's heading, named by its key (`run`, `stages[]`) or, for a task, by its type."""
    code = title.split("`")[1::2]   # the code spans of the title: the key, then `type: X` for a task
    name = code[1].split(": ")[1] if len(code) > 1 else code[0]
    return f"[`{name}`](#{_slug(title)})"


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def _doc(cls: type) -> str:
    """A schema class's docstring as one paragraph."""
    return " ".join(inspect.cleandoc(cls.__doc__ or "").split())


def field_table(cls: type[BaseModel], titles: dict) -> str:
    """One row per field: key, type, default, description (a section's own docstring when it has none)."""
    rows = ["| key | type | default | description |", "|---|---|---|---|"]
    for name, field in cls.model_fields.items():
        sections = _sections(field.annotation)
        description = field.description or (_doc(sections[0]) if len(sections) == 1 else "")
        kind, bounds = type_name(field.annotation, titles), _bounds(field.metadata)
        kind = kind[:-len(" or null")] + bounds + " or null" if kind.endswith(" or null") else kind + bounds
        rows.append(f"| `{name}` | {_cell(kind)} | `{_cell(_default(field))}` | {_cell(description)} |")
    return "\n".join(rows)


def schema_sections() -> list[tuple[str, type[BaseModel]]]:
    """(title, schema) of the run config and every section below it, depth first, in the YAML's order."""
    out, seen = [("Top level", RunConfig)], {RunConfig}

    def walk(cls, path):
        for name, field in cls.model_fields.items():
            key = f"{path}.{name}" if path else name
            if get_origin(field.annotation) is list:
                key += "[]"
            found = [s for s in _sections(field.annotation) if s not in seen]
            for section in found:
                seen.add(section)
                kind = section.model_fields.get("type")
                tag = f" (`type: {kind.default}`)" if len(found) > 1 and kind is not None else ""
                out.append((f"`{key}`{tag}", section))
                walk(section, key)

    walk(RunConfig, "")
    return out


def render() -> str:
    """The whole of docs/config.md."""
    sections = schema_sections()
    titles = {cls: _link(title) for title, cls in sections[1:]}
    parts = ["# Run config reference",
             f"Generated from the pydantic schemas by `{REGENERATE}`; do not edit it by hand. How a run uses these "
             "keys: [training.md](training.md). A run config is one YAML file with the sections below. A key left "
             "out takes its default; an unknown key is an error that names the closest valid one. `stages[]` and "
             "`eval.evals[]` are lists of entries; an evaluation entry's `type` picks its task and its keys."]
    for title, cls in sections:
        parts += [f"## {title}", _doc(cls), field_table(cls, titles)]
    return "\n\n".join(p for p in parts if p) + "\n"


def main(argv=None) -> int:
    """Write docs/config.md, or with --check report whether it is current."""
    p = argparse.ArgumentParser(prog="python -m crate_clip.config_docs", description=__doc__.splitlines()[0])
    p.add_argument("--check", action="store_true", help="exit 1 when docs/config.md is stale; write nothing")
    args = p.parse_args(argv)
    text = render()
    if args.check:
        current = DOC_PATH.is_file() and DOC_PATH.read_text() == text
        print(f"{DOC_PATH} is {'current' if current else f'stale: run `{REGENERATE}`'}")
        return 0 if current else 1
    DOC_PATH.write_text(text)
    print(f"wrote {DOC_PATH}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
