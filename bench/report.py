"""Writes one benchmark's table into its own marked section of BENCHMARKS.md."""
import platform
import re
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


def section_head(title: str, label: str | None, meta: dict) -> list[str]:
    """A study's section opening: its heading, the run's label in bold if given, and the line saying when, where,
    with which command and for how long it ran (`meta`: date, machine, command, wall_seconds)."""
    lines = [f"## {title}", ""]
    if label:
        lines += [f"**{label}**", ""]
    return lines + [f"{meta['date']}, {meta['machine']}, `{meta['command']}`, {meta['wall_seconds'] / 60:.0f} min.", ""]


def markdown_table(header: list[str], rows: list[list[str]]) -> str:
    """A markdown table of already formatted cells."""
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    return "\n".join(lines + ["| " + " | ".join(r) + " |" for r in rows])
