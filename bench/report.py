"""Writes one benchmark's table into its own marked section of BENCHMARKS.md."""
import platform
import re
import shlex
import time
from pathlib import Path

import torch

BENCHMARKS_MD = Path(__file__).resolve().parents[1] / "BENCHMARKS.md"


def machine_line() -> str:
    """One line naming the machine, torch build and thread count the numbers came from."""
    return (f"_{time.strftime('%Y-%m-%d')}, {platform.machine()}, {torch.get_num_threads()} torch threads, "
            f"torch {torch.__version__}, {'CUDA ' + torch.cuda.get_device_name() if torch.cuda.is_available() else 'CPU'}_")


def write_section(name: str, markdown: str, path: Path = BENCHMARKS_MD) -> None:
    """Replace the text between `<!-- BEGIN name -->` and `<!-- END name -->` (appending the pair if absent)."""
    text = path.read_text() if path.exists() else "# Benchmarks\n"
    begin, end = f"<!-- BEGIN {name} -->", f"<!-- END {name} -->"
    block = f"{begin}\n{markdown.strip()}\n{end}"
    pattern = re.compile(re.escape(begin) + r".*?" + re.escape(end), re.S)
    text = pattern.sub(lambda _: block, text) if pattern.search(text) else text.rstrip() + f"\n\n{block}\n"
    path.write_text(text)


def print_section(name: str, markdown: str, print_only: bool = False) -> None:
    """Print a bench's section; write it into BENCHMARKS.md as section `name` unless `print_only`."""
    print(markdown)
    if not print_only:
        write_section(name, markdown)


def section_head(title: str, label: str | None, meta: dict) -> list[str]:
    """A study's section opening: its heading, the run's label in bold if given, and the line saying when, where,
    with which command and for how long it ran (`meta`: date, machine, command, wall_seconds)."""
    lines = [f"## {title}", ""]
    if label:
        lines += [f"**{label}**", ""]
    return lines + [f"{meta['date']}, {meta['machine']}, {shown_command(meta['command'])}, "
                    f"{meta['wall_seconds'] / 60:.0f} min.", ""]


FOLDER_OPTIONS = {"--data-dir": "data", "--out": "runs", "--docs": "docs"}


def shown_command(command: str) -> str:
    """A study's command as a page shows it: without the folders it read and wrote (paths of one machine, kept in
    the study's JSON), which a note names, so that the command a reader copies is one that runs anywhere; without its
    --label, which the section prints above it."""
    words, kept, folders = shlex.split(command), [], []
    while words:
        word = words.pop(0)
        name, has_value, _ = word.partition("=")
        if name == "--label":   # the run's label: printed in bold above the command (section_head)
            if not has_value and words:
                words.pop(0)
        elif name in FOLDER_OPTIONS:
            folders.append(FOLDER_OPTIONS[name])
            if not has_value and words:
                words.pop(0)
        else:
            kept.append(word)
    if not folders:
        return f"`{shlex.join(kept)}`"
    named = ", ".join(folders[:-1]) + " and " + folders[-1] if len(folders) > 1 else folders[0]
    return f"`{shlex.join(kept)}` (its {named} folder{'s' if len(folders) > 1 else ''} passed as options)"


def markdown_table(header: list[str], rows: list[list[str]]) -> str:
    """A markdown table of already formatted cells."""
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    return "\n".join(lines + ["| " + " | ".join(r) + " |" for r in rows])


def cpu_model() -> str:
    """The CPU's model name and its widest vector extension (/proc/cpuinfo)."""
    info = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    model = next((line.split(":", 1)[1].strip() for line in info.splitlines() if line.startswith("model name")), "?")
    flags = next((line.split(":", 1)[1].split() for line in info.splitlines() if line.startswith("flags")), [])
    widest = next((f for f in ("amx_tile", "avx512f", "avx2") if f in flags), "no AVX2")
    return f"{model} ({widest})"
