"""YAML of run configs and `--set` values, read so that a small input stays small and every problem is one line.

yaml.safe_load builds no objects from tags, but it expands aliases: a 1 KB file whose anchors each repeat the one
before ten times (a "billion laughs") is 10^8 values to whatever walks it (validation, error messages), gigabytes
and minutes. And composing the node graph costs ~460 bytes a value: a 16 MiB file of `0,` (8 million values, no
alias) took 8.3 GB and 5 minutes before its size was measured. So the text is first read as a stream of parser
events, nothing kept, counting the values it writes out and their nesting (MAX_NODES, MAX_DEPTH); only then is the
node graph composed, and measured before anything is built: the values it holds with every alias expanded, and
aliases that contain themselves. Every YAML problem (syntax, an undefined alias, a
`!!python/object` tag, a file that is a FIFO) is a ConfigError of one line: where, and what is wrong.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from crate_clip.core.errors import ConfigError
from crate_clip.core.file_kinds import read_regular_text
from crate_clip.core.user_text import cut, printable

MAX_CONFIG_BYTES = 16 << 20      # a run config listing 100,000 shard URLs one by one is ~6 MB
MAX_EXPANDED_VALUES = 1_000_000  # values (scalars, lists, mappings) with every alias expanded
# values written out in the text (an alias counts one): a config listing 100,000 shard URLs one by one holds ~100,000;
# composing 250,000 takes ~115 MB and 3 s
MAX_NODES = 250_000
MAX_DEPTH = 64                   # nesting; a run config's deepest key (deepspeed.overrides...) is ~6 levels
_Loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)   # libyaml's parser when PyYAML has it: same results


class _BoundedLoader(_Loader):
    """SafeLoader that measures the composed document before constructing Python values from it."""

    def construct_document(self, node):
        _measure(node)
        return super().construct_document(node)


_OPENS = (yaml.SequenceStartEvent, yaml.MappingStartEvent)
_CLOSES = (yaml.SequenceEndEvent, yaml.MappingEndEvent)
_VALUES = _OPENS + (yaml.ScalarEvent, yaml.AliasEvent)


def _count_values(text: str) -> None:
    """ValueError when the text writes out more than MAX_NODES values or nests deeper than MAX_DEPTH, found from
    the parser's events as they come (each dropped after it is counted: no node exists yet)."""
    values = depth = 0
    for event in yaml.parse(text, Loader=_Loader):
        if isinstance(event, _VALUES):
            values += 1
            if values > MAX_NODES:
                raise ValueError(f"it holds more than {MAX_NODES:,} values (line {event.start_mark.line + 1}); "
                                 "fix: list the shards as a brace pattern or a folder")
        if isinstance(event, _OPENS):
            depth += 1
            if depth > MAX_DEPTH:
                raise ValueError(f"nested more than {MAX_DEPTH} levels deep (line {event.start_mark.line + 1})")
        elif isinstance(event, _CLOSES):
            depth -= 1


def _measure(root: yaml.Node) -> None:
    """ValueError when the document, aliases expanded, holds more than MAX_EXPANDED_VALUES values, nests deeper
    than MAX_DEPTH, or has an alias inside the node it names. Each node is measured once (an alias is the same
    node object as its anchor), so this costs the size of the file, not of the expansion."""
    sizes: dict[int, tuple[int, int]] = {}   # id(node) -> (values, depth) with aliases expanded
    open_nodes: set[int] = set()
    stack = [(root, False)]
    while stack:   # iterative post-order walk: no recursion limit to hit
        node, children_done = stack.pop()
        key = id(node)
        if key in sizes and not children_done:
            continue
        children = _children(node)
        if not children_done:
            if key in open_nodes:
                raise ValueError(f"line {node.start_mark.line + 1}: an alias refers to a node that contains it")
            open_nodes.add(key)
            stack.append((node, True))
            for child in children:
                if id(child) in open_nodes:
                    raise ValueError(f"line {child.start_mark.line + 1}: an alias refers to a node that contains it")
                if id(child) not in sizes:
                    stack.append((child, False))
            continue
        open_nodes.discard(key)
        values = 1 + sum(sizes[id(c)][0] for c in children)
        depth = 1 + max((sizes[id(c)][1] for c in children), default=0)
        if values > MAX_EXPANDED_VALUES:
            raise ValueError(f"its aliases expand to more than {MAX_EXPANDED_VALUES:,} values (line "
                             f"{node.start_mark.line + 1}); fix: write the values out, or use fewer aliases")
        if depth > MAX_DEPTH:
            raise ValueError(f"nested more than {MAX_DEPTH} levels deep (line {node.start_mark.line + 1})")
        sizes[key] = (values, depth)


def _children(node: yaml.Node) -> list:
    if isinstance(node, yaml.SequenceNode):
        return list(node.value)
    if isinstance(node, yaml.MappingNode):
        return [part for pair in node.value for part in pair]
    return []


def _problem(exc: BaseException) -> str:
    """One line for a YAML error: where (line, column) and what, without the quoted snippet PyYAML adds."""
    if isinstance(exc, yaml.MarkedYAMLError):
        mark = exc.problem_mark or exc.context_mark
        where = f"line {mark.line + 1}, column {mark.column + 1}: " if mark is not None else ""
        what = " ".join(part for part in (exc.context, exc.problem) if part)
        return f"{where}{what}"
    if isinstance(exc, RecursionError):
        return f"nested too deeply (more than {MAX_DEPTH} levels)"
    return " ".join(str(exc).split())


def load_yaml(text: str, source: str) -> Any:
    """The value of YAML document `text` (safe types only, sizes bounded); ConfigError of one line naming
    `source` (a file, or `--set KEY=VALUE`) for anything that is not a bounded YAML document."""
    try:
        _count_values(text)
        return yaml.load(text, Loader=_BoundedLoader)
    except (yaml.YAMLError, RecursionError) as exc:
        raise ConfigError(cut(printable(f"{source}: not valid YAML: {_problem(exc)}"))) from None
    except ValueError as exc:   # _count_values, _measure: too many values, too deep, an alias inside itself
        raise ConfigError(cut(printable(f"{source}: refused: {exc}"))) from None


def load_yaml_file(path: str | Path, what: str = "--config") -> Any:
    """The value of the YAML file at `path`: a regular file of at most MAX_CONFIG_BYTES, UTF-8, bounded (see
    load_yaml); ConfigError of one line naming `what` and the file otherwise."""
    try:
        text = read_regular_text(path, MAX_CONFIG_BYTES, what)
    except FileNotFoundError:
        raise ConfigError(printable(f"{what}: file {str(path)!r} does not exist")) from None
    except (ValueError, OSError) as exc:   # a FIFO, a device, a folder, too large, not UTF-8, unreadable
        raise ConfigError(printable(" ".join(str(exc).split()))) from None
    return load_yaml(text, str(path))
