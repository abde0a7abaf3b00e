"""`make install` with uv: pip's own package sources handed to uv, which reads no pip configuration.

    python tools/uv_install.py UV VENV_PYTHON [uv pip install arguments ...]

A machine's pip may be configured (pip.conf, PIP_* variables: what `pip config list` prints) with a folder of
wheels, extra indexes or a constraint file; on the development machines that is where the pinned torch and
torchvision lie. uv without them would resolve against PyPI alone and download another build of torch (~3 GB),
so each one is passed as uv's own option, with pip's way of choosing among indexes (the best version any of them
has, not the first index's). Runs `UV pip install --python VENV_PYTHON ...` and exits with uv's code. Standard
library only: it runs before anything is installed.
"""
from __future__ import annotations

import ast
import os
import re
import subprocess
import sys

# pip's setting -> uv pip install's option (each value of a list setting passed once)
LIST_OPTIONS = {"extra-index-url": "--extra-index-url", "find-links": "--find-links", "constraint": "--constraint",
                "trusted-host": "--allow-insecure-host"}
ONE_OPTIONS = {"index-url": "--index-url"}
# `pip config list` names a setting section.key; the environment (":env:") beats [install], which beats [global]
PRECEDENCE = (":env:", "install", "global")
LINE = re.compile(r"^(?P<section>[^.=]+)\.(?P<key>[\w-]+)=(?P<value>.*)$")


def pip_settings(python: str) -> dict[str, str]:
    """pip's effective settings (key -> value) as VENV_PYTHON's pip reads them; {} when pip cannot say."""
    proc = subprocess.run([python, "-m", "pip", "config", "list"], capture_output=True, text=True)
    found: dict[tuple[str, str], str] = {}
    for line in proc.stdout.splitlines():
        m = LINE.match(line.strip())
        if m:
            try:
                found[(m["section"], m["key"])] = str(ast.literal_eval(m["value"]))   # printed as a Python repr
            except (ValueError, SyntaxError):
                continue
    settings: dict[str, str] = {}
    for section in reversed(PRECEDENCE):
        settings.update({key: value for (sec, key), value in found.items() if sec == section})
    return settings


def uv_options(settings: dict[str, str]) -> tuple[list[str], dict[str, str]]:
    """(uv pip install options, environment additions) saying what pip's `settings` say."""
    options = ["--index-strategy", "unsafe-best-match"]   # pip's rule: every index's versions compete
    for key, flag in ONE_OPTIONS.items():
        if settings.get(key):
            options += [flag, settings[key]]
    for key, flag in LIST_OPTIONS.items():
        for value in settings.get(key, "").split():
            options += [flag, value]
    if settings.get("no-index", "").lower() in ("1", "true", "yes", "on"):
        options.append("--no-index")
    env = {"SSL_CERT_FILE": settings["cert"]} if settings.get("cert") else {}
    return options, env


def main(argv: list[str]) -> int:
    if len(argv) < 2:
        print(__doc__.strip().splitlines()[2].strip(), file=sys.stderr)
        return 2
    uv, python, rest = argv[0], argv[1], argv[2:]
    options, env = uv_options(pip_settings(python))
    cmd = [uv, "pip", "install", "--python", python, *options, *rest]
    return subprocess.run(cmd, env={**os.environ, **env}).returncode


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
