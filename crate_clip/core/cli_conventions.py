"""The command line's conventions, shared by every `crate-clip` command: one name for one thing (an old name is
still accepted, with a one-line deprecation warning), a "did you mean" for a mistyped command, sub-command or
option (Python 3.11's argparse has no suggest_on_error), and `--json` for a command's result.

The canonical names (docs/cli.md): `--num-workers` (the settings key `num_workers`; old: `--workers`),
`--max-images` for "only the first N images" (the eval key `max_images`; old: `--limit`), the demo's
`--max-train-images` / `--max-test-images` (old: `--train-images` / `--test-images`), hyphenated sub-commands
(`eval linear-probe`; old: `linear_probe`)."""
from __future__ import annotations

import argparse
import contextlib
import difflib
import json
import re
import sys

_SUGGESTER = "_suggesting_parser"   # namespace attribute: the (sub-)parser that left arguments unrecognised


def did_you_mean(word: str, choices) -> str:
    """' (did you mean 'x'?)' for the closest of `choices` to `word`, '' when none is close."""
    close = difflib.get_close_matches(word, [str(c) for c in choices], n=1, cutoff=0.6)
    return f" (did you mean {close[0]!r}?)" if close else ""


# Option names that mean one thing, as one command or another tool spells it: an option of one group that a command
# lacks is pointed to the group's name the command has, before any spelling match (by spelling alone,
# `shards scenes --max-images` would be sent to --max-objects, not to --count, its number of images)
SAME_MEANING = (
    ("--max-images", "--count", "--limit", "--num-images", "--max-samples"),      # how many images (written, read)
    ("--out", "--output", "--out-dir", "--output-dir", "--output_dir"),           # where to write
    ("--nproc", "--gpus", "--nproc-per-node", "--nproc_per_node", "--num-gpus"),  # processes / GPUs
    ("--image-size", "--size", "--img-size", "--resolution"),                     # image side in pixels
    ("--config", "--config-file", "--cfg"),                                       # the run config
)


def did_you_mean_option(option: str, options) -> str:
    """did_you_mean for an unrecognised option: first the command's option of the same meaning (SAME_MEANING),
    else the closest spelling."""
    options = [str(o) for o in options]
    for group in SAME_MEANING:
        same = [o for o in group if o in options and o != option] if option in group else []
        if same:
            return f" (did you mean {same[0]!r}?)"
    return did_you_mean(option, options)


def deprecation_warning(prog: str, old: str, new: str) -> None:
    """The one line an old name costs: it still works, and says its new name."""
    print(f"{prog}: {old} is deprecated; use {new} (the old name will be removed)", file=sys.stderr)


class CommandParser(argparse.ArgumentParser):
    """An ArgumentParser whose errors suggest the closest option, sub-command or choice (its sub-parsers are
    CommandParsers too)."""

    def parse_known_args(self, args=None, namespace=None):
        namespace, extras = super().parse_known_args(args, namespace)
        if extras and not hasattr(namespace, _SUGGESTER):   # the innermost parser that saw them knows their options
            setattr(namespace, _SUGGESTER, self)
        return namespace, extras

    def parse_args(self, args=None, namespace=None):
        namespace, extras = self.parse_known_args(args, namespace)
        owner = getattr(namespace, _SUGGESTER, self)
        if hasattr(namespace, _SUGGESTER):
            delattr(namespace, _SUGGESTER)
        if extras:
            options = [s for a in owner._actions for s in a.option_strings if a.help != argparse.SUPPRESS]
            hints = [f"{x}{did_you_mean_option(x.split('=')[0], options)}" if x.startswith("-") else x
                     for x in extras]
            owner.error(f"unrecognized arguments: {' '.join(hints)}")
        return namespace

    def error(self, message: str):
        match = re.search(r"invalid choice: '([^']*)' \(choose from (.*)\)$", message)
        if match:
            choices = re.findall(r"'([^']*)'", match.group(2)) or match.group(2).split(", ")   # 3.12+: unquoted
            message += did_you_mean(match.group(1), choices)
        super().error(message)


def accept_old_name(parser: argparse.ArgumentParser, old: str, new: str) -> None:
    """Accept option `old` as `new` (already added to `parser`), hidden from --help, with a deprecation warning."""
    target = parser._option_string_actions[new]

    class OldName(argparse.Action):
        def __call__(self, p, namespace, values, option_string=None):
            deprecation_warning(p.prog, old, new)
            target(p, namespace, values, new)

    parser.add_argument(old, dest=target.dest, nargs=target.nargs, type=target.type, choices=target.choices,
                        metavar=target.metavar, default=argparse.SUPPRESS, help=argparse.SUPPRESS, action=OldName)


def chatter_to_stderr(when: bool = True):
    """Within it, what libraries print on stdout goes to stderr (when `when`): stdout keeps a --json result alone."""
    return contextlib.redirect_stdout(sys.stderr) if when else contextlib.nullcontext()


def print_json_result(record: dict, verify=None) -> int:
    """Print `record` as one JSON object on stdout, with "verified": the verdict of `verify()` (an exit code; run
    first, its words sent to stderr so that stdout holds the JSON alone), None without one. Returns that code."""
    code = 0
    if verify is not None:
        with contextlib.redirect_stdout(sys.stderr):
            code = verify()
    print(json.dumps({**record, "verified": None if verify is None else code == 0}, indent=1))
    return code


def add_json_flag(parser: argparse.ArgumentParser, what: str = "the result") -> None:
    """`--json`: print `what` as one JSON object on stdout instead of text."""
    parser.add_argument("--json", action="store_true", help=f"print {what} as JSON instead of text")
